"""Where one message lifecycle's time goes through the network service (BENCHMARKS.md, "peers"): a profile, not a
benchmark.

An SQM server (sqm.service.server.SQMServer with its QueueManager, authentication on) runs in this process on a
private CF (redis-server, no persistence); N clients (sqm.service.client.Client, one thread each) run the lifecycle
of bench_peers.py (1 KiB persistent put + commit, get + commit) from a child process for --seconds. Per lifecycle:
  wall:          the time one client waits for one lifecycle;
  fsync:         wall time in the log's fdatasync (sqm.log.writer._fdatasync wrapped; summed over the clients);
  CF round trip: wall time in CF.run and CF.run_many (every CF script call or grouped round trip, as the server
                 waits for it), and of that the CF's own execution time of the scripts (redis-server's INFO
                 commandstats, evalsha); cf_round_trips: round trips per lifecycle when the member groups its
                 concurrent requests' CF calls (sqm.core.cfgroup), against cf_calls (script calls);
  CPU:           user+system time of the server process, the CF and the client process;
  switches:      context switches of the server's threads (/proc: a thread that waited and was woken, or was
                 preempted), a cost of its own on a virtual machine;
  --batch B:     the batched lifecycle (put_batch of B, get_batch of B, each with its commit): figures per message.

    PYTHONPATH=<tree> .venv/bin/python bench/profile_service.py [--seconds 8] [--clients 1] [--one-call]
        [--batch B] [--slots N] [--ungrouped] [--cprofile PATH]

PYTHONPATH picks the tree whose server and client are profiled (e.g. a `git archive` of an older commit, for a
before/after); prints one JSON line. The work files go under var/ and are removed.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
# bench_peers puts its own tree first on sys.path unless it is there already: here it goes last, so that the tree
# PYTHONPATH names is the one imported (and profiled), not this script's.
if str(BENCH_DIR.parent) not in sys.path:
    sys.path.append(str(BENCH_DIR.parent))
# The tree profiled, as given: bench_peers (imported below) puts its own tree first in PYTHONPATH for the processes
# it starts, and the client started here must run the tree given, as this process does.
PROFILED_PATH = os.environ.get("PYTHONPATH", "")

from bench_peers import TICK, _proc_table  # noqa: E402
from harness import Stopwatch  # noqa: E402

import sqm.log.writer as writer  # noqa: E402
from cfemu import cf as cfmod  # noqa: E402
from cfemu.admin import Admin  # noqa: E402
from cfemu.embedded import EmbeddedRedis  # noqa: E402
from sqm.core.manager import QueueManager, QueueManagerConfig  # noqa: E402
from sqm.service.server import ServerConfig, SQMServer  # noqa: E402
from sqm.wings import WINGS  # noqa: E402

TOKEN = "profile-token-" + "x" * 24
CLIENT = '''
import os, sys, threading, time
from sqm.service.client import Client
body = os.urandom(1024)
n, seconds, one_call, batch = int(sys.argv[2]), float(sys.argv[3]), sys.argv[5] == "1", int(sys.argv[6])
handles = [Client(sys.argv[1], token=sys.argv[4]) for _ in range(n)]
bodies = [body] * batch
def lifecycle(c):
    if batch:  # B messages put and committed in one request, then got and committed in one (or more)
        c.put_batch(bodies, queue="Q1", commit=True)
        got = 0
        while got < batch:
            got += len(c.get_batch("Q1", batch - got, wait_ms=1000, commit=True))
    elif one_call:  # outside syncpoint: each put and get a unit of work of its own, one request each
        c.put("Q1", body, syncpoint=False); c.get("Q1", syncpoint=False, wait_ms=1000)
    else:
        c.put("Q1", body); c.commit(); c.get("Q1", wait_ms=1000); c.commit()
for c in handles:
    for _ in range(20):
        lifecycle(c)
print("ready", flush=True)
sys.stdin.readline()
stop, counts = time.time() + seconds, [0] * n
def run(i):
    c = handles[i]
    while time.time() < stop:
        lifecycle(c); counts[i] += 1
threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
[t.start() for t in threads]; [t.join() for t in threads]
print(sum(counts), flush=True)
'''


def own_ticks(pid: int) -> int:
    """CPU ticks of one process, without its children: the CF and the client are children of this process, and
    counting them in the server's figure (as an earlier version of this script did) counted them twice."""
    return _proc_table().get(pid, (0, 0))[1]


