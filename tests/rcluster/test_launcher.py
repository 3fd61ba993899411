"""``cfemu cluster up --redis-cluster 3``: the local launcher with a 3-master Redis Cluster as the CF (real
redis-server nodes, real ``sqm run`` members, the backup scheduler, the supervisor that restarts a dead node)."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from qsg.local_group import LocalGroup, LocalGroupError


@pytest.mark.e2e
@pytest.mark.slow
def test_a_cluster_with_a_redis_cluster_cf_shows_its_nodes_and_heals_a_killed_master(tmp_path: Path) -> None:
    c = LocalGroup.up(tmp_path / "cl", managers=2, backup_interval=1.0, redis_cluster=3, restart_cf=True)
    try:
        doc = c.status()
        nodes = [r for r in doc["processes"] if r["process"].startswith("CF ")]
        assert [r["role"] for r in nodes] == ["master"] * 3 and all(r["slots"] for r in nodes)
        assert doc["redis_url"].startswith("redis+cluster://") and "@" not in doc["redis_url"]  # no secret
        json.dumps(doc)  # what status --json prints
        for path in (tmp_path / "cl" / "cf").rglob("*"):
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
        client = connect(c.cf_url("operator"))
        admin = Admin(client)
        assert admin.state("APP1") == "ACTIVE"
        time.sleep(2.5)  # a backup of APP1 by the scheduler
        holder = next(r for r in nodes if r["address"] == c._cluster_nodes().address(
            c._cluster_nodes().master_of("APP1")))
        killed = c.kill_cf_node(holder["process"].split()[1])
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            try:
                if c.cf_alive() and admin.state("APP1") == "ACTIVE":
                    break
            except Exception:  # noqa: BLE001 - the cluster settles
                pass
            time.sleep(0.2)
        assert admin.state("APP1") == "ACTIVE" and c.cf_restarts >= 1
        assert c.running_processes()[holder["process"]] != killed
        with pytest.raises(LocalGroupError, match="no CF node"):
            c.kill_cf_node("node-9")
    finally:
        c.down()
    assert not c.running_processes()


def test_a_redis_cluster_needs_three_masters(tmp_path: Path) -> None:
    with pytest.raises(LocalGroupError, match="3-16"):
        LocalGroup.up(tmp_path / "cl", redis_cluster=2)
    assert not (tmp_path / "cl").exists()


def test_the_settings_resolver_gives_a_redis_cluster_cf_url_with_the_role_user(tmp_path: Path) -> None:
    """cluster.json of a Redis Cluster CF: its URL counts while any node runs (node-0 may be the dead one), and
    each command's role user and password go into it as for a single CF."""
    import os

    from cfemu import credentials
    from cfemu.settings import CLUSTER_CF, CLUSTER_FILE, CLUSTER_REDIS_URL, resolve

    d = tmp_path / "cl"
    d.mkdir()
    credentials.create(d / credentials.SECRETS_DIR)
    url = "redis+cluster://127.0.0.1:7000/?node=127.0.0.1:7001&node=127.0.0.1:7002"
    state = {CLUSTER_REDIS_URL: url, CLUSTER_CF: {"dir": str(d / "cf"), "redis_cluster": 3, "pid": None,
                                                  "nodes": [{"name": "node-0", "pid": None},
                                                            {"name": "node-1", "pid": os.getpid()}]}}
    (d / CLUSTER_FILE).write_text(json.dumps(state))
    found = resolve(cluster_dir=d, role="member", env={})
    password = credentials.read_password(d / credentials.SECRETS_DIR, "member")
    assert found.redis_url == url.replace("//", f"//qsg-member:{password}@", 1)
    state[CLUSTER_CF]["nodes"][1]["pid"] = None  # type: ignore[index]
    (d / CLUSTER_FILE).write_text(json.dumps(state))
    assert resolve(cluster_dir=d, role="member", env={}).redis_url is None  # no node runs: no CF


@pytest.mark.e2e
@pytest.mark.slow
def test_cfemu_cluster_up_redis_cluster_on_the_command_line(tmp_path: Path) -> None:
    """The detached launcher (what a user runs): up --json lists the nodes, down stops every one of them."""
    import subprocess
    import sys

    d = tmp_path / "cl"

    def cfemu(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "qsg.cli", "cluster", *args, "--dir", str(d), "--json"],
                              capture_output=True, text=True, timeout=120)

    up = cfemu("up", "--redis-cluster", "3", "--managers", "1", "--backup-interval", "0")
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        doc = json.loads(up.stdout)
        nodes = [r for r in doc["processes"] if r["process"].startswith("CF node-")]
        assert len(nodes) == 3 and all(r["alive"] and r["role"] == "master" for r in nodes)
        assert {r["process"] for r in doc["processes"]} >= {"QM1", "cf-supervisor"}
        status = json.loads(cfemu("status").stdout)
        assert [r["slots"] for r in status["processes"] if r["process"].startswith("CF node-")] == [
            r["slots"] for r in nodes]
    finally:
        down = cfemu("down")
    assert down.returncode == 0, down.stderr[-2000:]
    assert json.loads(down.stdout)["still_running"] == {}
    assert not LocalGroup.load(d).running_processes()
