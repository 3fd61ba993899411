"""Benchmark of the network service (BENCHMARKS.md, "service"): client lifecycle throughput through `sqm run`
servers, as a ratio to the in-process API in the same run.

A lifecycle is one 1 KiB persistent message put and committed, then got and committed (each commit forces the
log), exactly as in bench_lifecycle.py (its loop is reused). With 1, 8 and 32 clients spread over 3 SQMs:
  service:    a local cluster (qsg.local_group: an embedded CF, 3 `sqm run` processes), each client a sqm.service.client.Client
              in its own thread of this process, client i on server i mod 3;
  in-process: 3 QueueManagers in this process on the same CF, each client a sqm.core.manager.Connection in its own
              thread, client i on manager i mod 3.
Rounds of the two are interleaved; each figure is the median over the rounds.

    .venv/bin/python bench/bench_service.py [--quick] [--seconds 5] [--rounds 3] [--clients 1 8 32]

Logs go to a temporary directory under var/ on the real disk. Prints a table and appends one JSON line to
bench/results/service.jsonl.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from bench_lifecycle import QUEUE, STRUCTURE, in_threads, sqm_lifecycles
from harness import Windows, append_result, load_average, machine
from rich.console import Console
from rich.table import Table

from qsg.local_group import LocalGroup
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.service.client import Client
from sqm.wings import WINGS

REPO = Path(__file__).resolve().parents[1]
MANAGERS = 3
# Leases long enough that a member starved of CPU on a loaded machine is not fenced by its peers mid-measurement
# (failure detection is not what is measured here).
LEASE_MS = 60_000


def measure_service(cluster: LocalGroup, clients: int, seconds: float) -> float:
    endpoints = [f"{host}:{port}" for _, host, port in cluster.endpoints]
    handles = [Client(endpoints[i % MANAGERS], token=cluster.token, reconnect_timeout=5) for i in range(clients)]
    try:
        return in_threads([partial(sqm_lifecycles, h) for h in handles], seconds)  # type: ignore[arg-type]
    finally:
        for h in handles:
            h.close()


def measure_in_process(qms: list[QueueManager], clients: int, seconds: float) -> float:
    conns = [qms[i % MANAGERS].connect() for i in range(clients)]
    try:
        return in_threads([partial(sqm_lifecycles, c) for c in conns], seconds)
    finally:
        for c in conns:
            c.close()


WINDOWS = Windows(seconds=5.0, rounds=3, quick_seconds=1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    WINDOWS.add_to(ap)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--work-dir", type=Path, default=REPO / "var", help="where the logs go (a real disk)")
    args = ap.parse_args(argv)
    args.seconds, args.rounds = WINDOWS.of(ap, args)
    console = Console()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-service-", dir=args.work_dir))
    info = machine(work)
    started = datetime.now(UTC)
    cluster = LocalGroup.up(work / "cluster", managers=MANAGERS, backup_interval=None, structure=STRUCTURE,
                            queues=(QUEUE,), lease_ms=LEASE_MS)
    qms = [QueueManager(QueueManagerConfig(name=f"INPROC{i + 1}", log_root=cluster.log_root,
                                           redis_url=cluster.cf_url("member"), lease_ms=LEASE_MS), wings=WINGS)
           for i in range(MANAGERS)]
    for qm in qms:
        qm.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for n in args.clients:
            service, in_process = [], []
            for k in range(args.rounds):
                console.print(f"[dim]{n} client(s), round {k + 1}/{args.rounds}[/dim]")
                in_process.append(measure_in_process(qms, n, args.seconds))
                service.append(measure_service(cluster, n, args.seconds))
            s, p = statistics.median(service), statistics.median(in_process)
            results[n] = {"service_per_s": round(s, 1), "in_process_per_s": round(p, 1), "ratio": round(s / p, 3),
                          "service_rounds": [round(x, 1) for x in service],
                          "in_process_rounds": [round(x, 1) for x in in_process]}
    finally:
        for qm in qms:
            qm.stop()
        cluster.down()
        shutil.rmtree(work, ignore_errors=True)

    table = Table("clients", "in-process lifecycles/s", "service lifecycles/s", "ratio",
                  title=f"client lifecycle throughput over {MANAGERS} SQMs (1 KiB persistent, put+commit, "
                        "get+commit)")
    for n, r in results.items():
        table.add_row(str(n), f"{r['in_process_per_s']:.0f}", f"{r['service_per_s']:.0f}", f"{r['ratio']:.2f}")
    console.print(table)
    info["load_average_at_end"] = load_average()
    console.print(f"machine: {info}")
    record = {"benchmark": "service", "date": started.isoformat(timespec="seconds"), "quick": args.quick,
              "seconds": args.seconds, "rounds": args.rounds, "managers": MANAGERS, "machine": info,
              "results": {str(k): v for k, v in results.items()}, "elapsed_s": round(time.time() - started.timestamp())}
    append_result("service", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