def context_switches() -> int:
    """Context switches of this process so far (voluntary: a thread waited; involuntary: it was preempted), every
    thread's counted, those that have ended included: getrusage keeps an ended thread's switches in the process's
    total, where summing /proc/self/task would lose them and could make the difference of two readings negative."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


class ThreadProfiles:
    """A cProfile of every thread this process starts from now on, timed by each thread's own CPU clock: each new
    thread starts its own profiler at its first Python call; ``clear`` forgets what they saw so far (the start
    and the warm-up), ``dump`` merges them into one pstats file."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._profiles: list[cProfile.Profile] = []
        threading.setprofile(self._start)

    def _start(self, *_: Any) -> None:
        prof = cProfile.Profile(time.thread_time)
        with self._lock:
            self._profiles.append(prof)
        prof.enable()  # replaces this hook in this thread

    def clear(self) -> None:
        with self._lock:
            for prof in self._profiles:
                prof.clear()

    def dump(self, path: str) -> None:
        with self._lock:
            profiles = list(self._profiles)
        stats = None
        for prof in profiles:
            prof.snapshot_stats()
            if not prof.stats:  # a thread that made no call in the window
                continue
            if stats is None:
                stats = pstats.Stats(prof)
            else:
                stats.add(prof)
        if stats is not None:
            stats.dump_stats(path)


