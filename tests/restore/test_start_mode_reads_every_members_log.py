"""A start mode reads every member's log, as a restore does (restore.start_modes, docs/pstore.md): a WARM or COLD
start leaves a tombstone to each unit of work whose COMMIT its owner logged but had not applied when the CF was
lost, so that the owner's retry finds its commit standing. Started without one member's log (its volume not
mounted, the wrong --log-root), it would leave none for that member's units of work: the owner's restart would
hear "lost with the CF", log BACKOUT after its COMMIT, and a later restore of the structures its UOW also touched
would drop what it committed. Real redis-server, real logs; the member dies as kill -9 leaves it
(tests/support/crash.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis
from cfemu.pstore import warm_generations
from cfemu.repository import GroupRepository
from restore.run import RestoreError
from restore.start_modes import start
from sqm.log import LogReader
from tests.restore.test_group_history import ok, settings_env, tool
from tests.support.crash import crash
from tests.support.group import define_group, rejoin, start_qm
from tests.support.harness import lose_cf


def _committed_across_two_structures_then_lost(url: str, logs: Path, backups: Path, redis: EmbeddedRedis) -> None:
    """QM1 commits a UOW that puts a on APP1 (Q1) and b on APP2 (Q3), between APP1's backup and APP2's, and dies
    (its END appended, not forced, is lost); then the CF is lost."""
    client = define_group(url, queues=("Q1",))
    define_group(url, structure="APP2", queues=("Q3",))
    qm1 = start_qm(url, logs, "QM1", background=False)
    qm2 = start_qm(url, logs, "QM2", background=False)
    run_backup(client, "APP1", backups, log_root=logs)
    conn = qm1.connect()
    conn.put("Q1", b"a")
    conn.put("Q3", b"b")
    conn.commit()
    run_backup(client, "APP2", backups, log_root=logs)
    crash(qm1)
    qm2.stop()
    lose_cf(redis.client())


@pytest.mark.parametrize("mode", ["WARM", "COLD"])
def test_a_start_mode_refuses_a_log_root_without_the_log_of_a_member_the_group_knows(
        fresh_redis: EmbeddedRedis, tmp_path: Path, mode: str) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    _committed_across_two_structures_then_lost(fresh_redis.url, logs, backups, fresh_redis)
    client = fresh_redis.client()
    unmounted = tmp_path / "unmounted-QM1"
    shutil.move(logs / "QM1", unmounted)  # QM1's log volume is not mounted where the group keeps it
    with pytest.raises(RestoreError, match=r"no log for member QM1 under .*logs"):
        start(client, "APP2", mode, backup_root=backups, log_root=logs)
    assert Admin(client).state("APP2") == "FAILED"  # nothing changed: it is started once the log is back
    assert not warm_generations(GroupRepository(logs), "APP2")


def test_a_warm_start_with_every_log_keeps_the_commit_its_member_retries(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """With every log, the WARM start of APP2 leaves QM1's UOW its tombstone: QM1's restart does not back it out,
    and a's commit on APP1 stands (the other half of the rule above, which holds)."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    _committed_across_two_structures_then_lost(fresh_redis.url, logs, backups, fresh_redis)
    client = fresh_redis.client()
    start(client, "APP1", "HOT", backup_root=backups, log_root=logs)
    start(client, "APP2", "WARM", backup_root=backups, log_root=logs)
    qm1 = start_qm(fresh_redis.url, logs, "QM1", background=False)
    try:
        decided = [r["k"] for _, r in LogReader(logs / "QM1").records() if r["k"] in ("COMMIT", "BACKOUT")]
        assert "BACKOUT" not in decided, f"QM1's restart backed out its committed UOW: {decided}"
        rejoin(qm1)
        assert [m.body for m in qm1.connect().browse("Q1")] == [b"a"]
    finally:
        qm1.stop()


@pytest.mark.parametrize("mode", ["HOT", "WARM", "COLD"])
def test_a_start_mode_refuses_another_groups_log_root(fresh_redis: EmbeddedRedis, redis_factory: Any,
                                                      tmp_path: Path, mode: str) -> None:
    """The structure failed, the CF still records the group's repository; the --log-root named is another group's
    (members of the same names: its logs pass as logs of known members). The start is refused before anything
    changes: it would read that group's logs for the tombstones and record the WARM generation in its repository."""
    logs, backups, other = tmp_path / "logs", tmp_path / "backups", tmp_path / "other-group-logs"
    client = define_group(fresh_redis.url, queues=("Q1",))
    qm1 = start_qm(fresh_redis.url, logs, "QM1", background=False)
    run_backup(client, "APP1", backups, log_root=logs)
    elsewhere = redis_factory()
    define_group(elsewhere.url, queues=("Q1",))
    start_qm(elsewhere.url, other, "QM1", background=False).stop()
    qm1.stop()
    Admin(client).set_state("APP1", "FAILED")
    with pytest.raises(RestoreError, match=r"the log root .*other-group-logs is not the group's"):
        start(client, "APP1", mode, backup_root=backups, log_root=other)
    assert Admin(client).state("APP1") == "FAILED"
    assert not warm_generations(GroupRepository(other), "APP1")
    start(client, "APP1", mode, backup_root=backups, log_root=logs)  # the group's own root: started
    assert Admin(client).state("APP1") == "ACTIVE"


def test_cfrestore_purge_refuses_a_log_root_without_the_log_of_a_member_the_group_knows(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """RECOVER CFSTRUCT TYPE(PURGE) gives the same tombstones as a COLD start (it is one): run as the operator runs
    it without QM1's log, it is refused in one line and the structure stays FAILED with no restore point; with the
    log back, it purges and QM1's committed UOW keeps its commit on APP1."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    _committed_across_two_structures_then_lost(fresh_redis.url, logs, backups, fresh_redis)
    client = fresh_redis.client()
    start(client, "APP1", "HOT", backup_root=backups, log_root=logs)
    unmounted = tmp_path / "unmounted-QM1"
    shutil.move(logs / "QM1", unmounted)
    points_before = sorted((backups / "APP2").iterdir())
    env = settings_env(fresh_redis.url, logs, backups)
    refused = tool("restore.cli", "purge", "APP2", env=env)
    assert refused.returncode != 0 and refused.stderr.count("\n") == 1, (refused.returncode, refused.stderr)
    assert "a purge of APP2 reads every member's log" in refused.stderr and "no log for member QM1" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert Admin(client).state("APP2") == "FAILED"
    assert sorted((backups / "APP2").iterdir()) == points_before  # no restore point written
    shutil.move(unmounted, logs / "QM1")
    ok("restore.cli", "purge", "APP2", env=env)
    assert Admin(client).state("APP2") == "ACTIVE"
    qm1 = start_qm(fresh_redis.url, logs, "QM1", background=False)
    try:
        decided = [r["k"] for _, r in LogReader(logs / "QM1").records() if r["k"] in ("COMMIT", "BACKOUT")]
        assert "BACKOUT" not in decided, f"QM1's restart backed out its committed UOW: {decided}"
        rejoin(qm1)
        assert [m.body for m in qm1.connect().browse("Q1")] == [b"a"]
    finally:
        qm1.stop()
