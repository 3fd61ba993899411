"""Benchmark of log management and selective relogging (BENCHMARKS.md, "logs"), on a private redis-server started and
stopped here.

The steady workload: each checkpoint interval puts --per-interval persistent messages (--body bytes, UOWs of 5 puts);
10% are long-lived (queue LONG, each consumed --stay intervals after its put), the rest are short-lived (queue SHORT:
consumed in the next interval, so each is on the queue at one checkpoint). One interval ends with one checkpoint
(LOGLOAD's, compressed in time: each stands for a checkpoint interval, 300 s by default, so 120 intervals are 10
hours of such activity).

  (a) relog records and bytes per checkpoint, selective relogging with a CPL of n = 3 against relogging every
      message at every checkpoint (IMS/SNAP, the recovery-enhancement patent's prior art: measured for real, each
      checkpoint a termination-style pass), in the same run on the same machine;
  (b) restart time and CF restore time against the log span (intervals of activity before the member dies), with
      relogging (restore reads the relog window: n intervals) and without (no backup: restore reads every log
      from the structure's definition); the member is stopped without a checkpoint, restarted, then the CF lost;
  (c) CF restore of --messages messages from the logs alone (a relog window) against from a backup;
  (d) log disk use over a long steady run, linear (active log and archive) and circular (the ring).

    .venv/bin/python bench/bench_logs.py [--quick] [--intervals 120] [--messages 200000] [--spans 10 40 160]

The logs live in a temporary directory on the real disk. Prints tables and appends one JSON line to
bench/results/logs.jsonl.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
from harness import append_result
from rich.console import Console
from rich.table import Table

from cfemu import credentials
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis
from restore.run import run_restore
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.log.format import list_segments
from sqm.wings import WINGS

S = "APP1"


class Steady:
    """The steady workload on one member (see the module doc)."""

    def __init__(self, qm: QueueManager, per_interval: int, body: int, stay: int) -> None:
        self.qm, self.per, self.stay = qm, per_interval, stay
        self.conn: Connection = qm.connect()
        self.body = os.urandom(body)
        self.long: deque[int] = deque()  # the interval each long-lived message was put in
        self.short = 0  # short-lived messages put in the previous interval, still queued
        self.k = 0

    def interval(self, *, checkpoint: str | None = "logload") -> None:
        c = self.conn
        n_long = max(1, self.per // 10)
        for _ in range(self.short):  # the previous interval's short-lived messages
            c.get("SHORT")
        c.commit()
        self.short = self.per - n_long
        for i in range(self.per):
            is_long = i < n_long
            c.put("LONG" if is_long else "SHORT", self.body)
            if is_long:
                self.long.append(self.k)
            if i % 5 == 4:
                c.commit()
        c.commit()
        while self.long and self.long[0] <= self.k - self.stay:
            c.get("LONG")
            self.long.popleft()
        c.commit()
        self.k += 1
        if checkpoint:
            self.qm.checkpoint(checkpoint)


def fresh_cf(client: redis.Redis) -> None:
    client.flushall(asynchronous=True)
    admin = Admin(client)
    admin.define_structure(S)
    for q in ("LONG", "SHORT"):
        admin.define_queue(q, S)


def member(url: str, logs: Path, **cfg: Any) -> QueueManager:
    qm = QueueManager(QueueManagerConfig(name="QM1", log_root=logs, redis_url=url, background=False,
                                         logload=10**9, **cfg), wings=WINGS)
    qm.start()
    return qm


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("seg-*.log")) if d.is_dir() else 0


# --- (a) relog records per checkpoint ---------------------------------------------------------------------------
def relog_cost(url: str, work: Path, intervals: int, args: argparse.Namespace) -> dict[str, Any]:
    client = redis.Redis.from_url(url, socket_timeout=600)
    out: dict[str, Any] = {}
    for name, why in (("selective (CPL n=3)", "logload"), ("everything (IMS/SNAP)", "shutdown")):
        fresh_cf(client)
        logs = work / f"relog-{why}"
        qm = member(url, logs, cpl_entries=3, segment_bytes=1 << 20)
        w = Steady(qm, args.per_interval, args.body, args.stay)
        for _ in range(args.stay):  # warm up: the long-lived population reaches its steady size
            w.interval()
        r0, b0 = qm.counters.get("relog_records", 0), qm.counters.get("relog_bytes", 0)
        depth: list[tuple[int, float]] = []  # each checkpoint's queue depth and seconds
        for _ in range(intervals):
            w.interval(checkpoint=None)
            queued = len(w.long) + w.short
            t1 = time.perf_counter()
            qm.checkpoint(why)
            depth.append((queued, time.perf_counter() - t1))
        recs = qm.counters.get("relog_records", 0) - r0
        nbytes = qm.counters.get("relog_bytes", 0) - b0
        out[name] = {"relog_records_per_checkpoint": round(recs / intervals, 1),
                     "relog_bytes_per_checkpoint": round(nbytes / intervals),
                     "queue_depth": round(sum(d for d, _ in depth) / len(depth), 1),
                     "checkpoint_ms": round(1000 * sum(t for _, t in depth) / len(depth), 2)}
        qm.stop(checkpoint=False)
        shutil.rmtree(logs)
    sel, snap = out["selective (CPL n=3)"], out["everything (IMS/SNAP)"]
    out["ratio_records"] = round(sel["relog_records_per_checkpoint"] / max(snap["relog_records_per_checkpoint"], 1), 3)
    return out


# --- (b) restart and restore time against the log span ----------------------------------------------------------
def restart_vs_span(url: str, work: Path, spans: list[int], args: argparse.Namespace,
                    keys: credentials.BackupKeys) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(url, socket_timeout=600)
    rows = []
    for span in spans:
        for relog in (True, False):
            fresh_cf(client)
            logs = work / f"span-{span}-{relog}"
            qm = member(url, logs, cpl_entries=3 if relog else 0, segment_bytes=256 << 10)
            w = Steady(qm, args.per_interval, args.body, args.stay)
            for _ in range(span):
                w.interval()
            w.interval(checkpoint=None)  # work after the last checkpoint
            qm.stop(checkpoint=False)
            t0 = time.perf_counter()
            qm = member(url, logs, cpl_entries=3 if relog else 0, segment_bytes=256 << 10)
            restart_s = time.perf_counter() - t0
            rep = qm.last_restart
            qm.stop(checkpoint=False)
            client.flushall(asynchronous=True)
            t0 = time.perf_counter()
            # A backup root of its own: no backup, and no restore point of another run's (the restore writes one).
            res = run_restore(client, S, backup_root=work / f"bk-{span}-{relog}", log_root=logs, backup_keys=keys)
            restore_s = time.perf_counter() - t0
            rows.append({"span_intervals": span, "relogging": relog, "restart_s": round(restart_s, 3),
                         "restart_records_read": rep.records_read, "restore_s": round(restore_s, 3),
                         "restore_start": res.base_kind, "restore_records": sum(res.records_by_member.values()),
                         "log_bytes": dir_bytes(logs / "QM1") + dir_bytes(logs / "QM1" / "archive")})
            shutil.rmtree(logs)
    return rows


# --- (c) CF restore from the logs alone against from a backup -------------------------------------------------------
def restore_logs_vs_backup(url: str, work: Path, n: int, console: Console,
                           keys: credentials.BackupKeys) -> dict[str, Any]:
    from backup.run import run_backup

    client = redis.Redis.from_url(url, socket_timeout=600)
    fresh_cf(client)
    logs, backups = work / "big-logs", work / "big-bk"
    qm = member(url, logs, cpl_entries=3, segment_bytes=64 << 20)
    c = qm.connect()
    body = os.urandom(256)
    t0 = time.perf_counter()
    for i in range(n):
        c.put("LONG", body)
        if i % 500 == 499:
            c.commit()
    c.commit()
    fill_s = time.perf_counter() - t0
    console.print(f"(c) filled {n} messages in {fill_s:.1f} s")
    t0 = time.perf_counter()
    qm.checkpoint("shutdown")  # a pass that relogs every message: the window starts at its begin
    relog_s = time.perf_counter() - t0
    manifest = run_backup(client, S, backups, log_root=logs, backup_keys=keys)
    qm.stop(checkpoint=False)
    out: dict[str, Any] = {"messages": n, "body_bytes": 256, "fill_s": round(fill_s, 1),
                           "relog_everything_s": round(relog_s, 1)}
    for how in ("backup", "logs alone"):
        client.flushall(asynchronous=True)
        t0 = time.perf_counter()
        res = run_restore(client, S, backup_root=backups, log_root=logs, backup_keys=keys,
                          backup_id=manifest["id"] if how == "backup" else None, from_logs=how == "logs alone")
        seconds = time.perf_counter() - t0
        assert res.loaded_entries == n, (how, res.loaded_entries)
        out[how] = {"seconds": round(seconds, 1), "start": res.base_kind, "records_replayed":
                    sum(res.records_by_member.values()), "timings": res.timings}
        console.print(f"(c) restore from {how}: {seconds:.1f} s")
    out["logs_over_backup"] = round(out["logs alone"]["seconds"] / out["backup"]["seconds"], 2)
    shutil.rmtree(logs)
    shutil.rmtree(backups)
    return out


# --- (d) log disk use over a long run -------------------------------------------------------------------------------
def disk_use(url: str, work: Path, intervals: int, args: argparse.Namespace) -> dict[str, Any]:
    client = redis.Redis.from_url(url, socket_timeout=600)
    out: dict[str, Any] = {}
    seg = 64 << 10
    for mode in ("linear", "circular"):
        fresh_cf(client)
        logs = work / f"disk-{mode}"
        qm = member(url, logs, cpl_entries=3, segment_bytes=seg, log_mode=mode, log_ring=16)
        w = Steady(qm, args.per_interval, args.body, args.stay)
        active, archive = [], []
        records0 = 0
        for _ in range(intervals):
            w.interval()
            active.append(dir_bytes(qm.log_dir))
            archive.append(dir_bytes(qm.archive_dir))
        assert qm.log is not None
        records0 = qm.log.stats.records
        half = len(active) // 2
        out[mode] = {"intervals": intervals, "records": records0, "segment_bytes": seg,
                     "active_max_first_half": max(active[:half]), "active_max_second_half": max(active[half:]),
                     "active_final": active[-1], "active_segments_final": len(list_segments(qm.log_dir)),
                     "archive_final": archive[-1],
                     "refusals": qm.counters.get("log_full_refusals", 0)}
        if mode == "circular":
            out[mode]["ring_bytes"] = 16 * seg
        qm.stop(checkpoint=False)
        shutil.rmtree(logs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run (a smoke test)")
    ap.add_argument("--intervals", type=int, default=120, help="checkpoint intervals of (a) and (d)")
    ap.add_argument("--per-interval", type=int, default=50, help="messages put per interval")
    ap.add_argument("--body", type=int, default=512, help="message bytes")
    ap.add_argument("--stay", type=int, default=20, help="intervals a long-lived message stays")
    ap.add_argument("--spans", type=int, nargs="+", default=[10, 40, 160], help="(b): intervals before the kill")
    ap.add_argument("--messages", type=int, default=200_000, help="(c): messages restored")
    ap.add_argument("--skip", nargs="*", default=[], choices=["a", "b", "c", "d"], help="parts to skip")
    args = ap.parse_args()
    if args.quick:
        args.intervals, args.spans, args.messages, args.per_interval, args.stay = 12, [4, 8], 3000, 20, 5
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="bench-logs-", dir=os.environ.get("BENCH_TMP")))
    srv = EmbeddedRedis(data_dir=work / "cf").start()
    credentials.create_backup_key(work / "secrets")
    keys = credentials.backup_keys(work / "secrets")
    result: dict[str, Any] = {"bench": "logs", "date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                                          "python": platform.python_version(), "platform": platform.platform()},
                              "loadavg_before": os.getloadavg(), "quick": args.quick,
                              "workload": {"per_interval": args.per_interval, "body": args.body, "stay": args.stay,
                                           "long_lived": "10%"}}
    try:
        if "a" not in args.skip:
            result["relog"] = relog_cost(srv.url, work, args.intervals, args)
            t = Table("relogging", "records / checkpoint", "bytes / checkpoint", "queue depth at checkpoint",
                      "checkpoint ms", title=f"(a) relog cost per checkpoint, {args.intervals} intervals")
            for name in ("selective (CPL n=3)", "everything (IMS/SNAP)"):
                r = result["relog"][name]
                t.add_row(name, str(r["relog_records_per_checkpoint"]), str(r["relog_bytes_per_checkpoint"]),
                          str(r["queue_depth"]), str(r["checkpoint_ms"]))
            console.print(t)
        if "b" not in args.skip:
            result["span"] = restart_vs_span(srv.url, work, args.spans, args, keys)
            t = Table("span", "relogging", "restart s", "restart records", "restore s", "restore start",
                      "restore records", "log bytes", title="(b) restart and CF restore against the log span")
            for r in result["span"]:
                t.add_row(str(r["span_intervals"]), str(r["relogging"]), str(r["restart_s"]),
                          str(r["restart_records_read"]), str(r["restore_s"]), r["restore_start"],
                          str(r["restore_records"]), str(r["log_bytes"]))
            console.print(t)
        if "c" not in args.skip:
            result["restore"] = restore_logs_vs_backup(srv.url, work, args.messages, console, keys)
            r = result["restore"]
            t = Table("start", "seconds", "records replayed", title=f"(c) CF restore of {args.messages} messages")
            for how in ("backup", "logs alone"):
                t.add_row(how, str(r[how]["seconds"]), str(r[how]["records_replayed"]))
            console.print(t)
        if "d" not in args.skip:
            result["disk"] = disk_use(srv.url, work, args.intervals, args)
            t = Table("mode", "active max 1st half", "active max 2nd half", "active final", "archive final",
                      title=f"(d) log disk use (bytes), {args.intervals} intervals")
            for mode in ("linear", "circular"):
                r = result["disk"][mode]
                t.add_row(mode, str(r["active_max_first_half"]), str(r["active_max_second_half"]),
                          str(r["active_final"]), str(r["archive_final"]))
            console.print(t)
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    result["loadavg_after"] = os.getloadavg()
    append_result("logs", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
