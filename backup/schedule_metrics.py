"""The backup scheduler's Prometheus metrics (``cfbackup schedule --metrics-port``): what it ran and how long
each backup and each of its copy steps took, when each structure's last good backup ended, what retention removed.

The scheduler observes each backup as its child reports it (``cfbackup run --json``: the manifest, with each
step's seconds); the collector turns the counts into families on each scrape. Names: the ``cfbackup_scheduler_``
namespace, by the conventions of sqm.service.metrics (docs/metrics.md).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cfemu.exposition import histogram, package_version
from cfemu.latency import SLOW_BUCKETS, Latencies

PREFIX = "cfbackup_scheduler_"
RESULTS = ("ok", "busy", "failed")  # busy: another backup of the structure was running (MQRC_CF_STRUC_IN_USE)


class SchedulerMetrics(Collector):
    """The scheduler's counts (thread-safe: the scheduler's loop writes, the HTTP server's thread reads)."""

    def __init__(self, interval: float, keep: int) -> None:
        self.interval = interval
        self.keep = keep
        self.started_at = time.time()
        self.backups: Counter[tuple[str, str]] = Counter()  # (structure, result)
        self.seconds = Latencies(SLOW_BUCKETS)  # structure -> a good backup's wall time, the child's start to exit
        self.step_seconds = Latencies(SLOW_BUCKETS)  # "N label" (backup.protocol.STEPS) -> its copy step's time
        self.last_ok: dict[str, float] = {}  # structure -> when its last good backup ended (epoch seconds)
        self.last_bytes: dict[str, int] = {}  # structure -> message bytes of its last good backup
        self.removed: Counter[str] = Counter()  # structure -> backups retention removed
        self.retention_failures: Counter[str] = Counter()
        self.list_failures = 0  # ticks the CF could not say which structures are ACTIVE
        self.running: str | None = None  # the structure whose backup runs now
        self._lock = threading.Lock()

    # --- what the scheduler reports -----------------------------------------------------------------------------
    def begin(self, structure: str) -> None:
        self.running = structure

    def backup_done(self, structure: str, result: str, seconds: float, manifest: dict[str, Any] | None) -> None:
        with self._lock:
            self.running = None
            self.backups[(structure, result)] += 1
            if result != "ok":
                return
            self.seconds.observe(structure, seconds)
            self.last_ok[structure] = time.time()
            if manifest is not None:
                self.last_bytes[structure] = int(manifest.get("bytes") or 0)
                for step in manifest.get("steps") or []:
                    if "seconds" in step:
                        self.step_seconds.observe(f"{step['step']} {step['label']}", float(step["seconds"]))

    def retained(self, structure: str, removed: int) -> None:
        with self._lock:
            self.removed[structure] += removed

    def retention_failed(self, structure: str) -> None:
        with self._lock:
            self.retention_failures[structure] += 1

    def list_failed(self) -> None:
        with self._lock:
            self.list_failures += 1

    # --- the collector ----------------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        with self._lock:
            backups, last_ok, last_bytes = dict(self.backups), dict(self.last_ok), dict(self.last_bytes)
            removed, failures, list_failures = dict(self.removed), dict(self.retention_failures), self.list_failures
        g = GaugeMetricFamily(f"{PREFIX}info", "The backup scheduler: its version, interval and retention (always "
                              "1)", labels=["version", "interval_seconds", "keep"])
        g.add_metric([package_version(), f"{self.interval:g}", str(self.keep)], 1.0)
        yield g
        c = CounterMetricFamily(f"{PREFIX}backups", "Backups the scheduler ran, by structure and result (ok; busy: "
                                "another backup of it was running; failed)", labels=["structure", "result"])
        for (structure, result), n in sorted(backups.items()):
            c.add_metric([structure, result], n)
        yield c
        yield histogram(f"{PREFIX}backup_duration_seconds", "How long each good backup took, its process's start to "
                        "exit", ["structure"], [([s], lat) for s, lat in self.seconds.items()])
        yield histogram(f"{PREFIX}backup_step_duration_seconds", "How long each copy step of the good backups took "
                        "(backup.protocol.STEPS: its snapshot and copies)", ["step"],
                        [([s], lat) for s, lat in self.step_seconds.items()])
        g = GaugeMetricFamily(f"{PREFIX}last_success_timestamp_seconds", "When the scheduler's last good backup of "
                              "the structure ended, in seconds since the epoch", labels=["structure"])
        for s, t in sorted(last_ok.items()):
            g.add_metric([s], t)
        yield g
        g = GaugeMetricFamily(f"{PREFIX}last_backup_bytes", "Message bytes in the structure's last good backup",
                              labels=["structure"])
        for s, n in sorted(last_bytes.items()):
            g.add_metric([s], n)
        yield g
        g = GaugeMetricFamily(f"{PREFIX}backup_running", "1 while the scheduler's backup of the structure runs",
                              labels=["structure"])
        if self.running is not None:
            g.add_metric([self.running], 1.0)
        yield g
        for name, help_text, counts in (
                ("retention_removed_backups", "Backups the scheduler's retention removed (--keep)", removed),
                ("retention_failures", "Retention passes that failed (tried again after the next good backup)",
                 failures)):
            c = CounterMetricFamily(f"{PREFIX}{name}", help_text, labels=["structure"])
            for s, n in sorted(counts.items()):
                c.add_metric([s], n)
            yield c
        c = CounterMetricFamily(f"{PREFIX}structure_list_failures", "Ticks at which the CF could not say which "
                                "structures are ACTIVE (nothing was backed up)", labels=[])
        c.add_metric([], list_failures)
        yield c


__all__ = ["PREFIX", "RESULTS", "SchedulerMetrics"]
