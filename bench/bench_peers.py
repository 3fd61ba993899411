"""The transactional lifecycle against the durable queues people use instead (BENCHMARKS.md, "peers"): PostgreSQL,
RabbitMQ, Redis with appendfsync always, and the SQM in process and through its network service.

A lifecycle: put a 1 KiB persistent message and commit, then get it and commit; every commit is durable before
its reply. Each contender runs on 127.0.0.1, started here and stopped here (by pid):
  postgres:     a fresh cluster (initdb) in a temporary directory; a table queue (id bigserial, body bytea);
                put = INSERT + COMMIT, get = DELETE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1)
                RETURNING body + COMMIT; synchronous_commit on, fsync on (psycopg 3).
  rabbitmq:     a private node (its own epmd); a classic durable queue; put = basic_publish of a persistent
                message on a channel in confirm mode (returns once the broker confirmed it, after its fsync);
                get = basic_get with a manual ack (pika). An ack has no reply in AMQP 0-9-1: the get side's
                "commit" is the ack, not a confirmed durable write.
  redis-aof:    redis-server with appendonly yes, appendfsync always; put = LPUSH, get = LMOVE to a
                per-client processing list, commit = LREM (the reliable-queue pattern; each reply after fsync).
  sqm-inproc:   QueueManagers in the client processes (one per client process, 2 for 2+ clients), on an
                embedded CF, logs on the real disk; put, commit, get, commit through sqm.core.connection.Connection.
  sqm-service:  `sqm run` servers (--servers, default 1) of a local cluster (qsg.local_group: an embedded CF,
                authentication on, as users run it), clients sqm.service.client.Client with the group's token.
  sqm-service-ungrouped: the same, each of the members' CF calls in a round trip of its own (the baseline of the
                grouping of concurrent requests' CF calls, sqm.core.cfgroup); measured only when named in --peers.
  sqm-service-tcp: the same, the members reaching the CF over loopback TCP rather than its Unix-domain socket
                (the local cluster's default); measured only when named in --peers.
  sqm-service-base, sqm-service-1-base: sqm-service and sqm-service-1 with the members and the client processes
                running the code of --base-tree (an export of main, say: the A/B of a change in one run; run the benchmark from a
                directory that holds no package of the project); measured only when named in --peers.
--batch B [B ...]: the batched lifecycle as well, per message: B messages put and committed together, then got and
committed together (PostgreSQL: a multi-row INSERT, a DELETE of B rows; durable Redis: pipelines of B LPUSH, LMOVE,
LREM; the SQM: put_batch and get_batch with their commit in the same request; B=0 is the one-message lifecycle).
The clients of every contender run in --client-procs worker processes (default: up to 2, one thread per client),
so the benchmark process's GIL does not bound them. Client counts 1, 2, 4, 8, 16, 32, 64 (--clients); for each
count, rounds of all contenders interleaved; each figure is the median over the rounds, with:
  CPU per lifecycle:  user+system CPU of the contender's server processes (with their children) and of the client
                      processes over the window, per lifecycle (µs), and each of the two apart;
  of which redis:     the same for the redis-server among them alone (the SQM's CF; durable Redis's server): the
                      work Redis itself does for one lifecycle, which the SQM cannot go below on the same cores;
  fsyncs per commit:  where the contender counts them (the SQM's log, PostgreSQL's pg_stat_wal.wal_sync); '-' else;
  CF round trips:     per lifecycle, the SQM members' (their metrics; several script calls may share one);
  load average:       the 1-minute load average when the round ended.

PostgreSQL and RabbitMQ come from the system's packages: when missing they are installed with apt-get if this
process is root and apt-get is there (unless --no-install); when they cannot be had, the contender is reported
as skipped, with the reason, and no figure.

    .venv/bin/python bench/bench_peers.py [--quick] [--seconds 5] [--rounds 3] [--clients 1 8 32]
        [--peers postgres rabbitmq redis-aof sqm-inproc sqm-service sqm-service-1 sqm-service-ungrouped]
        [--servers 1] [--base-tree PATH] [--no-install] [--json]

Work files (PostgreSQL's cluster, RabbitMQ's node, the SQM logs, the AOF) live under the system's temp directory
(--work-dir; a real disk: fsync must cost what it costs; not the repository's var/, which is private to its owner
while PostgreSQL and RabbitMQ run as their own users). Prints tables (or, with --json, the JSON record) and appends the record to
bench/results/peers.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import multiprocessing as mp
import os
import pwd
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# The servers this benchmark starts (`sqm run`) and its client processes run this tree's code, not an installed one.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

from harness import append_result, load_average, machine  # noqa: E402

from cfemu.procs import free_port  # noqa: E402

BODY = os.urandom(1024)
STRUCTURE, QUEUE = "APP1", "Q1"
# sqm-service-1: the same service, each put and get outside syncpoint (MQPMO/MQGMO_NO_SYNCPOINT): a unit of work of
# its own, committed (COMMIT forced) before the reply, in one request instead of two; as RabbitMQ's confirmed publish
# and Redis's LPUSH are one request each.
# sqm-service-ungrouped: the service with each of its CF calls in a round trip of its own (sqm.core.cfgroup's
# benchmark baseline): the A/B of the grouping in one run, measured only when named (--peers).
# sqm-service-tcp: the service with its members reaching the CF over loopback TCP instead of the CF's Unix-domain
# socket (the local cluster's default, cfemu cluster up --no-cf-socket): the A/B of the socket in one run.
# sqm-service-base, sqm-service-1-base: sqm-service and sqm-service-1 with their members and their client processes
# running the code of another tree (--base-tree: an export of the main branch, say): the A/B of a change to the
# member or the client library in one run, measured only when named.
BASELINES = ("sqm-service-ungrouped", "sqm-service-tcp", "sqm-service-base", "sqm-service-1-base")
PEERS = ("postgres", "rabbitmq", "redis-aof", "sqm-inproc", "sqm-service", "sqm-service-1", *BASELINES)
ALL_CLIENTS = (1, 2, 4, 8, 16, 32, 64)
# The contenders with a batched lifecycle (--batch; make_batch_loop). RabbitMQ's would be B publishes and one wait
# for their confirms, not written: this machine has no RabbitMQ to measure it.
BATCHED = ("postgres", "redis-aof", "sqm-service")
LEASE_MS = 60_000  # a member starved of CPU on a loaded machine must not be fenced mid-measurement
TICK = os.sysconf("SC_CLK_TCK")


class Unavailable(Exception):
    """A contender that cannot run on this machine (not installed and not installable): no figure."""


# --- process CPU ---------------------------------------------------------------------------------------------
def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, utime+stime ticks) of every process."""
    out: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        out[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return out


def cpu_ticks(roots: list[int]) -> int:
    """CPU ticks of the processes roots and all their descendants, alive now."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    seen, stack, total = set(), list(roots), 0
    while stack:
        pid = stack.pop()
        if pid in seen or pid not in table:
            continue
        seen.add(pid)
        total += table[pid][1]
        stack.extend(children.get(pid, ()))
    return total


def descendants(pid: int) -> list[int]:
    table = _proc_table()
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        kids = [c for c, (pp, _) in table.items() if pp == p]
        out.extend(kids)
        stack.extend(kids)
    return out


def stop_tree(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
    """Stop a process we started and every process it started (by pid, deepest last to first)."""
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


# --- installing what is missing ----------------------------------------------------------------------------
def apt_install(packages: list[str], allow: bool, what: str) -> None:
    if not allow:
        raise Unavailable(f"{what} is not installed (and --no-install was given)")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"{what} is not installed, and this machine does not allow installing it (needs root and "
                          f"apt-get): apt-get install {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    print(f"bench_peers: installing {what}: {' '.join(cmd)}", file=sys.stderr)
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise Unavailable(f"installing {what} failed: {done.stderr.strip()[-300:]}")


def pg_bin(allow_install: bool) -> Path:
    def find() -> Path | None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
        if found:
            return Path(found[-1]).parent
        initdb = shutil.which("initdb")
        return Path(initdb).resolve().parent if initdb else None
    b = find()
    if b is None:
        apt_install(["postgresql"], allow_install, "PostgreSQL")
        b = find()
        if b is None:
            raise Unavailable("PostgreSQL was installed but no initdb was found")
    return b


def rabbit_bin(allow_install: bool) -> Path:
    script = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
    if not script.exists():
        apt_install(["rabbitmq-server"], allow_install, "RabbitMQ")
        if not script.exists():
            raise Unavailable("RabbitMQ was installed but /usr/lib/rabbitmq/bin/rabbitmq-server is missing")
    return script


def need_module(name: str, pip_name: str) -> None:
    try:
        __import__(name)
    except ImportError:
        raise Unavailable(f"the Python client {pip_name} is not installed (make venv installs it)") from None


def run_as(user: str) -> dict[str, Any]:
    """Popen arguments that run a server as ``user`` when we are root (PostgreSQL refuses to run as root)."""
    if os.geteuid() != 0:
        return {}
    pw = pwd.getpwnam(user)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def chown_tree(path: Path, user: str) -> None:
    if os.geteuid() != 0:
        return
    pw = pwd.getpwnam(user)
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, d) for d in dirs), *(os.path.join(root, f) for f in files)]:
            os.chown(name, pw.pw_uid, pw.pw_gid)


def wait_for(check: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None,
             log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:] if log and log.exists() else ""
            raise Unavailable(f"{what} exited with status {proc.returncode} while starting: {tail}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise Unavailable(f"{what} did not start within {timeout:g}s")


# --- the contenders' servers (in the benchmark process) -------------------------------------------------------
class Contender:
    name = ""
    servers_note = ""

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work = work / self.name
        self.work.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None: ...

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop_tree(p)

    def server_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def client_params(self) -> dict[str, Any]:
        """What a client worker needs to connect (picklable)."""
        return {}

    def fsyncs(self) -> tuple[int, int] | None:
        """(fsyncs, commits) so far as the servers count them; None: not measurable from outside the clients."""
        return None

    def cf_round_trips(self) -> int | None:
        """The SQM members' CF round trips so far (several script calls may share one); None: no such count."""
        return None

    def redis_pids(self) -> list[int]:
        """The redis-server processes among the servers (the SQM's CF; durable Redis's server): their CPU per
        lifecycle is shown apart, the work Redis itself does for one lifecycle."""
        return []


class Postgres(Contender):
    name = "postgres"
    servers_note = "PostgreSQL postmaster and backends"

    def start(self) -> None:
        need_module("psycopg", "psycopg")
        import psycopg
        b = pg_bin(self.args.install)
        data = self.work / "data"
        chown_tree(self.work, "postgres")
        done = subprocess.run([str(b / "initdb"), "-D", str(data), "-A", "trust", "-U", "bench", "-E", "UTF8"],
                              capture_output=True, text=True, **run_as("postgres"))
        if done.returncode != 0:
            raise Unavailable(f"initdb failed: {done.stderr.strip()[-500:]}")
        self.port = free_port()
        log = self.work / "postgres.log"
        with open(log, "ab") as out:
            self.procs.append(subprocess.Popen(
                [str(b / "postgres"), "-D", str(data), "-p", str(self.port), "-k", str(self.work),
                 "-c", "listen_addresses=127.0.0.1", "-c", "fsync=on", "-c", "synchronous_commit=on",
                 "-c", "max_connections=200", "-c", "shared_buffers=128MB", "-c", "track_wal_io_timing=off"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **run_as("postgres")))
        self.dsn = f"host=127.0.0.1 port={self.port} user=bench dbname=postgres"

        def ready() -> bool:
            psycopg.connect(self.dsn).close()
            return True

        wait_for(ready, 60, "PostgreSQL", self.procs[-1], log)
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute("CREATE TABLE queue (id bigserial PRIMARY KEY, body bytea NOT NULL)")
            setting: dict[str, str] = dict(c.execute("SELECT name, setting FROM pg_settings WHERE name IN "
                                                     "('fsync', 'synchronous_commit', 'wal_sync_method')").fetchall())
        self.servers_note = f"PostgreSQL {b.parent.name}: " + ", ".join(f"{k}={v}" for k, v in sorted(setting.items()))

    def client_params(self) -> dict[str, Any]:
        return {"dsn": self.dsn}

    def fsyncs(self) -> tuple[int, int] | None:
        import psycopg
        time.sleep(1.2)  # backends report their WAL statistics at most once a second
        with psycopg.connect(self.dsn, autocommit=True) as c:
            row = c.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()
            commits = c.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = 'postgres'").fetchone()
        return (int(row[0]), int(commits[0])) if row and commits else None


class RabbitMQ(Contender):
    name = "rabbitmq"
    servers_note = "RabbitMQ node (beam.smp) and its epmd"

    def start(self) -> None:
        need_module("pika", "pika")
        script = rabbit_bin(self.args.install)
        epmd = shutil.which("epmd") or next(iter(glob.glob("/usr/lib/erlang/erts-*/bin/epmd")), None)
        if epmd is None:
            raise Unavailable("RabbitMQ is installed but Erlang's epmd is missing")
        self.port, dist, epmd_port = free_port(), free_port(), free_port()
        (self.work / "enabled_plugins").write_text("[].\n")
        (self.work / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\nloopback_users.guest = true\n")
        (self.work / "env.conf").write_text("")
        chown_tree(self.work, "rabbitmq")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.work), "LANG": "C.UTF-8",
               "ERL_EPMD_PORT": str(epmd_port), "RABBITMQ_NODENAME": f"bench{self.port}@localhost",
               "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1", "RABBITMQ_NODE_PORT": str(self.port),
               "RABBITMQ_DIST_PORT": str(dist), "RABBITMQ_MNESIA_BASE": str(self.work / "mnesia"),
               "RABBITMQ_LOG_BASE": str(self.work / "log"), "RABBITMQ_CONFIG_FILE": str(self.work / "rabbitmq"),
               "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.work / "enabled_plugins"),
               "RABBITMQ_CONF_ENV_FILE": str(self.work / "env.conf"),
               "RABBITMQ_PID_FILE": str(self.work / "rabbit.pid")}
        log = self.work / "rabbitmq.log"
        with open(log, "ab") as out:
            kw: dict[str, Any] = {"stdout": out, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL, "env": env,
                                  **run_as("rabbitmq")}
            self.procs.append(subprocess.Popen([epmd, "-port", str(epmd_port)], **kw))
            self.procs.append(subprocess.Popen([str(script)], **kw))
        import pika

        def ready() -> bool:
            pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", self.port, connection_attempts=1)).close()
            return True
        wait_for(ready, 120, "RabbitMQ", self.procs[-1], log)
        with contextlib.closing(pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", self.port))) as c:
            c.channel().queue_declare("bench", durable=True, arguments={"x-queue-type": "classic"})
        version = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server"], capture_output=True,
                                 text=True).stdout.strip()
        self.servers_note = f"RabbitMQ {version or '?'}, classic durable queue, publisher confirms, manual acks"

    def client_params(self) -> dict[str, Any]:
        return {"port": self.port}


class RedisAOF(Contender):
    name = "redis-aof"

    def start(self) -> None:
        from cfemu.embedded import EmbeddedRedis
        self.server = EmbeddedRedis(data_dir=self.work, appendonly=True, appendfsync="always").start()
        self.servers_note = f"{self.server.server.describe()} ({self.server.server.source}), appendonly yes, " \
                            "appendfsync always"

    def stop(self) -> None:
        self.server.stop()

    def server_pids(self) -> list[int]:
        return [self.server.pid] if self.server.pid else []

    def redis_pids(self) -> list[int]:
        return self.server_pids()

    def client_params(self) -> dict[str, Any]:
        return {"url": self.server.url}


def group_with_env(extra: dict[str, str]) -> type[Any]:
    """qsg.local_group.LocalGroup whose processes get ``extra`` in their environment beside the cluster's own
    settings: this process's environment stays as it is (the contenders start side by side, in threads)."""
    from qsg.local_group import LocalGroup

    class Group(LocalGroup):
        def _env(self) -> dict[str, str]:
            return {**super()._env(), **extra}
    return Group


class SQMService(Contender):
    """The SQM through `sqm run`: a local cluster (authentication on)."""

    name = "sqm-service"
    member_env: dict[str, str] = {}  # for the members' processes, beside the cluster's settings
    member_args: tuple[str, ...] = ()  # for every `sqm run`
    cf_socket = True  # the members reach the CF over its Unix-domain socket (else loopback TCP)

    def start(self) -> None:
        self.cluster = group_with_env(self.member_env).up(
            self.work / "cluster", managers=self.args.servers, backup_interval=None, structure=STRUCTURE,
            queues=(QUEUE,), lease_ms=LEASE_MS, cf_socket=self.cf_socket, manager_args=self.member_args)
        self.servers_note = (f"{self.args.servers} `sqm run` server(s) (authentication on) and the CF "
                             "(redis-server, no persistence: the SQM logs are the durable copy), reached over "
                             + ("its Unix-domain socket" if self.cf_socket else "loopback TCP"))

    def stop(self) -> None:
        self.cluster.down()

    def server_pids(self) -> list[int]:
        pids = [int(p) for p in self.cluster.running_processes().values()]
        return pids

    def redis_pids(self) -> list[int]:
        return [int(p) for name, p in self.cluster.running_processes().items() if name == "CF"]

    def client_params(self) -> dict[str, Any]:
        return {"endpoints": [f"{h}:{p}" for _, h, p in self.cluster.endpoints], "token": self.cluster.token}

    def counters(self, *names: str) -> list[int]:
        """Each counter named (sqm_<name>_total) summed over the members, from their metrics pages."""
        totals = dict.fromkeys(names, 0)
        for m in self.cluster.state["managers"]:
            text = urllib.request.urlopen(f"http://{self.cluster.host}:{m['metrics_port']}/metrics", timeout=10)
            for line in text.read().decode().splitlines():
                for name in names:
                    if line.startswith(f"sqm_{name}_total"):
                        totals[name] += int(float(line.split()[-1]))
        return [totals[name] for name in names]

    def fsyncs(self) -> tuple[int, int] | None:
        fsyncs, commits = self.counters("fsyncs", "commits")
        return fsyncs, commits

    def cf_round_trips(self) -> int | None:
        return self.counters("cf_round_trips")[0]


class SQMInProcess(SQMService):
    """QueueManagers in the client worker processes, on the same kind of CF (a cluster with no servers used)."""

    name = "sqm-inproc"

    def start(self) -> None:
        from qsg.local_group import LocalGroup
        self.cluster = LocalGroup.up(self.work / "cluster", managers=1, backup_interval=None, structure=STRUCTURE,
                                     queues=(QUEUE,), lease_ms=LEASE_MS)
        self.cluster.kill_manager("QM1", signal.SIGTERM)  # only its CF and definitions are used
        self.servers_note = "a QueueManager in each client process, and the CF (redis-server, no persistence)"

    def server_pids(self) -> list[int]:
        return [int(p) for name, p in self.cluster.running_processes().items() if name == "CF"]

    def client_params(self) -> dict[str, Any]:
        return {"env": self.cluster.child_env(), "log_root": str(self.cluster.log_root),
                "redis_url": self.cluster.cf_url("member")}

    def fsyncs(self) -> tuple[int, int] | None:
        return None  # counted by the worker processes themselves

    def cf_round_trips(self) -> int | None:
        return None  # in the worker processes


class SQMServiceOneCall(SQMService):
    """The service, each put and each get outside syncpoint: one request, durable before its reply."""

    name = "sqm-service-1"


class SQMServiceBase(SQMService):
    """sqm-service with its members (and the cluster's other processes) and its client processes running the code of
    --base-tree."""

    name = "sqm-service-base"

    def start(self) -> None:
        if self.args.base_tree is None:
            raise SystemExit(f"{self.name} needs --base-tree")
        self.member_env = {"PYTHONPATH": str(self.args.base_tree.resolve())}
        super().start()
        self.servers_note += f"; the members and the client processes run the code of {self.args.base_tree}"

    def client_params(self) -> dict[str, Any]:
        assert self.args.base_tree is not None
        return {**super().client_params(), "code_tree": str(self.args.base_tree.resolve())}


class SQMServiceOneCallBase(SQMServiceBase):
    """sqm-service-1 with its members running the code of --base-tree."""

    name = "sqm-service-1-base"


class SQMServiceUngrouped(SQMService):
    """The service with each of its CF calls in a round trip of its own: the baseline of the grouping of concurrent
    requests' CF calls (sqm.core.cfgroup) and of the event loop's batches (a thread per connection), measured beside
    sqm-service in the same run."""

    name = "sqm-service-ungrouped"
    member_args = ("--thread-per-connection",)

    def start(self) -> None:
        from sqm.core.cfgroup import UNGROUPED_ENV
        self.member_env = {UNGROUPED_ENV: "1"}
        super().start()
        self.servers_note += "; each CF call in a round trip of its own (not grouped, a thread per connection)"


class SQMServiceTCP(SQMService):
    """The service with its members reaching the CF over loopback TCP: the baseline of the CF's Unix-domain socket
    (the local cluster's default), measured beside sqm-service in the same run."""

    name = "sqm-service-tcp"
    cf_socket = False


CONTENDERS: dict[str, type[Contender]] = {"postgres": Postgres, "rabbitmq": RabbitMQ, "redis-aof": RedisAOF,
                                          "sqm-inproc": SQMInProcess, "sqm-service": SQMService,
                                          "sqm-service-1": SQMServiceOneCall,
                                          "sqm-service-base": SQMServiceBase,
                                          "sqm-service-1-base": SQMServiceOneCallBase,
                                          "sqm-service-ungrouped": SQMServiceUngrouped,
                                          "sqm-service-tcp": SQMServiceTCP}


# --- the clients (in worker processes) -----------------------------------------------------------------------
def redis_client(params: dict[str, Any], index: int) -> tuple[Any, str]:
    """A client of the durable Redis, and the name of this client's own processing list (the reliable-queue
    pattern: LMOVE from the queue into it, LREM once done)."""
    import redis
    return redis.Redis.from_url(params["url"]), f"bench:processing:{os.getpid()}:{index}"


def make_loop(kind: str, params: dict[str, Any], index: int, qm: Any) -> tuple[Callable[[float], int], Callable[[], None]]:
    """A client of contender ``kind``: (run until a time.time() deadline -> lifecycles, close). With
    params["batch"] B >= 1, each lifecycle is a batch of B messages: put B and commit, then get B and commit (the
    count is of messages)."""
    if params.get("batch"):
        return make_batch_loop(kind, params, index, qm, int(params["batch"]))
    if kind == "postgres":
        import psycopg
        conn = psycopg.connect(params["dsn"])
        cur = conn.cursor()

        def pg(stop_at: float) -> int:
            n = 0
            while time.time() < stop_at:
                cur.execute("INSERT INTO queue (body) VALUES (%s)", (BODY,))
                conn.commit()
                while True:
                    cur.execute("DELETE FROM queue WHERE id = (SELECT id FROM queue ORDER BY id "
                                "FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING body")
                    row = cur.fetchone()
                    conn.commit()
                    if row is not None:
                        break
                n += 1
            return n
        return pg, conn.close
    if kind == "rabbitmq":
        import pika
        rconn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", params["port"]))
        ch = rconn.channel()
        ch.confirm_delivery()
        props = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)

        def rabbit(stop_at: float) -> int:
            n = 0
            while time.time() < stop_at:
                ch.basic_publish("", "bench", BODY, props, mandatory=True)  # returns once confirmed
                while True:
                    method, _, _ = ch.basic_get("bench", auto_ack=False)
                    if method is not None:
                        ch.basic_ack(method.delivery_tag)
                        break
                n += 1
            return n
        return rabbit, rconn.close
    if kind == "redis-aof":
        client, processing = redis_client(params, index)

        def red(stop_at: float) -> int:
            n = 0
            while time.time() < stop_at:
                client.lpush("bench:q", BODY)
                while True:
                    item = client.lmove("bench:q", processing, "RIGHT", "LEFT")
                    if item is not None:
                        break
                client.lrem(processing, 1, item)
                n += 1
            return n
        return red, client.close
    if kind in ("sqm-service", "sqm-inproc", "sqm-service-1", "sqm-service-base", "sqm-service-1-base",
                "sqm-service-ungrouped", "sqm-service-tcp"):
        if kind.startswith("sqm-service"):
            from sqm.service.client import Client
            eps = params["endpoints"]
            handle: Any = Client(eps[index % len(eps)], token=params["token"], reconnect_timeout=5)
        else:
            handle = qm.connect()

        def sqm_one_call(stop_at: float) -> int:
            n = 0
            while time.time() < stop_at:
                handle.put(QUEUE, BODY, syncpoint=False)
                handle.get(QUEUE, syncpoint=False, wait_ms=1000)
                n += 1
            return n

        def sqm(stop_at: float) -> int:
            n = 0
            while time.time() < stop_at:
                handle.put(QUEUE, BODY)
                handle.commit()
                handle.get(QUEUE, wait_ms=1000)
                handle.commit()
                n += 1
            return n
        return (sqm_one_call if kind.startswith("sqm-service-1") else sqm), handle.close
    raise ValueError(kind)


