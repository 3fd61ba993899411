"""cfbackup prune and the scheduler's retention keep a restore point its restore is still writing (unfinished: the
mark, no manifest) while that restore holds the writer lock of restore's own log under the log root: removed under
it, the restore would fail at the end of its whole load. One a killed restore left (the lock free) goes."""

from __future__ import annotations

import json
import time
from pathlib import Path

from backup.catalog import INCOMPLETE, list_backups, retain
from backup.points import RESTORE_LOG, UNFINISHED_MARK, RestorePointWriter, point_id
from backup.run import run_backup
from sqm.log import RecordLog
from tests.support.cfbackup import cfbackup, group_to_back_up
from tests.support.group import define_group

S = "APP1"


def _unfinished_point(backups: Path) -> str:
    """A restore point begun and not finished, as a restore leaves it during its load."""
    point = RestorePointWriter(backups, point_id(S), S)
    point.add({"id": "m0", "q": "Q1"}, b"loaded so far")
    assert (point.directory / UNFINISHED_MARK).exists()
    return point.backup_id


def test_prune_keeps_the_point_of_a_running_restore_and_removes_it_once_the_restore_is_gone(
        redis_url: str, tmp_path: Path) -> None:
    env = group_to_back_up(redis_url, tmp_path, 3)
    assert cfbackup("run", S, env=env).returncode == 0
    backups, logs = tmp_path / "bk", tmp_path / "logs"
    point = _unfinished_point(backups)
    running = RecordLog(logs / RESTORE_LOG, RESTORE_LOG)  # the restore's hold on its own log, as restore.run takes it
    time.sleep(1.1)  # older than the 1s asked for
    try:
        kept = cfbackup("prune", S, "--older-than", "1s", env=env)
        assert kept.returncode == 0, kept.stderr
        assert f"kept {point}: a restore point its restore is still writing" in kept.stdout
        assert (backups / S / point).is_dir()
    finally:
        running.close()

    gone = cfbackup("prune", S, "--older-than", "1s", "--json", env=env)
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout)["removed"] == [point]


def test_retention_keeps_the_point_of_a_running_restore(redis_url: str, tmp_path: Path) -> None:
    backups, logs = tmp_path / "bk", tmp_path / "logs"
    client = define_group(redis_url, queues=("Q1",))
    point = _unfinished_point(backups)
    time.sleep(1.1)  # the backups begin in a later second: the point stands below them
    taken = [run_backup(client, S, backups, log_root=logs)["id"] for _ in range(2)]
    assert [(b.id, b.state) for b in list_backups(backups, S)][-1] == (point, INCOMPLETE)
    running = RecordLog(logs / RESTORE_LOG, RESTORE_LOG)
    try:
        result = retain(backups, S, 1, client=client, log_root=logs)
        assert [b.id for b in result.removed] == [taken[0]]
        assert [b.id for b, _ in result.held] == [point] and (backups / S / point).is_dir()
    finally:
        running.close()
    run_backup(client, S, backups, log_root=logs)  # the next backup's retention: the restore is gone
    assert {b.id for b in retain(backups, S, 1, client=client, log_root=logs).removed} == {taken[1], point}
