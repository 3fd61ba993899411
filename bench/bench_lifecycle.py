"""Benchmark of the transactional message lifecycle (BENCHMARKS.md, "lifecycle"), on a private redis-server started
and stopped here.

A lifecycle is one 1 KiB persistent message put and committed, then got and committed (each commit forces the
log). It is measured against a plain Redis reliable-queue loop (LPUSH, LMOVE to a processing list, LREM) on the
same redis-server in the same run, rounds of the two interleaved:
  (a) 1 connection: one SQM, one thread; baseline one client, one thread. Target ratio >= 0.75.
  (b) 8 connections over 2 SQMs (threads, 4 per SQM); baseline 8 threads with a client each.
  (c) fsyncs per commit with 8 connections (group commit), target <= 0.25.
  (d) log bytes and records per lifecycle (1 connection).
  (e) where a single-connection lifecycle spends its time: fsync, CF round trips, the rest (Python), measured in
      a separate instrumented run; plus the raw fdatasync latency of the log's disk.
  (f) with --duplex: the cost of a duplexed CF (BENCHMARKS.md, "Duplexed CF"): the same lifecycles, 1 and 8
      connections, on a simplex CF and on a duplexed pair (a second redis-server, a replica every CF call waits
      for: WAIT), rounds of the two interleaved in the same run; the ratio duplexed / simplex.
  (g) with --socket: the CF over loopback TCP against the CF over its Unix-domain socket (BENCHMARKS.md, "the CF
      over a Unix socket"): the same lifecycles, 1 and 8 connections, each kind on a CF of its own (alike: both
      listen on a port and a socket), rounds interleaved; lifecycles/s and CPU µs per lifecycle of both processes
      (this one: the members and their callers; the CF's redis-server), and the CPU of one CF call alone.

    .venv/bin/python bench/bench_lifecycle.py [--quick] [--seconds 5] [--rounds 3] [--duplex] [--socket | --socket-only]

Part (e) times fsyncs by wrapping sqm.log.writer._fdatasync, a private name: a deliberate coupling (the writer's
stats count fsyncs but not their time, and a timing hook in the log's hot path would cost every commit).

The log lives in a temporary directory on the real disk (never tmpfs: fsync must cost what it costs). Prints a
table and appends one JSON line to bench/results/lifecycle.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import redis
from harness import Stopwatch, Windows, append_result, measured_on_real_disk
from rich.console import Console
from rich.table import Table

import sqm.log.writer
from cfemu import credentials, duplex_control
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.duplex import DUPLEX, SIMPLEX, duplex_url
from cfemu.embedded import EmbeddedRedis
from cfemu.entry import Entry
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.wings import WINGS

BODY = os.urandom(1024)
STRUCTURE, QUEUE = "APP1", "Q1"
CALLS_QUEUE = "QCALLS"  # (g): the CF calls measured alone put here, out of the lifecycles' way
TARGET_RATIO_1 = 0.75
TARGET_FSYNCS_PER_COMMIT = 0.25
WINDOWS = Windows(seconds=5.0, rounds=3, quick_seconds=1.0)


# --- the loops -----------------------------------------------------------------------------------------------
def sqm_lifecycles(conn: Connection, stop_at: float) -> int:
    n = 0
    while time.perf_counter() < stop_at:
        conn.put(QUEUE, BODY)
        conn.commit()
        conn.get(QUEUE, wait_ms=1000)
        conn.commit()
        n += 1
    return n


def redis_lifecycles(client: redis.Redis, tag: int, stop_at: float) -> int:
    """The reliable-queue pattern: LPUSH, LMOVE to a processing list, LREM once processed."""
    n = 0
    work, processing = f"bench:q:{QUEUE}", f"bench:processing:{tag}"
    while time.perf_counter() < stop_at:
        client.lpush(work, b"%d:%d:" % (tag, n) + BODY)
        item = client.lmove(work, processing, "RIGHT", "LEFT")
        client.lrem(processing, 1, item)  # type: ignore[arg-type]  # the stubs say str; redis-py takes bytes
        n += 1
    return n


def in_threads(loops: list[Callable[[float], int]], seconds: float) -> float:
    """Run each loop in its own thread for `seconds`; lifecycles per second over all of them."""
    counts = [0] * len(loops)
    start = threading.Barrier(len(loops) + 1)

    def worker(i: int) -> None:
        start.wait()
        counts[i] = loops[i](stop_at)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(loops))]
    for t in threads:
        t.start()
    stop_at = time.perf_counter() + seconds  # read by the workers only after the barrier
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


# --- where the time goes -----------------------------------------------------------------------------------
def server_usec(client: redis.Redis) -> int:
    """Microseconds the redis-server spent executing commands so far (INFO commandstats)."""
    return sum(int(v["usec"]) for v in client.info("commandstats").values())


def breakdown_sqm(qm: QueueManager, seconds: float) -> dict[str, float]:
    """Per lifecycle, in µs: total, fsync, CF round trips (every Redis command: scripts and admin reads; of which
    the server's own execution time), the rest (Python)."""
    fsync, cf = Stopwatch(), Stopwatch()
    server0 = server_usec(qm.redis)
    real_fdatasync, real_execute = sqm.log.writer._fdatasync, qm.redis.execute_command
    sqm.log.writer._fdatasync = fsync.wrap(real_fdatasync)
    qm.redis.execute_command = cf.wrap(real_execute)  # type: ignore[method-assign]
    fast = getattr(qm.cf, "_evalsha", None)  # the scripts' own path (cfemu.cf), where the tree has one
    if fast is not None:
        qm.cf._evalsha = cf.wrap(fast)  # type: ignore[method-assign]
    try:
        conn = qm.connect()
        t0 = time.perf_counter()
        n = sqm_lifecycles(conn, t0 + seconds)
        total = time.perf_counter() - t0
    finally:
        sqm.log.writer._fdatasync = real_fdatasync
        del qm.redis.execute_command  # back to the class's method
        if fast is not None:
            del qm.cf._evalsha
    per = 1e6 / n
    return {"lifecycles": n, "total_us": total * per, "fsync_us": fsync.seconds * per, "fsyncs": fsync.calls / n,
            "cf_us": cf.seconds * per, "cf_round_trips": cf.calls / n,
            "server_us": (server_usec(qm.redis) - server0) / n,
            "python_us": (total - fsync.seconds - cf.seconds) * per}


def breakdown_redis(client: redis.Redis, seconds: float) -> dict[str, float]:
    rt = Stopwatch()
    server0 = server_usec(client)
    client.execute_command = rt.wrap(client.execute_command)  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        n = redis_lifecycles(client, 99, t0 + seconds)
        total = time.perf_counter() - t0
    finally:
        del client.execute_command
    per = 1e6 / n
    return {"lifecycles": n, "total_us": total * per, "cf_us": rt.seconds * per, "cf_round_trips": rt.calls / n,
            "server_us": (server_usec(client) - server0) / n, "python_us": (total - rt.seconds) * per}


def raw_fdatasync_us(directory: Path, n: int = 200) -> float:
    """Median latency of appending 1 KiB and fdatasync-ing it, on the log's disk."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        samples = []
        for _ in range(n):
            os.write(fd, BODY)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            samples.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(samples) * 1e6


# --- the run -------------------------------------------------------------------------------------------------
def log_totals(qms: list[QueueManager]) -> tuple[int, int, int, int]:
    """(records, bytes, fsyncs, commits) summed over the queue managers."""
    stats = [qm.log.stats for qm in qms if qm.log is not None]
    return (sum(s.records for s in stats), sum(s.bytes for s in stats), sum(s.fsyncs for s in stats),
            sum(qm.counters["commits"] for qm in qms))


def measure(url: str, work: Path, seconds: float, rounds: int, console: Console) -> dict[str, Any]:
    admin = Admin(connect(url))
    admin.define_structure(STRUCTURE)
    admin.define_queue(QUEUE, STRUCTURE)
    qms = [QueueManager(QueueManagerConfig(name=f"QM{i}", log_root=work / "logs", redis_url=url), wings=WINGS)
           for i in (1, 2)]
    for qm in qms:
        qm.start()
    clients = [connect(url) for _ in range(8)]
    try:
        one_sqm = qms[0].connect()
        eight_sqm = [qms[i % 2].connect() for i in range(8)]
        sqm_1: list[Callable[[float], int]] = [partial(sqm_lifecycles, one_sqm)]
        sqm_8: list[Callable[[float], int]] = [partial(sqm_lifecycles, c) for c in eight_sqm]
        redis_1: list[Callable[[float], int]] = [partial(redis_lifecycles, clients[0], 0)]
        redis_8: list[Callable[[float], int]] = [partial(redis_lifecycles, clients[i], i) for i in range(8)]
        for loops in (sqm_1, redis_1, sqm_8, redis_8):  # warm up: connections, scripts, caches
            in_threads(loops, min(seconds, 0.5))

        rates: dict[str, list[float]] = {"sqm_1": [], "redis_1": [], "sqm_8": [], "redis_8": []}
        per_lifecycle: list[tuple[float, float]] = []
        fsyncs_per_commit: list[float] = []
        for r in range(rounds):
            console.log(f"round {r + 1}/{rounds}")
            rec0, byt0, _, _ = log_totals(qms[:1])
            rates["sqm_1"].append(in_threads(sqm_1, seconds))
            rec1, byt1, _, _ = log_totals(qms[:1])
            lifecycles = rates["sqm_1"][-1] * seconds
            per_lifecycle.append(((rec1 - rec0) / lifecycles, (byt1 - byt0) / lifecycles))
            rates["redis_1"].append(in_threads(redis_1, seconds))
            _, _, fs0, cm0 = log_totals(qms)
            rates["sqm_8"].append(in_threads(sqm_8, seconds))
            _, _, fs1, cm1 = log_totals(qms)
            fsyncs_per_commit.append((fs1 - fs0) / (cm1 - cm0))
            rates["redis_8"].append(in_threads(redis_8, seconds))

        rate = {k: statistics.median(v) for k, v in rates.items()}
        result: dict[str, Any] = {f"{k}_per_s": round(v, 1) for k, v in rate.items()}
        result.update(ratio_1=round(rate["sqm_1"] / rate["redis_1"], 3),
                      ratio_8=round(rate["sqm_8"] / rate["redis_8"], 3),
                      fsyncs_per_commit_8=round(statistics.median(fsyncs_per_commit), 3),
                      log_records_per_lifecycle=round(statistics.median(p[0] for p in per_lifecycle), 2),
                      log_bytes_per_lifecycle=round(statistics.median(p[1] for p in per_lifecycle)),
                      rounds=rounds, seconds_per_window=seconds)
        result["breakdown_sqm_1"] = {k: round(v, 1) for k, v in breakdown_sqm(qms[0], min(seconds, 2)).items()}
        result["breakdown_redis_1"] = {k: round(v, 1) for k, v in
                                       breakdown_redis(clients[0], min(seconds, 2)).items()}
        result["raw_fdatasync_us"] = round(raw_fdatasync_us(work), 1)
        return result
    finally:
        for qm in qms:
            qm.stop()
        for c in clients:
            c.close()


# --- (f) simplex against duplexed ------------------------------------------------------------------------------
def start_pair(work: Path) -> tuple[list[EmbeddedRedis], str, str]:
    """A simplex CF and a duplexed pair, secured alike (the group's users); their operator URLs."""
    secrets = work / "secrets"
    passwords = credentials.create(secrets)
    acl = [*credentials.acl_lines(passwords), *duplex_control.acl_lines(secrets)]
    servers = [EmbeddedRedis(data_dir=work / name, acl_users=acl).start() for name in ("simplex", "pa", "pb")]
    simplex, a, b = servers
    control = [duplex_control.control_client(srv.host, srv.port, secrets) for srv in (a, b)]
    duplex_control.set_mode(control[0], SIMPLEX, gen=1)
    duplex_control.attach(control[1], (a.host, a.port), secrets)
    deadline = time.monotonic() + 30
    while not duplex_control.in_sync(control[1]):
        if time.monotonic() > deadline:
            raise RuntimeError("the duplexed pair's secondary did not sync within 30s")
        time.sleep(0.05)
    if not duplex_control.set_mode(control[0], DUPLEX):
        raise RuntimeError("the duplexed pair could not be confirmed DUPLEX")

    def url(srv: EmbeddedRedis) -> str:
        return credentials.with_user(f"redis://{srv.host}:{srv.port}/0", "operator", passwords["operator"])

    return servers, url(simplex), duplex_url(url(a), (b.host, b.port))


def measure_duplex(work: Path, seconds: float, rounds: int, console: Console) -> dict[str, Any]:
    servers, simplex_url, pair_url = start_pair(work / "duplex")
    qms: list[QueueManager] = []
    try:
        loops: dict[str, dict[str, list[Callable[[float], int]]]] = {}
        for kind, url in (("simplex", simplex_url), ("duplexed", pair_url)):
            admin = Admin(connect(url))
            admin.define_structure(STRUCTURE)
            admin.define_queue(QUEUE, STRUCTURE)
            pair = [QueueManager(QueueManagerConfig(name=f"{kind[0].upper()}{i}", log_root=work / kind / "logs",
                                                    redis_url=url), wings=WINGS) for i in (1, 2)]
            for qm in pair:
                qm.start()
            qms += pair
            loops[kind] = {"1": [partial(sqm_lifecycles, pair[0].connect())],
                           "8": [partial(sqm_lifecycles, pair[i % 2].connect()) for i in range(8)]}
        for kind in loops:  # warm up
            for n in ("1", "8"):
                in_threads(loops[kind][n], min(seconds, 0.5))
        rates: dict[str, list[float]] = {f"{k}_{n}": [] for k in loops for n in ("1", "8")}
        for r in range(rounds):
            console.log(f"duplex round {r + 1}/{rounds}")
            for n in ("1", "8"):
                for kind in ("simplex", "duplexed"):
                    rates[f"{kind}_{n}"].append(in_threads(loops[kind][n], seconds))
        rate = {k: statistics.median(v) for k, v in rates.items()}
        out: dict[str, Any] = {f"{k}_per_s": round(v, 1) for k, v in rate.items()}
        # Where the time goes: one CF call (a put script) alone, simplex and duplexed (its WAIT for the copy).
        by_kind = {"simplex": qms[0], "duplexed": qms[2]}
        for kind, qm in by_kind.items():
            out[f"{kind}_cf_put_us"] = round(cf_put_us(qm, 300), 1)
        out.update(ratio_1=round(rate["duplexed_1"] / rate["simplex_1"], 3),
                   ratio_8=round(rate["duplexed_8"] / rate["simplex_8"], 3), rounds=rounds,
                   seconds_per_window=seconds, wait="WAIT 1 (redis-server has no WAITAOF)")
        return out
    finally:
        for qm in qms:
            qm.stop()
        for srv in servers:
            srv.stop()


def cf_put_us(qm: QueueManager, n: int, queue: str = QUEUE) -> float:
    """Median µs of one put script on the CF (no log, no commit): the CF call alone."""
    s = qm.cf.structure(STRUCTURE)
    samples = []
    for _ in range(n):
        entry = Entry(id=os.urandom(12).hex(), queue=queue, priority=0, persistent=False, msgid=os.urandom(24).hex(),
                      correlid="", expiry=0, put_time=0)
        t0 = time.perf_counter()
        s.put(qm.caller, entry, BODY)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


# --- (g) loopback TCP against the Unix-domain socket -------------------------------------------------------------
def cf_cpu_s(cf: redis.Redis) -> float:
    """CPU seconds so far of the CF (its own getrusage, from INFO cpu: microseconds, where /proc's clock ticks are
    10 ms)."""
    info = cf.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def cpu_of(cf: redis.Redis) -> float:
    """CPU seconds so far of this process (every thread: the members and the loops) and of the CF."""
    return time.process_time() + cf_cpu_s(cf)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def measure_socket(work: Path, seconds: float, rounds: int, console: Console) -> dict[str, Any]:
    secrets = work / "socket-secrets"
    passwords = credentials.create(secrets)
    acl = credentials.acl_lines(passwords)
    servers = {kind: EmbeddedRedis(data_dir=work / f"cf-{kind}", acl_users=acl, unix_socket=True).start()
               for kind in ("tcp", "unix")}
    urls = {kind: credentials.with_user(srv.url if kind == "tcp" else srv.unix_url, "operator", passwords["operator"])
            for kind, srv in servers.items()}
    probes = {kind: connect(url) for kind, url in urls.items()}  # INFO cpu, over the kind's own path
    qms: dict[str, list[QueueManager]] = {}
    try:
        loops: dict[str, dict[str, list[Callable[[float], int]]]] = {}
        for kind, url in urls.items():
            Admin(connect(url)).ensure_structure(STRUCTURE, (QUEUE, CALLS_QUEUE))
            pair = [QueueManager(QueueManagerConfig(name=f"{kind[0].upper()}{i}", log_root=work / kind / "logs",
                                                    redis_url=url), wings=WINGS) for i in (1, 2)]
            for qm in pair:
                qm.start()
            qms[kind] = pair
            loops[kind] = {"1": [partial(sqm_lifecycles, pair[0].connect())],
                           "8": [partial(sqm_lifecycles, pair[i % 2].connect()) for i in range(8)]}
        for kind in loops:  # warm up
            for n in ("1", "8"):
                in_threads(loops[kind][n], min(seconds, 0.5))
        series: dict[str, list[float]] = {}
        calls = 2000
        for r in range(rounds):
            console.log(f"socket round {r + 1}/{rounds}")
            for kind in (("tcp", "unix") if r % 2 == 0 else ("unix", "tcp")):
                for n in ("1", "8"):
                    cpu0 = cpu_of(probes[kind])
                    rate = in_threads(loops[kind][n], seconds)
                    series.setdefault(f"{kind}_{n}_per_s", []).append(rate)
                    series.setdefault(f"{kind}_{n}_cpu_us", []).append(
                        (cpu_of(probes[kind]) - cpu0) / (rate * seconds) * 1e6)
                # One CF call alone (a put script, no log): its wall time, and its CPU in each process.
                client0, server0 = time.process_time(), cf_cpu_s(probes[kind])
                series.setdefault(f"{kind}_cf_put_us", []).append(cf_put_us(qms[kind][0], calls, CALLS_QUEUE))
                client_us = (time.process_time() - client0) / calls * 1e6
                server_us = (cf_cpu_s(probes[kind]) - server0) / calls * 1e6
                series.setdefault(f"{kind}_cf_put_client_cpu_us", []).append(client_us)
                series.setdefault(f"{kind}_cf_put_server_cpu_us", []).append(server_us)
                series.setdefault(f"{kind}_cf_put_cpu_us", []).append(client_us + server_us)
        out: dict[str, Any] = {k: spread(v) for k, v in series.items()}
        # The same round's two kinds ran one after the other: their ratio drifts less with the machine's load than
        # either figure does.
        for key in [k[len("tcp_"):] for k in series if k.startswith("tcp_")]:
            out[f"ratio_{key}"] = spread([u / t for u, t in zip(series[f"unix_{key}"], series[f"tcp_{key}"],
                                                                strict=True)])
        out.update(rounds=rounds, seconds_per_window=seconds)
        return out
    finally:
        for pair in qms.values():
            for qm in pair:
                qm.stop()
        for srv in servers.values():
            srv.stop()


def report_socket(d: dict[str, Any], console: Console) -> None:
    def cell(key: str) -> str:
        v = d[key]
        return f"{v['median']} ({v['min']}-{v['max']})"

    table = Table("measure (median, range over rounds)", "TCP", "Unix socket", "socket / TCP (same round)",
                  title="the CF over loopback TCP and over its Unix socket (same run, interleaved rounds)")
    for key, what in (("1_per_s", "1 connection, lifecycles/s"), ("1_cpu_us", "1 connection, CPU µs per lifecycle"),
                      ("8_per_s", "8 connections, lifecycles/s"), ("8_cpu_us", "8 connections, CPU µs per lifecycle"),
                      ("cf_put_us", "one CF call (put script), wall µs"),
                      ("cf_put_cpu_us", "one CF call, CPU µs (both processes)"),
                      ("cf_put_client_cpu_us", "... of which the caller's"),
                      ("cf_put_server_cpu_us", "... of which the CF's")):
        r = d[f"ratio_{key}"]
        table.add_row(what, cell(f"tcp_{key}"), cell(f"unix_{key}"),
                      f"{round(r['median'], 3)} ({round(r['min'], 3)}-{round(r['max'], 3)})")
    console.print(table)


def report_duplex(d: dict[str, Any], console: Console) -> None:
    table = Table("connections", "simplex lifecycles/s", "duplexed lifecycles/s", "duplexed / simplex",
                  title="the cost of a duplexed CF (same run, interleaved rounds)")
    for n in ("1", "8"):
        table.add_row(n, str(d[f"simplex_{n}_per_s"]), str(d[f"duplexed_{n}_per_s"]), str(d[f"ratio_{n}"]))
    table.add_row("one CF call (put script), µs", str(d["simplex_cf_put_us"]), str(d["duplexed_cf_put_us"]),
                  f"+{round(d['duplexed_cf_put_us'] - d['simplex_cf_put_us'], 1)} µs")
    console.print(table)


def report(result: dict[str, Any], console: Console) -> None:
    met = {True: "met", False: "MISSED"}
    table = Table("measure", "value", "baseline (Redis loop)", "ratio", "target",
                  title="transactional lifecycle of 1 KiB persistent messages")
    table.add_row("1 connection, lifecycles/s", str(result["sqm_1_per_s"]), str(result["redis_1_per_s"]),
                  str(result["ratio_1"]), f">= {TARGET_RATIO_1}: {met[result['ratio_1'] >= TARGET_RATIO_1]}")
    table.add_row("8 connections / 2 SQMs, lifecycles/s", str(result["sqm_8_per_s"]), str(result["redis_8_per_s"]),
                  str(result["ratio_8"]), "")
    table.add_row("fsyncs per commit, 8 connections", str(result["fsyncs_per_commit_8"]), "", "",
                  f"<= {TARGET_FSYNCS_PER_COMMIT}: "
                  f"{met[result['fsyncs_per_commit_8'] <= TARGET_FSYNCS_PER_COMMIT]}")
    table.add_row("log records per lifecycle", str(result["log_records_per_lifecycle"]), "", "", "")
    table.add_row("log bytes per lifecycle", str(result["log_bytes_per_lifecycle"]), "", "", "")
    console.print(table)
    split = Table("per lifecycle, 1 connection (instrumented run)", "total µs", "fsync µs (count)",
                  "round trips µs (count)", "of which server µs", "Python µs")
    s, b = result["breakdown_sqm_1"], result["breakdown_redis_1"]
    split.add_row("SQM", str(s["total_us"]), f"{s['fsync_us']} ({s['fsyncs']})",
                  f"{s['cf_us']} ({s['cf_round_trips']})", str(s["server_us"]), str(s["python_us"]))
    split.add_row("Redis loop", str(b["total_us"]), "-", f"{b['cf_us']} ({b['cf_round_trips']})",
                  str(b["server_us"]), str(b["python_us"]))
    console.print(split)
    console.print(f"raw fdatasync of 1 KiB on the log's disk: {result['raw_fdatasync_us']} µs (median); "
                  f"load average {result['machine']['load_average_at_start']} at start, "
                  f"{result['machine']['load_average_at_end']} at end on {result['machine']['nproc']} CPUs")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    WINDOWS.add_to(ap)
    ap.add_argument("--duplex", action="store_true",
                    help="also compare a simplex CF with a duplexed pair (a replica every CF call waits for)")
    ap.add_argument("--socket", action="store_true",
                    help="also compare the CF over loopback TCP with the CF over its Unix-domain socket")
    ap.add_argument("--socket-only", action="store_true", help="that comparison alone (g)")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where the temporary CF and logs go (default: the system temp dir; must be a real disk)")
    args = ap.parse_args(argv)
    seconds, rounds = WINDOWS.of(ap, args)
    console = Console()

    def simplex_then_duplex(work: Path) -> dict[str, Any]:
        if args.socket_only:
            return {"socket": measure_socket(work, seconds, rounds, console)}
        srv = EmbeddedRedis(data_dir=work / "cf").start()
        try:
            measured = measure(srv.url, work, seconds, rounds, console)
        finally:
            srv.stop()
        if args.duplex:
            measured["duplex"] = measure_duplex(work, seconds, rounds, console)
        if args.socket:
            measured["socket"] = measure_socket(work, seconds, rounds, console)
        return measured

    result = measured_on_real_disk("lifecycle", args.work_dir, console, simplex_then_duplex, body_bytes=len(BODY),
                                   quick=args.quick)
    if result is None:
        return 2
    if not args.socket_only:
        report(result, console)
    if "duplex" in result:
        report_duplex(result["duplex"], console)
    if "socket" in result:
        report_socket(result["socket"], console)
    append_result("lifecycle", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
