"""Where the columnar restore plan's CPU goes (BENCHMARKS.md, restore, "Where the plan's CPU goes at 1M"): a profile,
not a benchmark.

Plans the files bench_restore.py made (`--dir D --keep`: D/size-N holds the backup, the logs and truth.json) with
the columnar engine, in this process, and prints one JSON line:
  plan_s, plan_cpu_s:  the plan's wall and process CPU seconds;
  read_cpu_s:          the process's CPU while the backup and the logs were read (the engine's own figure), and of
                       it each kind of thread's own CPU (time.thread_time): the C readers' threads on the backup's
                       files and on the log segments, the streamed INSERTs' threads (the rest is DuckDB's own
                       threads and the queues);
  statements_cpu_s:    the process's CPU during each statement of the plan (by the table it makes; "insert",
                       "drop", "fold" summed), and their total;
  output_cpu_s:        (--output) the survivors' query read as Arrow batches, as the load reads it;
  --duckdb-profile P:  DuckDB's JSON profile of every statement into directory P (one file a statement), and a
                       summary: each operator type's share of DuckDB's time, what the statements spilled and read
                       back from its temporary directory, the statements by their share.

    PYTHONPATH=<tree> .venv/bin/python bench/profile_restore_plan.py --dir D [--messages 1000000]
        [--memory 512MiB] [--workers 2] [--output] [--duckdb-profile P]

PYTHONPATH picks the tree whose plan is profiled (a copy of another commit with its own build of the C readers,
for a before/after). The profile wraps the engine's private steps (its statements, its readers' scans, its
streamed INSERTs): it follows restore/engine_columnar.py, and says so when those have moved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# This tree goes last: the one PYTHONPATH names, if any, is the one imported and profiled (bench_restore, imported
# from this directory, then leaves sys.path as it is).
sys.path.append(str(Path(__file__).resolve().parents[1]))

import bench_restore as br  # noqa: E402  (this directory's: run as a script)

from backup.files import read_backup  # noqa: E402
from cfemu.progress import no_progress  # noqa: E402
from restore import engine_columnar as ec  # noqa: E402
from restore.engine import get_engine  # noqa: E402
from restore.sql_statements import split_statements  # noqa: E402


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    for unit, factor in units.items():
        if text.lower().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


class Profiler:
    """The engine's statements, scans and INSERT streams wrapped, each adding its CPU to a figure."""

    def __init__(self, duckdb_profile: Path | None) -> None:
        self.statements: dict[str, float] = {}
        self.threads: dict[str, float] = {}
        self.lock = threading.Lock()
        self.duckdb_profile = duckdb_profile
        self.profiled = 0

    def install(self) -> None:
        for name in ("_execute", "_scan"):
            if not callable(getattr(ec, name, None)):
                raise SystemExit(f"restore.engine_columnar has no {name}: this profile needs updating")
        execute: Callable[..., None] = ec._execute
        scan: Callable[..., Any] = ec._scan
        insert: Callable[..., None] = ec._Streams._insert

        def profiled_execute(con: Any, sql: str, timings: dict[str, float], name: str = "") -> None:
            for statement in split_statements(sql):
                if self.duckdb_profile is not None:
                    con.execute("PRAGMA enable_profiling='json'")
                    con.execute(f"PRAGMA profiling_output='{self.duckdb_profile / f'{self.profiled:03d}.json'}'")
                    self.profiled += 1
                c0 = time.process_time()
                execute(con, statement, timings, name)
                what = name or (statement.split("CREATE TABLE ", 1)[-1].split()[0] if "CREATE TABLE" in statement
                                else "drop" if "DROP TABLE" in statement else "insert")
                self.statements[what] = self.statements.get(what, 0.0) + time.process_time() - c0

        def profiled_scan(job: Any, emit: Callable[..., None], **options: Any) -> Any:
            t0 = time.thread_time()
            try:
                return scan(job, emit, **options)
            finally:
                with self.lock:
                    kind = "backup" if job.backup_file is not None else "logs"
                    self.threads[kind] = self.threads.get(kind, 0.0) + time.thread_time() - t0

        def profiled_insert(streams: Any, cur: Any, name: str) -> None:
            t0 = time.thread_time()
            try:
                insert(streams, cur, name)
            finally:
                with self.lock:
                    self.threads["inserts"] = self.threads.get("inserts", 0.0) + time.thread_time() - t0

        setattr(ec, "_execute", profiled_execute)  # noqa: B010  (the engine's own step, replaced for the profile)
        setattr(ec, "_scan", profiled_scan)  # noqa: B010
        setattr(ec._Streams, "_insert", profiled_insert)  # noqa: B010


