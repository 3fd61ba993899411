"""A local queue-sharing group as real processes: an embedded CF, N ``sqm run`` servers, a backup scheduler.

The same topology as docker-compose.yml, for machines without Docker::

    cluster = LocalGroup.up("var/cluster", managers=3, backup_interval=10)
    cluster.endpoints            # [("QM1", "127.0.0.1", 40001), ...]
    cluster.kill_manager("QM2")  # kill -9; its peers recover its work once its lease lapses
    cluster.restart_manager("QM2")
    cluster.kill_cf(); cluster.restart_cf()   # lose the CF; it comes back empty on the same port
    cluster.supervise_cf()       # from now on a dead or hung CF is restarted (empty, same port) within seconds
    cluster.restart_member("QM1")  # an operator's restart: SIGTERM, bounded wait, SIGKILL, start, wait until it serves
    cluster.down()

Who brings a lost process back: the group's supervisor (qsg.group_supervisor). With ``restart_cf=True`` (``cfemu
cluster up`` does it) it restarts the CF's redis-server, empty, on the same port, whenever it dies or hangs; the
members re-join it and, for structures defined with RECAUTO, restore them by themselves (sqm.core.recauto; docs/runbook.md
"When the CF is lost"). With ``restart_members=True`` (``cfemu cluster up`` does it) it restarts a member that died
or was fenced, with backoff. In a cluster run by this process the supervisor is a thread of the LocalGroup object
(``supervise_cf()``, stopped by ``down()`` or ``supervise_cf(False)``); a detached cluster (``cfemu cluster up``)
gets a process of its own, ``python -m qsg.local_group supervise --dir DIR``, listed by status as
``cf-supervisor``. A member that ``kill_manager`` stopped is held: its caller restarts it (``restart_manager``), the
supervisor does not; a group run by this process (the chaos suite's) restarts no member unless asked to.

cluster.json is written by several processes of a detached group (the supervisor, ``cfemu cluster restart``,
``down``): each read-modify-write holds ``state_lock()`` (an flock on DIR/cluster.lock) and reads the file afresh.

The directory holds ``cluster.json`` (pids, ports, URLs, paths; the names every command reads it by are in
cfemu.settings), ``cf/`` (the redis-server's directory),
``logs/`` (every member's log: the log root), ``backups/`` and ``run/`` (each process's stderr). A cluster started
with ``detach=True`` (what ``cfemu cluster up`` does) outlives the process that started it; ``LocalGroup.load(dir)``
finds it again. Otherwise its processes die with the thread that started them.

The backup scheduler is its own process (``cfbackup schedule``) that runs
``cfbackup run STRUCTURE`` for every ACTIVE structure every N seconds, as a subprocess, so a failed or slow backup
never takes the scheduler down and the scheduler never imports more than it needs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cfemu import credentials, repository
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis, ServerNotRunningError, discard_data
from cfemu.embedded_rcluster import EmbeddedCluster
from cfemu.private_files import private_dir, write_private
from cfemu.procs import (
    CF_SERVER_MARKERS,
    cmdline_holds,
    free_port,
    log_tail,
    pid_alive,
    popen_tied,
    wait_gone,
)
from cfemu.settings import (
    CLUSTER_BACKUP_DIR,
    CLUSTER_CF,
    CLUSTER_CF_SOCKET,
    CLUSTER_FILE,
    CLUSTER_LOG_ROOT,
    CLUSTER_REDIS_URL,
    CLUSTER_SPARK,
    ENV_BACKUP_DIR,
    ENV_CLUSTER_DIR,
    ENV_LOG_ROOT,
    ENV_OPERATOR_TOKEN,
    ENV_TOKEN,
    ENV_URL,
    cluster_cf_url,
)
from cfemu.signals import handling
from qsg import rcluster_cf
from qsg.cfpair import CFPair
from qsg.group_supervisor import EXIT_FILE_ENV, SUPERVISE_INTERVAL_S, Supervisor, describe_exit

log = logging.getLogger("qsg.local_group")

# Runs the backup CLI in a fresh interpreter (no dependence on console scripts being on PATH).
SCHEDULER_COMMAND = [sys.executable, "-m", "backup.cli", "schedule"]  # cfbackup schedule
# A member: the ``sqm`` command, restore wired in for RECAUTO (qsg.member).
MEMBER_COMMAND = [sys.executable, "-m", "qsg.member", "run"]
SUPERVISOR_COMMAND = [sys.executable, "-m", "qsg.local_group", "supervise"]
CONSOLE_COMMAND = [sys.executable, "-m", "qsg.cli", "console"]  # cfemu console (qsg.console)
LOCK_FILE = "cluster.lock"


class LocalGroupError(RuntimeError):
    """The cluster cannot be started, found or stopped as asked."""


def _pid_runs(pid: int | None, marker: bytes | tuple[bytes, ...]) -> bool:
    """Is pid alive and still the process we started (its command line holds marker)? Guards against pid reuse."""
    return pid is not None and pid > 0 and pid_alive(pid) and cmdline_holds(pid, marker)


class LocalGroup:
    """A running (or stopped) local cluster, described by DIR/cluster.json."""

    def __init__(self, directory: Path, state: dict[str, Any]) -> None:
        self.dir = directory
        self.state = state
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._cf: EmbeddedRedis | None = None
        self._nodes: EmbeddedCluster | None = None  # the CF's nodes when it is a Redis Cluster (qsg.rcluster_cf)
        self._cf_lock = threading.RLock()  # the supervisor and the API's CF restarts, one at a time
        self._supervisor: tuple[threading.Thread, threading.Event] | None = None
        self.cf_restarts = 0  # restarts the supervisor made
        self._pair: CFPair | None = None
        self._state_mutex = threading.RLock()
        self._lock_fd: int | None = None
        self._lock_depth = 0

    @property
    def duplexed(self) -> bool:
        return bool(self.state.get("duplex"))

    @property
    def pair(self) -> CFPair:
        """The duplexed CF's controller (qsg.cfpair); only for a cluster started with duplex=True."""
        if not self.duplexed:
            raise LocalGroupError("this cluster's CF is not duplexed (start it with 'cfemu cluster up --duplex')")
        if self._pair is None:
            self._pair = CFPair(self)
        return self._pair

    # --- what callers use ----------------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return str(self.state[CLUSTER_REDIS_URL])

    @property
    def host(self) -> str:
        return str(self.state["host"])

    @property
    def endpoints(self) -> list[tuple[str, str, int]]:
        return [(m["name"], self.host, int(m["port"])) for m in self.state["managers"]]

    @property
    def log_root(self) -> Path:
        return Path(self.state[CLUSTER_LOG_ROOT])

    @property
    def backup_dir(self) -> Path:
        return Path(self.state[CLUSTER_BACKUP_DIR])

    @property
    def secrets_dir(self) -> Path:
        return self.dir / credentials.SECRETS_DIR

    @property
    def token(self) -> str | None:
        """The service's application token, from the group's secrets (never from cluster.json, which is not a
        secret file)."""
        return credentials.service_token(self.secrets_dir, "application", create=False)

    @property
    def operator_token(self) -> str | None:
        """The service's operator token (define, status, resolve of any in-doubt UOW), from the group's secrets."""
        return credentials.service_token(self.secrets_dir, "operator", create=False)

    def backup_keys(self) -> credentials.BackupKeys:
        """The group's backup keys, from its secrets: what signs and checks this cluster's backups (its
        scheduler's, and those a process beside it takes or restores from)."""
        return credentials.backup_keys(self.secrets_dir)

    @property
    def local_url(self) -> str:
        """The CF's URL for the group's processes, all on this host: its Unix-domain socket where it listens on
        one (cf_socket), else redis_url (TCP, what a process elsewhere or a fault proxy in the path uses)."""
        return cluster_cf_url(self.state)

    def cf_url(self, role: str = "operator") -> str:
        """The CF's URL (local_url) with the user and password of a role (for this process's own connections:
        never put it on a command line or in a file)."""
        password = credentials.read_password(self.secrets_dir, role)
        return credentials.with_user(self.local_url, role, password) if password else self.local_url

    def manager(self, name: str) -> dict[str, Any]:
        for m in self.state["managers"]:
            if m["name"] == name:
                return dict(m)
        raise LocalGroupError(f"no queue manager {name} in this cluster ({', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [m["name"] for m in self.state["managers"]]

    # --- start ---------------------------------------------------------------------------------------------
    @classmethod
    def up(cls, directory: str | os.PathLike[str], managers: int = 3, *, backup_interval: float | None = 10.0,
           structure: str | None = "APP1", queues: Sequence[str] = ("Q1", "Q2"), lease_ms: int = 5000,
           token: str | None = None, host: str = "127.0.0.1", detach: bool = False, start_timeout: float = 90.0,
           manager_args: Sequence[str] = (), cf_url_for: Callable[[str, str], str] | None = None,
           restart_cf: bool = False, recauto: bool = True, spark_workers: int = 0, spark_cores: int = 1,
           spark_memory: str = "2g", duplex: bool = False, redis_cluster: int = 0,
           restart_members: bool = False, rest: bool = False, backup_keep: int = 5,
           backup_keep_age: str | None = None, console: bool = False, cf_socket: bool = True) -> LocalGroup:
        """Start an embedded CF, managers QM1..QMn and (with a backup_interval) the backup scheduler.

        start_timeout: how long each member's first start may take before the group is taken down. A member that
        exits is reported at once; one that is only slow (a loaded machine: on 2 cores under a test suite's load
        of 15-20 a member took more than 30 s to write its first log line) is waited for.

        structure/queues are defined when missing (structure=None defines nothing). manager_args go to every
        ``sqm run``. cf_url_for(manager, cf_url) gives the CF URL a manager uses (a proxy in the path, for the
        chaos suite); it is kept in cluster.json for restarts. restart_cf: a supervisor restarts the CF whenever
        it dies (a thread here, or with detach a process). recauto: the RECAUTO attribute of the structure defined
        here. spark_workers: also a standalone Spark master and that many workers (qsg.spark_standalone), each
        offering spark_cores and spark_memory, in DIR/spark. duplex: the CF is a pair, the secondary a
        synchronous copy of the primary (qsg.cfpair); its controller is the supervisor, so restart_cf is
        required. redis_cluster: the CF is a Redis Cluster of that many masters (qsg.rcluster_cf; 0: one
        redis-server). restart_members: the supervisor restarts a member that died or was fenced, with backoff
        (qsg.group_supervisor; a thread here, or with detach the supervisor process). backup_keep: the
        scheduler's retention, good backups kept per structure (cfbackup schedule --keep; 0: all);
        backup_keep_age: also those started within that age (--keep-age, e.g. 7d). console: also
        the group's web console (cfemu console) on a free loopback port, shown by status. cf_socket: the CF
        also listens on a Unix-domain socket (in its directory, cf/cf.sock), and the group's processes (members,
        scheduler, supervisor, commands) reach it there rather than over loopback TCP, which costs more CPU a
        call (BENCHMARKS.md); its TCP port stays for everything else (a member given cf_url_for, a proxy). A
        duplexed CF and a Redis Cluster CF are reached over TCP. On any failure everything already started is
        stopped again.
        """
        if duplex and redis_cluster:
            raise LocalGroupError("--duplex and --redis-cluster do not go together: a Redis Cluster CF keeps its copies "
                                  "with its own replicas (docs/architecture.md)")
        if duplex and not restart_cf:
            raise LocalGroupError("a duplexed CF needs the CF supervisor, which degrades and promotes the pair: drop "
                                  "--no-cf-restart")
        if not 1 <= managers <= 32:
            raise LocalGroupError(f"--managers must be 1-32, not {managers}")
        if redis_cluster and not 3 <= redis_cluster <= 16:
            raise LocalGroupError(f"--redis-cluster must be 3-16 masters, not {redis_cluster}")
        if backup_interval is not None and backup_interval <= 0:
            raise LocalGroupError(f"the backup interval must be > 0 seconds, not {backup_interval}")
        d = Path(directory).resolve()
        existing = cls._read_state(d)
        if existing is not None and cls(d, existing).running_processes():
            raise LocalGroupError(f"a cluster is already running in {d}: run 'cfemu cluster down --dir {d}' first")
        private_dir(d)
        for sub in ("cf", "logs", "backups", "run", *(("cf2",) if duplex else ())):
            private_dir(d / sub)
        # The group's secrets, made once and kept across restarts: the CF's users and the service's tokens. A token
        # given here replaces the application's (what clients already hold).
        secrets_dir = d / credentials.SECRETS_DIR
        credentials.create(secrets_dir)
        if token and token != credentials.service_token(secrets_dir, "application"):
            write_private(credentials.service_token_file(secrets_dir, "application"), token.encode())
        state: dict[str, Any] = {
            "dir": str(d), "host": host, "detached": detach, "lease_ms": lease_ms,
            CLUSTER_LOG_ROOT: str(d / "logs"), CLUSTER_BACKUP_DIR: str(d / "backups"),
            CLUSTER_CF: {"dir": str(d / "cf"), **({rcluster_cf.KEY: redis_cluster} if redis_cluster else {}),
                         **({CLUSTER_CF_SOCKET: None} if cf_socket and not duplex and not redis_cluster else {})},
            "managers": [{"name": f"QM{i}", "port": free_port(host), "metrics_port": free_port("127.0.0.1"),
                          **({"rest_port": free_port("127.0.0.1")} if rest else {})}
                         for i in range(1, managers + 1)],
            "manager_args": list(manager_args),
            "scheduler": {"interval": backup_interval, "keep": backup_keep,
                          **({"keep_age": backup_keep_age} if backup_keep_age else {})} if backup_interval else None,
            "cf_supervisor": {} if restart_cf or restart_members else None,
            "cf_restart": restart_cf, "member_restart": restart_members,
            CLUSTER_SPARK: None,
            "duplex": CFPair.new_state(d / "cf2") if duplex else None,
            "console": {"port": free_port("127.0.0.1")} if console else None,
            "started_at": time.time(),
        }
        cluster = cls(d, state)
        try:
            cluster._start_cf(port=None)
            if duplex:
                cluster.pair.establish()
            if structure:
                cluster._define(structure, queues, recauto=recauto)
            if cf_url_for is not None:
                for m in state["managers"]:
                    m["cf_url"] = cf_url_for(m["name"], cluster.redis_url)
            for m in state["managers"]:
                cluster.spawn_manager(m["name"])
            for m in state["managers"]:
                cluster._wait_first_start(m["name"], start_timeout)
            if backup_interval:
                cluster._spawn_scheduler()
            if console:
                cluster._spawn_console(start_timeout)
            if spark_workers:
                cluster._start_spark(spark_workers, spark_cores, spark_memory)
            if (restart_cf or restart_members) and detach:
                cluster.save_state()  # the supervisor process reads it
                cluster._spawn_supervisor()
            elif restart_cf or restart_members:
                cluster.supervise_cf(cf=restart_cf)
        except BaseException:
            cluster.down(timeout=5.0)
            raise
        cluster.save_state()
        return cluster

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> LocalGroup:
        d = Path(directory).resolve()
        state = cls._read_state(d)
        if state is None:
            raise LocalGroupError(f"no cluster in {d} (no {CLUSTER_FILE}); start one with 'cfemu cluster up'")
        return cls(d, state)

    @staticmethod
    def _read_state(d: Path) -> dict[str, Any] | None:
        try:
            return dict(json.loads((d / CLUSTER_FILE).read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise LocalGroupError(f"unreadable {d / CLUSTER_FILE}: {e}") from None

    def save_state(self) -> None:
        write_private(self.dir / CLUSTER_FILE, (json.dumps(self.state, indent=2) + "\n").encode())

    @contextlib.contextmanager
    def state_lock(self) -> Any:
        """Hold the group's state lock (re-entrant in this object): every process that reads, changes and saves
        cluster.json of a detached group holds it, and reads the file afresh inside it (``refresh``)."""
        with self._state_mutex:
            if self._lock_depth == 0:
                fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
                self._lock_fd = fd
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
                if self._lock_depth == 0 and self._lock_fd is not None:
                    os.close(self._lock_fd)  # closing releases the flock
                    self._lock_fd = None

    def refresh(self) -> None:
        """Read cluster.json again (what other processes changed since), keeping what only this object holds: the
        processes it started (their exit status) and its CF server while it is the same process."""
        fresh = self._read_state(self.dir)
        if fresh is None:
            return
        self.state = fresh
        if self._cf is not None and self._cf.pid != (fresh.get(CLUSTER_CF) or {}).get("pid"):
            self._cf = None
        self._pair = None
        self._nodes = None

    def _refresh_if_shared(self) -> None:
        """A detached group's file is shared with its supervisor and commands: read it afresh (call it under
        state_lock). A group run by this process is this object's alone."""
        if self.state.get("detached"):
            self.refresh()

    def child_env(self) -> dict[str, str]:
        """The environment the cluster gives its processes (its settings, its token), for one started beside
        them (the chaos suite's stray member)."""
        return self._env()

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Every setting in the environment, this cluster's directory included, so that the children (and the
        # scheduler's backups) resolve this cluster's settings, not those of a cluster near their working directory.
        env.update({ENV_URL: self.local_url, credentials.ENV_SECRETS_DIR: str(self.secrets_dir), ENV_LOG_ROOT: str(self.log_root), ENV_BACKUP_DIR: str(self.backup_dir),
                    ENV_CLUSTER_DIR: str(self.dir), "PYTHONUNBUFFERED": "1"})
        # The children read the tokens from the secrets directory, like the CF's passwords.
        env.pop(ENV_TOKEN, None)
        env.pop(ENV_OPERATOR_TOKEN, None)
        return env

    def _popen(self, key: str, cmd: list[str], log_name: str,
               env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.dir / "run" / log_name, "ab") as out:
            kw: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": out, "stderr": subprocess.STDOUT,
                                  "env": {**self._env(), **(env or {})}, "close_fds": True}
            if self.state["detached"]:
                proc = subprocess.Popen(cmd, start_new_session=True, **kw)
            else:
                proc = popen_tied(cmd, **kw)
        self._procs[key] = proc
        return proc

    def _start_cf(self, port: int | None) -> None:
        if rcluster_cf.is_cluster_cf(self.state[CLUSTER_CF]):
            self._start_cluster_cf()
            return
        cf_dir = Path(self.state[CLUSTER_CF]["dir"])
        discard_data(cf_dir)  # the CF always starts empty, like a lost CF
        passwords = credentials.create(self.secrets_dir)
        acl = credentials.acl_lines(passwords) + (self.pair.acl() if self.duplexed else [])
        cf = self.state[CLUSTER_CF]
        # The socket's path is chosen at the first start and kept, so that a restarted CF is found where it was.
        unix_socket = (cf.get(CLUSTER_CF_SOCKET) or True) if CLUSTER_CF_SOCKET in cf else False
        self._cf = EmbeddedRedis(port=port, data_dir=cf_dir, host=self.host, detach=self.state["detached"],
                                 acl_users=acl, unix_socket=unix_socket).start()
        cf.update(port=self._cf.port, pid=self._cf.pid, server=self._cf.server.as_dict())
        if unix_socket:
            cf[CLUSTER_CF_SOCKET] = str(self._cf.socket_path)
        self.state[CLUSTER_REDIS_URL] = self.pair.url() if self.duplexed and self.pair.state["addresses"] \
            else self._cf.url

    def _cluster_nodes(self) -> EmbeddedCluster:
        if self._nodes is None:
            self._nodes = rcluster_cf.embedded(self.state[CLUSTER_CF], self.secrets_dir, self.host,
                                               bool(self.state["detached"]))
        return self._nodes

    def _start_cluster_cf(self) -> None:
        """Start (or restart) the Redis Cluster's nodes: those that do not run, empty, on their ports."""
        nodes = self._cluster_nodes()
        if all((nodes.directory / n / "nodes.conf").exists() for n in nodes.nodes):
            for n in nodes.dead():
                nodes.start_node(n)
            nodes.wait_ok()  # as a single CF's start waits for PING: the restarted nodes serve their slots
        else:
            nodes.start()
        self.state[CLUSTER_REDIS_URL] = rcluster_cf.record(self.state[CLUSTER_CF], nodes)

    def _define(self, structure: str, queues: Sequence[str], *, recauto: bool = True) -> None:
        """Define what is missing, in the CF and in the group repository under the cluster's log root."""
        client = connect(self.cf_url("operator"))
        try:
            admin = Admin(client)
            repo = repository.open_group_repository(admin, self.log_root, who="cfemu cluster")
            repository.ensure_structure(admin, repo, structure, list(queues), recauto=recauto)
        finally:
            client.close()

    def _ready_file(self, name: str) -> Path:
        return self.dir / "run" / f"{name}.ready"

    def _exit_file(self, name: str) -> Path:
        return self.dir / "run" / f"{name}.exit"

    def spawn_manager(self, name: str, env: Mapping[str, str] | None = None) -> None:
        m = self.manager(name)
        for stale in (self._ready_file(name), self._exit_file(name)):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        env = {EXIT_FILE_ENV: str(self._exit_file(name)), **(env or {})}
        cmd = [*MEMBER_COMMAND, "--name", name, "--host", self.host, "--port", str(m["port"]),
               "--metrics-port", str(m["metrics_port"]), "--redis-url", m.get("cf_url") or self.local_url,
               *(("--rest-port", str(m["rest_port"])) if m.get("rest_port") else ()),
               "--log-root", str(self.log_root), "--backup-dir", str(self.backup_dir), "--lease-ms", str(self.state["lease_ms"]), "--ready-file",
               str(self._ready_file(name)), *self.state.get("manager_args", []), *m.get("extra_args", [])]
        proc = self._popen(name, cmd, f"{name}.log", env)
        self.set_manager(name, pid=proc.pid)

    def set_manager(self, name: str, **values: Any) -> None:
        for m in self.state["managers"]:
            if m["name"] == name:
                m.update(values)

    def _hold(self, name: str, why: str | None) -> None:
        """Mark a member held (why: who stopped it; the supervisor leaves it alone) or free again (None)."""
        with self.state_lock():
            self._refresh_if_shared()
            self.manager(name)  # an unknown member is an error
            self.set_manager(name, held=why)
            self.save_state()

    def manager_runs(self, name: str) -> bool:
        return _pid_runs(self.manager(name).get("pid"), name.encode())

    def ready_pid(self, name: str) -> int | None:
        """The pid a member's ready file names (written once it serves; None: not serving, or not yet)."""
        try:
            return int(json.loads(self._ready_file(name).read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def exit_reason(self, name: str, pid: int) -> str:
        """Why a member's process pid is gone, as a restart's reason: its exit status from the kernel when this
        object started it, else from the exit file it wrote (qsg.member), else a signal it could not record."""
        proc = self._procs.get(name)
        if proc is not None and proc.pid == pid:
            code = proc.poll()
            if code is not None:
                return describe_exit(code)
        try:
            doc = json.loads(self._exit_file(name).read_text())
            if int(doc["pid"]) == pid:
                return describe_exit(int(doc["code"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return "died with no exit status recorded (killed by a signal such as SIGKILL, or it crashed)"

    def note_in_member_log(self, name: str, text: str) -> None:
        """A line of the group's own in a member's run/<name>.log, between its incarnations' lines."""
        with contextlib.suppress(OSError), open(self.dir / "run" / f"{name}.log", "a") as f:
            f.write(f"--- cfemu cluster {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {name} {text}\n")

    def _wait_manager(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ready = self._ready_file(name)
        proc = self._procs.get(name)
        while not ready.exists():
            if proc is not None and proc.poll() is not None:
                raise LocalGroupError(f"{name} exited with status {proc.returncode} while starting; tail of "
                                      f"{self.dir / 'run' / (name + '.log')}:\n{log_tail(self.dir / 'run' / (name + '.log'))}")
            if time.monotonic() >= deadline:
                raise LocalGroupError(f"{name} was not serving within {timeout:g}s; see {self.dir / 'run'}")
            time.sleep(0.05)

    def _wait_first_start(self, name: str, timeout: float, attempts: int = 3) -> None:
        """Wait for a manager's first start. Its ports were picked free when the cluster was planned, but another
        process on the machine may have taken one since (seen in the test suite while other suites ran): then it
        gets fresh ports and starts again. Only the first start may move: later restarts keep the ports clients
        hold."""
        for attempt in range(attempts):
            try:
                self._wait_manager(name, timeout)
                return
            except LocalGroupError as e:
                if "address already in use" not in str(e).lower() or attempt == attempts - 1:
                    raise
            self.set_manager(name, port=free_port(self.host), metrics_port=free_port(self.host),
                             **({"rest_port": free_port("127.0.0.1")} if self.manager(name).get("rest_port") else {}))
            self.spawn_manager(name)

    def _spawn_scheduler(self) -> None:
        sched = self.state["scheduler"]
        sched["metrics_port"] = free_port("127.0.0.1")
        cmd = [*SCHEDULER_COMMAND, "--interval", str(sched["interval"]), "--metrics-port", str(sched["metrics_port"]),
               *(("--keep", str(sched["keep"])) if "keep" in sched else ()),
               *(("--keep-age", sched["keep_age"]) if sched.get("keep_age") else ())]
        proc = self._popen("scheduler", cmd, "backup-scheduler.log")
        sched["pid"] = proc.pid
        # Until the child has exec'd, its command line is ours: wait, so that status never reports it dead.
        deadline = time.monotonic() + 15
        while not _pid_runs(proc.pid, b"backup.cli") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)

    def _spawn_console(self, timeout: float) -> None:
        """The group's web console on its loopback port; returns once it serves (its ready file)."""
        con = self.state["console"]
        self.save_state()  # the console reads the group (its CF, members, TLS) from cluster.json
        ready = self.dir / "run" / "console.ready"
        with contextlib.suppress(FileNotFoundError):
            ready.unlink()
        proc = self._popen("console", [*CONSOLE_COMMAND, "--cluster-dir", str(self.dir), "--port", str(con["port"]),
                                       "--ready-file", str(ready)], "console.log")
        con["pid"] = proc.pid
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() >= deadline:
                raise LocalGroupError(f"the console did not serve within {timeout:g}s; tail of "
                                      f"{self.dir / 'run' / 'console.log'}:\n{log_tail(self.dir / 'run' / 'console.log')}")
            time.sleep(0.05)
        con["url"] = json.loads(ready.read_text())["url"]

    @property
    def console_url(self) -> str | None:
        """The web console's URL (cfemu cluster up --console), None when the cluster has none."""
        return (self.state.get("console") or {}).get("url")

    # --- faults and restarts -------------------------------------------------------------------------------
    def kill_manager(self, name: str, sig: int = signal.SIGKILL, timeout: float = 15.0) -> None:
        """Send sig to a manager and wait (bounded) until it is gone. The manager is held: a supervisor restarting
        members leaves it to this caller (``restart_manager``)."""
        pid = self.manager(name).get("pid")
        if not _pid_runs(pid, name.encode()):
            raise LocalGroupError(f"{name} is not running")
        assert pid is not None
        self._hold(name, "stopped by LocalGroup.kill_manager")
        os.kill(pid, sig)
        if not self._wait_gone(name, pid, timeout):
            raise LocalGroupError(f"{name} (pid {pid}) still runs {timeout:g}s after signal {sig}")

    def restart_manager(self, name: str, timeout: float = 30.0, *,
                        extra_args: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> None:
        """Start a stopped (or killed) manager again on its port; restart recovery runs from its log.
        extra_args (kept for later restarts) go to this manager's ``sqm run`` only, e.g. --clock-skew-ms; env
        (this start only) is added to its environment, e.g. SQM_FAILPOINTS for the chaos suite."""
        pid = self.manager(name).get("pid")
        if _pid_runs(pid, name.encode()):
            raise LocalGroupError(f"{name} is still running (pid {pid})")
        with self.state_lock():
            self._refresh_if_shared()
            if extra_args is not None:
                self.set_manager(name, extra_args=list(extra_args))
            self.spawn_manager(name, env)
            self.set_manager(name, held=None)
            self.save_state()
        self._wait_manager(name, timeout)

    def stop_member(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        """An operator's stop (``cfemu cluster stop``): the member is held (the supervisor does not restart it
        until ``restart_member``), then SIGTERM (a shutdown checkpoint), SIGKILL after timeout."""
        self._hold(name, "stopped by the operator")
        return self._stop_member(name, timeout)

    def _stop_member(self, name: str, timeout: float) -> dict[str, Any]:
        t0 = time.monotonic()
        pid = self.manager(name).get("pid")
        how = "was not running"
        if _pid_runs(pid, name.encode()):
            assert pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            how = "SIGTERM"
            if not self._wait_gone(name, pid, timeout):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                how = f"SIGKILL after {timeout:g}s"
                if not self._wait_gone(name, pid, 10.0):
                    raise LocalGroupError(f"{name} (pid {pid}) survived SIGKILL")
        return {"member": name, "old_pid": pid, "stopped_by": how, "stop_seconds": round(time.monotonic() - t0, 2)}

    def restart_member(self, name: str, timeout: float = 10.0, start_timeout: float = 60.0) -> dict[str, Any]:
        """An operator's restart (``cfemu cluster restart``): stop the member gracefully (SIGTERM, SIGKILL after
        timeout; a stopped one is only started), start it on its ports and wait until it serves (its ready file).
        The supervisor leaves it alone meanwhile; afterwards it tends it again, even when the start failed."""
        t0 = time.monotonic()
        self._hold(name, "restarted by the operator")
        try:
            doc = self._stop_member(name, timeout)
            t1 = time.monotonic()
            with self.state_lock():
                self._refresh_if_shared()
                self.spawn_manager(name)
                self.save_state()
            self._wait_manager(name, start_timeout)
            doc.update(pid=self.manager(name)["pid"], start_seconds=round(time.monotonic() - t1, 2))
        finally:
            self._hold(name, None)
        doc["seconds"] = round(time.monotonic() - t0, 2)
        return doc

    def wait_manager_exit(self, name: str, timeout: float) -> int | None:
        """Wait until a manager started by this LocalGroup object exits; its exit code (None: still running after
        timeout, or not started by this object, so its status cannot be known)."""
        proc = self._procs.get(name)
        if proc is None:
            return None
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill_cf_node(self, node: str) -> int:
        """kill -9 one node of a Redis Cluster CF (its structures are lost; the others' keep working); its pid."""
        if not rcluster_cf.is_cluster_cf(self.state[CLUSTER_CF]):
            raise LocalGroupError("the CF is one redis-server, not a Redis Cluster (cfemu cluster up --redis-cluster)")
        with self._cf_lock:
            nodes = self._cluster_nodes()
            if node not in nodes.nodes:
                raise LocalGroupError(f"no CF node {node} (nodes: {', '.join(nodes.nodes)})")
            pid = nodes.kill(node)
            rcluster_cf.record(self.state[CLUSTER_CF], nodes)
            self.save_state()
            return pid

    def kill_cf(self) -> None:
        """kill -9 the CF (everything in it is lost; the SQMs see a failed structure)."""
        if rcluster_cf.is_cluster_cf(self.state[CLUSTER_CF]):
            for n in self._cluster_nodes().running():
                self.kill_cf_node(n)
            return
        self._cf_server().kill()
        self.state[CLUSTER_CF]["pid"] = None
        self.save_state()

    def restart_cf(self) -> None:
        """Start the CF again on the same port, empty."""
        with self._cf_lock:
            if self.cf_alive():
                raise LocalGroupError("the CF is still running; kill_cf() first")
            self._start_cf(port=int(self.state[CLUSTER_CF].get("port") or 0) or None)
            if self.duplexed:  # a new generation, simplex; the secondary's copy is replaced by the empty one's
                self.pair.restarted_empty()
            self.save_state()

    # --- the CF supervisor: who brings a lost CF back ----------------------------------------------------------
    def cf_alive(self) -> bool:
        if rcluster_cf.is_cluster_cf(self.state.get(CLUSTER_CF, {})):
            return rcluster_cf.alive(self.state[CLUSTER_CF], _pid_runs)
        return _pid_runs(self.state.get(CLUSTER_CF, {}).get("pid"), CF_SERVER_MARKERS)

    def restart_dead_cf(self, reason: str = "died") -> bool:
        """Restart the CF (empty, same port) if it is dead; True when it did. What the supervisor does (reason:
        why it is dead, for the CF's last_restart). A duplexed CF's supervisor tends the pair instead (qsg.cfpair:
        degrade, promote, resync, or restart empty)."""
        with self._cf_lock:
            if self.duplexed:
                event = self.pair.tend()
                if event:
                    self.save_state()
                return event is not None
            if self.cf_alive():
                return False
            if self._cf is not None:  # reap a child killed under us (a zombie holds no port, but is a pid)
                with contextlib.suppress(Exception):
                    self._cf.kill()
            self._start_cf(port=int(self.state[CLUSTER_CF].get("port") or 0) or None)
            cf = self.state[CLUSTER_CF]
            cf["restarts"] = int(cf.get("restarts") or 0) + 1
            cf["last_restart"] = {"at": time.time(), "reason": reason}
            self.save_state()
            self.cf_restarts += 1
            log.warning("the CF %s; restarted it empty on port %s (pid %s): members re-join it, RECAUTO "
                        "structures are restored by a member", reason, cf.get("port") or "(its nodes' ports)",
                        cf["pid"])
            return True

    def supervise_cf(self, on: bool = True, interval: float = SUPERVISE_INTERVAL_S, *, cf: bool = True) -> None:
        """Start (or stop) the supervisor thread (qsg.group_supervisor): with cf, a dead CF is restarted within
        `interval` seconds, a hung one within a few; members only in a group started with restart_members."""
        if not on:
            if self._supervisor is not None:
                thread, stop = self._supervisor
                stop.set()
                thread.join(timeout=30)
                self._supervisor = None
            return
        if self._supervisor is not None:
            return
        from qsg import group_supervisor

        stop = threading.Event()
        thread = threading.Thread(target=group_supervisor.run, args=(self, stop), kwargs={"reload": False, "cf": cf,
                                  "interval": interval}, name="cf-supervisor", daemon=True)
        self._supervisor = (thread, stop)
        thread.start()

    def _spawn_supervisor(self) -> None:
        port = free_port("127.0.0.1")
        proc = self._popen("cf_supervisor", [*SUPERVISOR_COMMAND, "--dir", str(self.dir), "--metrics-port",
                                             str(port)], "cf-supervisor.log")
        self.state["cf_supervisor"] = {"pid": proc.pid, "metrics_port": port}
        deadline = time.monotonic() + 15
        while not _pid_runs(proc.pid, b"qsg.local_group") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)

    def _cf_server(self) -> EmbeddedRedis:
        if self._cf is not None and self._cf.is_running():
            return self._cf
        try:
            self._cf = EmbeddedRedis.attach(self.state[CLUSTER_CF]["dir"])
        except ServerNotRunningError as e:
            raise LocalGroupError(f"the CF is not running: {e}") from None
        return self._cf

    def _wait_gone(self, key: str, pid: int, timeout: float) -> bool:
        return wait_gone(pid, timeout, self._procs.get(key))

    # --- Spark ----------------------------------------------------------------------------------------------------
    def _start_spark(self, workers: int, cores: int, memory: str) -> None:
        from qsg.spark_standalone import SparkStandalone  # pyspark: only for a cluster that asks for Spark

        self.state[CLUSTER_SPARK] = {"dir": str(self.dir / "spark"), "workers": workers}
        spark = SparkStandalone.start(self.dir / "spark", workers, secrets_dir=self.secrets_dir, cores=cores,
                                      memory=memory, detach=self.state["detached"])
        self.state[CLUSTER_SPARK].update(master_url=spark.master_url, master_pid=spark.state["master_pid"])

    def spark(self) -> Any:
        """The cluster's SparkStandalone (qsg.spark_standalone), None when it has none."""
        if not self.state.get(CLUSTER_SPARK):
            return None
        from qsg.spark_standalone import SparkStandalone

        return SparkStandalone.load(self.state[CLUSTER_SPARK]["dir"])

    # --- status and stop -------------------------------------------------------------------------------------
    def running_processes(self) -> dict[str, int]:
        """Name -> pid of every cluster process still alive (the CF as 'CF', the scheduler as 'scheduler')."""
        out: dict[str, int] = {}
        cf_pid = self.state.get(CLUSTER_CF, {}).get("pid")
        if _pid_runs(cf_pid, CF_SERVER_MARKERS):
            out["CF"] = cf_pid
        for node in self.state.get(CLUSTER_CF, {}).get("nodes") or []:  # a Redis Cluster CF's nodes
            if _pid_runs(node.get("pid"), CF_SERVER_MARKERS):
                out[f"CF {node['name']}"] = node["pid"]
        for m in self.state.get("managers", []):
            if _pid_runs(m.get("pid"), m["name"].encode()):
                out[m["name"]] = m["pid"]
        sched = self.state.get("scheduler") or {}
        if _pid_runs(sched.get("pid"), b"backup.cli"):
            out["scheduler"] = sched["pid"]
        if self.duplexed and self.pair.secondary_runs():
            out["CF2"] = self.pair.state["secondary"]["pid"]
        sup = self.state.get("cf_supervisor") or {}
        if _pid_runs(sup.get("pid"), b"qsg.local_group"):
            out["cf_supervisor"] = sup["pid"]
        con = self.state.get("console") or {}
        if _pid_runs(con.get("pid"), b"console"):
            out["console"] = con["pid"]
        spark = self.spark()
        if spark is not None:
            out.update(spark.running())
        return out

    def status(self) -> dict[str, Any]:
        """Each process: pid, alive, and for managers the answer of /readyz."""
        alive = self.running_processes()
        cf = self.state[CLUSTER_CF]
        rows: list[dict[str, Any]] = [{"process": "CF", "pid": cf.get("pid"), "alive": "CF" in alive,
                                       "address": self.state.get(CLUSTER_REDIS_URL, ""), "ready": "CF" in alive,
                                       **_restarts(cf)}]
        pair = self.pair.status() if self.duplexed else None
        if rcluster_cf.is_cluster_cf(cf):  # one row per node: role and slots
            rows = rcluster_cf.status_rows(cf, self._cluster_nodes())
        elif pair is not None:
            rows[0].update(process="CF (primary)", address=pair["primary"], role="primary")
            rows.append({"process": "CF (secondary)", "pid": self.pair.state["secondary"].get("pid"),
                         "alive": "CF2" in alive, "address": pair["secondary"], "role": "secondary",
                         "ready": pair["secondary_state"] == "in sync", "state": pair["secondary_state"]})
        for m in self.state["managers"]:
            ready = m["name"] in alive and self._readyz(int(m["metrics_port"]))
            rows.append({"process": m["name"], "pid": m.get("pid"), "alive": m["name"] in alive,
                         "address": f"{self.host}:{m['port']}", "metrics": f"127.0.0.1:{m['metrics_port']}",
                         **({"rest": f"127.0.0.1:{m['rest_port']}"} if m.get("rest_port") else {}),
                         "ready": ready, **_restarts(m), "held": m.get("held")})
        if self.state.get("scheduler"):
            s = self.state["scheduler"]
            rows.append({"process": "backup-scheduler", "pid": s.get("pid"), **_metrics_address(s),
                         "alive": "scheduler" in alive,
                         "address": f"every {s['interval']}s", "ready": "scheduler" in alive})
        if self.state.get("cf_supervisor") and self.state["detached"]:
            pid = self.state["cf_supervisor"].get("pid")
            what = [w for w, on in (("a dead or hung CF", self.state.get("cf_restart", True)),
                                    ("dead or fenced members", self.state.get("member_restart"))) if on]
            rows.append({"process": "cf-supervisor", "pid": pid, **_metrics_address(self.state["cf_supervisor"]),
                         "alive": "cf_supervisor" in alive,
                         "address": "restarts " + " and ".join(what), "ready": "cf_supervisor" in alive})
        if self.state.get("console"):
            con = self.state["console"]
            rows.append({"process": "console", "pid": con.get("pid"), "alive": "console" in alive,
                         "address": con.get("url", ""), "ready": "console" in alive})
        spark = self.spark()
        spark_master = None
        if spark is not None:
            for row in spark.processes():
                rows.append({**row, "ready": row["alive"]})
            spark_master = spark.master_url
        doc = {"dir": str(self.dir), "redis_url": self.state.get(CLUSTER_REDIS_URL),
               "cf_socket": cf.get(CLUSTER_CF_SOCKET), "spark_master": spark_master,
               "log_root": str(self.log_root),
               "backup_dir": str(self.backup_dir), "processes": rows}
        if cf.get("server"):  # which binary and version the CF runs (cfemu.embedded.find_server chose it)
            doc["cf_server"] = cf["server"]
        if pair is not None:
            doc["duplex"] = pair
        return doc

    def _readyz(self, port: int) -> bool:
        try:
            # the managers' HTTP port listens on loopback (sqm run --metrics-host): this machine's processes
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2.0) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def down(self, timeout: float = 10.0, *, purge: bool = False) -> dict[str, int]:
        """SIGTERM the scheduler and the managers (they take a shutdown checkpoint), SIGKILL whatever is left after
        timeout, then stop the CF. Returns name -> pid of what had to be killed. purge also deletes the directory."""
        killed: dict[str, int] = {}
        self.supervise_cf(False)  # nothing may restart the CF or a member while the group is taken down
        sup_pid = (self.state.get("cf_supervisor") or {}).get("pid")
        if _pid_runs(sup_pid, b"qsg.local_group"):  # first and alone: it would restart what is stopped below
            assert sup_pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(sup_pid, signal.SIGTERM)
            if not self._wait_gone("cf_supervisor", sup_pid, timeout):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(sup_pid, signal.SIGKILL)
                self._wait_gone("cf_supervisor", sup_pid, 10.0)
                killed["cf_supervisor"] = sup_pid
            # what it changed since this object read cluster.json: the CF it restarted (a promoted secondary of
            # a duplexed CF: the roles swapped), the members it restarted
            with self.state_lock():
                self.refresh()
        spark = self.spark()
        if spark is not None:  # first: its executors may be reading the members' logs for a restore
            killed.update(spark.stop(timeout=timeout))
            self.state[CLUSTER_SPARK]["master_pid"] = None
        targets = {k: v for k, v in self.running_processes().items() if not k.startswith("CF")}
        for pid in targets.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for key, pid in targets.items():
            if not self._wait_gone(key, pid, max(0.1, deadline - time.monotonic())):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._wait_gone(key, pid, 10.0)
                killed[key] = pid
        if self.duplexed:
            # Before the primary: a primary stopped with its replica attached waits for the replica's next
            # acknowledgement (about a second); nothing writes by now (the members and the supervisor are gone).
            self.pair.stop_secondary(timeout=timeout)
        if rcluster_cf.is_cluster_cf(self.state.get(CLUSTER_CF, {})):
            self._nodes = None  # the supervisor may have restarted nodes: adopt what runs now
            self._cluster_nodes().stop()
            for node in self.state[CLUSTER_CF].get("nodes") or []:
                node["pid"] = None
        elif "pid" in self.state.get(CLUSTER_CF, {}) and self.state[CLUSTER_CF].get("pid"):
            with contextlib.suppress(LocalGroupError):
                self._cf_server().stop(timeout=timeout)
        self.state[CLUSTER_CF]["pid"] = None
        for m in self.state["managers"]:
            m["pid"] = None
        if self.state.get("scheduler"):
            self.state["scheduler"]["pid"] = None
        if self.state.get("cf_supervisor"):
            self.state["cf_supervisor"]["pid"] = None
        if self.state.get("console"):
            self.state["console"]["pid"] = None
        self._procs.clear()
        if purge:
            shutil.rmtree(self.dir, ignore_errors=True)
        elif self.dir.exists():
            self.save_state()
        return killed


def supervise_main(argv: list[str] | None = None) -> int:
    """``python -m qsg.local_group supervise --dir DIR``: the supervisor of a detached cluster (``cfemu cluster
    up``; qsg.group_supervisor), until SIGTERM (``cfemu cluster down`` sends it first)."""
    import argparse

    from qsg import group_supervisor

    p = argparse.ArgumentParser(prog="qsg.local_group")
    p.add_argument("verb", choices=["supervise"])
    p.add_argument("--dir", required=True)
    p.add_argument("--interval", type=float, default=SUPERVISE_INTERVAL_S)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve the supervisor's and the CF's metrics (its INFO) on 127.0.0.1:PORT")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    with handling((signal.SIGTERM, signal.SIGINT), lambda *_: stop.set(), in_thread=True):
        group = LocalGroup.load(args.dir)
        sup = Supervisor(group, reload=True)
        if args.metrics_port is not None:
            serve_metrics(group, sup, args.metrics_port)
        group_supervisor.run(group, stop, reload=True, interval=args.interval, supervisor=sup)
    return 0


def serve_metrics(group: LocalGroup, sup: Supervisor, port: int) -> int:
    """The supervisor's metrics and the CF's (an exporter of its INFO, as the operator's CF user) on
    127.0.0.1:port (loopback: they have no authentication)."""
    import redis

    from cfemu import exposition
    from cfemu.cf_exporter import INFO_TIMEOUT_S, CFInfoCollector
    from qsg.supervisor_metrics import SupervisorCollector

    def cf() -> redis.Redis:
        return redis.Redis.from_url(group.cf_url("operator"), socket_timeout=INFO_TIMEOUT_S,
                                    socket_connect_timeout=INFO_TIMEOUT_S)

    bound = exposition.serve([SupervisorCollector(sup), CFInfoCollector(cf)], "127.0.0.1", port)
    log.info("supervisor: metrics (its own and the CF's) on http://127.0.0.1:%d/metrics", bound)
    return bound


def _metrics_address(proc: Mapping[str, Any]) -> dict[str, str]:
    """The metrics column of a process's status row (the scheduler's, the supervisor's), when it serves any."""
    return {"metrics": f"127.0.0.1:{proc['metrics_port']}"} if proc.get("metrics_port") else {}


def _restarts(proc: Mapping[str, Any]) -> dict[str, Any]:
    """A CF's or member's restarts by the supervisor, for its status row."""
    return {"restarts": int(proc.get("restarts") or 0), "last_restart": proc.get("last_restart")}


if __name__ == "__main__":
    sys.exit(supervise_main())
