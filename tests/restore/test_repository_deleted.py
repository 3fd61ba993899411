"""The group repository (<log root>/_group/repository.json) deleted, or its volume not mounted, while the members'
logs beside it are stamped with its id (RecordLog.stamp_group). Missing is not "never made": the logs say the group
had one. A restore, a member's start or a define that went on would make a new, empty repository with a new id
(forgetting the group's members, definitions, declared lost logs and migrated structures), record it in the CF as the
group's, and then every member's start would be refused because its log "is of another group ... move it away".
Each must refuse instead, in one line naming the file, and change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from backup.catalog import list_backups
from backup.run import run_backup
from cfemu.admin import Admin, AdminError
from cfemu.embedded import EmbeddedRedis
from cfemu.repository import GroupRepository
from restore.run import run_restore
from tests.restore.test_group_history import settings_env, tool
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

MISSING = r"group repository .*_group/repository\.json is missing.*stamped with its id"


def _group_then_cf_lost_and_repository_deleted(url: str, redis: EmbeddedRedis, logs: Path, backups: Path) -> str:
    client = define_group(url, queues=("Q1",))
    qm = start_qm(url, logs, "QM1", background=False)
    conn = qm.connect()
    conn.put("Q1", b"a")
    conn.commit()
    run_backup(client, "APP1", backups, log_root=logs)
    conn.put("Q1", b"b")
    conn.commit()
    qm.stop()
    repo_id = GroupRepository(logs).id
    assert repo_id
    lose_cf(redis.client())
    (logs / "_group" / "repository.json").unlink()
    return repo_id


def _nothing_changed(redis: EmbeddedRedis, logs: Path) -> None:
    assert not (logs / "_group" / "repository.json").exists()
    admin = Admin(redis.client())
    assert admin.repository() is None
    assert admin.structures() == []


def test_a_restore_refuses_when_the_repository_the_logs_name_is_missing(fresh_redis: EmbeddedRedis,
                                                                          tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    repo_id = _group_then_cf_lost_and_repository_deleted(fresh_redis.url, fresh_redis, logs, backups)
    before = [b.id for b in list_backups(backups, "APP1")]
    with pytest.raises(AdminError, match=MISSING) as e:
        run_restore(fresh_redis.client(), "APP1", backup_root=backups, log_root=logs)
    assert repo_id in str(e.value)
    _nothing_changed(fresh_redis, logs)
    assert [b.id for b in list_backups(backups, "APP1")] == before  # no restore point


def test_a_member_does_not_start_when_the_repository_its_log_names_is_missing(fresh_redis: EmbeddedRedis,
                                                                             tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    _group_then_cf_lost_and_repository_deleted(fresh_redis.url, fresh_redis, logs, backups)
    with pytest.raises(AdminError, match=MISSING):
        start_qm(fresh_redis.url, logs, "QM1", background=False)
    _nothing_changed(fresh_redis, logs)


def test_a_member_does_not_start_when_the_repository_the_cf_records_is_missing(redis_url: str,
                                                                              tmp_path: Path) -> None:
    """The CF still records the repository at this very path: the refusal says it is missing, not that the log
    root is another group's (and tells to use the path it was given)."""
    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))
    start_qm(redis_url, logs, "QM1", background=False).stop()
    (logs / "_group" / "repository.json").unlink()
    with pytest.raises(AdminError, match=MISSING):
        start_qm(redis_url, logs, "QM1", background=False)


def test_cfemu_define_refuses_when_the_repository_the_logs_name_is_missing(fresh_redis: EmbeddedRedis,
                                                                          tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    _group_then_cf_lost_and_repository_deleted(fresh_redis.url, fresh_redis, logs, backups)
    r = tool("qsg.cli", "define", "structure", "APP1", env=settings_env(fresh_redis.url, logs, backups))
    assert r.returncode == 2, r
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "repository.json is missing" in r.stderr
    _nothing_changed(fresh_redis, logs)


def test_a_new_group_on_an_empty_log_root_still_makes_its_repository(redis_url: str, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))
    start_qm(redis_url, logs, "QM1", background=False).stop()
    assert GroupRepository(logs).id


def test_a_define_says_the_repository_the_cf_records_at_this_path_is_missing(redis_url: str, tmp_path: Path) -> None:
    """No log stamped yet (only defines so far): the CF's record of the repository at this very path says it."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    env = settings_env(redis_url, logs, backups)
    assert tool("qsg.cli", "define", "structure", "APP1", env=env).returncode == 0
    (logs / "_group" / "repository.json").unlink()
    r = tool("qsg.cli", "define", "queue", "Q1", "--structure", "APP1", env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"the group repository {logs}/_group/repository.json is missing, and the CF records it there" in r.stderr
    assert "is not the group's" not in r.stderr
    assert not (logs / "_group" / "repository.json").exists()
