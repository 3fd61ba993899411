"""Automatic structure recovery (RECAUTO) on real processes: a local cluster (real redis-server, real `sqm run`
members started as the `sqm` command starts them, qsg.member), the CF killed with a real SIGKILL under load.

Nobody types a command: the cluster's supervisor restarts the CF, the members re-join it, one of them restores
every RECAUTO structure; a structure with RECAUTO off stays FAILED until the operator restores it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from backup.points import RESTORE, kind_of
from backup.run import run_backup
from cfemu import repository
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import MQError, NoMessageError
from qsg.local_group import LocalGroup
from restore.run import run_restore
from sqm.service.client import Client

STRUCTURES = {"APP1": ("Q1", "Q2"), "APP2": ("Q3",)}  # APP1: RECAUTO on (the default); APP2: off


def _states(c: LocalGroup) -> dict[str, str]:
    client = connect(c.cf_url(), socket_timeout=2.0)
    try:
        admin = Admin(client)
        return {s: admin.state(s) for s in STRUCTURES}
    finally:
        client.close()


def _probe(c: LocalGroup, name: str) -> bool:
    """Full service through one member: a persistent put, commit, get of it, commit."""
    ep = [(h, p) for n, h, p in c.endpoints if n == name]
    try:
        with Client(ep, token=c.token, client_name="probe", connect_timeout=2, request_timeout=5,
                    reconnect_timeout=0.5) as cl:
            m = cl.put("Q2", b"probe")
            cl.commit()
            cl.get("Q2", msgid=m.msgid, wait_ms=500)
            cl.commit()
        return True
    except (MQError, OSError):
        return False


class Load:
    """Producers and consumers on Q1 through every member, each message its own UOW; what the clients were told."""

    def __init__(self, c: LocalGroup) -> None:
        self.c = c
        self.stop = threading.Event()
        self.acked_puts: set[str] = set()
        self.maybe_puts: set[str] = set()
        self.consumed: list[str] = []  # acknowledged gets
        self.maybe_consumed: list[str] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._produce, args=(n, i), daemon=True)
                        for i, n in enumerate(c.names)]
        self.threads += [threading.Thread(target=self._consume, args=(n,), daemon=True) for n in c.names]

    def _client(self, name: str) -> Client:
        ep = [(h, p) for n, h, p in self.c.endpoints if n == name]
        return Client(ep, token=self.c.token, client_name=f"load-{name}", request_timeout=20,
                      reconnect_timeout=60)

    def _produce(self, name: str, k: int) -> None:
        with self._client(name) as cl:
            i = 0
            while not self.stop.is_set():
                body = f"{name}-{k}-{i}"
                i += 1
                try:
                    cl.put("Q1", body.encode())
                except (MQError, OSError) as e:
                    self.errors.append(f"put: {e}")
                    with contextlib.suppress(MQError, OSError):
                        cl.backout()
                    time.sleep(0.05)
                    continue
                try:
                    cl.commit()
                    self.acked_puts.add(body)
                except (MQError, OSError) as e:
                    self.errors.append(f"commit: {e}")
                    self.maybe_puts.add(body)
                    time.sleep(0.05)

    def _consume(self, name: str) -> None:
        with self._client(name) as cl:
            while not self.stop.is_set():
                try:
                    m = cl.get("Q1", wait_ms=200)
                except NoMessageError:
                    continue
                except (MQError, OSError) as e:
                    self.errors.append(f"get: {e}")
                    with contextlib.suppress(MQError, OSError):
                        cl.backout()
                    time.sleep(0.05)
                    continue
                body = m.body.decode()
                try:
                    cl.commit()
                    self.consumed.append(body)
                except (MQError, OSError) as e:
                    self.errors.append(f"get commit: {e}")
                    self.maybe_consumed.append(body)
                    time.sleep(0.05)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def _drain(c: LocalGroup, queue: str) -> list[str]:
    out = []
    with Client([(h, p) for _, h, p in c.endpoints], token=c.token, client_name="drain") as cl:
        while True:
            try:
                out.append(cl.get(queue, syncpoint=False).body.decode())
            except NoMessageError:
                return out


def _member_logs(c: LocalGroup) -> str:
    return "".join((c.dir / "run" / f"{n}.log").read_text(errors="replace") for n in c.names)


def _restore_points(c: LocalGroup, structure: str) -> list[str]:
    out = []
    for manifest in (c.backup_dir / structure).glob("*/manifest.json"):
        with contextlib.suppress(OSError, ValueError):
            if kind_of(json.loads(manifest.read_text())) == RESTORE:
                out.append(manifest.parent.name)
    return out


def _wait(what: str, cond: Any, timeout: float, interval: float = 0.1) -> float:
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if cond():
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(interval)


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    c = LocalGroup.up(tmp_path / "c", managers=2, backup_interval=None, lease_ms=2000, restart_cf=True,
                      structure="APP1", queues=STRUCTURES["APP1"])
    try:
        client = connect(c.cf_url())
        try:
            admin = Admin(client)
            repo = repository.open_group_repository(admin, c.log_root, who="test")
            repository.ensure_structure(admin, repo, "APP2", STRUCTURES["APP2"], recauto=False)
        finally:
            client.close()
        yield c
    finally:
        c.down()


def test_the_cf_killed_under_load_comes_back_with_every_recauto_structure_active_and_nothing_lost(
        cluster: LocalGroup) -> None:
    """Automatic structure recovery (docs/architecture.md, "Automatic structure recovery"): kill -9 of the CF under
    load, RECAUTO on; no command typed: every RECAUTO structure ACTIVE again, full service through every member,
    nothing acknowledged lost, the time measured; the two members race to recover and one restore only runs; APP2
    (RECAUTO off) waits for the operator."""
    c = cluster
    for s in STRUCTURES:
        client = connect(c.cf_url("backup"))
        try:
            run_backup(client, s, c.backup_dir, log_root=c.log_root, backup_keys=c.backup_keys())
        finally:
            client.close()
    with Load(c) as load:
        _wait("load running", lambda: len(load.acked_puts) >= 20 and len(load.consumed) >= 5, 60)
        os.kill(int(c.state["cf"]["pid"]), signal.SIGKILL)  # a real CF loss: no API, no command
        t_kill = time.monotonic()
        _wait("the supervisor restarted the CF", lambda: c.cf_alive() and c.cf_restarts == 1, 30)
        _wait("APP1 ACTIVE again", lambda: _states(c)["APP1"] == "ACTIVE", 120)
        t_active = time.monotonic() - t_kill
        _wait("full service through every member", lambda: all(_probe(c, n) for n in c.names), 60, 0.2)
        t_service = time.monotonic() - t_kill
        acked_before = len(load.acked_puts)
        _wait("the load goes on after the recovery", lambda: len(load.acked_puts) >= acked_before + 10, 60)
    print(f"\nRECAUTO: CF killed -> APP1 ACTIVE in {t_active:.2f}s, full service in {t_service:.2f}s "
          f"({len(load.acked_puts)} puts acknowledged, {len(load.errors)} client errors during the loss)")

    print("\n".join(ln for ln in _member_logs(c).splitlines() if "CSQE" in ln or "re-joined" in ln))

    # RECAUTO off: nothing happened to APP2 (a member says nothing of it) until the operator restores it.
    assert _states(c)["APP2"] == "FAILED"
    logs = _member_logs(c)
    assert "recovery started for APP2" not in logs
    client = connect(c.cf_url("restore"))
    try:
        run_restore(client, "APP2", backup_root=c.backup_dir, log_root=c.log_root, backup_keys=c.backup_keys())
    finally:
        client.close()
    assert _states(c)["APP2"] == "ACTIVE"

    # One restore of APP1, by one member, logged as MQ does; the other waited.
    started = re.findall(r"CSQE132I structure recovery started for APP1 by (QM\d)", logs)
    assert len(started) == 1, logs[-4000:]
    assert re.search(r"CSQE131I recovery of APP1 completed in [\d.]+ s", logs), logs[-4000:]
    assert re.search(r"CSQE130I recovery of APP1 used backup ", logs)
    assert "CSQE135E" not in logs, logs[-4000:]
    assert len(_restore_points(c, "APP1")) == 1
    assert len(_restore_points(c, "APP2")) == 1  # the operator's

    # Nothing lost: every acknowledged put was consumed or is still there, and nothing came twice.
    drained = _drain(c, "Q1")
    seen = load.consumed + drained
    assert len(seen) == len(set(seen)), "a message was delivered twice"
    present = set(seen) | set(load.maybe_consumed)
    lost = load.acked_puts - present
    assert not lost, f"acknowledged puts lost: {sorted(lost)[:10]}"
    assert set(seen) <= load.acked_puts | load.maybe_puts

    # The metrics count it (the member that recovered).
    winner = c.manager(started[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{winner['metrics_port']}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    wanted = f'sqm_structure_recoveries_total{{event="completed",qmgr="{started[0]}"}} 1.0'
    assert wanted in metrics, [ln for ln in metrics.splitlines() if "recoveries" in ln]
    # ... and time it, whole and by phase (the restore's progress phases).
    assert f'sqm_restore_duration_seconds_count{{qmgr="{started[0]}"}} 1.0' in metrics
    for phase in ("read backup", "read logs", "settle", "load"):
        assert f'sqm_restore_phase_duration_seconds_count{{phase="{phase}",qmgr="{started[0]}"}} 1.0' in metrics, \
            [ln for ln in metrics.splitlines() if "restore_phase" in ln and "_count" in ln]


# --- the race, in process: two members, one lock, and restore's own ownership behind it ----------------------------
def test_two_members_race_one_restores_and_a_lost_lock_lets_no_second_restore_write(
        redis_url: str, tmp_path: Path) -> None:
    """Both members find APP1 missing from a CF that came back empty. The one that takes the lock restores; the
    other waits. Then the lock is lost mid-restore (its TTL lapsed while the holder stalled in its load): the other
    member takes it and starts a restore of its own, which restore's ownership refuses (another restore is running)
    without writing anything; the first completes. One restore point; every committed message is there once."""
    from cfemu.progress import Progress
    from qsg.member import summary
    from restore.engine import LOAD
    from sqm.core.manager import QueueManager, QueueManagerConfig
    from sqm.wings import WINGS
    from tests.support.harness import lose_cf

    log_root, backup_root = tmp_path / "logs", tmp_path / "backups"
    client = connect(redis_url)
    admin = Admin(client)
    repo = repository.open_group_repository(admin, log_root, who="test")
    repository.ensure_structure(admin, repo, "APP1", ["Q1"])
    in_load, go = threading.Event(), threading.Event()

    def hook(hold: bool) -> Any:
        def recover(structure: str, progress: Progress) -> dict[str, Any]:
            def held(phase: str, done: int, total: int | None) -> None:
                progress(phase, done, total)
                if hold and phase == LOAD and not in_load.is_set():
                    in_load.set()
                    assert go.wait(60)
            c = connect(redis_url)
            try:
                r = run_restore(c, structure, backup_root=backup_root, log_root=log_root, progress=held)
            finally:
                c.close()
            return {"backup": r.backup_id, "base_kind": r.base_kind, "replay_from": r.replay_from,
                    "summary": summary(r)}
        return recover

    qms = [QueueManager(QueueManagerConfig(name=n, log_root=log_root, redis_url=redis_url, background=False,
                                           recover_structure=hook(hold=(n == "QM1"))), wings=WINGS)
           for n in ("QM1", "QM2")]
    for qm in qms:
        qm.start()
    try:
        conn = qms[0].connect()
        for i in range(30):
            conn.put("Q1", f"m{i}".encode())
            conn.commit()
        lose_cf(client)  # the CF came back empty
        for qm in qms:
            qm.renew_membership()  # what the heartbeat does: re-join the new CF
        qm1, qm2 = qms
        assert qm1.recauto is not None and qm2.recauto is not None
        assert qm1.recauto.check(now=1e9) == ["APP1"]
        assert in_load.wait(60)
        assert qm2.recauto.check(now=1e9) == []  # QM1 holds the lock: QM2 waits
        assert admin.structure_recovery_holder("APP1") == qm1.recauto.holder
        client.delete("{ADMIN}:recauto:APP1")  # QM1's lock lapsed while it stalled
        assert qm2.recauto.check(now=2e9) == ["APP1"]  # so QM2 takes it and tries ...
        assert qm2.recauto.wait(60)
        assert qm2.counters["structure_recoveries_failed"] == 1  # ... and restore refuses it: one restore runs
        assert admin.state("APP1") == "RECOVERING"
        go.set()
        assert qm1.recauto.wait(60)
        assert qm1.counters["structure_recoveries_completed"] == 1
        assert admin.state("APP1") == "ACTIVE"
        assert admin.recovery_attempt("APP1") is None and admin.structure_recovery_holder("APP1") is None
        points = [m for m in (backup_root / "APP1").glob("*/manifest.json")
                  if kind_of(json.loads(m.read_text())) == RESTORE]
        assert len(points) == 1
        got = []
        with contextlib.suppress(NoMessageError):
            while True:
                got.append(conn.get("Q1", syncpoint=False).body.decode())
        assert sorted(got) == sorted(f"m{i}" for i in range(30))
    finally:
        go.set()
        for qm in qms:
            qm.stop()
        client.close()


def test_recauto_off_and_an_operators_restore_are_left_alone(redis_url: str, tmp_path: Path) -> None:
    """RECAUTO off: a member never recovers the structure. A RECOVERING structure without an automatic
    recovery's mark is an operator's restore: left alone too; with the mark and no lock (the recovering member
    died), it is recovered again."""
    from sqm.core.manager import QueueManager, QueueManagerConfig
    from sqm.wings import WINGS
    from tests.support.harness import lose_cf

    log_root = tmp_path / "logs"
    client = connect(redis_url)
    admin = Admin(client)
    repo = repository.open_group_repository(admin, log_root, who="test")
    repository.ensure_structure(admin, repo, "APP1", ["Q1"], recauto=False)
    repository.ensure_structure(admin, repo, "APP2", ["Q2"])
    calls: list[str] = []
    qm = QueueManager(QueueManagerConfig(name="QM1", log_root=log_root, redis_url=redis_url, background=False,
                                         recover_structure=lambda s, progress: calls.append(s) or {}), wings=WINGS)
    qm.start()
    try:
        assert qm.recauto is not None
        assert repository.GroupRepository(log_root).structures()["APP1"].recauto is False
        admin.set_state("APP2", "RECOVERING")  # an operator's cfrestore is loading it
        assert qm.recauto.check(now=1e9) == [] and calls == []
        admin.set_recovery_attempt("APP2", "QM9@1")  # an automatic one whose member died (no lock)
        assert qm.recauto.check(now=2e9) == ["APP2"]
        lose_cf(client)
        qm.renew_membership()
        assert qm.recauto.wait(10)
        assert qm.recauto.check(now=3e9) == ["APP2"]  # APP1 (RECAUTO off) stays FAILED, unrecovered
        assert qm.recauto.wait(10)
        assert calls == ["APP2", "APP2"] and admin.state("APP1") == "FAILED"
        # Altered on while the CF has lost it (in the repository alone): now recovered.
        repository.alter_structure(admin, repo, "APP1", recauto=True)
        assert qm.recauto.check(now=4e9) == ["APP1", "APP2"]
        assert qm.recauto.wait(10)
    finally:
        qm.stop()
        client.close()


def test_a_queue_of_a_structure_the_cf_lost_is_failed_not_unknown(redis_url: str, tmp_path: Path) -> None:
    """The CF back empty holds no definitions; the group repository still does. A queue it defines is on a failed
    structure (MQRC_CF_STRUC_FAILED, 2373, what MQ answers while a structure is lost, which applications retry),
    never 'unknown' (2085, a configuration error to an application); a queue nobody defined stays unknown."""
    from cfemu.errors import StructureFailedError, UnknownObjectError
    from sqm.core.manager import QueueManager, QueueManagerConfig
    from sqm.wings import WINGS
    from tests.support.harness import lose_cf

    log_root = tmp_path / "logs"
    client = connect(redis_url)
    admin = Admin(client)
    repo = repository.open_group_repository(admin, log_root, who="test")
    repository.ensure_structure(admin, repo, "APP1", ["Q1"], recauto=False)
    qm = QueueManager(QueueManagerConfig(name="QM1", log_root=log_root, redis_url=redis_url, background=False), wings=WINGS)
    qm.start()
    try:
        lose_cf(client)
        qm.renew_membership()
        conn = qm.connect()
        with pytest.raises(StructureFailedError, match="Q1 is defined on structure APP1.*cfrestore run APP1") as e:
            conn.put("Q1", b"m", syncpoint=False)
        assert e.value.reason == 2373
        with pytest.raises(UnknownObjectError) as unknown:
            conn.put("NOSUCH", b"m", syncpoint=False)
        assert unknown.value.reason == 2085
    finally:
        qm.stop(checkpoint=False)
        client.close()
