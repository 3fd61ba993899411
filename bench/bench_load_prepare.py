"""Benchmark of the restore load's preparing work on one columnar plan (BENCHMARKS.md, "A load prepared in C"): the
CPU an entry of the thread that makes the load's batches, by the Python path (restore.load.staged of the plan's
survivors: each decoded, made Settled, and packed again by cfemu.bulk.prepare) against the C path (the plan's own
staged: restore.columnar_staged, cfemu.bulk.prepare_columns), alternated in one process on the same plan, and the
bytes of both checked equal. Data: bench_restore.py's generator (its messages survive a restore).

    .venv/bin/python bench/bench_load_prepare.py [--quick] [--messages N] [--rounds R]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_restore as br  # noqa: E402  (this directory's: run as a script)

from backup.files import read_backup  # noqa: E402
from cfemu import bulk  # noqa: E402
from cfemu.progress import no_progress  # noqa: E402
from restore import load  # noqa: E402
from restore.engine import get_engine  # noqa: E402
from restore.engine_columnar import ColumnarPlan  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "load_prepare.jsonl"
MEMORY = 512 << 20


def thread_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def measured(source: Iterator[tuple[bulk.Staged, int]]) -> tuple[float, int, str]:
    """Thread CPU seconds to iterate the load's source, its entries, and the sha1 of its batches' commands."""
    t0, n, digest = thread_cpu_s(), 0, hashlib.sha1()
    for st, floor in source:
        n += st.entries
        digest.update(st.commands.data())
        digest.update(b"%d" % floor)
    return thread_cpu_s() - t0, n, digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run: 20k messages, 2 rounds")
    ap.add_argument("--messages", type=int, default=200_000, help="messages to restore (log records: twice)")
    ap.add_argument("--body", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    messages, rounds = (20_000, 2) if args.quick else (args.messages, args.rounds)
    console = Console()
    root = Path(tempfile.mkdtemp(prefix="bench-load-prepare-"))
    try:
        br.generate(root, 2 * messages, messages, args.body)
        backup = read_backup(root / "backup" / br.S / "b", backup_keys=br.bench_keys(root))
        (root / "work").mkdir()
        plan = get_engine("columnar", memory=MEMORY, work_dir=root / "work", workers=2).plan(
            br.S, backup, br.find_log_dirs(root / "logs"), br.REPLAY_FROM, br.NOW_MS, no_progress)
        assert isinstance(plan, ColumnarPlan)
        batch_bytes = load.batch_bytes_for(MEMORY)
        cpu: dict[str, list[float]] = {"python": [], "c": []}
        digests: dict[str, set[str]] = {"python": set(), "c": set()}
        entries = 0
        try:
            for _ in range(rounds):
                for path in ("python", "c"):
                    source = (plan.staged(br.S, load.BATCH, batch_bytes) if path == "c"
                              else load.staged(br.S, plan.in_load_order(), load.BATCH, batch_bytes))
                    seconds, entries, digest = measured(source)
                    cpu[path].append(seconds)
                    digests[path].add(digest)
        finally:
            plan.close()
        same = digests["python"] == digests["c"] and len(digests["c"]) == 1
        table = Table("path", "entries", "CPU s (each round)", "best us an entry",
                      title=f"the load's preparing thread, {messages:,} messages of {args.body} B, load average "
                            f"{os.getloadavg()[0]:.1f}")
        for path, label in (("python", "Python (load.staged + bulk.prepare)"), ("c", "C (plan.staged)")):
            table.add_row(label, f"{entries:,}", ", ".join(f"{s:.2f}" for s in cpu[path]),
                          f"{min(cpu[path]) / max(1, entries) * 1e6:.2f}")
        console.print(table)
        ratio = min(cpu["python"]) / max(1e-9, min(cpu["c"]))
        console.print(f"C path: {ratio:.1f}x less CPU; the same bytes: {'yes' if same else 'NO'}")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a") as f:
            f.write(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "messages": messages,
                                "entries": entries, "body": args.body, "cpu_s": cpu, "same_bytes": same,
                                "python_over_c": round(ratio, 2), "loadavg": os.getloadavg()}) + "\n")
        return 0 if same else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
