"""How fast could a restore be if its load overlapped its plan? The bound every overlap meets on this machine
(BENCHMARKS.md, restore, "Overlapping the plan with the load").

A restore plans (reads the backup and the logs, settles every message) and then loads the survivors into the CF
(restore.run: plan, claim, load). A restore that overlaps the two (its load starting as parts of its plan settle)
cannot finish before the whole plan and the whole load of the same data run side by side from the same instant:
its load starts no earlier than its plan, it does at least their work, and it shares the same cores with the CF.
This benchmark measures, on the same generated data, in one run:

  * sequential: bench_restore.py's child as it is (plan, then the load with its restore point, then the raw writes
    of the same final data): the restore's wall (restore_s) and the same-data raw write (raw_write_same_data_s);
  * side by side: two processes on that data, each within the memory limit. One plans, then loads its plan into a
    fresh CF with its restore point when told to; the other plans when told to, at the same instant. The wall from
    that instant to the end of both (side_by_side_s) is the lower bound of an overlapped restore's wall; their CPU
    (both processes' and the CF's) is what the machine's cores have to give.

A restore at `goal` (0.8) of the raw write's speed needs raw_write_same_data_s / side_by_side_s >= goal for any
overlap to reach it. The side-by-side run holds two plans' memory at once (each process within the limit): it
bounds the wall, not a restore's memory.

    .venv/bin/python bench/bench_restore_overlap.py [--quick] [--dir D] [--size 1000000:2000000] [--memory 512MiB]
                                                    [--workers 2] [--engine columnar] [--rounds 1]

--dir D reuses data bench_restore.py --keep --dir D generated (D/size-N); otherwise the data are generated there
(or in a temporary directory). Appends one JSON line a round to bench/results/restore_overlap.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_restore  # noqa: E402
from bench_restore import MEMBERS, NOW_MS, QUEUES, REPLAY_FROM, S, Truth, bench_keys, cf_cpu_s, cpu_s  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "restore_overlap.jsonl"
GOAL = 0.8
WAIT_S = 1800.0  # the longest a child waits for its signal (a 10M plan under load takes minutes)


def _wait_for(path: Path, deadline_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {deadline_s:.0f} s")
        time.sleep(0.005)


def _plan(root: Path, memory: int, workers: int, engine_name: str) -> Any:
    from backup.files import read_backup
    from cfemu.progress import no_progress
    from restore.engine import get_engine
    from sqm.log import find_log_dirs

    backup = read_backup(root / "backup" / S / "b", backup_keys=bench_keys(root))
    engine = get_engine(engine_name, memory=memory, work_dir=root / "work", workers=workers)
    return engine.plan(S, backup, find_log_dirs(root / "logs"), REPLAY_FROM, NOW_MS, no_progress)


def child_plan(root: Path, memory: int, workers: int, engine_name: str, ready: Path, go: Path) -> None:
    """Plan when told to; print the plan's wall and CPU, and when it began and ended (the clock all children
    share)."""
    ready.touch()
    _wait_for(go)
    start, c0 = time.time(), cpu_s()
    plan = _plan(root, memory, workers, engine_name)
    end = time.time()
    out = {"start": start, "end": end, "plan_s": round(end - start, 2), "plan_cpu_s": round(cpu_s() - c0, 2),
           "restored": int(plan.counts.get("restored", 0))}
    plan.close()
    print(json.dumps(out), flush=True)


def child_load(root: Path, memory: int, workers: int, engine_name: str, ready: Path, go: Path) -> None:
    """Plan (untimed), then when told to, load the plan into a fresh CF with its restore point, as run_restore
    does; print the load's wall and CPU (this process's and the CF's), and when it began and ended."""
    from backup.points import RESTORE, RestorePointWriter
    from cfemu.admin import Admin, QueueDef
    from cfemu.bulk import claim, observe
    from cfemu.embedded import EmbeddedRedis
    from restore.load import load_plan

    for name in ("points-overlap", "redis-overlap"):
        shutil.rmtree(root / name, ignore_errors=True)
    server = EmbeddedRedis(data_dir=root / "redis-overlap")
    server.start()
    try:
        client = server.client()
        admin = Admin(client)
        admin.define_structure(S)
        for q in QUEUES:
            admin.define_queue(q, S)
        plan = _plan(root, memory, workers, engine_name)
        ready.touch()
        _wait_for(go)
        start, c0, cf0 = time.time(), cpu_s(), cf_cpu_s(client)
        point = RestorePointWriter(root / "points-overlap", "p", S, backup_keys=bench_keys(root))

        def finish_point() -> None:
            point.finish(kind=RESTORE, group="BENCH", sdef=admin.structure_def(S),
                         queues=[QueueDef(q, S) for q in QUEUES], members=MEMBERS, gen=plan.restore_lrsn,
                         lrsn=plan.restore_lrsn, replay_from=plan.restore_lrsn, tombstones={})

        with claim(client, S, observe(client, S)) as owner:
            load = load_plan(owner, plan, admin.structure_def(S), list(QUEUES), copies_to=point.add_copies,
                             before_activate=finish_point)
        end = time.time()
        out = {"start": start, "end": end, "load_s": round(end - start, 2), "load_cpu_s": round(cpu_s() - c0, 2),
               "cf_load_cpu_s": round(cf_cpu_s(client) - cf0, 2), "loaded": load.entries}
        plan.close()
    finally:
        server.stop()
        for name in ("points-overlap", "redis-overlap"):
            shutil.rmtree(root / name, ignore_errors=True)
    print(json.dumps(out), flush=True)


