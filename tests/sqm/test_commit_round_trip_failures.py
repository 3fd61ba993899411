"""A batch's commits (Outcomes.decide_many, apply_many) when a step fails in a way no one names: the round trip that
applies them (a refusal the member does not map, a reply it cannot read, a bug), or the append of their COMMITs
part way. A unit of work whose COMMIT is in the log must end applied, or pending with its caller told so (and
completed by retry_pending); one whose COMMIT is not is backed out; none may be left decided and locked on the CF
until the member restarts. In process, on a real redis-server and a real log; the failures are injected by
patching the CF calls and the log's append."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from cfemu.cf import Structure
from cfemu.embedded import EmbeddedRedis
from cfemu.errors import BackedOutError, LogFailedError, OutcomePendingError, OutcomeUnknownError
from sqm.core.connection import Message, PutSpec
from sqm.core.lifecycles import Lifecycles, OneGet, OnePut
from sqm.core.manager import QueueManager
from sqm.core.records import INCOMMIT
from tests.support.group import define_group, start_qm

N = 4


@pytest.fixture
def srv(redis_factory: Callable[..., EmbeddedRedis]) -> EmbeddedRedis:
    cf = redis_factory()
    define_group(cf.url, queues=("Q1",))
    return cf


@pytest.fixture
def qm(srv: EmbeddedRedis, tmp_path: Path) -> Iterator[QueueManager]:
    member = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    try:
        yield member
    finally:
        member.stop()


def _commits_round_trip_gives(qm: QueueManager, monkeypatch: pytest.MonkeyPatch,
                              answer: Callable[[list[Any]], list[Any]]) -> None:
    """The batch's round trip of commit calls (only that one) answered by ``answer`` instead of the CF."""
    real = qm.cf.run_many

    def run_many(calls: list[Any]) -> list[Any]:
        if calls and all(op == "commit" for op, _, _ in calls):
            return answer(calls)
        return real(calls)

    monkeypatch.setattr(qm.cf, "run_many", run_many)


def _bodies(qm: QueueManager) -> list[bytes]:
    return sorted(m.body for m in qm.connect().browse("Q1"))


def _no_uow_decided_and_left(qm: QueueManager) -> None:
    stuck = [u.id for u in qm.uows.values() if u.state == INCOMMIT and u.id not in qm.pending]
    assert not stuck, f"decided, neither applied nor pending: {stuck}"


def _unmapped_error(calls: list[Any]) -> list[Any]:
    raise redis.exceptions.ResponseError("WEIRD an error the member does not map")


def _bug(calls: list[Any]) -> list[Any]:
    raise TypeError("a bug in the round trip")


def _unreadable(calls: list[Any]) -> list[Any]:
    return [[b"not", b"a commit's", b"reply"]] * len(calls)


@pytest.mark.parametrize("answer", [_unmapped_error, _bug, _unreadable], ids=["unmapped-error", "bug", "unreadable"])
def test_commits_whose_round_trip_fails_unexpectedly_go_on_alone_and_commit(
        qm: QueueManager, monkeypatch: pytest.MonkeyPatch, answer: Callable[[list[Any]], list[Any]]) -> None:
    lifecycles = Lifecycles(qm)
    begun = lifecycles.begin([OnePut(PutSpec("Q1", b"m%d" % k)) for k in range(N)])
    _commits_round_trip_gives(qm, monkeypatch, answer)
    lifecycles.finish([begun])
    assert all(isinstance(o, Message) for o in begun.out), begun.out
    _no_uow_decided_and_left(qm)
    assert not qm.uows and not qm.pending
    assert _bodies(qm) == [b"m%d" % k for k in range(N)]


