"""What the member's RECAUTO restore (qsg.member) tells RECAUTO when a restore fails: once its load began (its claim
made, the structure RECOVERING under it), StructureLeftRecovering, so that the recovery is tried again; before its
claim, or stopped by another restore or purge, the restore's own error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import backup.points
import restore.run
from backup.files import BackupError
from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.progress import Progress
from cfemu.pstore import COLD, WARM
from qsg.member import claimed_failures
from restore.engine import PURGING
from restore.run import RestoreStoppedError, run_restore
from restore.start_modes import start
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


@pytest.mark.parametrize("mode", [COLD, WARM])
def test_a_start_modes_purge_that_fails_after_its_claim_is_left_recovering_and_said_so(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """RECAUTO's COLD and WARM starts are purges: one that fails once it claimed the structure (its restore point
    not written, its definitions not made again) leaves it RECOVERING under its claim, to be tried again."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    conn = qm.connect()
    conn.put("Q1", b"m")
    conn.commit()
    qm.stop()
    lose_cf(client)
    seen: list[str] = []

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    # COLD's restore point, written after the claim; WARM's definitions, its first step once it owns the structure.
    monkeypatch.setattr(restore.run, "write_restore_point" if mode == COLD else "_redefine", full)
    with pytest.raises(StructureLeftRecovering, match=r"^OSError: \[Errno 28\] No space left on device"):
        claimed_failures(lambda progress: start(client, S, mode, backup_root=backups, log_root=logs,
                                                progress=progress),
                         lambda phase, done, total: seen.append(phase))
    assert Admin(client).state(S) == "RECOVERING" and PURGING in seen

    monkeypatch.undo()
    with pytest.raises(ValueError, match="^start mode must be one of"):  # refused before its claim: as it is
        claimed_failures(lambda progress: start(client, S, "LUKEWARM", backup_root=backups, log_root=logs,
                                                progress=progress), lambda *a: None)