def duckdb_summary(directory: Path) -> dict[str, Any]:
    """DuckDB's profiles of the statements: each operator type's share of their time, the bytes spilled and read
    back, and the statements by share (the first line of each)."""
    operators: dict[str, float] = {}  # seconds by operator type
    statements: list[tuple[float, str, int, int]] = []

    def walk(node: dict[str, Any]) -> None:
        kind = str(node.get("type", "?"))
        operators[kind] = operators.get(kind, 0) + float(node.get("timing") or 0)
        for child in node.get("children", []):
            walk(child)

    for path in sorted(directory.glob("*.json")):
        profile = json.loads(path.read_text())
        query, system, io = profile.get("query", {}), profile.get("system", {}), profile.get("io", {})
        statements.append((float(query.get("cpu_time") or 0), str(query.get("sql", "")).strip().split("\n")[0][:60],
                           int(system.get("total_bytes_spilled") or 0), int(io.get("total_bytes_read") or 0)))
        for node in profile.get("operator", []):
            walk(node)
    total_ops, total = sum(operators.values()) or 1.0, sum(s[0] for s in statements) or 1.0
    return {"operators_share": {k: round(v / total_ops, 3) for k, v in sorted(operators.items(), key=lambda kv: -kv[1])},
            "spilled_mib": sum(s[2] for s in statements) >> 20, "read_back_mib": sum(s[3] for s in statements) >> 20,
            "statements_share": [(round(c / total, 3), q, spilled >> 20, read >> 20)
                                 for c, q, spilled, read in sorted(statements, reverse=True)[:20]]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="bench_restore.py's --dir (its files kept with --keep)")
    ap.add_argument("--messages", type=int, default=1_000_000, help="the size's final messages (D/size-N)")
    ap.add_argument("--memory", default="512MiB", help="the restore memory limit")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--output", action="store_true", help="also read the survivors' query as the load does")
    ap.add_argument("--duckdb-profile", type=Path, help="a directory for DuckDB's profile of each statement")
    args = ap.parse_args(argv)
    root = Path(args.dir) / f"size-{args.messages}"
    if args.duckdb_profile is not None:
        args.duckdb_profile.mkdir(parents=True, exist_ok=True)
    profiler = Profiler(args.duckdb_profile)
    profiler.install()
    backup = read_backup(root / "backup" / br.S / "b", backup_keys=br.bench_keys(root))
    memory = parse_size(args.memory)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = get_engine("columnar", **br.engine_options(root, memory, args.workers, "columnar")).plan(
        br.S, backup, br.find_log_dirs(root / "logs"), br.REPLAY_FROM, br.NOW_MS, no_progress)
    assert isinstance(plan, ec.ColumnarPlan)
    out: dict[str, Any] = {"tree": str(Path(ec.__file__).resolve().parents[1]), "loadavg": os.getloadavg()[0],
                           "plan_s": round(time.perf_counter() - t0, 2), "plan_cpu_s": round(time.process_time() - c0, 2),
                           "read_cpu_s": round(plan.read_cpu_s, 2),
                           "read_threads_cpu_s": {k: round(v, 2) for k, v in profiler.threads.items()},
                           "statements_total_cpu_s": round(sum(profiler.statements.values()), 2),
                           "statements_cpu_s": {k: round(v, 3) for k, v in sorted(profiler.statements.items(),
                                                                                    key=lambda kv: -kv[1])},
                           "counts": dict(plan.counts)}
    if args.output:
        c1, rows = time.process_time(), 0
        for batch in ec._batches(plan.cursor(), ec.SURVIVORS_SQL):
            rows += batch.num_rows
        out["output_cpu_s"], out["output_rows"] = round(time.process_time() - c1, 2), rows
    truth = json.loads((root / "truth.json").read_text())
    out["correct"] = plan.counts.get("restored", 0) == truth["restored"]
    plan.close()
    if args.duckdb_profile is not None:
        out["duckdb"] = duckdb_summary(args.duckdb_profile)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
