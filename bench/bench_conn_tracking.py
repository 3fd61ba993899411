"""Benchmark of what DISPLAY CONN's and DISPLAY QSTATUS's bookkeeping costs a request (BENCHMARKS.md, "connection
tracking").

A member (in process, on a real redis-server and a log on the real disk) runs non-persistent put + get outside
syncpoint (two CF calls, no fsync: where a per-request cost shows most) through the service's own handlers
(sqm.service.queue_ops.put and get), each request preceded by what the dispatcher does for DISPLAY CONN (the
session's request count and last request time) and followed by the handler's QueueActivity store (the queue's last
put or get, the session's queues), in windows interleaved with windows where that bookkeeping is a no-op. The ratio
of the medians (tracked / untracked requests per second) is its cost, and the bookkeeping alone is timed in a
tight loop, as a share of one untracked request's time (the steadier figure on a loaded machine); no CF call is
added by it either way.

    .venv/bin/python bench/bench_conn_tracking.py [--quick] [--seconds 2] [--rounds 5]

Prints a table and appends one JSON line to bench/results/conn_tracking.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from harness import Windows, append_result, load_average, one_member
from rich.console import Console
from rich.table import Table

from sqm.core.client_watch import ClientWatch
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager
from sqm.service import queue_ops
from sqm.service.protocol import MAX_FRAME
from sqm.service.queue_activity import QueueActivity

QUEUE, BODY = "Q1", b"x" * 1024
WINDOWS = Windows(seconds=2.0, rounds=5, quick_seconds=0.5)


class NoActivity(QueueActivity):
    """A QueueActivity that keeps nothing (the baseline)."""

    def put(self, used: set[str], queue: str) -> None:
        pass

    def got(self, used: set[str], queue: str) -> None:
        pass


@dataclass
class Svc:
    qm: QueueManager
    activity: QueueActivity
    max_wait_ms: int = 60_000
    stopping: bool = False


@dataclass
class Sess:
    number: int = 1
    role: str = "application"
    reply_limit: int = MAX_FRAME
    conn: Connection | None = None
    gone: ClientWatch = field(default_factory=ClientWatch)
    queues: set[str] = field(default_factory=set)
    served: int = 0
    last_request: float = 0.0

    def reply_room(self, messages: int = 1) -> int:
        return self.reply_limit


def requests(svc: Svc, session: Sess, tracked: bool, stop_at: float) -> int:
    put_args: dict[str, Any] = {"queue": QUEUE, "body": BODY, "persistent": False, "syncpoint": False}
    get_args: dict[str, Any] = {"queue": QUEUE, "syncpoint": False, "wait_ms": 1000}
    n = 0
    while time.perf_counter() < stop_at:
        for handler, args in ((queue_ops.put, put_args), (queue_ops.get, get_args)):
            if tracked:  # what SQMServer.dispatch does for DISPLAY CONN before each handler
                session.served += 1
                session.last_request = time.time()
            handler(svc, session, args)  # type: ignore[arg-type]
            n += 1
    return n


def bookkeeping_ns(activity: QueueActivity, session: Sess, n: int = 200_000) -> float:
    """The bookkeeping alone, per request (median of 5 runs of n): the dispatcher's two stores and one activity
    store, as each tracked request above does them."""
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            session.served += 1
            session.last_request = time.time()
            activity.put(session.queues, QUEUE)
        runs.append((time.perf_counter() - t0) / n * 1e9)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    WINDOWS.add_to(ap)
    args = ap.parse_args(argv)
    seconds, rounds = WINDOWS.of(ap, args)
    with one_member("conn", QUEUE) as (host, qm):
        session = Sess()
        on, off = Svc(qm, QueueActivity()), Svc(qm, NoActivity())
        requests(on, session, True, time.perf_counter() + 0.3)  # warm: scripts loaded, connection open
        rates: dict[str, list[float]] = {"untracked": [], "tracked": []}
        for i in range(rounds):  # each round in the other order: neither window always runs first
            for name, svc in (("untracked", off), ("tracked", on))[::1 if i % 2 == 0 else -1]:
                t0 = time.perf_counter()
                n = requests(svc, session, name == "tracked", t0 + seconds)
                rates[name].append(n / (time.perf_counter() - t0))
        medians = {k: round(statistics.median(v), 1) for k, v in rates.items()}
        bookkeeping = bookkeeping_ns(on.activity, session)
        result: dict[str, Any] = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": host, "seconds": seconds,
            "rounds": rounds, "requests_per_s": medians,
            "ratio_tracked_over_untracked": round(medians["tracked"] / medians["untracked"], 3),
            "bookkeeping_ns_per_request": round(bookkeeping),
            "bookkeeping_share_of_request": round(bookkeeping * 1e-9 * medians["untracked"], 5),
            "load_average_at_end": load_average()}
    table = Table(title="connection tracking: non-persistent put and get requests per second (median of rounds)")
    for col in ("untracked", "tracked", "tracked / untracked"):
        table.add_column(col, justify="right")
    table.add_row(str(medians["untracked"]), str(medians["tracked"]), str(result["ratio_tracked_over_untracked"]))
    Console().print(table)
    Console().print(f"the bookkeeping alone: {result['bookkeeping_ns_per_request']} ns a request, "
                    f"{result['bookkeeping_share_of_request']:.3%} of an untracked request's time")
    append_result("conn_tracking", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
