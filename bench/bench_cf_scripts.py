"""What the CF's lifecycle scripts cost the Redis server: CPU µs and Redis commands per script call, and per lifecycle.

A lifecycle as a member runs it under syncpoint (1 KiB persistent message, a message id, no expiry): put.lua,
standing.lua (asked before the COMMIT is forced), commit.lua; get.lua, standing.lua, commit.lua. The Structure
methods are called directly on a private redis-server (no log, no service): only the server's share is measured.

CPU: the redis-server process's own CPU time (/proc/<pid>/schedstat, ns), around a batch of `--batch` calls of one
step (each on its own UOW), divided by the batch: the script, and the server's reading of the request and writing
of the reply. CPU time, not the slow log's wall time, which on a loaded machine counts the time the server waited
for a core. The queue holds `--depth` committed messages besides the batch's (a put's commit goes behind them, a
get takes the head). Commands: the server's `INFO commandstats` call counts (which count the commands a script
calls) around each step of one lifecycle, in a separate pass.

With `--baseline DIR` (a copy of an older cfemu/scripts/), the same batches run on those scripts too, on a
redis-server of their own, in rounds interleaved with the current scripts' (the machine's load falls on both
alike); the ratio current / baseline is shown per step. Figures are the median over the rounds.

The fused lifecycle (scripts that have put_committed.lua and get_committed.lua): a persistent put outside
syncpoint and its commit in one call (put_committed), and a get that carries the commit of the get before it
(get_committed): two scripts per message. It is set against the lifecycle outside syncpoint as the member made it
before (put.lua, commit.lua, get.lua, commit.lua: the lifecycle above without its standing.lua calls, which a put
or get outside syncpoint does not make) of the baseline's scripts, or of the current ones without a baseline.

    .venv/bin/python bench/bench_cf_scripts.py [--baseline /tmp/old/scripts] [--rounds 9] [--batch 300]

Appends one JSON line to bench/results/cf_scripts.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import CountingClock  # noqa: E402

from cfemu import lua  # noqa: E402
from cfemu.admin import Admin  # noqa: E402
from cfemu.cf import CF, Caller, CarriedCommit, Structure  # noqa: E402
from cfemu.embedded import EmbeddedRedis  # noqa: E402
from cfemu.entry import Entry  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "cf_scripts.jsonl"
BODY = b"x" * 1024
STEPS = ["put", "standing(put)", "commit(put)", "get", "standing(get)", "commit(get)"]
FUSED_STEPS = ["put_committed", "get_committed"]
OUTSIDE_SYNCPOINT = ["put", "commit(put)", "get", "commit(get)"]  # STEPS a member makes outside syncpoint
# The longest message the caller can take (sqm passes one with every get).
MAX_LENGTH = 4 * 1024 * 1024


def scripts_from(client: Any, folder: Path | None) -> dict[str, Any]:
    """The structure scripts registered on the client: cfemu's own, or those of an older copy (folder)."""
    if folder is None:
        return lua.register(client, lua.structure_operations())
    prelude = (folder / "_prelude.lua").read_text()
    return {f.stem: client.register_script(prelude + "\n" + f.read_text()) for f in sorted(folder.glob("*.lua"))
            if not f.stem.startswith(("_", "admin_"))}


