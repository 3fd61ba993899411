"""A log directory of another group's member under our log root (restored onto the wrong volume, two groups sharing
one log volume): restore refuses it, naming it, rather than replay its records into our structures and start from
its relog window (which lost every message of ours); log retention leaves it out of the structures' starts. A log
is another group's when its member is not one the group knows, or when its manifest is stamped with another group
repository's id (each member stamps its log when it starts; a log with no stamp is taken for ours)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import redis

from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.repository import GroupRepository
from restore.run import RestoreError, run_restore
from sqm.core.group_logs import split_log_dirs
from sqm.core.retention import log_retention
from sqm.log import LogFormatError
from sqm.log.format import read_manifest, write_manifest
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"


def _manifest(log_dir: Path) -> dict[str, Any]:
    manifest = read_manifest(log_dir)
    assert manifest is not None
    return manifest


def _ours_and_a_foreign_log(redis_url: str, other_url: str, tmp_path: Path) -> tuple[redis.Redis, Path, Path]:
    """QM1 of our group logs after a backup; QM9 of another group (its own CF and log root) logs and checkpoints.
    Returns our client, our log root and our backup root (QM9's log not copied yet)."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, segment_bytes=4096)
    c = qm.connect()
    for i in range(3):
        c.put("Q1", f"OURS{i}".encode())
    c.commit()
    run_backup(client, S, backups, log_root=logs)
    for _ in range(40):
        c.put("Q1", b"load" + b"." * 300, syncpoint=False)
        c.get("Q1", syncpoint=False)
    c.put("Q1", b"OURS-after-backup")
    c.commit()
    qm.stop(checkpoint=False)
    define_group(other_url, queues=("Q1",))
    qm9 = start_qm(other_url, tmp_path / "other-logs", "QM9", background=False)
    c9 = qm9.connect()
    for i in range(3):
        c9.put("Q1", f"FOREIGN{i}".encode())
    c9.commit()
    qm9.stop()
    return client, logs, backups


def test_restore_refuses_a_log_of_a_member_the_group_does_not_know(redis_url: str, fresh_redis,
                                                                    tmp_path: Path) -> None:
    client, logs, backups = _ours_and_a_foreign_log(redis_url, fresh_redis.url, tmp_path)
    shutil.copytree(tmp_path / "other-logs" / "QM9", logs / "QM9")
    lose_cf(client)
    with pytest.raises(RestoreError) as caught:
        run_restore(client, S, backup_root=backups, log_root=logs)
    message = str(caught.value)
    assert f"the log {logs / 'QM9'} is another group's (it is of member QM9, which the group does not know)" in message
    assert "\n" not in message


def test_log_retention_leaves_a_foreign_log_out_of_the_structures_starts(redis_url: str, fresh_redis,
                                                                         tmp_path: Path) -> None:
    client, logs, _ = _ours_and_a_foreign_log(redis_url, fresh_redis.url, tmp_path)
    admin = Admin(client)
    before = log_retention(logs / "QM1", admin, logs)
    shutil.copytree(tmp_path / "other-logs" / "QM9", logs / "QM9")
    assert log_retention(logs / "QM1", admin, logs) == before


def _ours_and_theirs_of_one_name(redis_url: str, other_url: str, tmp_path: Path) -> tuple[redis.Redis, Path, Path]:
    """Our group's QM1 and QM2 log after a backup; another group's QM2 (its own CF and log root) logs too, and its
    log is put where ours of QM2 was (restored onto the wrong volume)."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm1 = start_qm(redis_url, logs, "QM1", background=False)
    qm2 = start_qm(redis_url, logs, "QM2", background=False)
    run_backup(client, S, backups, log_root=logs)
    for qm in (qm1, qm2):
        c = qm.connect()
        c.put("Q1", f"OURS-{qm.name}".encode())
        c.commit()
    qm2.stop()
    qm1.stop()
    define_group(other_url, queues=("Q1",))
    theirs = start_qm(other_url, tmp_path / "other-logs", "QM2", background=False)
    c9 = theirs.connect()
    c9.put("Q1", b"FOREIGN")
    c9.commit()
    theirs.stop()
    shutil.rmtree(logs / "QM2")
    shutil.copytree(tmp_path / "other-logs" / "QM2", logs / "QM2")
    return client, logs, backups


def test_a_member_stamps_its_log_with_its_group(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url, queues=("Q1",))
    start_qm(redis_url, tmp_path / "logs", "QM1", background=False).stop()
    stamp = _manifest(tmp_path / "logs" / "QM1")["group"]
    assert stamp == GroupRepository(tmp_path / "logs").id and stamp


def test_restore_refuses_a_log_stamped_with_another_group(redis_url: str, fresh_redis, tmp_path: Path) -> None:
    client, logs, backups = _ours_and_theirs_of_one_name(redis_url, fresh_redis.url, tmp_path)
    lose_cf(client)
    with pytest.raises(RestoreError) as caught:
        run_restore(client, S, backup_root=backups, log_root=logs)
    theirs = _manifest(logs / "QM2")["group"]
    assert f"the log {logs / 'QM2'} is another group's (its manifest names group repository {theirs}" in str(
        caught.value)


def test_a_member_does_not_start_on_a_log_stamped_with_another_group(redis_url: str, fresh_redis,
                                                                     tmp_path: Path) -> None:
    _, logs, _ = _ours_and_theirs_of_one_name(redis_url, fresh_redis.url, tmp_path)
    with pytest.raises(LogFormatError, match="the log is of another group"):
        start_qm(redis_url, logs, "QM2", background=False)


def test_a_log_with_no_stamp_is_taken_for_the_groups(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url, queues=("Q1",))
    logs = tmp_path / "logs"
    start_qm(redis_url, logs, "QM1", background=False).stop()
    manifest = _manifest(logs / "QM1")
    del manifest["group"]  # written before logs were stamped
    write_manifest(logs / "QM1", manifest)
    assert split_log_dirs(logs, ["QM1"], GroupRepository(logs).id) == ([logs / "QM1"], [])
    start_qm(redis_url, logs, "QM1", background=False).stop()  # and stamped when its member starts
    assert _manifest(logs / "QM1")["group"] == GroupRepository(logs).id


def test_restore_stamps_its_own_log_with_its_group(redis_url: str, tmp_path: Path) -> None:
    """Restore's own log (its RECOVERY decisions) says whose it is, as each member's does: another group sharing the
    log root refuses it rather than take our decisions for its own."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    run_backup(client, S, backups, log_root=logs)
    qm.stop()
    lose_cf(client)
    run_restore(client, S, backup_root=backups, log_root=logs)
    stamp = _manifest(logs / "_restore")["group"]
    assert stamp == GroupRepository(logs).id and stamp
    assert logs / "_restore" in [f.directory for f in split_log_dirs(logs, ["QM1", "_restore"], "another-group")[1]]