def _last_json(stdout: str) -> dict[str, Any]:
    printed = [line for line in stdout.splitlines() if line.startswith("{")]
    return json.loads(printed[-1]) if printed else {}


def sequential(root: Path, memory: int, truth_file: Path, workers: int, engine_name: str) -> dict[str, Any]:
    """bench_restore.py's child: the restore as it runs, and the raw writes of the same data."""
    proc = subprocess.run([sys.executable, bench_restore.__file__, "--child", str(root), str(memory), str(truth_file),
                           str(workers), engine_name], capture_output=True, text=True, cwd=ROOT)
    run = _last_json(proc.stdout)
    if proc.returncode != 0 or run.get("problems") or "raw_write_same_data_s" not in run:
        raise RuntimeError(f"the sequential restore failed: {run.get('problems')} "
                           f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return run


def side_by_side(root: Path, memory: int, workers: int, engine_name: str) -> dict[str, Any]:
    """One process's load beside another's plan, both started at the same instant."""
    signals = Path(tempfile.mkdtemp(prefix="overlap-", dir=root))
    go = signals / "go"
    procs = {}
    try:
        for role in ("load", "plan"):
            procs[role] = subprocess.Popen(
                [sys.executable, __file__, "--child", role, str(root), str(memory), str(workers), engine_name,
                 str(signals / f"ready-{role}"), str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, cwd=ROOT)
        for role in procs:
            ready = signals / f"ready-{role}"
            deadline = time.monotonic() + WAIT_S
            while not ready.exists():
                if procs[role].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {role} child ended before it was ready: "
                                       f"{procs[role].communicate()[1].strip()[-2000:]}")
                time.sleep(0.01)
        loadavg = os.getloadavg()[0]
        go_at = time.time()
        go.touch()
        outs = {}
        for role, proc in procs.items():
            stdout, stderr = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"the {role} child failed: {stderr.strip()[-2000:]}")
            outs[role] = _last_json(stdout)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(signals, ignore_errors=True)
    load, plan = outs["load"], outs["plan"]
    return {"side_by_side_s": round(max(load["end"], plan["end"]) - go_at, 2), "loadavg_at_go": loadavg,
            "plan_s": plan["plan_s"], "plan_cpu_s": plan["plan_cpu_s"], "load_s": load["load_s"],
            "load_cpu_s": load["load_cpu_s"], "cf_load_cpu_s": load["cf_load_cpu_s"], "loaded": load["loaded"],
            "restored": plan["restored"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run: 20k messages, 40k records")
    ap.add_argument("--size", help="FINAL_MESSAGES:LOG_RECORDS (default 1000000:2000000)")
    ap.add_argument("--memory", default="512MiB", help="the restore memory limit (cfrestore --memory-limit)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--engine", default="columnar")
    ap.add_argument("--rounds", type=int, default=1, help="sequential then side by side, this many times")
    ap.add_argument("--dir", help="where the generated data are, or go (default: a temporary directory)")
    ap.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        role, root, memory, workers, engine_name, ready, go = args.child
        (child_load if role == "load" else child_plan)(Path(root), int(memory), int(workers), engine_name,
                                                       Path(ready), Path(go))
        return 0
    from cfemu.settings import parse_size

    memory = parse_size(args.memory, what="--memory")
    final, records = (int(x) for x in (args.size or ("20000:40000" if args.quick else "1000000:2000000")).split(":"))
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-overlap-"))
    root = base / f"size-{final}"
    console = Console()
    try:
        truth_file = root / "truth.json"
        if truth_file.exists():
            truth = Truth(**json.loads(truth_file.read_text()))
        else:
            truth = bench_restore.generate(root, records, final, 1024)
            truth_file.write_text(json.dumps(asdict(truth)))
        table = Table("round", "load avg", "plan s (CPU s)", "load s (CPU s: process / CF)", "restore s",
                      "same-data raw s", "restore / raw (speed)", "side by side s", "raw / side by side",
                      "CPU s in all", "CPU s / 2 cores",
                      title=f"{final:,} messages, --memory-limit {args.memory}, {args.engine}, --workers "
                            f"{args.workers}: the restore, and its plan and load side by side")
        bad = 0
        for r in range(1, args.rounds + 1):
            seq = sequential(root, memory, truth_file, args.workers, args.engine)
            par = side_by_side(root, memory, args.workers, args.engine)
            cpu = par["plan_cpu_s"] + par["load_cpu_s"] + par["cf_load_cpu_s"]
            raw = seq["raw_write_same_data_s"]
            row = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": bench_restore.machine(),
                   "messages": truth.restored, "records": truth.records, "memory_limit": args.memory,
                   "engine": args.engine, "workers": args.workers, "round": r, "sequential": seq,
                   "side_by_side": par, "restore_over_raw": round(raw / seq["restore_s"], 3),
                   "side_by_side_over_raw": round(raw / par["side_by_side_s"], 3),
                   "cpu_s": round(cpu, 2), "cpu_floor_s": round(cpu / (os.cpu_count() or 1), 2),
                   "loadavg_after": os.getloadavg()}
            if par["loaded"] != truth.restored or par["restored"] != truth.restored:
                row["problems"] = [f"side by side: loaded {par['loaded']}, planned {par['restored']}, "
                                   f"truth {truth.restored}"]
                bad += 1
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            with RESULTS.open("a") as f:
                f.write(json.dumps(row) + "\n")
            console.print(row)
            table.add_row(str(r), f"{seq.get('loadavg_at_load', [0])[0]:.1f} / {par['loadavg_at_go']:.1f}",
                          f"{seq['plan_s']} ({seq['plan_cpu_s']})",
                          f"{seq['load_s']} ({seq['load_cpu_s']} / {seq['cf_load_cpu_s']})", str(seq["restore_s"]),
                          str(raw), f"{row['restore_over_raw']:.3f}", str(par["side_by_side_s"]),
                          f"{row['side_by_side_over_raw']:.3f}", str(row["cpu_s"]), str(row["cpu_floor_s"]))
        console.print(table)
        console.print(f"goal: restore / raw >= {GOAL}; no overlap of plan and load beats the side-by-side column")
        return 1 if bad else 0
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
        else:
            for name in ("points-overlap", "redis-overlap"):
                shutil.rmtree(root / name, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
