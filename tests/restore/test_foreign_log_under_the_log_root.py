"""A log directory of another group's member under our log root (restored onto the wrong volume, two groups sharing
one log volume): restore refuses it, naming it, rather than replay its records into our structures and start from
its relog window (which lost every message of ours); log retention leaves it out of the structures' starts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis

from backup.run import run_backup
from cfemu.admin import Admin
from restore.run import RestoreError, run_restore
from sqm.core.retention import log_retention
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"


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
    assert f"the log {logs / 'QM9'} is of member QM9, which the group does not know" in message
    assert "\n" not in message


def test_log_retention_leaves_a_foreign_log_out_of_the_structures_starts(redis_url: str, fresh_redis,
                                                                         tmp_path: Path) -> None:
    client, logs, _ = _ours_and_a_foreign_log(redis_url, fresh_redis.url, tmp_path)
    admin = Admin(client)
    before = log_retention(logs / "QM1", admin, logs)
    shutil.copytree(tmp_path / "other-logs" / "QM9", logs / "QM9")
    assert log_retention(logs / "QM1", admin, logs) == before
