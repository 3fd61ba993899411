"""What the CF's server module saves the CF's server: CPU µs per call of each operation the module has
(cfemu.server_module.COMMANDS: put, get, commit), its Lua script against its module command, in one server and one run.

One redis-server (the one the CF runs, with the module loaded) holds the same structure twice: database 0 driven
through the scripts (EVALSHA), database 1 through the module's commands. A round runs a batch of `--batch` calls
on each (each on its own UOW, 1 KiB persistent messages, the same arguments), the order swapped every other round,
so that the machine's load falls on both alike. Two ways of sending: pipelined (the batch in one round trip: what
a member's grouped CF calls do) and one call per round trip (each reply read before the next call: the request's
reading and the reply's writing counted in every call). CPU: the server's own CPU time (/proc/<pid>/schedstat)
around each batch, divided by the batch; figures are the median over the rounds, and the ratio script / module.

    .venv/bin/python bench/bench_cf_module.py [--quick] [--rounds 7] [--batch 1000] [--json]

Appends one JSON line to bench/results/cf_module.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import CountingClock  # noqa: E402

from cfemu import keys, lua, server_module  # noqa: E402
from cfemu.admin import Admin  # noqa: E402
from cfemu.cf import CF, Caller  # noqa: E402
from cfemu.embedded import EmbeddedRedis  # noqa: E402
from cfemu.entry import Entry  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "cf_module.jsonl"
MAX_LENGTH = 4 * 1024 * 1024  # the longest message a get can take (sqm passes one with every get)
BODY = b"x" * 1024
# The commits' own queue (Q2): the puts and gets the other cases leave uncommitted in Q1 would make each commit's
# LREM of its entry scan past them, as no member's queue holds thousands of uncommitted entries.
S, Q, Q2 = "APP1", "Q1", "Q2"
# The calls measured: (name, operation, whether each message is put in a UOW of its own).
CASES = [("put (in a UOW)", "put", True), ("put (outside syncpoint)", "put", False), ("get (in a UOW)", "get", True),
         ("commit of a put", "commit", True), ("commit of a get", "commit", False)]


def cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds of 200 calls")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.batch = 3, 200
    with EmbeddedRedis() as srv:
        if not srv.module_loaded:
            print("bench_cf_module: the CF's server module is not built or does not load here: nothing to compare",
                  file=sys.stderr)
            return 1
        assert srv.pid is not None
        sides = {"script": srv.client(db=0), "module": srv.client(db=1)}
        caller = Caller("QM1", 0, CountingClock())
        for r in sides.values():
            admin = Admin(r)
            admin.ensure_structure(S, (Q, Q2))
            caller = Caller("QM1", admin.join("QM1", {}, lease_ms=3_600_000), caller.clock)
        for r in sides.values():  # both fences at the same epoch
            Admin(r).join_structures("QM1", caller.epoch)
        structure = CF(sides["script"]).structure(S)
        script_keys = keys.script_keys(S)
        shas = {op: sides["script"].script_load(lua.source(op)) for _, op, _ in CASES}
        for op in shas:
            sides["module"].script_load(lua.source(op))
        figures: dict[str, dict[str, list[float]]] = {}
        serial = 0

        def batch(side: str, op: str, in_uow: bool, pipelined: bool, queue: str = Q) -> float:
            nonlocal serial
            r = sides[side]
            head: tuple[Any, ...] = ((server_module.COMMANDS[op], shas[op]) if side == "module"
                                     else ("EVALSHA", shas[op], len(script_keys)))
            commands = []
            if op == "get":  # the messages the batch takes, put first (not measured)
                batch(side, "put", False, True, queue)
            held = serial
            if op == "commit":  # the UOWs the batch commits, each holding one put (in_uow) or one get (not measured)
                batch(side, "put" if in_uow else "get", True, True, Q2)
            for i in range(args.batch):
                serial += 1
                if op == "commit":
                    uow = f"u{held + 1 + i}" if in_uow else f"g{held + args.batch + 1 + i}"
                    _, _, call_args = structure.commit_call(caller, uow, gen=0, lrsn=caller.clock.now())
                elif op == "put":
                    _, _, call_args = structure.put_call(caller, Entry(id=f"e{serial}", queue=queue,
                                                                       msgid=f"{serial:048x}"),
                                                         BODY, uow=f"u{serial}" if in_uow else "")
                else:
                    _, _, call_args = structure.get_call(caller, queue, uow=f"g{serial}", now_ms=1_000,
                                                         max_length=MAX_LENGTH)
                commands.append((*head, *script_keys, *call_args))
            before = cpu_ns(srv.pid or 0)
            if pipelined:
                p = r.pipeline(transaction=False)
                for c in commands:
                    p.execute_command(*c)
                p.execute()
            else:
                for c in commands:
                    r.execute_command(*c)
            return (cpu_ns(srv.pid or 0) - before) / 1e3 / args.batch

        for rnd in range(args.rounds):
            order = ["script", "module"] if rnd % 2 == 0 else ["module", "script"]
            for name, op, in_uow in CASES:
                for pipelined in (True, False):
                    key = f"{name}, {'pipelined' if pipelined else 'one per round trip'}"
                    for side in order:
                        figures.setdefault(key, {}).setdefault(side, []).append(batch(side, op, in_uow, pipelined))
    rows = []
    for key, by_side in figures.items():
        script_us, module_us = statistics.median(by_side["script"]), statistics.median(by_side["module"])
        rows.append({"call": key, "script_us": round(script_us, 1), "module_us": round(module_us, 1),
                     "ratio": round(script_us / module_us, 2)})
    print(f"{'call':48s} {'script µs':>10s} {'module µs':>10s} {'script/module':>14s}")
    for row in rows:
        print(f"{row['call']:48s} {row['script_us']:10.1f} {row['module_us']:10.1f} {row['ratio']:14.2f}")
    result = {"bench": "cf_module", "when": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()} nproc={os.cpu_count()}", "load": os.getloadavg()[0],
              "rounds": args.rounds, "batch": args.batch, "rows": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(result) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
