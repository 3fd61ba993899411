"""Latency histograms as plain counters: how long a kind of step took, counted into fixed buckets.

Library code on every floor (the log's fsync, the queue manager's CF calls, a restore's phases, the service's
operations) observes durations into a ``Latency`` without knowing who exports it; the Prometheus collectors
(sqm.service.metrics, the scheduler's and the supervisor's) turn a ``snapshot`` into a histogram family on each
scrape. The buckets are fixed at construction, so an observation is a few integer additions under a lock, never
an allocation, and the exposition's ``le`` values never change between scrapes (Prometheus's histogram_quantile
needs that).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Requests, CF calls, fsyncs: from 100 microseconds (a CF call on loopback) to 10 s (a get that waited).
FAST_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                   0.5, 1.0, 2.5, 5.0, 10.0)
# Backups, restores and their phases: from 10 ms (an empty structure) to an hour.
SLOW_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                                   600.0, 1800.0, 3600.0)


@dataclass(frozen=True)
class Snapshot:
    """A histogram as Prometheus exposes it: cumulative counts per upper bound (the last one +Inf), the sum."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    sum: float


class Latency:
    """One histogram of durations in seconds (thread-safe)."""

    def __init__(self, buckets: tuple[float, ...] = FAST_BUCKETS) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(f"histogram buckets must be distinct and ascending, not {buckets}")
        self.bounds = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.bounds, seconds)  # le: a duration equal to a bound counts in that bucket
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def time(self) -> _Timing:
        """Observe the duration of the ``with`` block, whether it returns or raises (a plain object, not a
        generator-based context manager: it times every request and CF call, so it costs a microsecond)."""
        return _Timing(self)

    def snapshot(self) -> Snapshot:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts):
            running += n
            cumulative.append((bound, running))
        return Snapshot(tuple(cumulative), running, total)


class _Timing:
    __slots__ = ("latency", "t0")

    def __init__(self, latency: Latency) -> None:
        self.latency = latency
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.latency.observe(time.perf_counter() - self.t0)


class Latencies:
    """Histograms of one kind of step, one per label value (an operation, a phase): created on first use, with
    the same buckets. The label values must come from a fixed set of the caller's (never from a peer's input),
    as each is a time series of its own."""

    def __init__(self, buckets: tuple[float, ...] = FAST_BUCKETS) -> None:
        self.buckets = buckets
        self._by: dict[str, Latency] = {}
        self._lock = threading.Lock()

    def __getitem__(self, key: str) -> Latency:
        found = self._by.get(key)
        if found is None:
            with self._lock:
                found = self._by.setdefault(key, Latency(self.buckets))
        return found

    def observe(self, key: str, seconds: float) -> None:
        self[key].observe(seconds)

    def items(self) -> list[tuple[str, Latency]]:
        with self._lock:
            return sorted(self._by.items())


class PhaseTimes:
    """A progress callback (cfemu.progress) that times the phases it is told of into ``latencies``, one label
    value per phase: a phase lasts from its first report to the first report of the next (phases come one after
    another), the last one until ``finish``. ``inner`` is told everything as it comes."""

    def __init__(self, latencies: Latencies, inner: Callable[[str, int, int | None], None] | None = None) -> None:
        self.latencies = latencies
        self.inner = inner
        self._phase: str | None = None
        self._since = 0.0

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if phase != self._phase:
            self.finish()
            self._phase, self._since = phase, time.perf_counter()
        if self.inner is not None:
            self.inner(phase, done, total)

    def finish(self) -> None:
        if self._phase is not None:
            self.latencies.observe(self._phase, time.perf_counter() - self._since)
            self._phase = None


__all__ = ["FAST_BUCKETS", "SLOW_BUCKETS", "Latencies", "Latency", "PhaseTimes", "Snapshot"]
