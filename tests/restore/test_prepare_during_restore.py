"""The pending commit: a prepared (in-doubt) unit of work and a restore.

A coordinator's resolve-commit that meets a failed or RECOVERING structure is acknowledged, on the ground that a
restore keeps in-doubt UOWs in doubt. That holds only for a restore that read the PREPARE: a unit of work prepared
while its structure's restore loads (after it read the logs) is in flight in the logs that restore read, and is
backed out by it. So Connection.prepare asks each structure of the UOW after its PREPARE is forced
(QueueManager.confirm_prepared): one that is not ACTIVE refuses the vote (BackedOutError), and a yes vote is always
one the coordinator's commit can honour."""

from __future__ import annotations

from pathlib import Path

from cfemu.errors import BackedOutError, MQError
from tests.support.restore_at_load import restore_at_load


def test_a_resolve_commit_during_a_restore_of_a_uow_prepared_after_the_restore_read_the_logs(
        redis_url: str, tmp_path: Path) -> None:
    with restore_at_load(redis_url, tmp_path) as at:
        at.conn.put("Q1", b"prepared during the restore")
        at.backup()
        told: list[str] = []

        def prepare_and_commit() -> None:
            try:
                uow = at.conn.prepare("xid-review-1")  # the coordinator's phase one: voted yes
                told.append("prepared")
                at.qm.resolve(uow, True)  # the coordinator's phase two
                told.append("committed")
            except MQError as e:
                told.append(f"{type(e).__name__}: {e}")

        at.restore(prepare_and_commit)
        at.settle()
        after = at.view()
        if told[-1] == "committed":
            # The coordinator was told the unit of work committed: its put must be there.
            assert after == [(b"prepared during the restore", 0)], f"resolve answered committed, then: {after}"
        else:  # a no vote: the unit of work is backed out everywhere, its put nowhere
            assert told == [told[0]] and told[0].startswith("BackedOutError: "), told
            assert after == []


def test_a_uow_prepared_while_a_restore_loads_can_still_be_committed_by_its_coordinator(
        redis_url: str, tmp_path: Path) -> None:
    with restore_at_load(redis_url, tmp_path) as at:
        at.conn.put("Q1", b"prepared during the restore")
        at.backup()
        prepared: list[str] = []
        refused: list[BackedOutError] = []

        def prepare() -> None:
            try:
                prepared.append(at.conn.prepare("xid-review-2"))
            except BackedOutError as e:  # refusing the vote is a correct answer: the coordinator backs out
                refused.append(e)

        at.restore(prepare)
        at.settle()
        if refused:
            # A no vote: the unit of work is backed out everywhere, its put nowhere, nothing left in doubt.
            assert at.view() == [] and not at.qm.indoubt(), refused
            return
        # A participant that voted yes must be able to commit when its coordinator says so (two-phase commit).
        try:
            at.qm.resolve(prepared[0], True)
        except MQError as e:
            raise AssertionError(f"the coordinator's commit of a unit of work that voted yes was refused: {e}") from e
        assert at.view() == [(b"prepared during the restore", 0)]


def test_a_uow_prepared_before_the_restore_read_the_logs_is_kept_in_doubt_and_its_resolve_commit_holds(
        redis_url: str, tmp_path: Path) -> None:
    """The exemption's own ground, checked with a real restore: a PREPARE on the logs the restore reads keeps the
    unit of work in doubt in the restored structure, so a resolve-commit during the load, answered committed, ends
    with the put there."""
    with restore_at_load(redis_url, tmp_path) as at:
        at.conn.put("Q1", b"prepared before the restore")
        uow = at.conn.prepare("xid-review-3")
        at.backup()
        told: list[str] = []

        def commit() -> None:
            at.qm.resolve(uow, True)
            told.append("committed")

        at.restore(commit)
        assert told == ["committed"]
        at.settle()
        assert at.view() == [(b"prepared before the restore", 0)]
