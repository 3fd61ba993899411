"""A duplexed CF on real processes (docs/architecture.md, "A duplexed CF"): a local cluster started with duplex=True
(two real redis-servers, the secondary a Redis replica; real ``sqm run`` members), the pair tended by the cluster's
CF supervisor (qsg.cfpair). Client-side truth: what the clients were told, checked against what is on the queues."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu import duplex_control
from cfemu.admin import Admin
from cfemu.connection import connect
from qsg.local_group import LocalGroup, LocalGroupError
from tests.qsg.test_recauto import Load, _drain, _member_logs, _probe, _wait


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalGroup]:
    c = LocalGroup.up(tmp_path / "c", managers=2, backup_interval=None, lease_ms=2000, restart_cf=True,
                      structure="APP1", queues=("Q1", "Q2"), duplex=True,
                      manager_args=("--metrics-cache", "0"))  # _metric reads right after what it counts
    try:
        yield c
    finally:
        c.down()


def _nothing_lost(c: LocalGroup, load: Load) -> None:
    drained = _drain(c, "Q1")
    seen = load.consumed + drained
    assert len(seen) == len(set(seen)), "a message was delivered twice"
    lost = load.acked_puts - (set(seen) | set(load.maybe_consumed))
    assert not lost, f"acknowledged puts lost: {sorted(lost)[:10]}"
    assert set(seen) <= load.acked_puts | load.maybe_puts, "a message nobody put"
    resurrected = set(load.consumed) & set(drained)
    assert not resurrected, f"acknowledged gets came back: {sorted(resurrected)[:10]}"


def _metric(c: LocalGroup, name: str) -> str:
    port = c.manager(c.names[0])["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return next(ln.split()[-1] for ln in lines if ln.startswith(name + " "))


def _structure_state(c: LocalGroup) -> str:
    client = connect(c.cf_url(), socket_timeout=2.0)
    try:
        return Admin(client).state("APP1")
    finally:
        client.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_primary_killed_under_load_is_replaced_by_its_copy_nothing_lost_nothing_restored(
        cluster: LocalGroup) -> None:
    c = cluster
    assert c.pair.state["mode"] == "DUPLEX"
    old_primary, old_secondary = c.pair.primary_address, c.pair.secondary_address
    with Load(c) as load:
        _wait("load running", lambda: len(load.acked_puts) >= 30 and len(load.consumed) >= 10, 60)
        os.kill(int(c.state["cf"]["pid"]), signal.SIGKILL)  # a real loss of the primary: no API, no command
        t_kill = time.monotonic()
        _wait("the secondary promoted", lambda: c.pair.state["promotions"] == 1, 30, 0.02)
        t_promoted = time.monotonic() - t_kill
        _wait("full service through every member", lambda: all(_probe(c, n) for n in c.names), 60, 0.05)
        t_service = time.monotonic() - t_kill
        acked_before = len(load.acked_puts)
        _wait("the load goes on", lambda: len(load.acked_puts) >= acked_before + 20, 60)
        _wait("duplexed again (the old primary resynchronised as the secondary)",
              lambda: c.pair.state["mode"] == "DUPLEX", 60)
    print(f"\nduplex: primary killed -> secondary promoted in {t_promoted:.3f}s, full service in {t_service:.2f}s "
          f"({len(load.acked_puts)} puts acknowledged, {len(load.errors)} client errors during the loss)")
    assert c.pair.primary_address == old_secondary and c.pair.secondary_address == old_primary
    assert c.pair.state["gen"] == 2
    # no restore: nobody restarted the CF empty, no member started a recovery, APP1 never left ACTIVE
    assert c.pair.state["empty_restarts"] == 0 and c.cf_restarts == 0
    assert "CSQE132I" not in _member_logs(c)
    assert not list(c.backup_dir.glob("APP1/*/manifest.json"))
    assert _structure_state(c) == "ACTIVE"
    _nothing_lost(c, load)


@pytest.mark.e2e
@pytest.mark.slow
def test_secondary_killed_under_load_the_group_carries_on_simplex_then_resyncs(cluster: LocalGroup) -> None:
    c = cluster
    with Load(c) as load:
        _wait("load running", lambda: len(load.acked_puts) >= 30, 60)
        os.kill(int(c.pair.state["secondary"]["pid"]), signal.SIGKILL)
        t_kill = time.monotonic()
        _wait("degraded to simplex", lambda: c.pair.state["degrades"] == 1, 30, 0.02)
        status = c.status()
        acked_before = len(load.acked_puts)
        _wait("the load goes on", lambda: len(load.acked_puts) >= acked_before + 30, 60)
        t_on = time.monotonic() - t_kill
        _wait("duplexed again", lambda: c.pair.state["mode"] == "DUPLEX" and c.pair.state["resyncs"] == 1, 60)
    print(f"\nduplex: secondary killed -> degraded, {len(load.acked_puts) - acked_before} more puts within "
          f"{t_on:.2f}s, duplexed again ({len(load.errors)} client errors)")
    assert status["duplex"]["mode"] == "SIMPLEX" and "CSQE250W" in status["duplex"]["last_event"]
    assert _metric(c, "sqm_cf_duplexed") == "1.0"
    assert c.pair.state["promotions"] == 0 and c.cf_restarts == 0
    final = c.status()
    assert final["duplex"]["secondary_state"] == "in sync" and "CSQE251I" in final["duplex"]["last_event"]
    _nothing_lost(c, load)


@pytest.mark.e2e
@pytest.mark.slow
def test_primary_lost_while_simplex_is_not_promoted_it_is_restarted_empty(cluster: LocalGroup) -> None:
    """The copy was out of date (the pair simplex) when the primary died: promoting it would lose acknowledged
    work, so the controller restarts the primary empty at a new generation (RECAUTO's path, the loss of both)."""
    c = cluster
    c.supervise_cf(False)  # this test plays the supervisor, one step at a time
    assert _metric(c, "sqm_cf_duplexed") == "1.0" and _metric(c, "sqm_cf_generation") == "1.0"
    c.pair.kill_secondary()
    assert c.restart_dead_cf() and c.pair.state["mode"] == "SIMPLEX"  # degraded
    assert _metric(c, "sqm_cf_duplexed") == "0.0"  # what the members report (and CSQE250W in the supervisor's log)
    assert duplex_control.state(c.pair._control(c.pair.primary_address)) == ("SIMPLEX", 1)
    c.kill_cf()
    assert c.restart_dead_cf()
    assert c.pair.state["promotions"] == 0 and c.pair.state["empty_restarts"] == 1
    assert "CSQE253E" in c.pair.state["last_event"] and c.pair.state["gen"] == 2
    assert _structure_state(c) == "FAILED"  # the CF came back empty: RECAUTO's turn


@pytest.mark.e2e
@pytest.mark.slow
def test_both_lost_under_load_falls_back_to_the_backup_and_the_logs(cluster: LocalGroup) -> None:
    """The loss of both servers of the pair: the controller restarts the primary empty at a new generation and a
    member restores APP1 (RECAUTO) from the fuzzy backup and the logs; nothing acknowledged is lost."""
    c = cluster
    client = connect(c.cf_url("backup"))
    try:
        run_backup(client, "APP1", c.backup_dir, log_root=c.log_root, backup_keys=c.backup_keys())
    finally:
        client.close()
    with Load(c) as load:
        _wait("load running", lambda: len(load.acked_puts) >= 30 and len(load.consumed) >= 10, 60)
        os.kill(int(c.pair.state["secondary"]["pid"]), signal.SIGKILL)
        os.kill(int(c.state["cf"]["pid"]), signal.SIGKILL)
        t_kill = time.monotonic()
        _wait("the primary restarted empty", lambda: c.pair.state["empty_restarts"] == 1, 30, 0.05)
        _wait("APP1 ACTIVE again (RECAUTO)", lambda: _structure_state(c) == "ACTIVE", 120)
        _wait("full service through every member", lambda: all(_probe(c, n) for n in c.names), 60, 0.2)
        t_service = time.monotonic() - t_kill
        acked_before = len(load.acked_puts)
        _wait("the load goes on", lambda: len(load.acked_puts) >= acked_before + 10, 60)
    print(f"\nduplex: both lost -> restarted empty, restored by RECAUTO, full service in {t_service:.2f}s")
    assert c.pair.state["promotions"] == 0 and c.pair.state["empty_restarts"] == 1
    assert re.search(r"CSQE131I recovery of APP1 completed", _member_logs(c))
    _nothing_lost(c, load)


@pytest.mark.e2e
@pytest.mark.slow
def test_hung_primary_loses_its_lease_and_is_killed_before_the_promotion(cluster: LocalGroup) -> None:
    c = cluster
    pid = int(c.state["cf"]["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait("the secondary promoted", lambda: c.pair.state["promotions"] == 1, 30, 0.05)
        _wait("the hung primary killed", lambda: not Path(f"/proc/{pid}").exists()
              or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0], 10)
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGCONT)
    _wait("full service", lambda: all(_probe(c, n) for n in c.names), 60, 0.1)
    # the members could not renew their leases while the primary hung (2 s, their lease's length): the promoted copy
    # gave them a grace, so none took the others for dead and fenced them
    assert set(c.names) <= set(c.running_processes()), c.running_processes()
    assert "fenced" not in _member_logs(c) and "recovered QM" not in _member_logs(c), _member_logs(c)[-3000:]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_script_that_keeps_the_primary_busy_is_a_hang_the_copy_takes_over(cluster: LocalGroup) -> None:
    """A loop sent by anyone holding a CF password (here the member role's) holds the primary: it answers nobody,
    then BUSY. The pair's controller takes a primary that does not answer its PING within the pair's lease for
    hung (as the simplex CF's supervisor takes a BUSY one after its kill rule): killed, its in-sync copy promoted.
    The loop wrote nothing, so the copy has all the primary had; the group serves again, nobody fenced."""
    import threading

    c = cluster
    pid = int(c.state["cf"]["pid"])
    _wait("the pair in duplex", lambda: c.pair.state["mode"] == "DUPLEX", 60, 0.1)
    looper = connect(c.cf_url("member"), socket_timeout=60)
    ended: list[BaseException] = []

    def loop() -> None:
        try:
            looper.eval("while true do end", 0)
        except BaseException as e:  # noqa: BLE001 - its connection is cut when the primary is killed
            ended.append(e)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        _wait("the secondary promoted", lambda: c.pair.state["promotions"] == 1, 60, 0.05)
        _wait("the busy primary killed", lambda: not Path(f"/proc/{pid}").exists()
              or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0], 10)
        t.join(10)
        assert ended, "the loop's call still runs"
    finally:
        looper.close()
    _wait("full service", lambda: all(_probe(c, n) for n in c.names), 60, 0.1)
    assert set(c.names) <= set(c.running_processes()), c.running_processes()
    assert "fenced" not in _member_logs(c), _member_logs(c)[-3000:]


