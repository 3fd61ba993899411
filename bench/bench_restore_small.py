"""Benchmark of a small restore (BENCHMARKS.md, "Small restores"): plan and load of a structure of a few hundred to a
few tens of thousands of messages, the load's batches made in a thread of the restoring process (the rule below
restore.load.STREAM_FROM entries: "now") against made in a worker process started for the load (the rule before, for
every plan settled with two workers or more, however small: "before").

A small restore is the common one: RECAUTO restores each structure of a lost CF, most of them holding a few queues'
worth of messages, and the group waits for it. The history is a signed backup of N committed messages of 1 KiB and
an empty log; the local engine plans it with two workers (restore.engine.LocalEngine) and restore.load.load_plan
loads it into a fresh embedded redis-server, each round flushed. Both rules run in the same rounds, alternating.

    .venv/bin/python bench/bench_restore_small.py [--quick] [--sizes 500 5000 30000 80000] [--rounds 5] [--json]

Prints a table (median of the rounds, ms) and appends one JSON line to bench/results/restore_small.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import restore.load  # noqa: E402
from backup.files import BackupWriter, read_backup  # noqa: E402
from cfemu import bulk, credentials  # noqa: E402
from cfemu.admin import Admin, StructureDef  # noqa: E402
from cfemu.embedded import EmbeddedRedis  # noqa: E402
from cfemu.entry import Entry  # noqa: E402
from restore.engine import LocalEngine  # noqa: E402
from sqm.log import RecordLog  # noqa: E402

S, Q = "APP1", "Q1"
REPLAY_FROM = 10**7
RESULTS = ROOT / "bench" / "results" / "restore_small.jsonl"
# The load's rule, as restore.load.STREAM_FROM: None keeps the module's (a thread below it, a worker from it on); 0 is
# the rule before it (a worker for every plan settled by two workers or more).
RULES = {"now": None, "before": 0}


def history(root: Path, n: int, keys: credentials.BackupKeys) -> None:
    w = BackupWriter(root / "b", backup_keys=keys)
    for i in range(n):
        w.add(1, Entry(f"b{i:09d}", Q, state="CP", lrsn=1000 + i, order=(1000 + i, 1000 + i)).wire(), b"x" * 1024)
    w.finish({"id": "b", "group": "BENCH", "structure": S, "entries": n, "bytes": n * 1024,
              "replay_from": REPLAY_FROM, "gen": 1})
    with RecordLog(root / "logs" / "QM1", "QM1") as log:
        log.force()


def one(root: Path, server: EmbeddedRedis, keys: credentials.BackupKeys, stream_from: int | None) -> float:
    """Seconds to plan and load the history once, with the load's rule set by stream_from."""
    client = server.client()
    try:
        client.flushall()
        Admin(client).define_structure(S)
        Admin(client).define_queue(Q, S)
        kept = restore.load.STREAM_FROM
        if stream_from is not None:
            restore.load.STREAM_FROM = stream_from
        try:
            t0 = time.perf_counter()
            plan = LocalEngine(workers=2, work_dir=root / "work").plan(
                S, read_backup(root / "b", backup_keys=keys), [root / "logs" / "QM1"], REPLAY_FROM, 0)
            try:
                with bulk.claim(client, S, bulk.observe(client, S)) as owner:
                    loaded = restore.load.load_plan(owner, plan, StructureDef(S), [Q])
            finally:
                plan.close()
            seconds = time.perf_counter() - t0
        finally:
            restore.load.STREAM_FROM = kept
        n = int(read_backup(root / "b", backup_keys=keys).manifest["entries"])
        if loaded.entries != n:
            raise SystemExit(f"loaded {loaded.entries} of {n} messages")
        return seconds
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run: 500 messages, 2 rounds")
    ap.add_argument("--sizes", type=int, nargs="+", help="messages in the structure (default 500 5000 30000 80000)")
    ap.add_argument("--rounds", type=int, help="rounds of each rule at each size (default 5)")
    ap.add_argument("--json", action="store_true", help="print the run's record as JSON instead of the table")
    args = ap.parse_args(argv)
    sizes = args.sizes or ([500] if args.quick else [500, 5000, 30000, 80000])
    rounds = args.rounds or (2 if args.quick else 5)
    if min(sizes) < 1 or rounds < 1:
        ap.error("--sizes and --rounds must be at least 1")
    base = Path(tempfile.mkdtemp(prefix="bench-restore-small-"))
    record: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg": os.getloadavg()},
        "stream_from": restore.load.STREAM_FROM, "rounds": rounds, "runs": []}
    server = EmbeddedRedis(data_dir=base / "redis")
    server.start()
    try:
        credentials.create_backup_key(base / "secrets")
        keys = credentials.backup_keys(base / "secrets")
        for n in sizes:
            root = base / str(n)
            history(root, n, keys)
            times: dict[str, list[float]] = {name: [] for name in RULES}
            for _ in range(rounds):
                for name, stream_from in RULES.items():
                    times[name].append(one(root, server, keys, stream_from))
            record["runs"].append({"messages": n, **{name: {"median_ms": round(statistics.median(t) * 1000),
                                                            "all_ms": [round(x * 1000) for x in t]}
                                                     for name, t in times.items()}})
            shutil.rmtree(root, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    record["machine"]["loadavg_end"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(record) + "\n")
    if args.json:
        print(json.dumps(record))
        return 0
    table = Table("messages", "now, ms", "before, ms", "before / now",
                  title=f"small restore: plan and load, median of {rounds} (a worker from "
                        f"{restore.load.STREAM_FROM:,} messages now; always before)")
    for run in record["runs"]:
        now, before = run["now"]["median_ms"], run["before"]["median_ms"]
        table.add_row(f"{run['messages']:,}", str(now), str(before), f"{before / max(1, now):.2f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
