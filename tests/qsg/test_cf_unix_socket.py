"""A local group's processes reach its CF over the CF's Unix-domain socket (cfemu cluster up's default): the members
serve and are fenced over it, re-join a CF restarted empty and restore its structure over it, and cfbackup and
cfrestore run over it. Real processes: an embedded redis-server, `sqm run` members, the command lines.
The socket itself, its URLs and their errors: tests/cfemu/test_cf_unix_socket.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qsg.local_group import LocalGroup
from sqm.service.client import Client
from tests.support.waits import wait_until


def tcp_peer_ports(pid: int) -> list[int]:
    """The remote ports of a process's TCP connections (its socket descriptors looked up in the kernel's tables)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.append(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def member_pids(g: LocalGroup) -> list[int]:
    return [int(m["pid"]) for m in g.state["managers"]]


def assert_members_use_the_socket(g: LocalGroup) -> None:
    """The members made their CF calls (the test's requests needed them) and hold no TCP connection to the CF's
    port: the calls went over the socket."""
    cf_port = int(g.state["cf"]["port"])
    for pid in member_pids(g):
        assert cf_port not in tcp_peer_ports(pid), f"member {pid} reaches the CF over TCP"


def cli(module: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, f"{module} {' '.join(args)}: {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.mark.slow
def test_members_serve_over_the_cf_socket_and_a_stalled_one_is_fenced_over_it(tmp_path: Path) -> None:
    group_dir = tmp_path / "g"
    g = LocalGroup.up(group_dir, managers=2, backup_interval=None, lease_ms=1000)
    try:
        assert g.local_url == f"unix://{group_dir.resolve() / 'cf' / 'cf.sock'}?db=0"
        assert g.status()["cf_socket"] == str(group_dir.resolve() / "cf" / "cf.sock")
        endpoints = [f"{h}:{p}" for _, h, p in g.endpoints]
        with Client(endpoints[0], token=g.token) as c:
            c.put("Q1", b"one")
            c.commit()
            assert c.get("Q1").body == b"one"
            c.commit()
        with Client(endpoints[1], token=g.token) as c:
            c.put("Q1", b"two")
            c.commit()
        assert_members_use_the_socket(g)

        # QM2 stalls past its lease: QM1 (its lease checks over the socket) recovers its work and fences it; QM2,
        # resumed, finds itself fenced (its renewal over the socket) and exits 3.
        qm2 = int(g.manager("QM2")["pid"])
        qm1_log = group_dir / "run" / "QM1.log"
        os.kill(qm2, signal.SIGSTOP)
        try:
            wait_until(lambda: "recovered QM2" in qm1_log.read_text(), 60, "QM1 recovered QM2")
        finally:
            os.kill(qm2, signal.SIGCONT)
        assert g.wait_manager_exit("QM2", 60) == 3
        with Client(endpoints[0], token=g.token) as c:
            assert c.get("Q1", syncpoint=False).body == b"two"  # QM2's committed put, served by QM1
    finally:
        g.down()


@pytest.mark.slow
def test_backup_restore_and_a_restarted_cf_over_the_socket(tmp_path: Path) -> None:
    g = LocalGroup.up(tmp_path / "g", managers=1, backup_interval=None, lease_ms=2000)
    try:
        env = g.child_env()
        assert env["REDIS_URL"].startswith("unix://")  # what the group's commands are given
        endpoint = [f"{h}:{p}" for _, h, p in g.endpoints]
        with Client(endpoint, token=g.token) as c:
            c.put("Q1", b"backed up", syncpoint=False)
        cli("backup.cli", "run", "APP1", env=env)
        with Client(endpoint, token=g.token) as c:
            c.put("Q1", b"logged", syncpoint=False)
        ran = json.loads(cli("restore.cli", "run", "APP1", "--mark-failed", "--json", env=env).stdout)
        assert ran["loaded_entries"] == 2, ran
        with Client(endpoint, token=g.token) as c:
            assert [c.get("Q1", syncpoint=False).body for _ in range(2)] == [b"backed up", b"logged"]
            c.put("Q1", b"kept", syncpoint=False)

        # The CF is lost and comes back empty on the same socket: the member re-joins it there and restores APP1
        # (RECAUTO) from the backup and its log, over the socket.
        g.kill_cf()
        g.restart_cf()

        def kept() -> bool:
            try:
                with Client(endpoint, token=g.token, reconnect_timeout=1) as c:
                    return bool(c.get("Q1", syncpoint=False).body == b"kept")
            except Exception:  # the structure not restored yet
                return False

        wait_until(kept, 120, "APP1 restored by the member after the CF restarted")
        assert_members_use_the_socket(g)
    finally:
        g.down()


def test_a_member_given_a_url_that_names_no_socket_says_so_in_one_line(tmp_path: Path) -> None:
    """(Each kind of bad socket URL and its message: tests/cfemu/test_cf_unix_socket.py.)"""
    url = f"unix://{tmp_path / 'none.sock'}"
    r = subprocess.run([sys.executable, "-m", "sqm.cli", "run", "--name", "QM9", "--redis-url", url,
                        "--log-root", str(tmp_path / "logs"), "--no-auth"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"no CF socket at {tmp_path / 'none.sock'}: the file does not exist" in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr


@pytest.mark.slow
def test_cluster_up_with_no_cf_socket_keeps_the_group_on_tcp(tmp_path: Path) -> None:
    d = tmp_path / "g"
    env = {k: v for k, v in os.environ.items() if k != "CFEMU_SECRETS_DIR"}  # the cluster's secrets, not the suite's
    try:
        up = json.loads(cli("qsg.cli", "cluster", "up", "--dir", str(d), "--managers", "1", "--backup-interval", "0",
                            "--no-cf-restart", "--no-member-restart", "--no-cf-socket", "--json", env=env).stdout)
        assert up["cf_socket"] is None
        g = LocalGroup.load(d)
        assert g.local_url == g.redis_url and g.redis_url.startswith("redis://")
        assert not (d / "cf" / "cf.sock").exists()
        with Client([f"{h}:{p}" for _, h, p in g.endpoints], token=g.token) as c:
            c.put("Q1", b"over tcp", syncpoint=False)
        assert int(g.state["cf"]["port"]) in tcp_peer_ports(member_pids(g)[0])
    finally:
        cli("qsg.cli", "cluster", "down", "--dir", str(d), "--purge", env=env)