def make_batch_loop(kind: str, params: dict[str, Any], index: int, qm: Any,
                    batch: int) -> tuple[Callable[[float], int], Callable[[], None]]:
    """The batched lifecycle (--batch): B messages put and committed together, then B got and committed together,
    as each contender batches: PostgreSQL a multi-row INSERT and a DELETE of B rows, each with its COMMIT; durable
    Redis a pipeline of B LPUSH (one AOF fsync for the event loop's turn), then B LMOVE and B LREM pipelined;
    the SQM put_batch and get_batch, each with its commit in the same request."""
    if kind == "postgres":
        import psycopg
        conn = psycopg.connect(params["dsn"])
        cur = conn.cursor()
        insert = "INSERT INTO queue (body) VALUES " + ", ".join(["(%s)"] * batch)

        def pg(stop_at: float) -> int:
            n = 0
            while time.time() < stop_at:
                cur.execute(insert, [BODY] * batch)
                conn.commit()
                got = 0
                while got < batch:
                    cur.execute("DELETE FROM queue WHERE id IN (SELECT id FROM queue ORDER BY id "
                                "FOR UPDATE SKIP LOCKED LIMIT %s) RETURNING body", (batch - got,))
                    got += len(cur.fetchall())
                    conn.commit()
                n += batch
            return n
        return pg, conn.close
    if kind == "redis-aof":
        client, processing = redis_client(params, index)

        def red(stop_at: float) -> int:
            n = 0
            while time.time() < stop_at:
                pipe = client.pipeline(transaction=False)
                for _ in range(batch):
                    pipe.lpush("bench:q", BODY)
                pipe.execute()
                got: list[bytes] = []
                while len(got) < batch:
                    pipe = client.pipeline(transaction=False)
                    for _ in range(batch - len(got)):
                        pipe.lmove("bench:q", processing, "RIGHT", "LEFT")
                    got += [x for x in pipe.execute() if x is not None]
                pipe = client.pipeline(transaction=False)
                for item in got:
                    pipe.lrem(processing, 1, item)
                pipe.execute()
                n += batch
            return n
        return red, client.close
    if kind == "sqm-service":
        from sqm.service.client import Client
        eps = params["endpoints"]
        handle = Client(eps[index % len(eps)], token=params["token"], reconnect_timeout=5)
        bodies = [BODY] * batch

        def sqm(stop_at: float) -> int:
            n = 0
            while time.time() < stop_at:
                handle.put_batch(bodies, queue=QUEUE, commit=True)
                got = 0
                while got < batch:
                    got += len(handle.get_batch(QUEUE, batch - got, wait_ms=1000, commit=True))
                n += batch
            return n
        return sqm, handle.close
    raise Unavailable(f"{kind}: no batched lifecycle")


