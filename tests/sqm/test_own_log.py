"""A member starts only from its own log (sqm.core.own_log): one the group knows it had (its volume not mounted, a
disk that died) is never begun again by itself, because its restart would back out the units of work whose COMMIT
the missing log holds, and restore would replay the new log as the member's whole history. `sqm log lost` is the
operator's declaration that the log is gone for good: the member then begins a new log, purges and COLD and WARM
starts go on without it, and a HOT restore from a base the lost log was needed for is refused. Real redis-server,
real logs, the member killed as kill -9 leaves it (tests/support/crash.py), the commands run as processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis
from cfemu.repository import GroupRepository
from restore.run import RestoreError, run_purge
from restore.start_modes import start
from sqm.core.own_log import OwnLogMissingError
from sqm.core.recovery import recover_peers
from tests.restore.test_group_history import settings_env, tool
from tests.support.crash import Crash, crash, failpoint_armed
from tests.support.group import define_group, rejoin, start_qm
from tests.support.harness import lose_cf
from tests.support.waits import wait_until

LEASE_MS = 600  # a member killed is declared lost once its lease lapsed (sqm log lost refuses a live one)


def _committed_and_crashed(url: str, logs: Path) -> None:
    """QM1 puts 'kept' outside syncpoint, then 'a' in a unit of work whose COMMIT it forces and dies before
    applying it (its reply never sent): its restart, reading its log, must complete the commit."""
    define_group(url, queues=("Q1",))
    qm1 = start_qm(url, logs, "QM1", background=False, lease_ms=LEASE_MS)
    conn = qm1.connect()
    conn.put("Q1", b"kept", syncpoint=False)
    conn.put("Q1", b"a")
    with pytest.raises(Crash), failpoint_armed("after-log-force"):
        conn.commit()
    crash(qm1)


def _bodies(url: str, logs: Path, member: str = "QM1") -> list[bytes]:
    qm = start_qm(url, logs, member, background=False)
    try:
        return sorted(m.body for m in qm.connect().browse("Q1"))
    finally:
        qm.stop()


def _lapsed(redis: EmbeddedRedis, member: str) -> None:
    admin = Admin(redis.client())
    wait_until(lambda: admin.members().get(member, {}).get("lease_ms", -1) < 0, 10, f"{member}'s lease lapsed")


def _declare(redis: EmbeddedRedis, logs: Path, backups: Path, member: str) -> None:
    """`sqm log lost` of a member killed, once its lease lapsed."""
    _lapsed(redis, member)
    r = tool("sqm.cli", "log", "lost", member, "--confirm", member, env=settings_env(redis.url, logs, backups))
    assert r.returncode == 0, r.stderr


def test_a_member_whose_log_is_missing_does_not_start_and_its_commit_stands_once_the_log_is_back(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    _committed_and_crashed(fresh_redis.url, logs)
    unmounted = tmp_path / "unmounted-QM1"
    shutil.move(logs / "QM1", unmounted)  # the log's volume is not mounted where the group keeps it
    epoch = Admin(fresh_redis.client()).members()["QM1"]["epoch"]  # the dead incarnation's
    with pytest.raises(OwnLogMissingError, match=r"QM1: the group knows this member's log .*sqm log lost QM1"):
        start_qm(fresh_redis.url, logs, "QM1", background=False)
    assert not (logs / "QM1").exists()  # nothing begun in its place
    assert Admin(fresh_redis.client()).members()["QM1"]["epoch"] == epoch  # and it did not join
    shutil.move(unmounted, logs / "QM1")
    assert _bodies(fresh_redis.url, logs) == [b"a", b"kept"]  # its restart completed the commit its log holds


def test_sqm_run_without_its_log_exits_with_one_line_naming_the_way_out(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    define_group(fresh_redis.url, queues=("Q1",))
    start_qm(fresh_redis.url, logs, "QM1", background=False).stop()
    shutil.rmtree(logs / "QM1")
    (logs / "QM1").mkdir()  # the mount point, empty
    r = subprocess.run([sys.executable, "-m", "sqm.cli", "run", "--name", "QM1", "--port", "0", "--no-auth",
                        "--redis-url", fresh_redis.url, "--log-root", str(logs)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "SQM_TOKEN": ""})
    assert r.returncode == 2, (r.returncode, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "QM1: the group knows this member's log" in errors[0], r.stderr
    assert "sqm log lost QM1 --confirm QM1" in errors[0] and "Traceback" not in r.stderr
    assert list((logs / "QM1").iterdir()) == []


def test_sqm_log_lost_refuses_a_log_that_is_there_an_unknown_member_and_no_confirmation(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    define_group(fresh_redis.url, queues=("Q1",))
    start_qm(fresh_redis.url, logs, "QM1", background=False).stop()
    env = settings_env(fresh_redis.url, logs, backups)
    for args, said in ((("QM1", "--confirm", "QM1"), "holds QM1's log: it is not lost"),
                       (("QM9", "--confirm", "QM9"), "has no member QM9 (members: QM1)"),
                       (("QM1", "--confirm", "QM2"), "confirm with --confirm QM1")):
        r = tool("sqm.cli", "log", "lost", *args, env=env)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and said in r.stderr, (args, r.stderr)
    assert not GroupRepository(logs).lost_logs()


def test_a_member_declared_lost_begins_a_new_log_and_backs_its_work_out(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    _committed_and_crashed(fresh_redis.url, logs)
    shutil.rmtree(logs / "QM1")  # the disk died
    env = settings_env(fresh_redis.url, logs, backups)
    _lapsed(fresh_redis, "QM1")  # refused while it is live (test_sqm_log_lost_refuses_a_member_that_holds_...)
    r = tool("sqm.cli", "log", "lost", "QM1", "--confirm", "QM1", "--json", env=env)
    assert r.returncode == 0, r.stderr
    declared = json.loads(r.stdout)
    assert declared["member"] == "QM1" and declared["pending"] is True and declared["lrsn"] > 0
    status = tool("sqm.cli", "log", "status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    assert [(x["member"], x["pending"]) for x in json.loads(status.stdout)["lost_logs"]] == [("QM1", True)]
    assert _bodies(fresh_redis.url, logs) == [b"kept"]  # a new log: the unit of work it cannot decide is backed out
    lost = GroupRepository(logs).lost_logs()["QM1"]
    assert lost["pending"] is False and lost["lrsn"] == declared["lrsn"]
    shown = tool("sqm.cli", "log", "status", env=env)
    assert shown.returncode == 0 and "declared lost for good" in shown.stdout and "a new log begun" in shown.stdout
    shutil.rmtree(logs / "QM1")  # lost again: the old declaration does not let it begin anew by itself
    with pytest.raises(OwnLogMissingError):
        start_qm(fresh_redis.url, logs, "QM1", background=False)


def _backed_up_then_log_lost(redis: EmbeddedRedis, logs: Path, backups: Path) -> None:
    """APP1 backed up; QM1 puts 'after' (in its log only); QM1's disk dies and is declared lost; the CF is lost."""
    client = define_group(redis.url, queues=("Q1",))
    qm1 = start_qm(redis.url, logs, "QM1", background=False, lease_ms=LEASE_MS)
    qm2 = start_qm(redis.url, logs, "QM2", background=False)
    qm1.connect().put("Q1", b"before", syncpoint=False)
    run_backup(client, "APP1", backups, log_root=logs)
    qm1.connect().put("Q1", b"after", syncpoint=False)
    crash(qm1)
    qm2.stop()
    shutil.rmtree(logs / "QM1")
    _declare(redis, logs, backups, "QM1")
    lose_cf(redis.client())


