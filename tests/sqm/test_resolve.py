"""An in-doubt unit of work has one resolution: two resolves at once (the coordinator's commit and an operator's
heuristic backout) must not both be logged and applied, since a later restore follows the log's last decision
whatever the CF applied (restore.settle). Real redis-server, a real log."""

from __future__ import annotations

import contextlib
import errno
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from cfemu.errors import (
    BackedOutError,
    BadRequestError,
    InDoubtError,
    LogFailedError,
    OutcomeUnknownError,
    StructureFailedError,
)
from sqm.core.connection import XID_MAX_CHARS
from sqm.core.manager import QueueManager
from sqm.core.uow import UnitOfWork
from sqm.log import LogReader
from sqm.log import writer as log_writer
from sqm.service import queue_ops
from sqm.service.protocol import NotAuthorizedError

DECISIONS = ("COMMIT", "BACKOUT")


def _decisions(qm: QueueManager, uow_id: str) -> list[str]:
    return [r["k"] for _, r in LogReader(qm.log_dir).records() if r["k"] in DECISIONS and r.get("u") == uow_id]


def _prepared(qm: QueueManager, body: bytes, xid: str) -> str:
    c = qm.connect()
    c.put("Q1", body)
    return c.prepare(xid)


def test_a_second_resolve_while_one_is_under_way_is_refused_and_one_decision_is_logged(
        qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    uow = _prepared(qm, b"prepared", "xid-race")
    first_in, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}
    complete = qm.complete

    def held_before_its_decision(*args: Any, **kw: Any) -> None:  # the first resolve, claimed: it waits here
        first_in.set()
        release.wait(10)
        complete(*args, **kw)

    monkeypatch.setattr(qm, "complete", held_before_its_decision)

    def first() -> None:
        try:
            qm.resolve(uow, True)
            outcome["commit"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            outcome["commit"] = repr(e)

    t = threading.Thread(target=first)
    t.start()
    assert first_in.wait(10)
    try:
        with pytest.raises(BadRequestError, match="being resolved"):
            qm.resolve(uow, False)  # an operator's backout while the coordinator's commit is under way
    finally:
        release.set()
        t.join(10)
    monkeypatch.undo()
    assert outcome["commit"] == "ok"
    assert _decisions(qm, uow) == ["COMMIT"]
    assert qm.connect().get("Q1").body == b"prepared"
    with pytest.raises(BadRequestError, match="not in doubt"):
        qm.resolve(uow, False)  # decided: nothing left to resolve


def test_a_resolve_its_check_refuses_leaves_the_unit_of_work_to_be_resolved(qm: QueueManager) -> None:
    uow = _prepared(qm, b"kept", "xid-mine")

    def not_yours(_uow: object) -> None:
        raise NotAuthorizedError("not prepared with that xid")

    with pytest.raises(NotAuthorizedError):
        qm.resolve(uow, False, check=not_yours)
    assert [u.id for u in qm.indoubt()] == [uow] and _decisions(qm, uow) == []
    qm.resolve(uow, True)  # the claim ended with the refusal: the rightful resolve goes through
    assert _decisions(qm, uow) == ["COMMIT"]


def test_resolves_racing_from_threads_decide_each_unit_of_work_once(qm: QueueManager) -> None:
    """The race as the service runs it (each connection's request on its own thread), without a hold: both
    resolves start together; exactly one is acknowledged and logged, every time."""
    for trial in range(20):
        uow = _prepared(qm, f"m{trial}".encode(), f"xid-{trial}")
        start = threading.Barrier(2)
        acked: list[bool] = []

        def resolve(commit: bool, uow: str = uow, start: threading.Barrier = start, acked: list[bool] = acked) -> None:
            start.wait()
            try:
                qm.resolve(uow, commit)
                acked.append(commit)
            except BadRequestError:
                pass

        threads = [threading.Thread(target=resolve, args=(c,)) for c in (True, False)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(acked) == 1, f"trial {trial}: {acked}"
        assert _decisions(qm, uow) == ["COMMIT" if acked[0] else "BACKOUT"], trial


@pytest.mark.parametrize("asked", ["commit", "backout"])
def test_an_application_that_commits_or_backs_out_after_its_prepare_hears_the_unit_of_work_is_in_doubt(
        qm: QueueManager, asked: str) -> None:
    """Its coordinator decides a prepared unit of work: the application's commit or backout right after the
    prepare is refused by name (answered as done, the application would take its messages for put while they stay
    locked in doubt), and nothing is logged. Once resolved, or once the handle has begun other work, a commit or
    backout with nothing open is the no-op it always is."""
    c = qm.connect()
    c.put("Q1", b"x")
    uow = c.prepare("xid-held")
    with pytest.raises(InDoubtError, match=f"{uow} is prepared \\(xid xid-held\\)"):
        getattr(c, asked)()
    with pytest.raises(InDoubtError):  # asked again: the same answer
        getattr(c, asked)()
    assert [u.id for u in qm.indoubt()] == [uow] and _decisions(qm, uow) == []
    c.put("Q1", b"other work")  # the handle's next unit of work: its own commit commits it
    c.commit()
    getattr(c, asked)()  # nothing open: a no-op, though the first is still in doubt
    assert [u.id for u in qm.indoubt()] == [uow] and _decisions(qm, uow) == []
    other = qm.connect()
    other.put("Q1", b"y")
    second = other.prepare("xid-second")
    qm.resolve(second, True)
    getattr(other, asked)()  # resolved by its coordinator: nothing in doubt to refuse
    assert _decisions(qm, second) == ["COMMIT"]


@pytest.mark.parametrize("xid, why", [("x" * (XID_MAX_CHARS + 1), f"at most {XID_MAX_CHARS}"),
                                      ("", "non-empty"), ("tab\there", "printable ASCII")])
def test_an_xid_too_long_empty_or_unprintable_is_refused_and_the_unit_of_work_stays_open(
        qm: QueueManager, xid: str, why: str) -> None:
    c = qm.connect()
    c.put("Q1", b"open")
    with pytest.raises(BadRequestError, match=why):
        c.prepare(xid)
    assert c.uow is not None and c.uow.state == "INFLIGHT" and qm.indoubt() == []
    assert not [r for _, r in LogReader(qm.log_dir).records() if r["k"] == "PREPARE"]
    uow = c.prepare("x" * XID_MAX_CHARS)  # the longest xid there is: prepared
    assert [u.id for u in qm.indoubt()] == [uow]


def test_a_prepare_the_log_refuses_leaves_the_unit_of_work_open_and_its_backout_releases_it(
        qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log cannot be written (a failed fsync): non-persistent work goes on, and a prepare is refused, with no
    PREPARE on disk. The unit of work must stay the application's, open as it was: its backout makes the message it
    got available again. Were it dropped from the connection, the message stayed locked, taken by nobody, until
    the member restarted."""
    c = qm.connect()
    c.put("Q1", b"non-persistent", persistent=False, syncpoint=False)

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(log_writer, "_fdatasync", eio)
    with pytest.raises(OutcomeUnknownError):
        qm.connect().put("Q1", b"fails the log", syncpoint=False)
    monkeypatch.undo()
    assert qm.log_failed
    assert c.get("Q1").body == b"non-persistent"  # under syncpoint, in the connection's unit of work
    with pytest.raises(LogFailedError):
        c.prepare("xid-refused")
    assert c.uow is not None and c.uow.state == "INFLIGHT" and c.uow.xid == "" and qm.indoubt() == []
    c.backout()
    assert qm.connect().get("Q1", syncpoint=False).body == b"non-persistent"


def test_a_prepare_with_an_xid_already_in_doubt_is_refused_and_its_unit_of_work_stays_open(qm: QueueManager) -> None:
    """An xid names one unit of work in doubt on a member: its coordinator finds it by that xid (indoubt) after a
    lost reply and resolves what it finds. A second unit of work prepared under the same xid (a coordinator that
    did the branch again after its prepare's reply was lost, or another application) would be found and committed
    with it: its messages put twice. It is refused, untouched; once the first is resolved the xid is free again."""
    first = _prepared(qm, b"first", "xid-once")
    again = qm.connect()
    again.put("Q1", b"again")
    with pytest.raises(BadRequestError, match="xid-once.*already"):
        again.prepare("xid-once")
    assert again.uow is not None and again.uow.state == "INFLIGHT" and again.uow.xid == ""
    assert [u.id for u in qm.indoubt()] == [first]
    assert [r["u"] for _, r in LogReader(qm.log_dir).records() if r["k"] == "PREPARE"] == [first]
    qm.resolve(first, True)
    second = again.prepare("xid-once")  # the first is decided: its xid may name another unit of work
    assert [u.id for u in qm.indoubt()] == [second]


def test_a_resolve_while_the_prepare_still_takes_its_vote_is_refused_and_one_decision_is_logged(
        qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """After its PREPARE is forced, a prepare asks each structure how the unit of work stands (a CF round trip,
    seconds when the CF does not answer); meanwhile the unit of work is listed in doubt. An operator's resolve then
    must not decide it beside the prepare's own no vote: COMMIT and BACKOUT both logged, the operator told it
    committed, the coordinator told it backed out, and a restore following the last (BACKOUT) while the CF holds
    it committed. The resolve is refused, "being resolved", until the vote is known."""
    c = qm.connect()
    c.put("Q1", b"voted on")
    asked, answer = threading.Event(), threading.Event()

    def standing_not_answering(uow: UnitOfWork, sname: str) -> str:  # the CF does not answer, slowly
        asked.set()
        answer.wait(10)
        failed = StructureFailedError("the CF did not answer (injected)")
        failed.no_answer = True
        raise failed

    monkeypatch.setattr(qm, "_standing", standing_not_answering)
    voted: dict[str, object] = {}

    def prepare() -> None:
        try:
            voted["prepare"] = c.prepare("xid-voting")
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            voted["prepare"] = e

    t = threading.Thread(target=prepare)
    t.start()
    try:
        assert asked.wait(10)
        [uow] = qm.indoubt()  # listed in doubt while its vote is taken
        with pytest.raises(BadRequestError, match="being resolved"):
            qm.resolve(uow.id, True)  # the operator's heuristic commit
    finally:
        answer.set()
        t.join(10)
    assert isinstance(voted["prepare"], BackedOutError), voted
    assert _decisions(qm, uow.id) == ["BACKOUT"]
    assert qm.indoubt() == []


def test_resolves_its_check_refuses_never_make_the_coordinators_resolve_find_it_being_resolved(
        qm: QueueManager) -> None:
    """An application that guesses a unit of work's id (predictable: QM.<epoch>.<seq>) but not its xid sends
    resolve after resolve, each refused by its check. None may claim the unit of work even for a moment: the
    coordinator's own resolve would then be refused, "being resolved", as often as the guesses come. Real threads,
    the service's resolve handler for the guesses."""
    svc, app = SimpleNamespace(qm=qm), SimpleNamespace(role="application")
    refused = 0
    for trial in range(30):
        uow = _prepared(qm, f"m{trial}".encode(), f"xid-{trial}")
        stop = threading.Event()

        def guess(uow: str = uow, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                with contextlib.suppress(NotAuthorizedError, BadRequestError):
                    queue_ops.resolve(svc, app, {"uow": uow, "commit": False, "xid": "a-guess"})  # type: ignore[arg-type]

        guesser = threading.Thread(target=guess)
        guesser.start()
        try:
            qm.resolve(uow, True)  # the coordinator's
        except BadRequestError as e:
            assert "being resolved" in str(e), e
            refused += 1
        finally:
            stop.set()
            guesser.join(10)
        if _decisions(qm, uow) == []:
            qm.resolve(uow, True)  # no guess under way now
        assert _decisions(qm, uow) == ["COMMIT"], trial
    assert refused == 0, f"the coordinator's resolve was refused, being resolved, {refused} times in 30"


def test_a_unit_of_work_in_doubt_with_no_xid_is_no_applications_to_list_or_resolve(qm: QueueManager) -> None:
    """A unit of work recovered in doubt from a PREPARE with no xid (logged before xids were kept: its xid reads as
    "") is the operator's to resolve: an application naming the empty xid neither lists nor resolves it."""
    uow = _prepared(qm, b"old", "xid-old")
    found = [u for u in qm.indoubt() if u.id == uow]
    found[0].xid = ""  # as recovered from such a PREPARE (UnitOfWork's replay: rec.get("x", ""))
    svc, app = SimpleNamespace(qm=qm, service_status=dict), SimpleNamespace(role="application")
    assert queue_ops.indoubt(svc, app, {"xids": [""]}) == []  # type: ignore[arg-type]
    with pytest.raises(NotAuthorizedError, match="was not prepared with that xid"):
        queue_ops.resolve(svc, app, {"uow": uow, "commit": True, "xid": ""})  # type: ignore[arg-type]
    assert _decisions(qm, uow) == []
    qm.resolve(uow, False)  # the operator's
    assert _decisions(qm, uow) == ["BACKOUT"]