def one_round(kind: str, params: dict[str, Any], worker: int, qm: Any, threads_n: int, pipe: Pipe,
              batch: int = 0) -> None:
    params = {**params, "batch": batch}
    loops = [make_loop(kind, params, worker * 1000 + i, qm) for i in range(threads_n)]
    go = threading.Event()
    box: dict[str, float] = {}
    counts = [0] * threads_n
    errors: list[str] = []

    def run(i: int) -> None:
        go.wait()
        try:
            counts[i] = loops[i][0](box["stop_at"])
        except Exception as e:  # reported, and the figure is refused
            errors.append(f"{type(e).__name__}: {e}")
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads_n)]
    for t in threads:
        t.start()
    f0 = qm.log.stats.fsyncs if qm is not None else 0
    pipe.send(("ready",))
    cmd = pipe.recv()
    box["stop_at"] = cmd[1]
    go.set()
    for t in threads:
        t.join()
    extra: dict[str, Any] = {"errors": errors}
    if qm is not None:
        extra["fsyncs"] = qm.log.stats.fsyncs - f0
    for _, close in loops:
        with contextlib.suppress(Exception):
            close()
    pipe.send(("done", sum(counts), extra))


PACKAGES = ("cfemu", "sqm", "backup", "restore", "qsg")