def thread_clocks() -> dict[int, tuple[str, int, int, int, int]]:
    """Every thread of this process now: native id -> (its Python name, or the OS's for a thread Python did not
    start; user and system CPU ticks; voluntary and involuntary context switches), from /proc/self/task."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, int, int, int, int]] = {}
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        try:
            with open(f"/proc/self/task/{entry}/stat", "rb") as f:
                raw = f.read()
            with open(f"/proc/self/task/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # ended meanwhile
            continue
        comm = raw[raw.index(b"(") + 1:raw.rindex(b")")].decode(errors="replace")
        fields = raw.rsplit(b")", 1)[1].split()
        out[tid] = (names.get(tid, comm), int(fields[11]), int(fields[12]),
                    int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))
    return out


def per_thread(before: dict[int, tuple[str, int, int, int, int]], after: dict[int, tuple[str, int, int, int, int]],
               n: int) -> dict[str, dict[str, float]]:
    """Each thread's CPU (user, system µs) and context switches (voluntary, involuntary) per lifecycle over the
    window, by name (threads of one name summed: a connection's threads, the executor's); those that spent
    nothing left out. A thread that ended within the window is not counted (its figures went with it)."""
    out: dict[str, dict[str, float]] = {}
    for tid, (name, user, system, vol, invol) in after.items():
        name0, user0, system0, vol0, invol0 = before.get(tid, (name, 0, 0, 0, 0))
        row = out.setdefault(name.rstrip("0123456789_-") or name, {"user_us": 0.0, "system_us": 0.0,
                                                                  "voluntary": 0.0, "involuntary": 0.0})
        row["user_us"] += (user - user0) / TICK * 1e6 / n
        row["system_us"] += (system - system0) / TICK * 1e6 / n
        row["voluntary"] += (vol - vol0) / n
        row["involuntary"] += (invol - invol0) / n
    return {k: {f: round(v, 2 if f in ("voluntary", "involuntary") else 0) for f, v in row.items()}
            for k, row in sorted(out.items(), key=lambda kv: -(kv[1]["user_us"] + kv[1]["system_us"]))
            if row["user_us"] + row["system_us"] + row["voluntary"] > 0}


PERF_EVENTS = {"raw_syscalls:sys_enter": "syscalls", "context-switches": "switches_perf"}


def _perf_stat(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """perf stat counting the events of PERF_EVENTS on every thread of ``pid`` until it is interrupted."""
    perf = subprocess.Popen(["perf", "stat", "-x", ",", "-e", ",".join(PERF_EVENTS), "-p", str(pid), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached before the window opens
    return perf


def _perf_counts(perf: subprocess.Popen[bytes], out: Path) -> dict[str, int]:
    """What perf stat counted, by the names of PERF_EVENTS (an event it could not count is left out)."""
    perf.send_signal(signal.SIGINT)
    perf.wait(timeout=10)
    counts: dict[str, int] = {}
    for line in out.read_text().splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2] in PERF_EVENTS and fields[0].isdigit():
            counts[PERF_EVENTS[fields[2]]] = int(fields[0])
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--one-call", action="store_true",
                    help="puts and gets outside syncpoint (one request each) instead of put, commit, get, commit")
    ap.add_argument("--batch", type=int, default=0,
                    help="B >= 1: the batched lifecycle, put_batch of B then get_batch of B, each with its commit; "
                         "the figures are per message")
    ap.add_argument("--slots", type=int, default=0,
                    help="the server's request slots (ServerConfig.request_slots; 0: its default)")
    ap.add_argument("--ungrouped", action="store_true",
                    help="each of the member's CF calls in a round trip of its own (its concurrent requests' calls not "
                         "grouped: sqm.core.cfgroup; a thread per connection, no event loop's batches): the baseline "
                         "the grouping is measured against")
    ap.add_argument("--syscalls", action="store_true",
                    help="count the server's system calls and context switches over the window (perf stat on the "
                         "raw_syscalls:sys_enter tracepoint of its threads; needs perf and access to tracepoints): a "
                         "count per lifecycle, not a time, which a loaded machine does not blur")
    ap.add_argument("--threads", action="store_true",
                    help="each of the server's threads apart (by its name: the event loop's, the beginner's, the "
                         "finisher's, ...): CPU µs and context switches per lifecycle over the window "
                         "(/proc/self/task)")
    ap.add_argument("--cprofile", metavar="PATH",
                    help="write a pstats file of the server's threads over the window, timed by each thread's CPU "
                         "clock (time.thread_time): where the server's CPU goes, function by function")
    args = ap.parse_args(argv)
    (BENCH_DIR.parent / "var").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="profile-service-", dir=BENCH_DIR.parent / "var"))
    srv = EmbeddedRedis(data_dir=work / "cf").start()
    try:
        r = srv.client()
        admin = Admin(r)
        admin.define_structure("APP1")
        admin.define_queue("Q1", "APP1")
        profiles = ThreadProfiles() if args.cprofile else None
        fsync, cf = Stopwatch(), Stopwatch()
        writer._fdatasync = fsync.wrap(writer._fdatasync)
        cfmod.CF.run = cf.wrap(cfmod.CF.run)  # type: ignore[method-assign]
        cfmod.CF.run_many = cf.wrap(cfmod.CF.run_many)  # type: ignore[method-assign]  # a grouped round trip
        qm = QueueManager(QueueManagerConfig(name="QM1", log_root=work / "logs", redis_url=srv.url, lease_ms=60_000), wings=WINGS)
        if args.ungrouped:
            qm.cf.groups = False
        slots = {"request_slots": args.slots} if args.slots else {}
        server = SQMServer(ServerConfig(name="QM1", log_root=work / "logs", redis_url=srv.url, token=TOKEN,
                                        event_loop=not args.ungrouped, **slots), qm=qm)
        threading.Thread(target=lambda: asyncio.run(server.run(install_signals=False)), daemon=True).start()
        deadline = time.monotonic() + 60
        while not (qm.running and server.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        client_env = {**os.environ, "PYTHONPATH": PROFILED_PATH} if PROFILED_PATH else None
        client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{server.port}", str(args.clients),
                                   str(args.seconds), TOKEN, "1" if args.one_call else "0", str(args.batch)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=client_env)
        assert client.stdin is not None and client.stdout is not None
        if client.stdout.readline().strip() != "ready":
            raise SystemExit("the client did not start")
        stats0 = r.info("commandstats")
        trips0 = getattr(qm.cf, "round_trips", 0)
        fsync.seconds = fsync.calls = cf.seconds = cf.calls = 0
        pids = {"server": os.getpid(), "cf": srv.pid or 0, "client": client.pid}
        cpu0 = {k: own_ticks(p) for k, p in pids.items()}
        switches0 = context_switches()
        sys0 = os.times().system
        perf = _perf_stat(os.getpid(), work / "perf.txt") if args.syscalls else None
        if profiles is not None:
            profiles.clear()
        threads0 = thread_clocks() if args.threads else {}
        t0 = time.time()
        client.stdin.write("go\n")
        client.stdin.flush()
        n = int(client.stdout.readline()) * max(1, args.batch)
        elapsed = time.time() - t0
        threads1 = thread_clocks() if args.threads else {}
        counted = _perf_counts(perf, work / "perf.txt") if perf is not None else {}
        if profiles is not None:
            profiles.dump(args.cprofile)
        cpu1 = {k: own_ticks(p) for k, p in pids.items()}
        switches = context_switches() - switches0
        server_sys = os.times().system - sys0
        stats1 = r.info("commandstats")
        trips = getattr(qm.cf, "round_trips", 0) - trips0  # grouped CF calls (sqm.core.cfgroup); 0: not grouped
        client.wait()

        def usec(stats: dict[str, Any], only: Callable[[str], bool] | None = None) -> int:
            return sum(int(v["usec"]) for k, v in stats.items() if only is None or only(k))

        def operations(name: str) -> bool:
            """The CF operations' commands: the scripts' EVALSHA and the server module's (cf.put, ...), named here
            rather than imported: the tree profiled may be one without the module."""
            return name == "cmdstat_evalsha" or name.startswith("cmdstat_cf.")
        per = 1e6 / n
        print(json.dumps({
            "pythonpath": PROFILED_PATH, "tree": str(Path(cfmod.__file__).resolve().parents[1]),
            "clients": args.clients, "one_call": args.one_call,
            "batch": args.batch, "per": "message" if args.batch else "lifecycle", "slots": server.slots.n,
            "grouped": bool(getattr(qm.cf, "groups", False)),
            "cf_largest_round_trip": getattr(qm.cf, "largest", None),  # the most calls one shared round trip carried
            "lifecycles_per_s": round(n / elapsed, 1), "wall_us_per_lifecycle": round(elapsed * per * args.clients),
            "fsync_us": round(fsync.seconds * per), "fsyncs": round(fsync.calls / n, 2),
            "cf_round_trip_us": round(cf.seconds * per), "cf_calls": round(cf.calls / n, 2),
            "cf_round_trips": round(trips / n, 2) if trips else None,
            "cf_script_server_us": round((usec(stats1, operations) - usec(stats0, operations)) / n),
            "cf_all_commands_server_us": round((usec(stats1) - usec(stats0)) / n),
            **{f"cpu_{k}_us": round((cpu1[k] - cpu0[k]) / TICK * per) for k in pids},
            "cpu_server_system_us": round(server_sys * per),  # of cpu_server_us: the kernel's share
            "server_context_switches": round(switches / n, 1),
            **{f"server_{k}": round(v / n, 1) for k, v in counted.items()},
            **({"server_threads": per_thread(threads0, threads1, n)} if args.threads else {}),
            "load": [round(x, 2) for x in os.getloadavg()]}))
        sys.stdout.flush()
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    os._exit(0)  # the server's thread and its QueueManager's threads are daemons of a throwaway process


if __name__ == "__main__":
    main()
