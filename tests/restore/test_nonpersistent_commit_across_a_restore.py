"""The pending commit: the non-persistent path of a unit of work across two structures, one
restored between the commit's application on the first and on the second.

Nothing logs a non-persistent unit of work, so the restore of APP2 (between APP1's commit and APP2's) drops its
entries there and APP2 refuses the commit (its work there lost with the restore). No restore keeps a non-persistent
message: the commit is complete, not pending for good, and a structure not back yet keeps only its own UOW waiting
in retry_pending, never the outcomes pending after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.errors import MQError, OutcomePendingError
from restore.run import run_restore
from sqm.core.manager import QueueManager
from sqm.core.uow import UnitOfWork
from tests.restore.test_outcome_counts import bodies, two_structures
from tests.restore.test_restore import rejoin
from tests.support.group import start_qm


def test_a_split_non_persistent_commit_does_not_stop_the_other_pending_outcomes(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = two_structures(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    try:
        for s in ("APP1", "APP2"):
            run_backup(client, s, backups, log_root=logs)
        np = qm.connect()
        np.put("Q1", b"np one", persistent=False)
        np.put("Q3", b"np two", persistent=False)
        real = QueueManager._apply_one

        def restore_app2_first(self: QueueManager, uow: UnitOfWork, sname: str, commit: bool,
                               for_member: str | None) -> None:
            if sname == "APP2" and commit and "APP1" in uow.applied:
                monkeypatch.setattr(QueueManager, "_apply_one", real)
                run_restore(client, "APP2", backup_root=backups, log_root=logs, mark_failed=True)
                rejoin(qm)
            real(self, uow, sname, commit, for_member)

        monkeypatch.setattr(QueueManager, "_apply_one", restore_app2_first)
        told: list[str] = []
        try:
            np.commit()
            told.append("committed")
        except MQError as e:
            told.append(f"{type(e).__name__}: {e}")
        monkeypatch.setattr(QueueManager, "_apply_one", real)
        # Another unit of work, persistent, on APP1 only: its commit meets APP1 failed and waits, pending.
        later = qm.connect()
        later.put("Q1", b"persistent, pending after it")
        Admin(client).set_state("APP1", "FAILED")
        with pytest.raises(OutcomePendingError):
            later.commit()
        Admin(client).set_state("APP1", "ACTIVE")
        for _ in range(5):  # housekeeping's rounds
            qm.retry_pending()
        assert "persistent, pending after it" in bodies(qm, "Q1"), (
            f"the persistent commit is still pending behind the split one ({told}): {list(qm.pending)}")
        # The split non-persistent commit is complete (its work on APP2 went with the restore), not pending for good,
        # and nothing told the application a CF reply was lost when none was.
        assert not qm.pending, list(qm.pending)
        assert "reply was lost" not in told[0], told
    finally:
        qm.stop(checkpoint=False)