def use_code_tree(tree: str) -> None:
    """Import the project's packages from ``tree`` from now on (a base contender's client process): none of those
    this process imported already is kept."""
    for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
        del sys.modules[name]
    sys.path.insert(0, tree)


def client_worker(kind: str, params: dict[str, Any], worker: int, pipe: Pipe) -> None:
    """A client process: on ("prepare", threads) open that many clients, one thread each, and say "ready"; on
    ("go", stop_at) run them until stop_at (time.time()) and report ("done", lifecycles, extra)."""
    if params.get("code_tree"):
        use_code_tree(params["code_tree"])
    qm = None
    if kind == "sqm-inproc":
        os.environ.update(params["env"])
        from sqm.core.manager import QueueManager, QueueManagerConfig
        qm = QueueManager(QueueManagerConfig(name=f"INPROC{worker + 1}", log_root=Path(params["log_root"]),
                                             redis_url=params["redis_url"], lease_ms=LEASE_MS))
        qm.start()
    pipe.send(("started", os.getpid()))
    try:
        while True:
            msg = pipe.recv()
            if msg[0] == "quit":
                return
            one_round(kind, params, worker, qm, msg[1], pipe, msg[2] if len(msg) > 2 else 0)
    finally:
        if qm is not None:
            qm.stop()


