"""A unit of work committed while a restore of its structure loads, after the restore read the logs. The member
forces the COMMIT, but the structure is RECOVERING: the commit waits, pending. The restore read the logs before that
COMMIT was on them, so it found the unit of work in flight and backed it out in the new generation; the pending
retry then meets that decision and the member logs a BACKOUT. The member cannot tell, when the application
commits, which of the two the commit will end as: the application is told that the outcome is pending
(OutcomePendingError, MQRC_OUTCOME_PENDING), never "committed" (a put so acknowledged was lost; a get so
acknowledged was delivered again). The promise checked here: told committed, the work is there after the restore;
told pending, what the member ends with is the same in its log, in the CF, and in a later restore of the logs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.errors import OutcomePendingError
from restore.engine import LOAD
from restore.run import run_restore
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager
from tests.restore.test_restore import S, rejoin, uow_records
from tests.sqm.test_put_committed_recovery import warm
from tests.support.group import define_group, start_qm


def view(qm: QueueManager, queue: str = "Q1") -> list[tuple[bytes, int]]:
    """The queue's available messages: (body, backout count), in get order."""
    return [(m.body, m.backout_count) for m in qm.connect().browse(queue, limit=100)]


def commit_during_load(conn: Connection) -> tuple[Callable[[str, int, int | None], None], list[str]]:
    """A restore progress hook that commits ``conn``'s unit of work once, when the load begins; the list it fills
    says what the application was told: "committed", or "pending" with the error's text."""
    told: list[str] = []

    def during_load(phase: str, done: int, total: int | None) -> None:
        if phase == LOAD and not told:
            try:
                conn.commit()
                told.append("committed")
            except OutcomePendingError as e:
                told.extend(["pending", str(e)])
    return during_load, told


def settle(qm: QueueManager) -> None:
    """The member back on the restored structure, its pending outcomes retried until none is left."""
    rejoin(qm)
    qm.retry_pending()
    assert not qm.pending, f"still pending after the restore: {list(qm.pending)}"


def decision(logs: Path, uow: str) -> str:
    """The last outcome record the member logged for the unit of work (COMMIT or BACKOUT)."""
    kinds = [k for k in uow_records(logs / "QM1", uow) if k in ("COMMIT", "BACKOUT")]
    assert kinds, f"no outcome logged for {uow}"
    return kinds[-1]


def restored_again(client: object, backups: Path, logs: Path, qm: QueueManager) -> list[tuple[bytes, int]]:
    """The queue as a new restore of the structure (from the same backup and the logs as they are now) makes it."""
    run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True)  # type: ignore[arg-type]
    rejoin(qm)
    return view(qm)


def test_a_put_committed_while_a_restore_loads_is_never_acknowledged_and_then_lost(redis_url: str,
                                                                                  tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    try:
        warm(qm1)
        conn = qm1.connect()
        conn.put("Q1", b"committed during the restore")
        assert conn.uow is not None
        uow = conn.uow.id
        run_backup(client, S, backups, log_root=logs)
        during_load, told = commit_during_load(conn)
        run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True, progress=during_load)
        assert told, "the restore never reached its load"
        settle(qm1)
        after = view(qm1)
        if told[0] == "committed":
            assert after == [(b"committed during the restore", 0)], f"acknowledged, then: {after}"
            return
        assert "MQRC_OUTCOME_PENDING (2124)" in told[1] and uow in told[1] and "\n" not in told[1], told[1]
        # The restore read the logs before the COMMIT was forced: it backed the unit of work out, and the
        # member, learning it, logged the BACKOUT: the log, the CF and a restore of the logs all say so.
        assert decision(logs, uow) == "BACKOUT"
        assert after == []
        assert restored_again(client, backups, logs, qm1) == after
    finally:
        qm1.stop(checkpoint=False)


def test_a_get_committed_while_a_restore_loads_is_neither_consumed_twice_nor_lost(redis_url: str,
                                                                                 tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    try:
        warm(qm1)
        conn = qm1.connect()
        conn.put("Q1", b"taken during the restore", syncpoint=False)
        assert conn.get("Q1").body == b"taken during the restore"
        assert conn.uow is not None
        uow = conn.uow.id
        run_backup(client, S, backups, log_root=logs)
        during_load, told = commit_during_load(conn)
        run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True, progress=during_load)
        assert told, "the restore never reached its load"
        settle(qm1)
        after = view(qm1)
        if told[0] == "committed":
            assert after == [], f"acknowledged as consumed, then available again: {after}"
            return
        assert "MQRC_OUTCOME_PENDING (2124)" in told[1], told[1]
        # Backed out by the restore (its backout count raised), the message is there once: not consumed, not lost.
        assert decision(logs, uow) == "BACKOUT"
        assert [body for body, _ in after] == [b"taken during the restore"]
        assert restored_again(client, backups, logs, qm1) == after
    finally:
        qm1.stop(checkpoint=False)


@pytest.mark.parametrize("before_the_restore", [True, False], ids=["before-the-restore", "during-its-load"])
def test_the_pending_answer_is_given_whatever_the_restore_then_decides(redis_url: str, tmp_path: Path,
                                                                      before_the_restore: bool) -> None:
    """A commit that meets a failed structure before the restore reads the logs is pending too (the member cannot
    tell when the restore reads them); that restore reads its COMMIT and the put is there, the member's retry
    finding it committed."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    try:
        warm(qm1)
        conn = qm1.connect()
        conn.put("Q1", b"pending either way")
        run_backup(client, S, backups, log_root=logs)
        if before_the_restore:
            Admin(client).set_state(S, "FAILED")
            with pytest.raises(OutcomePendingError):
                conn.commit()
            run_restore(client, S, backup_root=backups, log_root=logs)
            want = [(b"pending either way", 0)]
        else:
            during_load, told = commit_during_load(conn)
            run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True, progress=during_load)
            assert told and told[0] == "pending", told
            want = []
        settle(qm1)
        assert view(qm1) == want
    finally:
        qm1.stop(checkpoint=False)