class Variant:
    """One set of scripts on a structure of its own."""

    def __init__(self, name: str, folder: Path | None) -> None:
        self.name = name
        self.queue = "Q1"
        self.srv = EmbeddedRedis(module=False).start()  # the scripts measured: not the module's commands
        assert self.srv.pid is not None
        self.pid = self.srv.pid
        self.client = self.srv.client()
        admin = Admin(self.client)
        cf = CF(self.client)
        cf._scripts = scripts_from(self.client, folder)  # a benchmark's coupling: the scripts under test
        admin.ensure_structure("APP1", (self.queue,))
        self.s: Structure = cf.structure("APP1")
        self.caller = Caller("QM1", admin.join("QM1", {}, lease_ms=3_600_000), CountingClock())
        self.n = 0
        self.fused = "put_committed" in cf._scripts and "get_committed" in cf._scripts
        self.carried: list[CarriedCommit] = []  # the commit of the last fused get, for the next one to carry

    def close(self) -> None:
        self.client.close()
        self.srv.stop()

    def _uow(self) -> str:
        self.n += 1
        return f"{self.name}-U{self.n}"

    def fill(self, depth: int) -> None:
        for _ in range(depth):
            self.put_commit()

    def put_one(self) -> tuple[str, int]:
        uow = self._uow()
        t = int(time.time() * 1000)
        e = Entry(id=os.urandom(12).hex(), queue=self.queue, msgid=os.urandom(24).hex(), put_time=t)
        return uow, self.s.put(self.caller, e, BODY, uow=uow, gen=0).gen

    def get_one(self) -> tuple[str, int]:
        uow = self._uow()
        r = self.s.get(self.caller, self.queue, uow=uow, gen=0, now_ms=int(time.time() * 1000), max_length=MAX_LENGTH)
        assert r.entry is not None, "the queue is empty"
        return uow, r.gen

    def put_commit(self, mark: Any = None) -> None:
        uow, gen = self.put_one()
        mark and mark("put")
        self.s.standing(self.caller, uow, gen=gen)
        mark and mark("standing(put)")
        self.s.commit(self.caller, uow, gen=gen, lrsn=self.caller.clock.now())
        mark and mark("commit(put)")

    def get_commit(self, mark: Any = None) -> None:
        uow, gen = self.get_one()
        mark and mark("get")
        self.s.standing(self.caller, uow, gen=gen)
        mark and mark("standing(get)")
        self.s.commit(self.caller, uow, gen=gen, lrsn=self.caller.clock.now())
        mark and mark("commit(get)")

    def lifecycle(self, mark: Any = None) -> None:
        self.put_commit(mark)
        self.get_commit(mark)

    def put_committed(self) -> None:
        uow = self._uow()
        e = Entry(id=os.urandom(12).hex(), queue=self.queue, msgid=os.urandom(24).hex(),
                  put_time=int(time.time() * 1000))
        put_lrsn = self.caller.clock.now()
        self.s.put_committed(self.caller, e, BODY, uow=uow, gen=1, put_lrsn=put_lrsn, lrsn=self.caller.clock.now())

    def get_committed(self) -> None:
        uow = self._uow()
        r = self.s.get_committed(self.caller, self.queue, uow=uow, gen=0, now_ms=int(time.time() * 1000),
                                 max_length=MAX_LENGTH, commits=self.carried)
        assert r.got is not None and r.got.entry is not None, "the queue is empty"
        assert all(c is None for c in r.commits), r.commits
        self.carried = [CarriedCommit(uow, r.got.gen, self.caller.clock.now())]  # its COMMIT, forced

    def fused_lifecycle(self, mark: Any = None) -> None:
        self.put_committed()
        mark and mark("put_committed")
        self.get_committed()
        mark and mark("get_committed")


