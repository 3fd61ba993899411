"""A local Redis Cluster as the CF: N masters (and a replica each, optionally), redis-server in cluster mode on
127.0.0.1, for the tests and the local launcher (qsg.local_group).

    with EmbeddedCluster(directory, masters=3, replicas=1) as cl:
        url = cl.url("member")                 # redis+cluster://qsg-member:...@127.0.0.1:P1/?node=...
        cl.kill(cl.master_of("APP1"))          # SIGKILL the master holding APP1's slot
        cl.start_node(name)                    # back on its port, empty, with its cluster config (nodes.conf)

Every node is secured as a single CF is (cfemu.credentials): the default user off, one user per role, plus
``qsg-cluster-admin`` (this class forms the cluster with it: ADDSLOTS, MEET, REPLICATE) and ``qsg-replication``
(a replica authenticates to its master with it: masteruser/masterauth, PSYNC/REPLCONF only). The role users may
also read the slot map (CLUSTER SLOTS/SHARDS/NODES/INFO), which a cluster client needs. Their passwords are in
the group's secrets directory (0600 files in a 0700 directory); every node's ACL file and directory are 0600/0700.

Nodes keep no data on disk (as the single embedded CF: no AOF, no RDB): a master killed and started again comes
back empty, still owning its slots (its nodes.conf), and the structures it held are FAILED until restored
(RECAUTO does it; docs/runbook.md). ``cluster-require-full-coverage no``: the other masters keep serving their
structures meanwhile. With a replica, the replica is promoted instead once the master is seen failed
(``cluster-node-timeout``); its copy is asynchronous, see docs/cf-layout.md for what that means.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

from cfemu import credentials
from cfemu.embedded import EmbeddedRedis, ServerNotRunningError, discard_data
from cfemu.private_files import private_dir, write_private
from cfemu.rcluster import slot_of

__all__ = ["ADMIN_USER", "REPLICATION_USER", "EmbeddedCluster", "cluster_acl_lines"]

SLOTS = 16384
BUS_OFFSET = 10000  # a node's cluster bus listens here above its port
ADMIN_USER = "qsg-cluster-admin"
REPLICATION_USER = "qsg-replication"
# What a cluster client needs beyond a role's commands: the slot map (read only).
CLUSTER_READS = " +cluster|slots +cluster|shards +cluster|nodes +cluster|info +cluster|myid +cluster|keyslot"


class ClusterStartError(RuntimeError):
    """The cluster did not form (the message says which node and what it reported)."""


ROLE_FILES = {ADMIN_USER: "cf-cluster-admin.password", REPLICATION_USER: "cf-replication.password"}


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections and port 0 (32768 on Linux by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def cluster_port(host: str = "127.0.0.1", taken: set[int] | None = None) -> int:
    """A free port for a cluster node: Redis wants its cluster bus at port + 10000, so both must be free. Both are
    taken below the kernel's ephemeral range where it leaves room: a node started again later (a restart, a
    replica coming back) finds them free, where a port in that range may meanwhile be any process's outgoing
    connection or port-0 listener (seen: a restarted node failing with the bus port in use)."""
    taken = taken if taken is not None else set()
    rng = random.Random()
    top = _ephemeral_low() - BUS_OFFSET
    low, high = (10240, top) if top - 10240 >= 2000 else (20000, 45000)
    for _ in range(500):
        port = rng.randrange(low, high)
        if port in taken or port + BUS_OFFSET in taken:
            continue
        try:
            for p in (port, port + BUS_OFFSET):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, p))
        except OSError:
            continue
        taken.update((port, port + BUS_OFFSET))
        return port
    raise ClusterStartError("no free port pair (port, port + 10000) for a cluster node")


def cluster_acl_lines(passwords: dict[str, str], admin_password: str, replication_password: str) -> list[str]:
    """The ACL file of every node: the group's role users (cfemu.credentials) with the slot map readable, the
    cluster's administrator and the replication user."""
    lines = [line + CLUSTER_READS if line.startswith("user qsg-") else line
             for line in credentials.acl_lines(passwords)]
    lines.append(f"user {ADMIN_USER} on >{admin_password} ~* &* +@all")
    lines.append(f"user {REPLICATION_USER} on >{replication_password} -@all +psync +replconf +ping")
    return lines