@pytest.mark.parametrize("member_restarted", [False, True])
def test_a_hot_restore_that_needed_the_lost_log_is_refused_and_a_cold_start_goes_on(
        fresh_redis: EmbeddedRedis, tmp_path: Path, member_restarted: bool) -> None:
    """The backup's replay starts before the loss: what QM1 logged since ('after') is gone, so HOT is refused in
    one line naming the member and COLD, whether QM1 began its new log already or not; COLD then starts APP1 empty
    without waiting for QM1's log, and both members serve it."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    _backed_up_then_log_lost(fresh_redis, logs, backups)
    client = fresh_redis.client()
    if member_restarted:
        start_qm(fresh_redis.url, logs, "QM1", background=False).stop()
    with pytest.raises(RestoreError, match=r"the log of member QM1 was declared lost for good .* start APP1 COLD"):
        start(client, "APP1", "HOT", backup_root=backups, log_root=logs)
    assert Admin(client).state("APP1") != "ACTIVE"
    start(client, "APP1", "COLD", backup_root=backups, log_root=logs)
    assert Admin(client).state("APP1") == "ACTIVE"
    for member in ("QM2", "QM1"):
        qm = start_qm(fresh_redis.url, logs, member, background=False)
        try:
            rejoin(qm)
            qm.connect().put("Q1", member.encode(), syncpoint=False)
        finally:
            qm.stop()
    assert _bodies(fresh_redis.url, logs, "QM2") == [b"QM1", b"QM2"]


def test_a_purge_goes_on_without_a_log_declared_lost(fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    _backed_up_then_log_lost(fresh_redis, logs, backups)
    client = fresh_redis.client()
    run_purge(client, "APP1", backup_root=backups, log_root=logs)
    assert Admin(client).state("APP1") == "ACTIVE"


def test_a_peer_backs_out_the_work_of_a_member_whose_log_was_declared_lost(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """QM2 forced a COMMIT and died before applying it, and its disk with it: QM1 leaves its entries locked while
    the log may come back (tests/sqm/test_recovery.py), and backs its work out once the log is declared lost, as
    QM2's own restart with a new log would: the message is available again, and QM2 leaves the group."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    define_group(fresh_redis.url, queues=("Q1",))
    qm1 = start_qm(fresh_redis.url, logs, "QM1", background=False, lease_ms=600)
    qm2 = start_qm(fresh_redis.url, logs, "QM2", background=False, lease_ms=600)
    try:
        qm1.connect().put("Q1", b"m", syncpoint=False)
        conn = qm2.connect()
        assert conn.get("Q1").body == b"m"
        with pytest.raises(Crash), failpoint_armed("after-log-force"):
            conn.commit()
        crash(qm2)
        shutil.rmtree(logs / "QM2")
        wait_until(lambda: "QM2" in qm1.admin.lapsed_members(), 10, "QM2's lease lapsed")
        assert recover_peers(qm1) == []  # its log may come back: nothing decided
        _declare(fresh_redis, logs, backups, "QM2")
        reports = recover_peers(qm1)
        assert [(rep.failed, rep.committed, rep.backed_out) for rep in reports] == [("QM2", 0, 1)]
        assert qm1.connect().get("Q1", syncpoint=False).body == b"m"
        assert "QM2" not in qm1.admin.members()
    finally:
        qm1.stop()




