"""A structure that a migration loaded into a target which had its own history of it (a backup, a relog pass) is
never restored, after a loss of the target CF, from that history as if nothing had been loaded (docs/migration.md,
"What moves"): a base older than the load holds none of what was loaded, and the target group's logs hold none of
it either. Before the fix RECAUTO's HOT start restored the target's old backup or relog pass and served the
structure empty. Real redis-servers, real members' puts, a real backup of the target, the target CF lost with
FLUSHALL."""

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
from tests.support.unloads import backed_up_target, unloaded

LOADED = [b"m%d" % i for i in range(5)]


@pytest.mark.parametrize("history", ["relog pass", "backup"])
def test_a_target_lost_after_a_load_is_not_restored_from_its_history_before_the_load(
        redis_url: str, redis_factory: Any, tmp_path: Path, history: str) -> None:
    unloaded(redis_url, tmp_path, LOADED)
    # The target group has its own APP1 already: backed up once (and relogged by its member's checkpoints, unless
    # relogging is off), emptied since: an empty structure takes a load.
    target = redis_factory()
    logs2, backups2 = tmp_path / "logs2", tmp_path / "backups2"
    relog = {} if history == "relog pass" else {"cpl_entries": 0}
    other = backed_up_target(target, logs2, backups2, b"old", **relog)
    assert drained(other.connect(), "Q1") == [b"old"]
    other.stop()
    migrate.load(target.client(), tmp_path / "mig", log_root=logs2)
    lose_cf(target.client())

    with pytest.raises(RestoreError) as refused:
        automatic_start(target.client(), "APP1", backup_root=backups2, log_root=logs2)
    said = str(refused.value)
    assert "structure APP1 was loaded by migration" in said and "before the load" in said and "\n" not in said
    assert Admin(target.client()).state("APP1") != "ACTIVE"
    (tmp_path / "mig" / TARGET_FILE).unlink()  # as the refusal says: the new CF is another store
    migrate.load(target.client(), tmp_path / "mig", log_root=logs2, report=tmp_path / "load-again.jsonl")
    member = start_qm(target.url, logs2, "QM1", background=False, **relog)
    try:
        assert drained(member.connect(), "Q1") == LOADED
    finally:
        member.stop()


def test_a_target_backed_up_after_the_load_is_restored_with_what_was_loaded_over_its_older_history(
        redis_url: str, redis_factory: Any, tmp_path: Path) -> None:
    unloaded(redis_url, tmp_path, LOADED)
    target = redis_factory()
    logs2, backups2 = tmp_path / "logs2", tmp_path / "backups2"
    backed_up_target(target, logs2, backups2).stop()
    migrate.load(target.client(), tmp_path / "mig", log_root=logs2)
    run_backup(target.client(), "APP1", backups2, log_root=logs2)  # the target's first backup after the load
    lose_cf(target.client())
    automatic_start(target.client(), "APP1", backup_root=backups2, log_root=logs2)
    member = start_qm(target.url, logs2, "QM1", background=False)
    try:
        assert drained(member.connect(), "Q1") == LOADED
    finally:
        member.stop()
