"""How long one CF call holds the CF (the Redis server) for a large input, and what another client sees meanwhile.

For a unit of work of N entries (puts, or gets of committed messages) this times its commit and its backout, and
for a structure of N entries an expiry sweep, one get behind N expired messages, a relog pass, a purge and a
restore's load. Every CF call is one command on the server (an EVALSHA, or a restore's MULTI/EXEC); the server's
slow log (every command of 1 ms or more) gives the longest one, and a probe thread sends PING all along on its own
connection, so its worst and 99th percentile latency is what any other client (a member's lease renewal) waited.

    .venv/bin/python bench/bench_cf_bounded.py [--quick] [--sizes 10000 60000 200000] [--ops commit-puts ...]

Appends one JSON line per run to bench/results/cf_bounded.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import redis  # noqa: E402
from harness import CountingClock  # noqa: E402

from cfemu import bulk, keys  # noqa: E402
from cfemu.admin import Admin, StructureDef  # noqa: E402
from cfemu.cf import CF, Caller  # noqa: E402
from cfemu.embedded import EmbeddedRedis  # noqa: E402
from cfemu.entry import Entry  # noqa: E402

S, Q = "APP1", "Q1"
RESULTS = ROOT / "bench" / "results" / "cf_bounded.jsonl"
NOW = 2_000


class Probe:
    """PING in a loop on a connection of its own while the operation runs: the latencies another client sees."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=None)
        self.client.ping()
        self.lat: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            while True:  # a BUSY reply (a script past the server's busy threshold) is still a wait
                try:
                    self.client.ping()
                    break
                except redis.exceptions.BusyLoadingError:
                    time.sleep(0.001)
                except redis.exceptions.ResponseError as e:
                    if not str(e).startswith("BUSY"):
                        raise
                    time.sleep(0.001)
            self.lat.append(time.perf_counter() - t)
            time.sleep(0.001)

    def __enter__(self) -> Probe:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def summary(self) -> dict[str, float]:
        lat = sorted(self.lat) or [0.0]
        return {"probe_max_ms": round(lat[-1] * 1000, 1),
                "probe_p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 1),
                "probes": len(lat)}


class Run(NamedTuple):
    op: str
    n: int
    seconds: float
    longest_call_ms: float
    calls_over_1ms: int
    probe: dict[str, float]


def slow_reset(r: redis.Redis) -> None:
    r.config_set("slowlog-log-slower-than", 1000)
    r.config_set("slowlog-max-len", 100000)
    r.slowlog_reset()


def slow_read(r: redis.Redis) -> tuple[float, int]:
    log = r.slowlog_get(100000)
    longest = max((e["duration"] for e in log), default=0) / 1000
    return round(longest, 1), len(log)


def setup(r: redis.Redis) -> tuple[CF, Caller]:
    r.flushall()
    admin = Admin(r)
    admin.ensure_structure(S, (Q, "Q2"))
    caller = Caller("QM1", admin.join("QM1", {}, lease_ms=600_000), CountingClock())
    return CF(r), caller


def desc(**kw: Any) -> bytes:
    base = {"p": 5, "per": 1, "mid": "", "cid": "", "exp": 0, "pt": 0, "bc": 0, "pr": {}}
    base.update(kw)
    return msgpack.packb(base, use_bin_type=False)


def fill(cf: CF, caller: Caller, n: int, uow: str, prefix: str, **kw: Any) -> None:
    """n puts under `uow` ('' : committed), pipelined."""
    put = cf.script("put")
    d = desc(**kw)
    sk = keys.script_keys(S)
    for i in range(0, n, 2000):
        pipe = cf.redis.pipeline(transaction=False)
        for j in range(i, min(n, i + 2000)):
            put(keys=sk, args=[caller.member, caller.epoch, 0, uow, 0, f"{prefix}{j:09d}", Q, d, b"x" * 100],
                client=pipe)
        pipe.execute()


def take(cf: CF, caller: Caller, n: int, uow: str) -> None:
    get = cf.script("get")
    sk = keys.script_keys(S)
    for i in range(0, n, 2000):
        pipe = cf.redis.pipeline(transaction=False)
        for _ in range(i, min(n, i + 2000)):
            get(keys=sk, args=[caller.member, caller.epoch, 0, uow, 0, Q, "", "", NOW, 0], client=pipe)
        pipe.execute()


def measure(r: redis.Redis, url: str, op: str, n: int, fn: Any) -> Run:
    slow_reset(r)
    with Probe(url) as probe:
        t = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t
    longest, count = slow_read(r)
    return Run(op, n, round(seconds, 3), longest, count, probe.summary())


