"""A structure a migration loaded is restored, after a loss of the target CF, with what the load wrote, or its
restore is refused with the reason (docs/migration.md, "What moves"): it is never started empty and served as if
nothing had been loaded. Real redis-servers, a real member's puts, the target CF lost with FLUSHALL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backup import migrate
from backup.migrate_target import TARGET_FILE
from backup.run import run_backup
from cfemu.admin import Admin
from restore.run import RestoreError
from restore.start_modes import automatic_start
from tests.support.group import start_qm
from tests.support.harness import lose_cf
from tests.support.messages import drained
from tests.support.unloads import unloaded

LOADED = [b"m%d" % i for i in range(5)]


def _loaded_into_a_target(redis_url: str, redis_factory: Any, tmp_path: Path) -> Any:
    """APP1 with LOADED unloaded from the source CF and loaded into a new target CF (group QSG2, its log root
    logs2). Returns the target."""
    unloaded(redis_url, tmp_path, LOADED)
    target = redis_factory()
    migrate.load(target.client(), tmp_path / "mig", group="QSG2", log_root=tmp_path / "logs2")
    return target


def _served(target: Any, tmp_path: Path) -> list[bytes]:
    member = start_qm(target.url, tmp_path / "logs2", "QM1", background=False)
    try:
        return drained(member.connect(), "Q1")
    finally:
        member.stop()


def test_a_target_lost_before_its_first_backup_keeps_the_loaded_messages(redis_url: str, redis_factory: Any,
                                                                        tmp_path: Path) -> None:
    """The load recorded APP1 in the target group's repository (--log-root); the target CF is lost before any
    backup or relog pass of APP1 there; RECAUTO's start (HOT) must bring back the five messages or refuse."""
    target = _loaded_into_a_target(redis_url, redis_factory, tmp_path)
    lose_cf(target.client())
    with pytest.raises(RestoreError) as refused:  # the unload still holds the messages: the operator loads it again
        automatic_start(target.client(), "APP1", backup_root=tmp_path / "backups2", log_root=tmp_path / "logs2")
    said = str(refused.value)
    assert "structure APP1 was loaded by migration" in said and "load-target.json" in said and "\n" not in said
    assert Admin(target.client()).state("APP1") != "ACTIVE"
    (tmp_path / "mig" / TARGET_FILE).unlink()  # as the refusal says: the new CF is another store
    migrate.load(target.client(), tmp_path / "mig", group="QSG2", log_root=tmp_path / "logs2",
                 report=tmp_path / "load-again.jsonl")
    assert _served(target, tmp_path) == LOADED


def test_a_target_backed_up_after_its_load_is_restored_with_what_was_loaded(redis_url: str, redis_factory: Any,
                                                                           tmp_path: Path) -> None:
    target = _loaded_into_a_target(redis_url, redis_factory, tmp_path)
    start_qm(target.url, tmp_path / "logs2", "QM1", background=False).stop()
    run_backup(target.client(), "APP1", tmp_path / "backups2", log_root=tmp_path / "logs2")
    lose_cf(target.client())
    automatic_start(target.client(), "APP1", backup_root=tmp_path / "backups2", log_root=tmp_path / "logs2")
    assert _served(target, tmp_path) == LOADED
