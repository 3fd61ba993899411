"""Benchmark of what the latency histograms cost (BENCHMARKS.md, "metrics overhead"), and what a scrape costs.

A member (in process, on a real redis-server and a log on the real disk) runs put + commit + get + commit
lifecycles of persistent 1 KiB messages, each lifecycle's four operations timed as the service's op table times
them (sqm.service.metrics.timed_handlers: one timing per operation), its CF calls and fsyncs timed as always, in
windows interleaved with windows where every Latency is replaced by one that records nothing. The ratio of the
medians (timed / untimed lifecycles per second) is the histograms' cost. Then the time one scrape of the member's
registry (prometheus_client.generate_latest) takes, every operation's histogram filled.

    .venv/bin/python bench/bench_metrics_overhead.py [--quick] [--seconds 2] [--rounds 5]

Prints a table and appends one JSON line to bench/results/metrics_overhead.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime
from typing import Any

from harness import Windows, append_result, load_average, one_member
from prometheus_client import generate_latest
from rich.console import Console
from rich.table import Table

from cfemu.latency import Latencies, Latency
from sqm.core.manager import QueueManager
from sqm.service import metrics
from sqm.service.ops import OPERATIONS

QUEUE, BODY = "Q1", b"x" * 1024
WINDOWS = Windows(seconds=2.0, rounds=5, quick_seconds=0.5)
WORKLOADS = {"persistent put+commit+get+commit": True, "non-persistent put+get": False}


class NoLatency(Latency):
    """A Latency that records nothing (the baseline)."""

    def observe(self, seconds: float) -> None:
        pass


class NoLatencies(Latencies):
    def __getitem__(self, key: str) -> Latency:
        return NO_LATENCY


NO_LATENCY = NoLatency()


def lifecycles(qm: QueueManager, op_seconds: Latencies, stop_at: float, persistent: bool) -> int:
    """Persistent: put, commit, get, commit (each commit waits for an fsync). Not: a non-persistent put and get
    outside syncpoint (no log, two CF calls: where a timing's cost shows most)."""
    conn = qm.connect()
    put, get, commit = op_seconds["put"], op_seconds["get"], op_seconds["commit"]
    n = 0
    while time.perf_counter() < stop_at:
        with put.time():
            conn.put(QUEUE, BODY, persistent=persistent, syncpoint=persistent)
        if persistent:
            with commit.time():
                conn.commit()
        with get.time():
            conn.get(QUEUE, wait_ms=1000, syncpoint=persistent)
        if persistent:
            with commit.time():
                conn.commit()
        n += 1
    conn.close()
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    WINDOWS.add_to(ap)
    args = ap.parse_args(argv)
    seconds, rounds = WINDOWS.of(ap, args)
    with one_member("metrics", QUEUE) as (host, qm):
        assert qm.log is not None
        timed = (Latency(), Latency(), Latencies())
        untimed = (NO_LATENCY, NO_LATENCY, NoLatencies())
        rates: dict[str, list[float]] = {f"{w} {t}": [] for w in WORKLOADS for t in ("untimed", "timed")}
        lifecycles(qm, timed[2], time.perf_counter() + 0.3, True)  # warm: scripts loaded, connection open
        for _ in range(rounds):
            for workload, persistent in WORKLOADS.items():
                for name, (cf_calls, fsyncs, ops) in (("untimed", untimed), ("timed", timed)):
                    qm.cf_call_seconds, qm.log.stats.fsync_seconds = cf_calls, fsyncs
                    t0 = time.perf_counter()
                    n = lifecycles(qm, ops, t0 + seconds, persistent)
                    rates[f"{workload} {name}"].append(n / (time.perf_counter() - t0))
        qm.cf_call_seconds, qm.log.stats.fsync_seconds = timed[0], timed[1]
        for op in OPERATIONS:  # every histogram filled, as on a member that ran every operation
            timed[2][op.name].observe(0.001)
        registry = metrics.make_registry(qm, op_seconds=timed[2])
        scrapes, size = [], 0
        for _ in range(20):
            t0 = time.perf_counter()
            size = len(generate_latest(registry))
            scrapes.append(time.perf_counter() - t0)
        result: dict[str, Any] = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": host,
            "seconds": seconds, "rounds": rounds,
            "lifecycles_per_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
            "ratio_timed_over_untimed": {w: round(statistics.median(rates[f"{w} timed"])
                                                  / statistics.median(rates[f"{w} untimed"]), 3) for w in WORKLOADS},
            "scrape_ms_median": round(statistics.median(scrapes) * 1000, 2), "scrape_bytes": size,
            "load_average_at_end": load_average()}
    table = Table(title="latency histograms: lifecycles per second (median of rounds), and one scrape")
    for col in ("workload", "untimed", "timed", "timed / untimed"):
        table.add_column(col, justify="right")
    for w in WORKLOADS:
        table.add_row(w, str(result["lifecycles_per_s"][f"{w} untimed"]), str(result["lifecycles_per_s"][f"{w} timed"]),
                      str(result["ratio_timed_over_untimed"][w]))
    Console().print(table)
    Console().print(f"one scrape of the member's registry: {result['scrape_ms_median']} ms, {size} bytes")
    append_result("metrics_overhead", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