class Workers:
    """The client processes of one contender (kept for the whole run)."""

    def __init__(self, contender: Contender, procs: int) -> None:
        ctx = mp.get_context("spawn")
        self.pipes: list[Pipe] = []
        self.procs = []
        params = contender.client_params()
        for w in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=client_worker, args=(contender.name, params, w, child), daemon=True)
            p.start()
            self.pipes.append(parent)
            self.procs.append(p)
        for pipe in self.pipes:
            if not pipe.poll(120):
                raise Unavailable(f"a client process of {contender.name} did not start")
            pipe.recv()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(Exception):
                pipe.send(("quit",))
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def measure(contender: Contender, workers: Workers, clients: int, seconds: float, batch: int = 0) -> dict[str, Any]:
    """One round: ``clients`` clients spread over the worker processes, for ``seconds``; ``batch``: the batched
    lifecycle of that many messages (0: one message a lifecycle, the contender's own way)."""
    used = workers.pipes[:min(clients, len(workers.pipes))]
    share = [clients // len(used) + (1 if i < clients % len(used) else 0) for i in range(len(used))]
    for pipe, n in zip(used, share):
        pipe.send(("prepare", n, batch))
    for pipe in used:
        if not pipe.poll(120):
            raise RuntimeError(f"{contender.name}: clients not ready")
        pipe.recv()
    f0, k0 = contender.fsyncs(), contender.cf_round_trips()
    servers, client_pids = contender.server_pids(), workers.pids()
    redis = contender.redis_pids()
    s0, cl0, r0, t0 = cpu_ticks(servers), cpu_ticks(client_pids), cpu_ticks(redis), time.time()
    stop_at = t0 + seconds
    for pipe in used:
        pipe.send(("go", stop_at))
    time.sleep(max(0.0, stop_at - time.time()))
    s1, cl1, r1, t1 = cpu_ticks(servers), cpu_ticks(client_pids), cpu_ticks(redis), time.time()
    total, extras = 0, []
    for pipe in used:
        if not pipe.poll(120):
            raise RuntimeError(f"{contender.name}: clients did not finish")
        _, n, extra = pipe.recv()
        total += n
        extras.append(extra)
    errors = [e for x in extras for e in x["errors"]]
    if errors:
        raise RuntimeError(f"{contender.name}: {len(errors)} client(s) failed: {errors[0]}")
    f1, k1 = contender.fsyncs(), contender.cf_round_trips()
    fsyncs_per_commit = None
    if f0 is not None and f1 is not None and f1[1] > f0[1]:
        fsyncs_per_commit = (f1[0] - f0[0]) / (2 * total) if total else None
    elif "fsyncs" in extras[0]:
        fsyncs_per_commit = sum(x["fsyncs"] for x in extras) / (2 * total) if total else None
    return {"per_s": total / (t1 - t0), "lifecycles": total,
            "cpu_us": (s1 - s0 + cl1 - cl0) / TICK * 1e6 / total if total else None,
            "server_cpu_us": (s1 - s0) / TICK * 1e6 / total if total else None,
            "client_cpu_us": (cl1 - cl0) / TICK * 1e6 / total if total else None,
            "redis_cpu_us": (r1 - r0) / TICK * 1e6 / total if total and redis else None,
            "fsyncs_per_commit": fsyncs_per_commit,
            "cf_round_trips": (k1 - k0) / total if k0 is not None and k1 is not None and total else None,
            "load": round(os.getloadavg()[0], 2)}


# --- the run ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="clients 1 and 8, 1 s windows, 1 round")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, nargs="+", default=list(ALL_CLIENTS))
    ap.add_argument("--peers", nargs="+", choices=PEERS, default=[p for p in PEERS if p not in BASELINES])
    ap.add_argument("--servers", type=int, default=1, help="`sqm run` servers for sqm-service (default 1)")
    ap.add_argument("--base-tree", type=Path, default=None,
                    help="for sqm-service-1-base: a source tree whose code its members run (run this benchmark "
                         "from a directory that holds no package of the project, so the tree's PYTHONPATH decides)")
    ap.add_argument("--client-procs", type=int, default=2, help="client worker processes per contender")
    ap.add_argument("--no-install", dest="install", action="store_false",
                    help="skip a contender that is not installed instead of installing it")
    ap.add_argument("--batch", type=int, nargs="+", default=None,
                    help="batched lifecycles of B messages (0: the one-message lifecycle), for each client count: "
                         "figures per message; contenders without a batched lifecycle are measured at 0 only")
    ap.add_argument("--json", action="store_true", help="print the JSON record instead of the tables")
    # Not the repository's var/: it is private to its owner (0700), and PostgreSQL and RabbitMQ run as their own
    # users, who must reach their data directories (initdb and the Erlang cookie failed with EACCES there).
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the servers' files go (a real disk, reachable by the postgres and rabbitmq users)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds = 1.0, 1
        if args.clients == list(ALL_CLIENTS):
            args.clients = [1, 8]
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-peers-", dir=args.work_dir))
    os.chmod(work, 0o755)  # the servers that run as their own users must reach their directories
    blocked = [str(p) for p in work.parents if not os.stat(p).st_mode & 0o001]
    if blocked:
        say(f"bench_peers: {', '.join(blocked)} cannot be traversed by other users: PostgreSQL and RabbitMQ will "
            "fail to start there; pick --work-dir elsewhere")
    info = machine(work)
    started = datetime.now(UTC)
    running: dict[str, tuple[Contender, Workers]] = {}
    skipped: dict[str, str] = {}
    results: dict[str, dict[str, Any]] = {p: {} for p in args.peers}
    keys: list[str] = []  # the rows: client counts, or (with --batch) client counts and batch sizes
    def start(name: str) -> tuple[Contender, Workers] | None:
        c = CONTENDERS[name](work, args)
        t0 = time.monotonic()
        try:
            c.start()
            started = (c, Workers(c, max(1, args.client_procs)))
            say(f"{name} started in {time.monotonic() - t0:.1f} s")
            return started
        except Unavailable as e:
            skipped[name] = str(e)
            say(f"{name}: SKIPPED, no figure: {e}")
            with contextlib.suppress(Exception):
                c.stop()
            return None

    try:
        # The contenders start side by side (most of it is waiting for RabbitMQ and initdb); none is measured yet.
        with ThreadPoolExecutor(len(args.peers)) as pool:
            for name, got in zip(args.peers, list(pool.map(start, args.peers))):
                if got is not None:
                    running[name] = got
        batches = args.batch if args.batch is not None else [0]
        for n, b in [(n, b) for n in args.clients for b in batches]:
            key = str(n) if args.batch is None else f"{n} B={b}"
            keys.append(key)
            here = [p for p in running if b == 0 or p in BATCHED]
            rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in here}
            for r in range(args.rounds):
                order = here if r % 2 == 0 else list(reversed(here))
                for name in order:
                    c, w = running[name]
                    m = measure(c, w, n, args.seconds, b)
                    rounds[name].append(m)
                    say(f"  {key:>8} clients, round {r + 1}/{args.rounds}, {name:<12} {m['per_s']:8.1f}/s  "
                        f"cpu {m['cpu_us'] or 0:7.0f} µs/lifecycle (servers {m['server_cpu_us'] or 0:5.0f}, "
                        f"clients {m['client_cpu_us'] or 0:5.0f})  load {m['load']}")
            for name, ms in rounds.items():
                fs = [m["fsyncs_per_commit"] for m in ms if m["fsyncs_per_commit"] is not None]
                trips = [m["cf_round_trips"] for m in ms if m["cf_round_trips"] is not None]
                results[name][key] = {
                    "per_s": round(statistics.median(m["per_s"] for m in ms), 1),
                    "cpu_us_per_lifecycle": round(statistics.median(m["cpu_us"] for m in ms)),
                    "server_cpu_us_per_lifecycle": _median_or_none([m["server_cpu_us"] for m in ms]),
                    "client_cpu_us_per_lifecycle": _median_or_none([m["client_cpu_us"] for m in ms]),
                    "redis_cpu_us_per_lifecycle": _median_or_none([m["redis_cpu_us"] for m in ms]),
                    "fsyncs_per_commit": round(statistics.median(fs), 3) if fs else None,
                    "cf_round_trips_per_lifecycle": round(statistics.median(trips), 2) if trips else None,
                    "load": [m["load"] for m in ms], "rounds_per_s": [round(m["per_s"], 1) for m in ms]}
    finally:
        def stop(cw: tuple[Contender, Workers]) -> None:
            cw[1].close()
            cw[0].stop()
        with ThreadPoolExecutor(max(1, len(running))) as pool:
            list(pool.map(stop, running.values()))
        shutil.rmtree(work, ignore_errors=True)
    info["load_average_at_end"] = load_average()
    record = {"benchmark": "peers", "date": started.isoformat(timespec="seconds"), "quick": args.quick,
              "seconds": args.seconds, "rounds": args.rounds, "clients": keys, "batch": args.batch,
              "servers": args.servers,
              "client_procs": args.client_procs, "machine": info, "skipped": skipped,
              "setups": {name: c.servers_note for name, (c, _) in running.items()},
              "results": {k: v for k, v in results.items() if k in running},
              "elapsed_s": round(time.time() - started.timestamp())}
    append_result("peers", record)
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        print_tables(record)
    return 0