def test_duplex_needs_the_supervisor(tmp_path: Path) -> None:
    with pytest.raises(LocalGroupError, match="needs the CF supervisor"):
        LocalGroup.up(tmp_path / "c", managers=1, backup_interval=None, restart_cf=False, duplex=True)


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_up_duplex_status_json_and_private_files(tmp_path: Path) -> None:
    d = tmp_path / "c"
    env = {k: v for k, v in os.environ.items() if k != "CFEMU_SECRETS_DIR"}
    cmd = [sys.executable, "-m", "qsg.cli", "cluster"]
    up = subprocess.run([*cmd, "up", "--dir", str(d), "--managers", "1", "--backup-interval", "0", "--duplex",
                         "--json"], capture_output=True, text=True, timeout=120, env=env)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        st = subprocess.run([*cmd, "status", "--dir", str(d), "--json"], capture_output=True, text=True,
                            timeout=60, env=env)
        doc = json.loads(st.stdout)
        assert doc["duplex"]["mode"] == "DUPLEX" and doc["duplex"]["secondary_state"] == "in sync"
        roles = {p["process"]: p for p in doc["processes"]}
        assert roles["CF (primary)"]["alive"] and roles["CF (secondary)"]["alive"]
        assert "duplex=" in doc["redis_url"] and "@" not in doc["redis_url"]  # no password in the URL shown
        text = subprocess.run([*cmd, "status", "--dir", str(d)], capture_output=True, text=True, timeout=60,
                              env=env).stdout
        assert "duplexed CF: DUPLEX (generation 1)" in text
        for f in [*(d / "secrets").iterdir(), d / "cf" / "users.acl", d / "cf2" / "users.acl"]:
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        assert stat.S_IMODE((d / "cf2").stat().st_mode) == 0o700
        assert (d / "secrets" / "cf-replica.password").exists()
        # the replica's password is never on a command line
        secret = (d / "secrets" / "cf-replica.password").read_text().strip()
        pid = doc["processes"][1]["pid"]
        assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        # the detached cluster's supervisor process is the pair's controller: it promotes the secondary
        os.kill(int(doc["processes"][0]["pid"]), signal.SIGKILL)

        def promoted() -> bool:
            out = subprocess.run([*cmd, "status", "--dir", str(d), "--json"], capture_output=True, text=True,
                                 timeout=60, env=env).stdout
            pair = json.loads(out)["duplex"]
            return bool(pair["generation"] == 2 and pair["promotions"] == 1 and pair["mode"] == "DUPLEX")

        _wait("promoted by the supervisor process, then duplexed again", promoted, 60, 0.5)
        assert "CSQE252I" in (d / "run" / "cf-supervisor.log").read_text()
    finally:
        down = subprocess.run([*cmd, "down", "--dir", str(d), "--json"], capture_output=True, text=True,
                              timeout=120, env=env)
        assert down.returncode == 0, down.stderr[-2000:]


@pytest.mark.e2e
@pytest.mark.slow
def test_the_supervisor_metrics_count_the_pairs_events(cluster: LocalGroup) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from qsg.group_supervisor import Supervisor
    from qsg.supervisor_metrics import SupervisorCollector

    c = cluster
    c.supervise_cf(False)  # this test plays the supervisor
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SupervisorCollector(Supervisor(c, reload=False)))
    before = generate_latest(registry).decode()
    assert 'cfemu_supervisor_cf_pair_events_total{event="degrade"} 0.0' in before
    c.pair.kill_secondary()
    assert c.restart_dead_cf() and c.pair.state["mode"] == "SIMPLEX"  # degraded
    after = generate_latest(registry).decode()
    assert 'cfemu_supervisor_cf_pair_events_total{event="degrade"} 1.0' in after
    assert f'cfemu_supervisor_cf_pair_generation {float(c.pair.state["gen"])}' in after

