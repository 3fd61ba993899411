"""Benchmark of units of work sent to a service (BENCHMARKS.md, "uow"): the cost of status tracking.

A UOW lifecycle: a sender (a Conversation on QM1) sends N messages of 1 KiB to a service and COMMITs; a receiver
(a Conversation on QM2) receives all N (RECV_FIRST ... RECV_LAST) and COMMITs. It is measured
  - with persistent status (the service's UWSTATP 1: the PROCESSED status is kept one UOW lifetime) against
    without (UWSTATP 0: no trace remains once the receiver commits),
  - for persistent and non-persistent UOWs (STORE on / off: EntireX's four persistence variations),
  - against the same messages as plain MQ: put N + commit on QM1, get N + commit on QM2 (the baseline),
for N = 1 and N = 4, rounds of every variant interleaved in the same run; medians are reported. Per UOW it also
reports log records, log bytes and fsyncs (both members' log stats, qm.status()), CF operations (Lua scripts
called: each one round trip) and Redis commands (INFO commandstats, which counts the commands inside scripts too),
both including the members' background work over the window (heartbeats, housekeeping, the sweeper).

The two status settings run on two groups of their own (a CF and two members each, alike), so that one group's
sweeper, which scans the statuses a service keeps (sqm.conversations.uowsweeper), does not slow the other's rounds; the MQ
baseline runs on the status-off group. Every member runs its housekeeping and sweeper as in production.

    .venv/bin/python bench/bench_uow.py [--quick] [--seconds 3] [--rounds 3] [--sizes 1 4]

The logs live in a temporary directory on the real disk (never tmpfs: fsync must cost what it costs). Prints a
table and appends one JSON line to bench/results/uow.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from harness import Windows, append_result, measured_on_real_disk
from rich.console import Console
from rich.table import Table

from cfemu import server_module
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from sqm.conversations.conversation import SYNC, Conversation
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.wings import WINGS

BODY = os.urandom(1024)
STRUCTURE, SERVICE, PLAIN = "APP1", "SVC", "PLAIN"
WINDOWS = Windows(seconds=3.0, rounds=3, quick_seconds=0.5)
STATUS_SETTINGS = {"status_on": 1, "status_off": 0}  # the service's UWSTATP


@dataclass
class Group:
    """One CF and two members: QM1 sends, QM2 receives."""
    name: str
    cf: EmbeddedRedis
    qms: list[QueueManager]

    def totals(self) -> dict[str, int]:
        s = [qm.status() for qm in self.qms]
        stats = connect(self.cf.url).info("commandstats")
        operations = ("evalsha", "eval", *(c.lower() for c in server_module.COMMANDS.values()))  # scripts, module
        scripts = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in operations)
        return {"log_records": sum(x["log_records"] for x in s), "log_bytes": sum(x["log_bytes"] for x in s),
                "fsyncs": sum(x["fsyncs"] for x in s), "cf_scripts": scripts,
                "redis_commands": sum(int(v["calls"]) for v in stats.values())}

    def stop(self) -> None:
        for qm in self.qms:
            qm.stop()
        self.cf.stop()


def start_group(work: Path, name: str, status_lifetime: int) -> Group:
    cf = EmbeddedRedis(data_dir=work / name / "cf").start()
    admin = Admin(connect(cf.url))
    admin.define_structure(STRUCTURE)
    admin.define_queue(SERVICE, STRUCTURE, uow={"status_lifetime": status_lifetime, "max_uows": 100_000})
    admin.define_queue(PLAIN, STRUCTURE)
    qms = [QueueManager(QueueManagerConfig(name=f"QM{i}", log_root=work / name / "logs", redis_url=cf.url), wings=WINGS)
           for i in (1, 2)]
    for qm in qms:
        qm.start()
    return Group(name, cf, qms)


# --- the loops: each runs lifecycles until stop_at and returns how many ---------------------------------------
def uow_lifecycles(snd: Conversation, rcv: Conversation, n: int, store: bool, stop_at: float) -> int:
    done = 0
    while time.perf_counter() < stop_at:
        for _ in range(n):
            snd.send(SERVICE, BODY, store=store)
        snd.commit()
        for _ in range(n):
            got = rcv.receive(SERVICE, option=SYNC, wait_ms=1000)
        if got.recv not in ("RECV_LAST", "RECV_ONLY"):  # the UOW was not received whole: the figures would lie
            raise RuntimeError(f"unit of work {got.uow}: its last message came as {got.recv}")
        rcv.commit()
        done += 1
    return done


def mq_lifecycles(put: Connection, get: Connection, n: int, store: bool, stop_at: float) -> int:
    done = 0
    while time.perf_counter() < stop_at:
        for _ in range(n):
            put.put(PLAIN, BODY, persistent=store)
        put.commit()
        for _ in range(n):
            get.get(PLAIN, wait_ms=1000)
        get.commit()
        done += 1
    return done


@dataclass
class Variant:
    name: str  # e.g. "uow persistent, status on"
    group: Group
    n: int
    loop: Callable[[float], int]


def variants(groups: dict[str, Group], sizes: list[int]) -> list[Variant]:
    out: list[Variant] = []
    for n in sizes:
        for store in (True, False):
            per = "persistent" if store else "non-persistent"
            for setting in STATUS_SETTINGS:
                g = groups[setting]
                snd, rcv = Conversation(g.qms[0], "sender", "s1"), Conversation(g.qms[1], "receiver", "r1")
                out.append(Variant(f"UOW {per}, {setting.replace('_', ' ')}", g, n,
                                   partial(uow_lifecycles, snd, rcv, n, store)))
            g = groups["status_off"]
            put, get = g.qms[0].connect(), g.qms[1].connect()
            out.append(Variant(f"MQ {per} (baseline)", g, n,
                               partial(mq_lifecycles, put, get, n, store)))
    return out


def window(v: Variant, seconds: float) -> dict[str, float]:
    """One measuring window of a variant: lifecycles per second and the per-UOW costs."""
    before = v.group.totals()
    t0 = time.perf_counter()
    done = v.loop(t0 + seconds)
    elapsed = time.perf_counter() - t0
    after = v.group.totals()
    out = {"per_s": done / elapsed, "messages_per_s": done * v.n / elapsed}
    out.update({k: (after[k] - before[k]) / done for k in before})
    return out


def measure(work: Path, seconds: float, rounds: int, sizes: list[int], console: Console) -> dict[str, Any]:
    groups: dict[str, Group] = {}
    try:
        for setting, mult in STATUS_SETTINGS.items():
            groups[setting] = start_group(work, setting, mult)
        vs = variants(groups, sizes)
        for v in vs:  # warm up: connections, scripts, caches
            v.loop(time.perf_counter() + min(seconds, 0.3))
        samples: dict[tuple[str, int], list[dict[str, float]]] = {(v.name, v.n): [] for v in vs}
        for r in range(rounds):
            console.log(f"round {r + 1}/{rounds}")
            for v in vs:
                samples[(v.name, v.n)].append(window(v, seconds))
        rows = []
        for (name, n), ws in samples.items():
            row: dict[str, Any] = {"variant": name, "messages": n}
            for k in ws[0]:
                row[k] = round(statistics.median(w[k] for w in ws), 2 if k != "per_s" else 1)
            rows.append(row)
        kept = {s: int(connect(g.cf.url).info("keyspace").get("db0", {}).get("keys", 0)) for s, g in groups.items()}
        return {"rows": rows, "cf_keys_at_end": kept, "rounds": rounds, "seconds_per_window": seconds,
                "sizes": sizes}
    finally:
        for g in groups.values():
            g.stop()


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """status on / status off, and UOW / MQ baseline, per size and persistence."""
    by = {(r["variant"], r["messages"]): r for r in rows}
    out: dict[str, float] = {}
    for n in sorted({r["messages"] for r in rows}):
        for per in ("persistent", "non-persistent"):
            on, off = by[(f"UOW {per}, status on", n)], by[(f"UOW {per}, status off", n)]
            mq = by[(f"MQ {per} (baseline)", n)]
            out[f"on_over_off_{per}_{n}"] = round(on["per_s"] / off["per_s"], 3)
            out[f"off_over_mq_{per}_{n}"] = round(off["per_s"] / mq["per_s"], 3)
    return out


def report(result: dict[str, Any], console: Console) -> None:
    table = Table("messages", "variant", "UOWs/s", "msgs/s", "log records/UOW", "log bytes/UOW", "fsyncs/UOW",
                  "CF scripts/UOW", "Redis commands/UOW", title="UOW lifecycles (send N + COMMIT on QM1, receive N + COMMIT on QM2)")
    for r in result["rows"]:
        table.add_row(str(r["messages"]), r["variant"], str(r["per_s"]), str(round(r["messages_per_s"], 1)),
                      str(r["log_records"]), str(round(r["log_bytes"])), str(r["fsyncs"]), str(r["cf_scripts"]),
                      str(round(r["redis_commands"])))
    console.print(table)
    console.print("ratios: " + ", ".join(f"{k} {v}" for k, v in result["ratios"].items()))
    m = result["machine"]
    console.print(f"load average {m['load_average_at_start']} at start, {m['load_average_at_end']} at end on "
                  f"{m['nproc']} CPUs ({m['cpu']}); log on {m['log_filesystem']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    WINDOWS.add_to(ap)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4], help="messages per UOW")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where the temporary CFs and logs go (default: the system temp dir; must be a real disk)")
    args = ap.parse_args(argv)
    seconds, rounds = WINDOWS.of(ap, args)
    if any(n < 1 for n in args.sizes):
        ap.error("--sizes: a UOW holds at least 1 message")
    console = Console()
    result = measured_on_real_disk("uow", args.work_dir, console,
                                   lambda work: measure(work, seconds, rounds, args.sizes, console),
                                   body_bytes=len(BODY), quick=args.quick)
    if result is None:
        return 2
    result["ratios"] = ratios(result["rows"])
    report(result, console)
    append_result("uow", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