def _median_or_none(values: list[float | None]) -> int | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known)) if known else None


def print_tables(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console()
    peers = list(record["results"])
    for title, key, fmt in (("lifecycles/s (median)", "per_s", "{:.0f}"),
                            ("CPU µs per lifecycle (servers + clients)", "cpu_us_per_lifecycle", "{:.0f}"),
                            ("of which the servers (with their children)", "server_cpu_us_per_lifecycle",
                             "{:.0f}"),
                            ("of which the client processes", "client_cpu_us_per_lifecycle", "{:.0f}"),
                            ("of which redis-server (the SQM's CF; durable Redis's server)",
                             "redis_cpu_us_per_lifecycle", "{:.0f}"),
                            ("fsyncs per commit", "fsyncs_per_commit", "{:.2f}"),
                            ("CF round trips per lifecycle (the SQM members': several script calls may share one)",
                             "cf_round_trips_per_lifecycle", "{:.2f}")):
        table = Table("clients", *peers, "load", title=title)
        for n in record["clients"]:
            row = [str(n)]
            loads: list[float] = []
            for p in peers:
                r = record["results"][p].get(str(n), {})
                v = r.get(key)
                row.append("-" if v is None else fmt.format(v))
                loads += r.get("load", [])
            row.append(f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-")
            table.add_row(*row)
        console.print(table)
    for name, why in record["skipped"].items():
        console.print(f"[yellow]{name}: skipped, no figure: {why}[/yellow]")
    for name, note in record["setups"].items():
        console.print(f"[dim]{name}: {note}[/dim]")
    console.print(f"machine: {record['machine']}")


if __name__ == "__main__":
    sys.exit(main())