def bench(url: str, r: redis.Redis, op: str, n: int) -> Run:
    cf, caller = setup(r)
    s = cf.structure(S)
    if op == "commit-puts":
        fill(cf, caller, n, "U1", "p")
        return measure(r, url, op, n, lambda: s.commit(caller, "U1", gen=1, lrsn=10**9))
    if op == "backout-puts":
        fill(cf, caller, n, "U1", "p")
        return measure(r, url, op, n, lambda: s.backout(caller, "U1", gen=1, lrsn=10**9, has_data=True))
    if op == "commit-gets":
        fill(cf, caller, n, "", "c")
        take(cf, caller, n, "U1")
        return measure(r, url, op, n, lambda: s.commit(caller, "U1", gen=1, lrsn=10**9))
    if op == "backout-gets":
        fill(cf, caller, n, "", "c")
        take(cf, caller, n, "U1")
        return measure(r, url, op, n, lambda: s.backout(caller, "U1", gen=1, lrsn=10**9, has_data=True))
    if op == "expire":
        # n committed messages: every other one has expired, the rest live (the sweep's LREMs reach deep)
        fill(cf, caller, n // 2, "", "l", exp=10**13)
        fill(cf, caller, n // 2, "", "e", exp=1_000)

        def sweep() -> None:
            while s.expire(NOW).ids:
                pass
            s.expire(NOW)

        return measure(r, url, op, n, sweep)
    if op == "get-expired-head":
        # n expired messages at the head of the queue, one live message behind them: one get takes it
        fill(cf, caller, n, "", "e", exp=1_000)
        fill(cf, caller, 1, "", "l", exp=10**13)

        def get() -> None:
            got = s.get(caller, Q, uow="U1", now_ms=NOW)
            assert got.entry is not None and got.entry.id == "l000000000", got

        return measure(r, url, op, n, get)
    if op == "relog":
        fill(cf, caller, n, "", "c")

        def scan() -> None:
            cursor = "0"
            while True:
                b = s.relog_scan(caller, threshold=-1, cursor=cursor)
                cursor = b.cursor
                if cursor == "0":
                    break

        return measure(r, url, op, n, scan)
    if op == "purge":
        fill(cf, caller, n, "", "c")
        fill(cf, caller, min(n, 1000), "U1", "u")
        sdef = StructureDef(S)
        return measure(r, url, op, n, lambda: bulk.purge(r, sdef, [Q, "Q2"]))
    if op == "load":
        survivors = [Survivor(f"r{i:09d}", Entry(f"r{i:09d}", Q, state="CP", lrsn=1000 + i,
                                                 order=(1000 + i, 1000 + i)).wire(), b"x" * 100) for i in range(n)]

        def load() -> None:
            owner = bulk.claim(r, S, bulk.observe(r, S))
            with owner:
                bulk.reset(owner, StructureDef(S))
                loader = bulk.Loader(owner, 2)
                for i in range(0, n, bulk.BATCH):
                    loader.write(survivors[i:i + bulk.BATCH])

        return measure(r, url, op, n, load)
    raise SystemExit(f"unknown op {op}")


class Survivor(NamedTuple):
    id: str
    entry: dict[str, Any]
    data: bytes


OPS = ["commit-puts", "backout-puts", "commit-gets", "backout-gets", "expire", "get-expired-head", "relog", "purge",
       "load"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 60_000, 200_000])
    ap.add_argument("--ops", nargs="+", default=OPS)
    ap.add_argument("--label", default="")
    ap.add_argument("--quick", action="store_true", help="one small size (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.sizes = [2_000]
    srv = EmbeddedRedis().start()
    runs = []
    try:
        r = srv.client(socket_timeout=None)
        for n in args.sizes:
            for op in args.ops:
                run = bench(srv.url, r, op, n)
                runs.append(run)
                print(f"{op:14} n={n:>7}  total {run.seconds:8.3f} s  longest call {run.longest_call_ms:9.1f} ms  "
                      f"calls>=1ms {run.calls_over_1ms:6}  probe max {run.probe['probe_max_ms']:8.1f} ms  "
                      f"p99 {run.probe['probe_p99_ms']:7.1f} ms", flush=True)
    finally:
        srv.stop()
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps({"at": datetime.now(UTC).isoformat(timespec="seconds"), "label": args.label,
                            "machine": f"{platform.machine()} {os.cpu_count()} cpus", "load": os.getloadavg(),
                            "runs": [r._asdict() for r in runs]}) + "\n")


if __name__ == "__main__":
    main()