def test_a_log_back_after_its_declaration_is_read_again_by_restore(fresh_redis: EmbeddedRedis,
                                                                   tmp_path: Path) -> None:
    """The volume came back after `sqm log lost`: the member starts from its old log, the declaration is no longer
    pending, and a restore from a backup begun after it reads that log (what it committed after the backup
    included), rather than calling it another group's."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(fresh_redis.url, queues=("Q1",))
    qm1 = start_qm(fresh_redis.url, logs, "QM1", background=False, lease_ms=LEASE_MS)
    qm1.connect().put("Q1", b"m", syncpoint=False)
    crash(qm1)
    away = tmp_path / "QM1-away"
    (logs / "QM1").rename(away)
    _declare(fresh_redis, logs, backups, "QM1")
    away.rename(logs / "QM1")
    qm1 = start_qm(fresh_redis.url, logs, "QM1", background=False)
    lost = GroupRepository(logs).lost_logs()["QM1"]
    assert lost["pending"] is False and "log_back_at" in lost
    qm1.connect().put("Q1", b"n", syncpoint=False)
    run_backup(client, "APP1", backups, log_root=logs)
    qm1.connect().put("Q1", b"o", syncpoint=False)  # after the backup: in QM1's log only
    qm1.stop()
    lose_cf(client)
    start(client, "APP1", "HOT", backup_root=backups, log_root=logs)
    assert _bodies(fresh_redis.url, logs) == [b"m", b"n", b"o"]


def test_a_start_that_failed_after_beginning_the_new_log_leaves_it_to_the_next(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """The new log was begun, then the start failed (a mistyped --pstore-report): the log is closed again (the next
    start in the same process is not refused as locked), and the next start goes on from the new log and ends the
    declaration's pending state, so that restore reads it."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    define_group(fresh_redis.url, queues=("Q1",))
    crash(start_qm(fresh_redis.url, logs, "QM1", background=False, lease_ms=LEASE_MS))
    shutil.rmtree(logs / "QM1")
    _declare(fresh_redis, logs, backups, "QM1")
    with pytest.raises(OSError):
        start_qm(fresh_redis.url, logs, "QM1", background=False, pstore_report=tmp_path / "no-such-dir" / "r.jsonl")
    assert (logs / "QM1" / "manifest.json").exists()
    start_qm(fresh_redis.url, logs, "QM1", background=False).stop()
    assert GroupRepository(logs).lost_logs()["QM1"]["pending"] is False


