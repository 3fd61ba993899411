"""A unit of work committed while a restore of its structure loads, after the restore read the logs. The member
forces the COMMIT, but the structure is RECOVERING: the commit waits, pending. The restore read the logs before that
COMMIT was on them, so it found the unit of work in flight and backed it out in the new generation; the pending
retry then meets that decision and the member logs a BACKOUT. The member cannot tell, when the application
commits, which of the two the commit will end as: the application is told that the outcome is pending
(OutcomePendingError, MQRC_OUTCOME_PENDING), never "committed" (a put so acknowledged was lost; a get so
acknowledged was delivered again). The promise checked here: told committed, the work is there after the restore;
told pending, what the member ends with is the same in its log, in the CF, and in a later restore of the logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.errors import OutcomePendingError
from tests.restore.test_restore import S, uow_records
from tests.support.restore_at_load import RestoreAtLoad, restore_at_load


def decision(logs: Path, uow: str) -> str:
    """The last outcome record the member logged for the unit of work (COMMIT or BACKOUT)."""
    kinds = [k for k in uow_records(logs / "QM1", uow) if k in ("COMMIT", "BACKOUT")]
    assert kinds, f"no outcome logged for {uow}"
    return kinds[-1]


def restored_again(at: RestoreAtLoad) -> list[tuple[bytes, int]]:
    """The queue as a new restore of the structure (from the same backup and the logs as they are now) makes it."""
    at.restore()
    at.settle()
    return at.view()


def test_a_put_committed_while_a_restore_loads_is_never_acknowledged_and_then_lost(redis_url: str,
                                                                                  tmp_path: Path) -> None:
    with restore_at_load(redis_url, tmp_path) as at:
        at.conn.put("Q1", b"committed during the restore")
        assert at.conn.uow is not None
        uow = at.conn.uow.id
        told, after = at.commit_during_restore()
        if told[0] == "committed":
            assert after == [(b"committed during the restore", 0)], f"acknowledged, then: {after}"
            return
        assert "MQRC_OUTCOME_PENDING (2124)" in told[1] and uow in told[1] and "\n" not in told[1], told[1]
        # The restore read the logs before the COMMIT was forced: it backed the unit of work out, and the
        # member, learning it, logged the BACKOUT: the log, the CF and a restore of the logs all say so.
        assert decision(at.logs, uow) == "BACKOUT"
        assert after == []
        assert restored_again(at) == after


def test_a_get_committed_while_a_restore_loads_is_neither_consumed_twice_nor_lost(redis_url: str,
                                                                                 tmp_path: Path) -> None:
    with restore_at_load(redis_url, tmp_path) as at:
        at.conn.put("Q1", b"taken during the restore", syncpoint=False)
        assert at.conn.get("Q1").body == b"taken during the restore"
        assert at.conn.uow is not None
        uow = at.conn.uow.id
        told, after = at.commit_during_restore()
        if told[0] == "committed":
            assert after == [], f"acknowledged as consumed, then available again: {after}"
            return
        assert "MQRC_OUTCOME_PENDING (2124)" in told[1], told[1]
        # Backed out by the restore (its backout count raised), the message is there once: not consumed, not lost.
        assert decision(at.logs, uow) == "BACKOUT"
        assert [body for body, _ in after] == [b"taken during the restore"]
        assert restored_again(at) == after


@pytest.mark.parametrize("before_the_restore", [True, False], ids=["before-the-restore", "during-its-load"])
def test_the_pending_answer_is_given_whatever_the_restore_then_decides(redis_url: str, tmp_path: Path,
                                                                      before_the_restore: bool) -> None:
    """A commit that meets a failed structure before the restore reads the logs is pending too (the member cannot
    tell when the restore reads them); that restore reads its COMMIT and the put is there, the member's retry
    finding it committed."""
    with restore_at_load(redis_url, tmp_path) as at:
        at.conn.put("Q1", b"pending either way")
        at.backup()
        if before_the_restore:
            Admin(at.client).set_state(S, "FAILED")
            with pytest.raises(OutcomePendingError):
                at.conn.commit()
            at.restore(mark_failed=False)
            want = [(b"pending either way", 0)]
        else:
            told = at.restore_committing()
            assert told and told[0] == "pending", told
            want = []
        at.settle()
        assert at.view() == want