def test_commits_that_fail_unexpectedly_alone_too_wait_pending_and_complete_later(
        qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """The round trip fails with a bug, and so does each commit made alone: each waits pending, its caller hears
    OutcomePendingError, and retry_pending completes it once the CF calls work again. A retry that fails the same
    way keeps it pending and does not stop the other retries."""
    lifecycles = Lifecycles(qm)
    begun = lifecycles.begin([OnePut(PutSpec("Q1", b"m%d" % k)) for k in range(N)])
    _commits_round_trip_gives(qm, monkeypatch, _bug)
    real_commit = Structure.commit

    def commit_fails(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a bug in the commit")

    monkeypatch.setattr(Structure, "commit", commit_fails)
    lifecycles.finish([begun])
    assert all(isinstance(o, OutcomePendingError) for o in begun.out), begun.out
    _no_uow_decided_and_left(qm)
    assert len(qm.pending) == N
    assert qm.retry_pending() == 0  # the same bug: each stays pending, none stops the others' retries
    assert len(qm.pending) == N
    monkeypatch.setattr(Structure, "commit", real_commit)
    assert qm.retry_pending() == N
    assert not qm.pending and not qm.uows
    assert _bodies(qm) == [b"m%d" % k for k in range(N)]


def test_a_batch_whose_commits_fail_to_append_part_way_applies_those_appended_and_backs_out_the_rest(
        qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log's append fails (a bug, not an OSError) at the third of four COMMITs: the two appended are decided
    and go on, forced and applied; the two after them are backed out and hear so. None is left decided and
    unapplied, or in flight."""
    assert qm.log is not None
    real_append = qm.log.append
    commits = 0

    def append(record: dict[str, Any]) -> Any:
        nonlocal commits
        if record.get("k") == "COMMIT":
            commits += 1
            if commits == 3:
                raise TypeError("a bug in the append")
        return real_append(record)

    monkeypatch.setattr(qm.log, "append", append)
    out = Lifecycles(qm).run([OnePut(PutSpec("Q1", b"m%d" % k)) for k in range(N)])
    assert [type(o) for o in out] == [Message, Message, BackedOutError, BackedOutError], out
    _no_uow_decided_and_left(qm)
    assert not qm.uows and not qm.pending
    assert _bodies(qm) == [b"m0", b"m1"]



def _force_fails_inside(monkeypatch: pytest.MonkeyPatch) -> None:
    """The log's next flush fails with what is not an I/O error (a bug in it): the writer fails for good."""
    import sqm.log.writer as writer

    def broken(fd: int) -> None:
        raise ValueError("a bug in the force")

    monkeypatch.setattr(writer, "_fdatasync", broken)


def _restarted(srv: EmbeddedRedis, tmp_path: Path, qm: QueueManager) -> QueueManager:
    qm.stop()
    return start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)


def test_a_batch_whose_force_fails_unexpectedly_is_a_log_failure_not_a_lock_left_behind(
        qm: QueueManager, srv: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log's force fails with what is not an I/O error: whether the COMMITs reached the disk is not known. Each
    caller hears its outcome is unknown (never "failed": a put so told might be delivered), the member refuses
    persistent work as after a failed fsync, and its restart decides every one of them from the log, leaving none
    locked on the CF."""
    lifecycles = Lifecycles(qm)
    begun = lifecycles.begin([OnePut(PutSpec("Q1", b"m%d" % k)) for k in range(N)])
    _force_fails_inside(monkeypatch)
    lifecycles.finish([begun])
    assert all(isinstance(o, OutcomeUnknownError) for o in begun.out), begun.out
    assert qm.log_failed and "a bug in the force" in qm.log_failed
    [refused] = Lifecycles(qm).run([OnePut(PutSpec("Q1", b"after"))])
    assert isinstance(refused, LogFailedError), refused
    monkeypatch.undo()
    again = _restarted(srv, tmp_path, qm)
    try:
        assert not again.uows and not again.pending
        bodies = _bodies(again)
        assert bodies in ([], [b"m%d" % k for k in range(N)]), bodies  # as the log decided: all or none
        got = [again.connect().get("Q1", syncpoint=False).body for _ in bodies]
        assert sorted(got) == bodies  # none is left locked: each decided one can be taken
    finally:
        again.stop()


@pytest.mark.parametrize("path", ["batched", "alone"])
def test_a_get_whose_commit_is_not_known_delivers_its_message(
        qm: QueueManager, srv: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A get outside syncpoint whose force fails: its outcome is not known (its COMMIT may be on disk, and then the
    restart commits it), so the message goes with the error, never consumed for nobody: the caller has it, and,
    should the restart back the get out, it is delivered again."""
    qm.connect().put("Q1", b"held", syncpoint=False)
    _force_fails_inside(monkeypatch)
    if path == "batched":
        [outcome] = Lifecycles(qm).run([OneGet("Q1")])
        assert isinstance(outcome, OutcomeUnknownError), outcome
        error = outcome
    else:
        with pytest.raises(OutcomeUnknownError) as caught:
            qm.connect().get("Q1", syncpoint=False)
        error = caught.value
    assert isinstance(error.message, Message) and error.message.body == b"held"
    assert qm.log_failed
    monkeypatch.undo()
    again = _restarted(srv, tmp_path, qm)
    try:
        assert not again.uows and not again.pending
        assert _bodies(again) in ([], [b"held"])  # consumed (its COMMIT on disk) or back on its queue
    finally:
        again.stop()


def test_a_put_alone_whose_force_fails_unexpectedly_is_not_known_and_the_member_refuses_persistent_work(
        qm: QueueManager, srv: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same failure on a put outside syncpoint made alone (Connection.put: QueueManager.append's force): the
    caller hears its outcome is unknown (before: the ValueError itself, which the service reports as a refusal, for
    a put its restart then delivered), and the member refuses persistent work from then on."""
    conn = qm.connect()
    _force_fails_inside(monkeypatch)
    with pytest.raises(OutcomeUnknownError):
        conn.put("Q1", b"alone", syncpoint=False)
    with pytest.raises(LogFailedError):
        conn.put("Q1", b"after", syncpoint=False)
    monkeypatch.undo()
    again = _restarted(srv, tmp_path, qm)
    try:
        assert not again.uows and not again.pending and _bodies(again) in ([], [b"alone"])
    finally:
        again.stop()