def test_a_backup_begun_after_the_declaration_restores_while_a_unit_of_work_pins_its_replay_start(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """QM2's unit of work, open since before the declaration, holds the backup's replay start below it; the backup
    began after the declaration all the same, when QM1 was long dead: nothing of QM1's lost log is needed."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(fresh_redis.url, queues=("Q1",))
    qm1 = start_qm(fresh_redis.url, logs, "QM1", background=False, lease_ms=LEASE_MS)
    qm2 = start_qm(fresh_redis.url, logs, "QM2", background=False)
    qm2.connect().put("Q1", b"open", syncpoint=True)
    crash(qm1)
    shutil.rmtree(logs / "QM1")
    _declare(fresh_redis, logs, backups, "QM1")
    qm2.connect().put("Q1", b"after", syncpoint=False)
    manifest = run_backup(client, "APP1", backups, log_root=logs)
    assert manifest["replay_from"] < GroupRepository(logs).lost_logs()["QM1"]["lrsn"] < manifest["start_lrsn"]
    qm2.stop()
    lose_cf(client)
    start(client, "APP1", "HOT", backup_root=backups, log_root=logs)
    assert _bodies(fresh_redis.url, logs, "QM2") == [b"after"]


def test_a_base_begun_before_the_declaration_is_refused_whatever_the_lost_members_clock(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """QM1's LRSN clock ran 60 s ahead, and the CF's with it: the backup's LRSNs are above the LRSN the declaration
    can know, but the backup began before it by the wall clock, and QM1's lost log holds a put committed after it."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(fresh_redis.url, queues=("Q1",))
    qm1 = start_qm(fresh_redis.url, logs, "QM1", background=False, clock_skew_us=60_000_000, lease_ms=LEASE_MS)
    qm1.connect().put("Q1", b"before", syncpoint=False)
    manifest = run_backup(client, "APP1", backups, log_root=logs)
    qm1.connect().put("Q1", b"after", syncpoint=False)
    crash(qm1)
    shutil.rmtree(logs / "QM1")
    _declare(fresh_redis, logs, backups, "QM1")
    assert manifest["start_lrsn"] > GroupRepository(logs).lost_logs()["QM1"]["lrsn"]
    lose_cf(client)
    with pytest.raises(RestoreError, match=r"the log of member QM1 was declared lost .* begun before that"):
        start(client, "APP1", "HOT", backup_root=backups, log_root=logs)


def test_sqm_log_lost_refuses_a_member_that_holds_a_live_lease(fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """Its log where this host cannot see it, a member that runs is not declared lost."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    define_group(fresh_redis.url, queues=("Q1",))
    qm1 = start_qm(fresh_redis.url, logs, "QM1", background=False, lease_ms=60_000)
    try:
        (logs / "QM1").rename(tmp_path / "elsewhere")  # its open files go on; this host sees no log there
        r = tool("sqm.cli", "log", "lost", "QM1", "--confirm", "QM1", env=settings_env(fresh_redis.url, logs, backups))
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "QM1 holds a live lease in the CF" in r.stderr and "wait for its lease to lapse" in r.stderr
        assert not GroupRepository(logs).lost_logs()
        (tmp_path / "elsewhere").rename(logs / "QM1")
    finally:
        qm1.stop()
