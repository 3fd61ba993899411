"""The group under test: a LocalGroup with a fault proxy on every SQM's path to the CF and on every client's
path to an SQM, a second structure, a probe queue, and (where the machine allows) one SQM's log on a small tmpfs.
When the run's mix has the REST kind, every member also serves the messaging REST API on a loopback port of its own
(kept across its restarts), with the service's authentication.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis

from cfemu import repository
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import MQError
from cfemu.procs import free_port
from qsg.chaos.conversations import SERVICE, SERVICE_UOW
from qsg.chaos.history import History
from qsg.chaos.proxy import CUT, FaultProxy
from qsg.chaos.pubsub_actions import TOPIC, TOPIC_ATTRS, TOPIC_STRUCTURE
from qsg.local_group import LocalGroup
from sqm.service.client import Client

STRUCTURES = {"APP1": ("Q1", "Q2"), "APP2": ("Q3",)}
QUEUES = ("Q1", "Q2", "Q3")
PROBE_QUEUE = "PROBE"  # on APP1; the history never sees it
# On APP1, for the faults whose own clients need a queue the workload does not compete for (clients that leave a
# waiting get, messages near and over the size limits); in the history like any queue, and drained.
EDGE_QUEUE = "EDGE"
# On APP1, for the faults that need many messages on a member's queues that are no workload's (a slow restart):
# outside the history, never drained, emptied by the fault that filled it.
BULK_QUEUE = "BULK"
DRAINED = (*QUEUES, EDGE_QUEUE)
SERVICE_STRUCTURE = "APP2"  # where the service of the conversation actions lives (qsg.chaos.conversations.SERVICE)
TMPFS_BYTES = 128 * 2**20


def _live_children(pid: int) -> list[int]:
    """The children of a process that have not exited yet (a stopped parent cannot reap them: zombies count
    as ended). Every thread's: a child is listed under the thread that forked it (cfemu.procs.popen_tied forks from
    a spawner thread of its own)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    live = []
    for c in children:
        try:
            state = Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            live.append(c)
    return live


class LogDisk:
    """A size-limited filesystem (tmpfs) under one SQM's log directory, that the suite can fill and free."""

    def __init__(self, path: Path, size: int = TMPFS_BYTES) -> None:
        self.path = path
        self.size = size
        self.mounted = False

    @staticmethod
    def unavailable_because(probe_dir: Path) -> str:
        """'' when a tmpfs can be mounted here, else why not (the fault kind then reports itself unavailable)."""
        if os.geteuid() != 0:
            return "needs root to mount a tmpfs (not running as root)"
        probe = probe_dir / ".tmpfs-probe"
        probe.mkdir(parents=True, exist_ok=True)
        try:
            out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode != 0:
                return f"mount -t tmpfs failed: {out.stderr.strip() or out.returncode}"
            subprocess.run(["umount", str(probe)], capture_output=True, timeout=10)
            return ""
        except (OSError, subprocess.SubprocessError) as e:
            return f"mount -t tmpfs failed: {e}"
        finally:
            with contextlib.suppress(OSError):
                probe.rmdir()

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=700", "tmpfs", str(self.path)], check=True,
                       capture_output=True, timeout=10)
        self.mounted = True

    @property
    def filler(self) -> Path:
        return self.path / "chaos-filler"

    def fill(self) -> int:
        """Write until the filesystem is full (ENOSPC); the bytes written."""
        written = 0
        block = b"\0" * 2**20
        with open(self.filler, "ab", buffering=0) as f:
            while block:
                try:
                    written += f.write(block)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    block = block[: len(block) // 2]  # fill the last bits too
        return written

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=10)
            self.mounted = False