def cpu_ns(pid: int) -> int:
    """The process's time on a CPU so far (ns)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def command_counts(client: Any, v: Variant) -> dict[str, int]:
    """Redis commands each step of one lifecycle runs (INFO commandstats, less the EVALSHA, the INFO and the
    SCRIPT LOAD of a script's first call)."""
    def total() -> int:
        stats = client.info("commandstats")
        return sum(int(s["calls"]) for k, s in stats.items()
                   if k not in ("cmdstat_evalsha", "cmdstat_info", "cmdstat_script"))
    counts: dict[str, int] = {}
    last = [total()]

    def mark(step: str) -> None:
        now = total()
        counts[step] = now - last[0]
        last[0] = total()
    v.lifecycle(mark)
    if v.fused:
        v.fused_lifecycle(mark)
    return counts


def step_batches(v: Variant, batch: int) -> dict[str, float]:
    """CPU µs of the variant's server per call of each step, over a batch of each in lifecycle order."""
    out: dict[str, float] = {}
    puts, gets = [], []

    def timed(step: str, fn: Any) -> None:
        t = cpu_ns(v.pid)
        for i in range(batch):
            fn(i)
        out[step] = (cpu_ns(v.pid) - t) / 1000 / batch

    def put(i: int) -> None:
        puts.append(v.put_one())

    def get(i: int) -> None:
        gets.append(v.get_one())
    timed("put", put)
    timed("standing(put)", lambda i: v.s.standing(v.caller, puts[i][0], gen=puts[i][1]))
    timed("commit(put)", lambda i: v.s.commit(v.caller, puts[i][0], gen=puts[i][1], lrsn=v.caller.clock.now()))
    timed("get", get)
    timed("standing(get)", lambda i: v.s.standing(v.caller, gets[i][0], gen=gets[i][1]))
    timed("commit(get)", lambda i: v.s.commit(v.caller, gets[i][0], gen=gets[i][1], lrsn=v.caller.clock.now()))
    if v.fused:
        timed("put_committed", lambda i: v.put_committed())
        timed("get_committed", lambda i: v.get_committed())
    return out


def run_shape(variants: list[Variant], depth: int, rounds: int, batch: int) -> dict[str, Any]:
    for v in variants:
        v.fill(depth)
    counts = {v.name: command_counts(v.client, v) for v in variants}
    cpu: dict[str, dict[str, list[float]]] = {v.name: defaultdict(list) for v in variants}
    for r in range(rounds):
        for v in variants if r % 2 == 0 else list(reversed(variants)):
            for step, us in step_batches(v, batch).items():
                cpu[v.name][step].append(us)
    out: dict[str, Any] = {}
    for v in variants:
        per_step = {step: statistics.median(us) for step, us in cpu[v.name].items()}
        out[v.name] = {
            "cpu_us": per_step,
            "cpu_us_per_lifecycle": sum(per_step[s] for s in STEPS),
            "cpu_us_lifecycle_rounds": [sum(cpu[v.name][s][r] for s in STEPS) for r in range(rounds)],
            "commands": counts[v.name],
            "commands_per_lifecycle": sum(counts[v.name][s] for s in STEPS),
            "outside_syncpoint": {
                "cpu_us_rounds": [sum(cpu[v.name][s][r] for s in OUTSIDE_SYNCPOINT) for r in range(rounds)],
                "commands": sum(counts[v.name][s] for s in OUTSIDE_SYNCPOINT), "scripts": len(OUTSIDE_SYNCPOINT)},
        }
        if v.fused:
            out[v.name]["fused"] = {
                "cpu_us_rounds": [sum(cpu[v.name][s][r] for s in FUSED_STEPS) for r in range(rounds)],
                "commands": sum(counts[v.name][s] for s in FUSED_STEPS), "scripts": len(FUSED_STEPS)}
    for v in variants:  # empty the queues for the next shape (and apply the last fused get's commit)
        for c in v.carried:
            v.s.commit(v.caller, c.uow, gen=c.gen, lrsn=c.lrsn)
        v.carried = []
        for _ in range(depth):
            v.get_commit()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="a directory of older scripts (a copy of cfemu/scripts/)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batch", type=int, default=300, help="calls of a step per round and variant")
    ap.add_argument("--depth", type=int, default=100, help="queue depth of the deep shape")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 20 calls, depth 10")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.batch, args.depth = 2, 20, 10
    variants: list[Variant] = []
    try:
        if args.baseline:
            variants.append(Variant("baseline", args.baseline))
        variants.append(Variant("current", None))
        load = os.getloadavg()[0]
        shapes = {f"depth {d}": run_shape(variants, d, args.rounds, args.batch) for d in (0, args.depth)}
    finally:
        for v in variants:
            v.close()
    result = {"time": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "load_before": load, "load_after": os.getloadavg()[0],
              "rounds": args.rounds, "batch": args.batch, "shapes": shapes}
    names = [v.name for v in variants]
    for shape, res in shapes.items():
        print(f"\n{shape}: redis-server CPU µs per call, median of {args.rounds} rounds (Redis commands)")
        print(f"{'step':16}" + "".join(f"{n:>18}" for n in names) + ("   ratio" if len(names) == 2 else ""))
        for step in STEPS:
            cells = [f"{res[n]['cpu_us'][step]:>10.1f} ({res[n]['commands'][step]:>3})" for n in names]
            ratio = f"   {res[names[1]]['cpu_us'][step] / res[names[0]]['cpu_us'][step]:.2f}" if len(names) == 2 else ""
            print(f"{step:16}" + "".join(f"{c:>18}" for c in cells) + ratio)
        cells = [f"{res[n]['cpu_us_per_lifecycle']:>10.1f} ({res[n]['commands_per_lifecycle']:>3})" for n in names]
        ratio = (f"   {res[names[1]]['cpu_us_per_lifecycle'] / res[names[0]]['cpu_us_per_lifecycle']:.2f}"
                 if len(names) == 2 else "")
        print(f"{'lifecycle':16}" + "".join(f"{c:>18}" for c in cells) + ratio)
        if len(names) == 2:
            rr = [c / b for b, c in zip(res[names[0]]["cpu_us_lifecycle_rounds"],
                                        res[names[1]]["cpu_us_lifecycle_rounds"], strict=True)]
            print(f"lifecycle ratio per round: min {min(rr):.2f} median {statistics.median(rr):.2f} max {max(rr):.2f}")
        fused = [n for n in names if "fused" in res[n]]
        for step in FUSED_STEPS if fused else ():
            cells = [f"{res[n]['cpu_us'][step]:>10.1f} ({res[n]['commands'][step]:>3})" if n in fused else "-"
                     for n in names]
            print(f"{step:16}" + "".join(f"{c:>18}" for c in cells))
        if fused:
            f = fused[-1]
            old = res[names[0]]["outside_syncpoint"]
            rr = [a / b for a, b in zip(res[f]["fused"]["cpu_us_rounds"], old["cpu_us_rounds"], strict=True)]
            print(f"outside syncpoint, {names[0]} put+commit+get+commit ({old['scripts']} scripts) "
                  f"{statistics.median(old['cpu_us_rounds']):.1f} µs ({old['commands']}) -> {f} put_committed+"
                  f"get_committed ({res[f]['fused']['scripts']}) {statistics.median(res[f]['fused']['cpu_us_rounds']):.1f}"
                  f" µs ({res[f]['fused']['commands']}); ratio per round: min {min(rr):.2f} median "
                  f"{statistics.median(rr):.2f} max {max(rr):.2f}")
    print(f"\nload {load:.1f} -> {result['load_after']:.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as out:
        out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
