"""What the member's RECAUTO restore (qsg.member) tells RECAUTO when a restore fails: once its load began (its claim
made, the structure RECOVERING under it), StructureLeftRecovering, so that the recovery is tried again; before its
claim, or stopped by another restore or purge, the restore's own error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import backup.points
from backup.files import BackupError
from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.progress import Progress
from qsg.member import claimed_failures
from restore.run import RestoreStoppedError, run_restore
from sqm.core.config import StructureLeftRecovering
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"


def test_a_restore_that_fails_in_its_load_is_left_recovering_and_said_so(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    conn = qm.connect()
    conn.put("Q1", b"m")
    conn.commit()
    run_backup(client, S, backups, log_root=logs)
    qm.stop()
    lose_cf(client)
    seen: list[str] = []

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(backup.points.RestorePointWriter, "finish", full)
    with pytest.raises(StructureLeftRecovering, match=r"^OSError: \[Errno 28\] No space left on device"):
        claimed_failures(lambda progress: run_restore(client, S, backup_root=backups, log_root=logs,
                                                      progress=progress),
                         lambda phase, done, total: seen.append(phase))
    assert Admin(client).state(S) == "RECOVERING" and "load" in seen

    monkeypatch.undo()
    with pytest.raises(BackupError):  # refused before its claim: as it is
        claimed_failures(lambda progress: run_restore(client, S, backup_root=backups, log_root=logs,
                                                      backup_id=f"{S}-20990101T000000Z-000000", progress=progress),
                         lambda *a: None)


def test_a_restore_stopped_by_a_lost_cf_is_tried_again_one_taken_over_is_not() -> None:
    def stopped(cf_lost: bool) -> Callable[[Progress], None]:
        def run(progress: Progress) -> None:
            raise RestoreStoppedError("restore of APP1 stopped: ...", cf_lost=cf_lost)
        return run

    with pytest.raises(StructureLeftRecovering, match="^RestoreStoppedError: restore of APP1 stopped"):
        claimed_failures(stopped(True), lambda *a: None)  # a CF back from its own data: RECOVERING, ours
    with pytest.raises(RestoreStoppedError):
        claimed_failures(stopped(False), lambda *a: None)  # another restore's or a purge's now