class ChaosGroup:
    """Start, probe, heal and stop the group under test."""

    def __init__(self, directory: Path, *, managers: int, lease_ms: int, backup_interval: float | None,
                 log_disk: bool, duplex: bool = False, redis_cluster: int = 0, rest: bool = False) -> None:
        self.dir = directory
        self.rest = rest  # every member serves the REST door too (the REST kind is in the run's mix)
        self.redis_cluster = redis_cluster  # the CF as a Redis Cluster: no proxy between the SQMs and the CF
        self.managers = managers
        self.lease_ms = lease_ms
        self.backup_interval = backup_interval
        self.want_log_disk = log_disk
        self.duplex = duplex  # a duplexed CF (qsg.cfpair), for the kinds that need one (faults.DUPLEX_KINDS)
        self.cluster: LocalGroup | None = None
        self.cf_proxies: dict[str, FaultProxy] = {}
        self.client_proxies: dict[str, FaultProxy] = {}
        self.disk: LogDisk | None = None
        self.disk_unavailable = ""
        self.stopped: set[str] = set()  # managers the suite has SIGSTOPped
        self.backups_paused: int | None = None  # the backup scheduler's pid while a fault holds it stopped
        self.history: History | None = None  # where faults that act as clients record their calls
        self.seed = 0  # the run's seed: what varies from one restore to the next is drawn from it (faults)
        self.restores = 0  # the restores run so far (each one's engine options: the seed and its number)
        # member -> (pid, monotonic time) of the first probe it passed with that pid since forget_serving(): when
        # each member was seen serving again after a fault's heal (the checker's liveness rule)
        self.serving: dict[str, tuple[int | None, float]] = {}

    # --- start and stop ------------------------------------------------------------------------------------------
    def up(self) -> ChaosGroup:
        names = [f"QM{i}" for i in range(1, self.managers + 1)]
        if self.want_log_disk:
            self.disk_unavailable = LogDisk.unavailable_because(self.dir)
            if not self.disk_unavailable:
                self.disk = LogDisk(self.dir / "logs" / names[-1])
                self.disk.mount()
        try:
            self.cluster = LocalGroup.up(self.dir, managers=self.managers, backup_interval=self.backup_interval,
                                         structure="APP1", queues=(*STRUCTURES["APP1"], PROBE_QUEUE, EDGE_QUEUE, BULK_QUEUE),
                                         lease_ms=self.lease_ms, recauto=False, redis_cluster=self.redis_cluster,
                                         duplex=self.duplex, restart_cf=self.duplex, rest=self.rest,
                                         # a cluster client follows the cluster's redirections to the nodes
                                         # themselves: no proxy can stand between an SQM and a Redis Cluster CF
                                         cf_url_for=None if self.redis_cluster else self._cf_route)
            if self.duplex:  # the pair's supervisor runs only while a duplex fault runs (the others restart by hand)
                self.cluster.supervise_cf(False)
            client = self.cf()
            try:
                admin = Admin(client)
                repo = repository.open_group_repository(admin, self.cluster.log_root, who="chaos group")
                for s, queues in STRUCTURES.items():
                    # RECAUTO off: the other fault kinds play the operator, who restores after a CF loss (their
                    # restore spans are what the checker's restore rules read); cf-kill-recauto turns it on for
                    # the length of its fault.
                    repository.ensure_structure(admin, repo, s, queues, recauto=False)
                # The service the conversation actions send units of work to, with its companion queues.
                repository.define_queue(admin, repo, SERVICE, SERVICE_STRUCTURE, uow=SERVICE_UOW)
                # The topic of the publishers and subscribers, with its companion queues.
                repository.define_queue(admin, repo, TOPIC, TOPIC_STRUCTURE, topic=TOPIC_ATTRS)
            finally:
                client.close()
            for name, host, port in self.cluster.endpoints:
                self.client_proxies[name] = FaultProxy((host, port), name=f"clients->{name}").start()
        except BaseException:
            self.down()
            raise
        return self

    def _cf_route(self, manager: str, cf_url: str) -> str:
        parts = urlsplit(cf_url)
        proxy = FaultProxy((parts.hostname or "127.0.0.1", int(parts.port or 6379)), name=f"{manager}->CF").start()
        self.cf_proxies[manager] = proxy
        return urlunsplit(parts._replace(netloc=f"127.0.0.1:{proxy.port}"))

    def down(self) -> None:
        self.resume_backups()
        for name in list(self.stopped):
            self.cont(name)
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.down(timeout=10.0)
        for p in [*self.cf_proxies.values(), *self.client_proxies.values()]:
            p.stop()
        if self.disk is not None:
            self.disk.unmount()

    def remove(self) -> None:
        """Delete the cluster directory (logs, backups): a soak keeps only the reports."""
        if self.disk is not None and self.disk.mounted:
            return
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- what faults and checks use ------------------------------------------------------------------------------
    @property
    def c(self) -> LocalGroup:
        assert self.cluster is not None, "the group is not up"
        return self.cluster

    @property
    def names(self) -> list[str]:
        return self.c.names

    @property
    def client_endpoints(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", self.client_proxies[n].port) for n in self.names]

    @property
    def rest_endpoints(self) -> list[tuple[str, str, int]]:
        """(member, host, REST port) of every member; none when the group has no REST door."""
        return [(n, "127.0.0.1", int(self.c.manager(n)["rest_port"])) for n in self.names
                if self.c.manager(n).get("rest_port")]

    def clients_reach(self, name: str) -> bool:
        """Whether clients may reach a member now: not while a fault has its client proxy cut (the REST door, which
        has no proxy, follows this)."""
        return self.client_proxies[name].mode != CUT

    @property
    def direct(self) -> dict[str, tuple[str, int]]:
        return {n: (h, p) for n, h, p in self.c.endpoints}

    def cf(self) -> redis.Redis:
        """A direct connection to the CF (no proxy): the operator's and the checker's view."""
        return connect(self.c.cf_url("operator"), socket_timeout=5.0)

    def pid(self, name: str) -> int | None:
        pid = self.c.manager(name).get("pid")
        return int(pid) if pid else None

    def running(self, name: str) -> bool:
        return name in self.c.running_processes()

    def stop(self, name: str) -> None:
        pid = self.pid(name)
        assert pid is not None
        os.kill(pid, 19)  # SIGSTOP
        self.stopped.add(name)

    def cont(self, name: str) -> None:
        pid = self.pid(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 18)  # SIGCONT
        self.stopped.discard(name)

    def pids(self) -> dict[str, int | None]:
        """Each member's process id while it runs (None: not running)."""
        running = self.c.running_processes()
        return {n: running.get(n) for n in self.names}

    def forget_serving(self) -> None:
        """From now on a member counts as serving again only once it passes a probe (ChaosGroup.serving)."""
        self.serving = {}

    def probe(self, name: str, timeout: float = 3.0) -> bool:
        """A persistent put, commit, get and commit through the manager's client proxy: full service. A pass is
        noted in ``serving`` (the first one of each process of the member since forget_serving)."""
        pid = self.pid(name)
        try:
            with Client([("127.0.0.1", self.client_proxies[name].port)], token=self.c.token, client_name="probe",
                        connect_timeout=timeout, request_timeout=timeout, reconnect_timeout=0.5) as c:
                m = c.put(PROBE_QUEUE, b"probe")
                c.commit()
                c.get(PROBE_QUEUE, msgid=m.msgid, wait_ms=500)
                c.commit()
        except (MQError, OSError):
            return False
        seen = self.serving.get(name)
        if seen is None or seen[0] != pid:
            self.serving[name] = (pid, time.monotonic())
        return True

    def wait_service(self, timeout: float, names: list[str] | None = None) -> float | None:
        """Seconds until every manager passes the probe (None: not within timeout)."""
        t0 = time.monotonic()
        pending = list(names or self.names)
        while pending:
            pending = [n for n in pending if not self.probe(n)]
            if not pending:
                break
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(0.2)
        return time.monotonic() - t0

    def wait_peer_recovered(self, name: str, timeout: float) -> bool:
        """Until a peer has recovered `name` (it is no longer a member of the group)."""
        deadline = time.monotonic() + timeout
        client = self.cf()
        try:
            admin = Admin(client)
            while time.monotonic() < deadline:
                with contextlib.suppress(redis.RedisError):
                    if name not in admin.members():
                        return True
                time.sleep(0.05)
            return False
        finally:
            client.close()

    def pause_backups(self, timeout: float = 60.0) -> None:
        """Hold the backup scheduler (SIGSTOP), and wait until every backup it started (a `cfbackup run` child,
        perhaps still importing) has ended: a fault that needs the next restore to start from an older base (two
        CF losses, a purge then a loss) is then sure that no backup falls between."""
        pid = self.c.running_processes().get("scheduler")
        if pid is None:
            return
        os.kill(pid, signal.SIGSTOP)
        self.backups_paused = pid
        deadline = time.monotonic() + timeout
        while _live_children(pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def resume_backups(self) -> None:
        if self.backups_paused is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.backups_paused, signal.SIGCONT)
            self.backups_paused = None

    def start_stray_member(self, name: str, log_root: Path, ready: Path) -> subprocess.Popen[bytes]:
        """`sqm run` of one more member, as an operator might start it, with a log root of its own (not the
        group's): on the CF directly, with the cluster's token and lease, its output in run/<name>.log."""
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "sqm.cli", "run", "--name", name, "--host", self.c.host, "--port",
               str(free_port(self.c.host)), "--redis-url", self.c.redis_url, "--log-root", str(log_root),
               "--lease-ms", str(self.lease_ms), "--ready-file", str(ready)]
        with open(self.dir / "run" / f"{name}.log", "ab") as out:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.c.child_env(), close_fds=True)

    def heal_network(self) -> None:
        for p in [*self.cf_proxies.values(), *self.client_proxies.values()]:
            p.heal()
