"""Benchmark of durable publish and subscribe (BENCHMARKS.md, "pubsub"): one copy per publication against one copy
per queue.

A publication of one 1 KiB message is published on QM1 (PubSubSession: publish + COMMIT) to a topic with K durable
subscriptions; each subscriber (a session of its own on QM2) receives it and COMMITs (its position moves). Against
it, the same message put to K queues in one unit of work on QM1 (put K + COMMIT), and each queue's reader on QM2
gets it and COMMITs. For K = 1, 10 and 100, rounds of both interleaved in the same run; medians are reported:
  - publish/s: the publisher's side alone (publish + COMMIT, against put K + COMMIT),
  - delivered/s: whole lifecycles (publish, then every subscriber receives and commits; put K, every reader gets),
  - storage per publication: structure entries and bytes (cfemu's {S}:meta counters) per publication left
    unconsumed (a publication is kept once whatever K; the queues keep K copies), and the subscription entries.
Every member runs its housekeeping as in production, the publish/subscribe sweeper included (it removes what every
subscriber has committed).

    .venv/bin/python bench/bench_pubsub.py [--quick] [--seconds 2] [--rounds 3] [--subscribers 1 10 100]

The logs live in a temporary directory on the real disk (never tmpfs: fsync must cost what it costs). Prints a
table and appends one JSON line to bench/results/pubsub.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness import Windows, append_result, measured_on_real_disk
from rich.console import Console
from rich.table import Table

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from cfemu.errors import NoMessageError
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.pubsub import pubsub as ps
from sqm.wings import WINGS

BODY = os.urandom(1024)
STRUCTURE = "APP1"
WINDOWS = Windows(seconds=2.0, rounds=3, quick_seconds=0.3)


class Group:
    def __init__(self, work: Path, k: int) -> None:
        self.k = k
        self.cf = EmbeddedRedis(data_dir=work / f"k{k}" / "cf").start()
        admin = Admin(connect(self.cf.url))
        admin.define_structure(STRUCTURE)
        self.topic = f"T{k}"
        admin.define_queue(self.topic, STRUCTURE, topic={})
        self.queues = [f"Q{k}.{i}" for i in range(k)]
        for q in self.queues:
            admin.define_queue(q, STRUCTURE)
        self.qms = [QueueManager(QueueManagerConfig(name=f"QM{i}", log_root=work / f"k{k}" / "logs",
                                                    redis_url=self.cf.url), wings=WINGS) for i in (1, 2)]
        for qm in self.qms:
            qm.start()
        self.subs = [f"s{i}" for i in range(k)]
        for name in self.subs:
            ps.subscribe(self.qms[1], self.topic, name)
        self.publisher = ps.PubSubSession(self.qms[0])
        self.receivers = [ps.PubSubSession(self.qms[1]) for _ in self.subs]
        self.putter = self.qms[0].connect()
        self.getters = [self.qms[1].connect() for _ in self.queues]

    def meta(self) -> tuple[int, int]:
        info = self.qms[0].structure(STRUCTURE).info()
        return int(info["entries"]), int(info["bytes"])

    def stop(self) -> None:
        for qm in self.qms:
            qm.stop()
        self.cf.stop()


def publish_only(g: Group, stop_at: float) -> int:
    n = 0
    while time.perf_counter() < stop_at:
        g.publisher.publish(g.topic, BODY, commit=True)
        n += 1
    return n


def put_only(g: Group, stop_at: float) -> int:
    n = 0
    while time.perf_counter() < stop_at:
        for q in g.queues:
            g.putter.put(q, BODY)
        g.putter.commit()
        n += 1
    return n


def drain(g: Group) -> None:
    """What the publish-only windows left: every subscriber receives it, every reader gets it."""
    for name, r in zip(g.subs, g.receivers, strict=True):
        while True:
            try:
                r.receive(g.topic, name)
            except NoMessageError:
                break
        r.commit()
    for q, c in zip(g.queues, g.getters, strict=True):
        while True:
            try:
                c.get(q)
            except NoMessageError:
                break
        c.commit()


def pubsub_lifecycles(g: Group, stop_at: float) -> int:
    n = 0
    while time.perf_counter() < stop_at:
        g.publisher.publish(g.topic, BODY, commit=True)
        for name, r in zip(g.subs, g.receivers, strict=True):
            if r.receive(g.topic, name, wait_ms=1000).messages != [BODY]:
                raise RuntimeError("a publication was not received whole")
            r.commit()
        n += 1
    return n


def mq_lifecycles(g: Group, stop_at: float) -> int:
    n = 0
    while time.perf_counter() < stop_at:
        for q in g.queues:
            g.putter.put(q, BODY)
        g.putter.commit()
        for q, c in zip(g.queues, g.getters, strict=True):
            c.get(q, wait_ms=1000)
            c.commit()
        n += 1
    return n


def settle(g: Group, timeout_s: float = 15.0) -> None:
    """Wait until the sweeper has removed every publication all subscribers committed (so that the counters move
    only by what storage() adds)."""
    s, deadline = g.qms[0].structure(STRUCTURE), time.monotonic() + timeout_s
    while s.browse(ps.topic(g.qms[0], g.topic).pub_queue, 1, 0) and time.monotonic() < deadline:
        time.sleep(0.1)


def storage(g: Group, count: int) -> dict[str, float]:
    """Entries and bytes per publication held, both ways, then drained."""
    settle(g)
    e0, b0 = g.meta()
    for _ in range(count):
        g.publisher.publish(g.topic, BODY, commit=True)
    e1, b1 = g.meta()
    for _ in range(count):
        for q in g.queues:
            g.putter.put(q, BODY)
        g.putter.commit()
    e2, b2 = g.meta()
    drain(g)
    return {"pub_entries": (e1 - e0) / count, "pub_bytes": (b1 - b0) / count,
            "mq_entries": (e2 - e1) / count, "mq_bytes": (b2 - b1) / count}


def measure(work: Path, seconds: float, rounds: int, ks: list[int], console: Console) -> dict[str, Any]:
    rows = []
    for k in ks:
        g = Group(work, k)
        try:
            loops = {"publish": publish_only, "put K": put_only, "pubsub lifecycle": pubsub_lifecycles,
                     "MQ lifecycle": mq_lifecycles}
            rates: dict[str, list[float]] = {name: [] for name in loops}
            for _ in range(rounds):
                for name, loop in loops.items():
                    t0 = time.perf_counter()
                    n = loop(g, t0 + seconds)
                    rates[name].append(n / (time.perf_counter() - t0))
                    drain(g)
            store = storage(g, 20)
            subs_bytes = sum(len(s.pack()) for s in ps.subscriptions(g.qms[1], ps.topic(g.qms[1], g.topic)))
            rows.append({"subscribers": k, **{name: round(statistics.median(v), 1) for name, v in rates.items()},
                         **store, "subscription_bytes_each": round(subs_bytes / k, 1)})
            console.print(f"K={k} done")
        finally:
            g.stop()
    return {"rows": rows}


def report(result: dict[str, Any], console: Console) -> None:
    table = Table("K", "publish/s", "put K/s", "pubsub deliv./s", "MQ deliv./s", "entries/pub", "bytes/pub",
                  "entries/MQ", "bytes/MQ", "sub entry bytes",
                  title="publications of one 1 KiB message to K durable subscribers vs put to K queues in one UOW")
    for r in result["rows"]:
        table.add_row(str(r["subscribers"]), str(r["publish"]), str(r["put K"]), str(r["pubsub lifecycle"]),
                      str(r["MQ lifecycle"]), str(r["pub_entries"]), str(round(r["pub_bytes"])),
                      str(r["mq_entries"]), str(round(r["mq_bytes"])), str(r["subscription_bytes_each"]))
    console.print(table)
    m = result["machine"]
    console.print(f"load average {m['load_average_at_start']} at start, {m['load_average_at_end']} at end on "
                  f"{m['nproc']} CPUs ({m['cpu']}); log on {m['log_filesystem']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    WINDOWS.add_to(ap, "a short run: 1 round of 0.3 s windows, K = 1 and 10")
    ap.add_argument("--subscribers", type=int, nargs="+", default=None, help="K values (default 1 10 100)")
    ap.add_argument("--work-dir", type=Path, default=None, help="where the CFs and logs go (a real disk)")
    args = ap.parse_args(argv)
    seconds, rounds = WINDOWS.of(ap, args)
    ks = args.subscribers or ([1, 10] if args.quick else [1, 10, 100])
    if any(k < 1 for k in ks):
        ap.error("every K must be >= 1")
    console = Console()
    result = measured_on_real_disk("pubsub", args.work_dir, console,
                                   lambda work: measure(work, seconds, rounds, ks, console),
                                   body_bytes=len(BODY), quick=args.quick)
    if result is None:
        return 2
    report(result, console)
    append_result("pubsub", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