def cluster_secrets(secrets_dir: Path) -> tuple[dict[str, str], str, str]:
    """The group's CF passwords (made where missing) and the cluster's two own ones."""
    passwords = credentials.create(secrets_dir)
    own = []
    for user in (ADMIN_USER, REPLICATION_USER):
        path = secrets_dir / ROLE_FILES[user]
        if not path.exists():
            write_private(path, secrets.token_urlsafe(32).encode())
        own.append(path.read_text().strip())
    return passwords, own[0], own[1]


class EmbeddedCluster:
    """N masters (+ N replicas) in cluster mode, their directories under `directory` (node-<i>)."""

    def __init__(self, directory: str | Path, *, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 ports: list[int] | None = None, secrets_dir: Path | None = None, host: str = "127.0.0.1",
                 detach: bool = False) -> None:
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, not {masters}")
        if replicas not in (0, 1):
            raise ValueError(f"replicas per master: 0 or 1, not {replicas}")
        self.directory = private_dir(Path(directory))
        self.secrets_dir = private_dir(secrets_dir or self.directory / credentials.SECRETS_DIR)
        self.passwords, self.admin_password, self.replication_password = cluster_secrets(self.secrets_dir)
        self.masters, self.replicas, self.node_timeout_ms = masters, replicas, node_timeout_ms
        self.host, self.detach = host, detach
        count = masters * (1 + replicas)
        if ports is not None and len(ports) != count:
            raise ValueError(f"{count} ports needed, {len(ports)} given")
        taken: set[int] = set()
        self.ports = {f"node-{i}": ports[i] if ports else cluster_port(host, taken) for i in range(count)}
        self.nodes: dict[str, EmbeddedRedis] = {n: self._server(n) for n in self.ports}

    def _server(self, name: str) -> EmbeddedRedis:
        """A node's server (not started): its port, directory, ACL file and cluster settings. masterauth is set
        with CONFIG SET once it runs (start_node): never on a command line, where ps shows it."""
        config = {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
                  "cluster-node-timeout": str(self.node_timeout_ms), "cluster-require-full-coverage": "no",
                  "cluster-replica-validity-factor": "0"}
        acl = cluster_acl_lines(self.passwords, self.admin_password, self.replication_password)
        return EmbeddedRedis(port=self.ports[name], data_dir=self.directory / name, host=self.host, acl_users=acl,
                             config=config, detach=self.detach)

    def adopt(self) -> EmbeddedCluster:
        """Take over the nodes another process started detached (their server.json), to kill or stop them."""
        for n in self.nodes:
            with contextlib.suppress(ServerNotRunningError):
                self.nodes[n] = EmbeddedRedis.attach(self.directory / n)
        return self

    # --- addresses -------------------------------------------------------------------------------------------
    def address(self, name: str) -> str:
        srv = self.nodes[name]
        return f"{srv.host}:{srv.port}"

    def url(self, role: str = "member") -> str:
        """A cluster URL for a role's user, with every node as a seed."""
        addrs = [self.address(n) for n in self.nodes]
        query = "&".join(f"node={a}" for a in addrs[1:])
        user = quote(credentials.user(role), safe="")
        return f"redis+cluster://{user}:{quote(self.passwords[role], safe='')}@{addrs[0]}/?{query}"

    def bare_url(self) -> str:
        """The cluster URL without credentials (the settings resolver adds the role's)."""
        addrs = [self.address(n) for n in self.nodes]
        return f"redis+cluster://{addrs[0]}/?" + "&".join(f"node={a}" for a in addrs[1:])

    def admin_client(self, name: str) -> redis.Redis:
        srv = self.nodes[name]
        return redis.Redis(host=srv.host, port=srv.port, username=ADMIN_USER, password=self.admin_password,
                           socket_timeout=5.0, socket_connect_timeout=2.0)

    def _ask(self, name: str, *args: Any) -> Any:
        c = self.admin_client(name)
        try:
            return c.execute_command(*args)
        finally:
            c.close()

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> EmbeddedCluster:
        """Start every node and form the cluster (a directory that held one: the nodes rejoin by their nodes.conf)."""
        names = list(self.nodes)
        formed = all((self.directory / n / "nodes.conf").exists() for n in names)
        for n in names:
            self.start_node(n)
        if not formed:
            self._form(names)
        self.wait_ok(timeout)
        return self

    def _form(self, names: list[str]) -> None:
        masters, replicas = names[:self.masters], names[self.masters:]
        for i, n in enumerate(masters):
            lo, hi = i * SLOTS // self.masters, (i + 1) * SLOTS // self.masters
            self._ask(n, "CLUSTER", "ADDSLOTS", *range(lo, hi))
        first = self.nodes[names[0]]
        for n in names[1:]:
            self._ask(n, "CLUSTER", "MEET", first.host, first.port)
        self._wait(lambda: all(self._ask(n, "CLUSTER", "NODES").decode().count("\n") >= len(names) - 1
                               and b"handshake" not in self._ask(n, "CLUSTER", "NODES") for n in names),
                   20.0, "every node to know every other")
        for m, r in zip(masters, replicas, strict=False):
            master_id = self._ask(m, "CLUSTER", "MYID").decode()
            self._wait(lambda r=r, mid=master_id: mid in self._ask(r, "CLUSTER", "NODES").decode(), 10.0,
                       f"{r} to know its master")
            self._ask(r, "CLUSTER", "REPLICATE", master_id)

    def _wait(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                if cond():
                    return
            except (redis.exceptions.RedisError, OSError) as e:
                last = e
            time.sleep(0.1)
        raise ClusterStartError(f"timed out waiting for {what}" + (f" (last: {last})" if last else ""))

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running node says cluster_state:ok and every slot has a master that runs."""
        def ok() -> bool:
            for n in self.running():
                if b"cluster_state:ok" not in self._ask(n, "CLUSTER", "INFO"):
                    return False
            return len(self.slot_masters()) == self.masters
        self._wait(ok, timeout, "cluster_state:ok on every node")

    def running(self) -> list[str]:
        return [n for n, s in self.nodes.items() if s.is_running()]

    def dead(self) -> list[str]:
        return [n for n, s in self.nodes.items() if not s.is_running()]

    def pids(self) -> dict[str, int | None]:
        return {n: s.pid if s.is_running() else None for n, s in self.nodes.items()}

    def slot_masters(self) -> dict[str, list[tuple[int, int]]]:
        """address -> the slot ranges it serves as master, as a running node sees it."""
        for n in self.running():
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                out: dict[str, list[tuple[int, int]]] = {}
                for lo, hi, master, *_ in self._ask(n, "CLUSTER", "SLOTS"):
                    addr = f"{master[0].decode()}:{master[1]}"
                    out.setdefault(addr, []).append((int(lo), int(hi)))
                return out
        return {}

    def node_at(self, address: str) -> str:
        return next(n for n in self.nodes if self.address(n) == address)

    def master_of(self, structure: str) -> str:
        """The name of the node that serves the structure's slot as master now."""
        slot = slot_of(structure)
        for addr, ranges in self.slot_masters().items():
            if any(lo <= slot <= hi for lo, hi in ranges):
                return self.node_at(addr)
        raise ClusterStartError(f"no master serves slot {slot} ({structure}) now")

    def role(self, name: str) -> str:
        c = self.admin_client(name)
        try:
            return "master" if c.info("replication").get("role") == "master" else "replica"
        finally:
            c.close()

    def kill(self, name: str) -> int:
        """SIGKILL one node; returns its pid."""
        srv = self.nodes[name]
        pid = srv.pid or 0
        srv.kill()
        return pid

    def start_node(self, name: str) -> None:
        """Start a (stopped) node on its port: empty (no data on disk), with its cluster config; then give it the
        replication user's password, so that as a replica it can authenticate to its master."""
        if self.nodes[name].is_running():
            return
        with contextlib.suppress(Exception):
            self.nodes[name].kill()  # reap a child killed under us
        discard_data(self.directory / name)  # a node always starts empty, as a lost CF does
        self.nodes[name] = self._server(name)
        self.nodes[name].start()
        self._ask(name, "CONFIG", "SET", "masteruser", REPLICATION_USER)
        self._ask(name, "CONFIG", "SET", "masterauth", self.replication_password)

    def stop(self) -> None:
        for srv in self.nodes.values():
            srv.stop()

    def status(self) -> list[dict[str, Any]]:
        """Every node: name, address, pid, running, role and slot ranges (status --json)."""
        slots = self.slot_masters()
        out = []
        for n, srv in self.nodes.items():
            alive = srv.is_running()
            role = "down"
            if alive:
                with contextlib.suppress(redis.exceptions.RedisError, OSError):
                    role = self.role(n)
            out.append({"name": n, "address": self.address(n), "pid": srv.pid if alive else None,
                        "running": alive, "role": role, "slots": slots.get(self.address(n), [])})
        return out

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
