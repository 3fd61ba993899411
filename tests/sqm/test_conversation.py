"""Units of work sent to a service (sqm.conversations.conversation), against a real redis-server and real logs: every transition
of the state table as an application makes it, every SYNCPOINT option, and the refusals (each names the operation
and the status). Restarts and CF loss: tests/sqm/test_uow_restart.py; the network: tests/sqm/test_service_uow.py."""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import (
    BadRequestError,
    EndOfUowError,
    NoMessageError,
    OutcomePendingError,
    OutcomeUnknownError,
    UnknownUowError,
    UowLimitError,
    UowStatusError,
)
from sqm.conversations.conversation import ANY, BOTH, MSG, SYNC, Conversation
from sqm.conversations.uowsweeper import Sweeper
from sqm.core.manager import QueueManager
from sqm.log import writer as log_writer
from tests.support.group import two_members

S, SVC, PLAIN_SVC, LIMITED = "APP1", "SVC", "NOSTAT", "LIM"


@pytest.fixture
def qms(redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, QueueManager]]:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S, ("BQ",))
    admin.define_queue(SVC, S, uow={"status_lifetime": 2, "postpone_attempts": 1, "postpone_delay_s": 1},
                       backout_queue="BQ")
    admin.define_queue(PLAIN_SVC, S, uow={})  # the defaults: no persistent status
    admin.define_queue(LIMITED, S, uow={"max_uows": 2, "max_messages": 2, "status_lifetime": 1})
    with two_members(redis_url, tmp_path / "logs") as pair:
        yield pair


@pytest.fixture
def pair(qms: tuple[QueueManager, QueueManager]) -> Iterator[tuple[Conversation, Conversation]]:
    snd, rcv = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[1], "bob", "tok-b")
    yield snd, rcv
    snd.close()
    rcv.close()


def status(conv: Conversation, uow: str) -> str | None:
    return conv.query(uow)["status"]


def sent_uow(snd: Conversation, n: int = 3, service: str = SVC, **kw: object) -> str:
    uow = ""
    for i in range(n):
        uow = snd.send(service, b"m%d" % i, **kw).uow  # type: ignore[arg-type]
    snd.commit()
    return uow


# --- send and receive ------------------------------------------------------------------------------------------
def test_a_uow_is_received_whole_in_order_on_another_member(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    ids = {snd.send(SVC, b"m%d" % i).uow for i in range(3)}
    assert len(ids) == 1  # the UOW id comes back on every send
    uow = ids.pop()
    with pytest.raises(NoMessageError):
        rcv.receive(SVC, option=SYNC)  # RECEIVED: not committed by its sender, not receivable
    assert snd.commit() == {"status": "ACCEPTED", "uow": uow}
    got = [rcv.receive(SVC, option=SYNC) for _ in range(3)]
    assert [(g.body, g.recv, g.uow, g.status) for g in got] == [
        (b"m0", "RECV_FIRST", uow, "DELIVERED"), (b"m1", "RECV_MIDDLE", uow, "DELIVERED"),
        (b"m2", "RECV_LAST", uow, "DELIVERED")]
    with pytest.raises(EndOfUowError, match="end of unit of work"):
        rcv.receive(SVC)
    assert status(snd, uow) == "DELIVERED"
    assert rcv.commit() == {"status": "PROCESSED", "uow": uow}
    assert status(snd, uow) == "PROCESSED"


def test_uows_are_received_in_commit_order_and_one_message_is_recv_only(
        pair: tuple[Conversation, Conversation], qms: tuple[QueueManager, QueueManager]) -> None:
    snd, rcv = pair
    other = Conversation(qms[0], "carol")
    first = other.send(SVC, b"first")
    second = snd.send(SVC, b"second", commit=True)
    other.commit()
    assert rcv.receive(SVC, option=SYNC).uow == second.uow  # committed first, received first
    rcv.commit()
    got = rcv.receive(SVC, option=SYNC)
    assert (got.uow, got.recv) == (first.uow, "RECV_ONLY")
    rcv.commit()


def test_receive_options_sync_msg_and_any(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    plain = snd.send(SVC, b"plain", option=MSG)
    assert plain.uow == "" and plain.status == ""
    with pytest.raises(NoMessageError):
        rcv.receive(SVC, option=SYNC)  # only UOW messages
    uow = snd.send(SVC, b"in a uow", commit=True).uow
    got = rcv.receive(SVC, option=MSG)  # only messages outside a UOW
    assert (got.body, got.recv, got.uow) == (b"plain", "RECV_NONE", "")
    with pytest.raises(NoMessageError):
        rcv.receive(SVC, option=MSG)
    got = rcv.receive(SVC, option=ANY)
    assert (got.uow, got.recv) == (uow, "RECV_ONLY")
    rcv.commit()
    with pytest.raises(BadRequestError, match="SYNC, MSG or ANY"):
        rcv.receive(SVC, option="SOME")


def test_a_receive_waits_for_a_uow(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    t0 = time.monotonic()
    with pytest.raises(NoMessageError):
        rcv.receive(SVC, option=SYNC, wait_ms=300)
    assert time.monotonic() - t0 >= 0.3


# --- the sender's syncpoints -------------------------------------------------------------------------------------
def test_sender_backout_leaves_backedout_and_no_message(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    uow = snd.send(SVC, b"x").uow
    assert snd.backout() == {"uow": uow, "status": "BACKEDOUT"}
    assert status(rcv, uow) == "BACKEDOUT"
    with pytest.raises(NoMessageError):
        rcv.receive(SVC, option=ANY)


def test_without_persistent_status_a_finished_uow_leaves_no_trace(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    backed = snd.send(PLAIN_SVC, b"x").uow
    snd.backout()
    with pytest.raises(UnknownUowError, match=backed):
        snd.query(backed)
    done = sent_uow(snd, 1, PLAIN_SVC)
    rcv.receive(PLAIN_SVC, option=SYNC)
    rcv.commit()
    with pytest.raises(UnknownUowError):
        snd.query(done)
    kept = sent_uow(snd, 1, PLAIN_SVC, status_lifetime=3)  # a request overrides the service's default (UWSTATP)
    rcv.receive(PLAIN_SVC, option=SYNC)
    rcv.commit()
    assert status(snd, kept) == "PROCESSED"
    gone = sent_uow(snd, 1, SVC, status_lifetime=255)  # 255: no persistent status, whatever the service says
    rcv.receive(SVC, option=SYNC)
    rcv.commit()
    with pytest.raises(UnknownUowError):
        snd.query(gone)


def test_sender_cancel_withdraws_an_accepted_uow(pair: tuple[Conversation, Conversation],
                                                 qms: tuple[QueueManager, QueueManager]) -> None:
    snd, rcv = pair
    uow = sent_uow(snd)
    with pytest.raises(UowStatusError, match="only its sender"):
        rcv.cancel(uow)
    assert snd.cancel(uow) == {"uow": uow, "status": "CANCELLED"}
    with pytest.raises(NoMessageError):
        rcv.receive(SVC, option=SYNC)
    with pytest.raises(UowStatusError, match="CANCEL is not allowed in status CANCELLED"):
        snd.cancel(uow)
    pending = snd.send(SVC, b"x").uow
    with pytest.raises(UowStatusError, match="CANCEL is not allowed in status RECEIVED"):
        Conversation(qms[0], "alice", "tok-a").cancel(pending)


def test_commit_needs_a_message_and_a_uow(pair: tuple[Conversation, Conversation]) -> None:
    snd, _ = pair
    with pytest.raises(UowStatusError, match="holds no unit of work"):
        snd.commit()
    with pytest.raises(UowStatusError, match="not held by this session"):
        snd.commit("ab" * 16)


def test_eoc_and_eoccancel_commit_and_tell_the_receiver(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    snd.send(SVC, b"last words")
    r = snd.syncpoint("EOC")
    assert r["status"] == "ACCEPTED"
    assert rcv.receive(SVC, option=SYNC).eoc == "EOC"
    rcv.commit()
    snd.send(SVC, b"abandon", eoc="EOCCANCEL")  # SEND with an end of conversation commits
    assert rcv.receive(SVC, option=SYNC).eoc == "EOCCANCEL"
    rcv.commit()


# --- the receiver's syncpoints -----------------------------------------------------------------------------------
def test_receiver_commit_takes_what_it_did_not_read(pair: tuple[Conversation, Conversation],
                                                    qms: tuple[QueueManager, QueueManager]) -> None:
    snd, rcv = pair
    uow = sent_uow(snd, 3)
    rcv.receive(SVC, option=SYNC)
    rcv.commit()
    assert status(snd, uow) == "PROCESSED"
    assert qms[0].structure(S).depths()[SVC + ".UOWDATA"] == {"UP": 0, "UG": 0, "EX": 0, "CP": 0}


def test_receiver_backout_makes_it_accepted_again_with_its_delivery_counted(
        pair: tuple[Conversation, Conversation], qms: tuple[QueueManager, QueueManager]) -> None:
    snd, rcv = pair
    uow = sent_uow(snd, 2)
    rcv.receive(SVC, option=SYNC)
    assert rcv.backout() == {"uow": uow, "status": "ACCEPTED"}
    again = Conversation(qms[0], "dave")
    got = again.receive(SVC, option=SYNC)
    assert (got.uow, got.recv, got.body, got.deliveries) == (uow, "RECV_FIRST", b"m0", 1)
    again.commit()


def test_receiver_cancel_postpones_then_cancels_to_the_backout_queue(
        pair: tuple[Conversation, Conversation], qms: tuple[QueueManager, QueueManager]) -> None:
    snd, rcv = pair
    uow = sent_uow(snd, 2)
    rcv.receive(SVC, option=SYNC)
    assert rcv.cancel()["status"] == "POSTPONED"  # POSTPONE-ATTEMPTS 1
    with pytest.raises(NoMessageError):
        rcv.receive(SVC, option=SYNC)  # POSTPONE-DELAY: not before a second of up-time
    sweeper = Sweeper(qms[1])
    sweeper.sweep()
    assert status(snd, uow) == "POSTPONED"
    time.sleep(1.1)
    assert sweeper.sweep()["resumed"] == 1
    assert status(snd, uow) == "ACCEPTED"
    got = rcv.receive(SVC, option=SYNC)
    assert got.uow == uow and got.recv == "RECV_FIRST"
    r = rcv.cancel()  # the attempts are used up: CANCELLED, its messages to the backout queue
    assert r == {"uow": uow, "status": "CANCELLED", "moved_to": "BQ"}
    moved = [qms[0].connect().get("BQ", syncpoint=False).body for _ in range(2)]
    assert moved == [b"m0", b"m1"]


def test_a_cancel_without_postponement_is_final(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    uow = sent_uow(snd, 1, LIMITED)
    rcv.receive(LIMITED, option=SYNC)
    assert rcv.cancel()["status"] == "CANCELLED"
    assert status(snd, uow) == "CANCELLED"


def test_commit_both_settles_a_received_and_a_sent_uow_at_once(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    request = sent_uow(snd, 1)
    rcv.receive(SVC, option=SYNC)
    reply = rcv.send(SVC, b"reply").uow
    with pytest.raises(UowStatusError, match="COMMIT BOTH"):
        rcv.commit(request)
    with pytest.raises(UowStatusError, match="COMMIT BOTH"):
        rcv.commit(reply)
    r = rcv.commit(BOTH)
    assert r == {"status": "ACCEPTED", "uow": reply, "received": {"uow": request, "status": "PROCESSED"}}
    assert (status(snd, request), status(snd, reply)) == ("PROCESSED", "ACCEPTED")
    with pytest.raises(UowStatusError, match="COMMIT BOTH needs a unit of work being"):
        rcv.commit(BOTH)


def test_backout_both(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    request = sent_uow(snd, 1)
    rcv.receive(SVC, option=SYNC)
    reply = rcv.send(SVC, b"reply").uow
    with pytest.raises(UowStatusError, match="use BOTH"):
        rcv.backout()
    with pytest.raises(UowStatusError, match="BACKOUT BOTH"):
        rcv.backout(reply)
    rcv.backout(BOTH)
    assert (status(snd, request), status(snd, reply)) == ("ACCEPTED", "BACKEDOUT")


# --- status: QUERY, LAST, SETUSTATUS, DELETE ---------------------------------------------------------------------
def test_query_and_last_by_user_id_and_token(pair: tuple[Conversation, Conversation],
                                             qms: tuple[QueueManager, QueueManager]) -> None:
    snd, rcv = pair
    uow = sent_uow(snd, 2)
    again = Conversation(qms[1], "alice", "tok-a")  # the same user after a failure, on another member
    last = again.last()
    assert (last["uow"], last["status"], last["messages"], last["sender"]) == (uow, "ACCEPTED", 2, "alice")
    with pytest.raises(UnknownUowError):
        Conversation(qms[1], "alice", "other-token").last()
    with pytest.raises(UnknownUowError, match="not known"):
        rcv.query("cd" * 16)
    with pytest.raises(BadRequestError, match="QUERY needs"):
        rcv.syncpoint("QUERY")
    assert rcv.syncpoint("QUERY", uow)["status"] == "ACCEPTED"
    with pytest.raises(BadRequestError, match="syncpoint option must be one of"):
        rcv.syncpoint("FLUSH")


def test_user_status_in_received_accepted_and_delivered_only(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    uow = snd.send(SVC, b"x", user_status=b"v0").uow
    assert snd.set_user_status(uow, b"sending")["user_status"] == "sending"
    snd.commit()
    assert snd.syncpoint("SETUSTATUS", uow, user_status=b"accepted")["user_status"] == "accepted"
    got = rcv.receive(SVC, option=SYNC)
    assert got.user_status == b"accepted"
    with pytest.raises(UowStatusError, match="neither sent nor received"):
        Conversation(snd.qm, "mallory").set_user_status(uow, b"x")
    assert rcv.set_user_status(uow, b"50% done")["status"] == "DELIVERED"
    assert snd.query(uow)["user_status"] == "50% done"
    with pytest.raises(BadRequestError, match="at most 64 bytes"):
        rcv.set_user_status(uow, b"x" * 65)
    rcv.commit()
    with pytest.raises(UowStatusError, match="SETUSTATUS is not allowed in status PROCESSED"):
        snd.set_user_status(uow, b"late")
    assert snd.query(uow)["user_status"] == "50% done"  # the refusal changed nothing


def test_delete_a_finished_status_by_its_sender(pair: tuple[Conversation, Conversation]) -> None:
    snd, rcv = pair
    uow = sent_uow(snd, 1)
    with pytest.raises(UowStatusError, match="DELETE is not allowed in status ACCEPTED"):
        snd.delete(uow)
    rcv.receive(SVC, option=SYNC)
    rcv.commit()
    with pytest.raises(UowStatusError, match="only its sender"):
        rcv.delete(uow)
    assert snd.syncpoint("DELETE", uow) == {"uow": uow, "status": None, "deleted": True}
    with pytest.raises(UnknownUowError):
        snd.query(uow)


# --- limits and bad input ----------------------------------------------------------------------------------------
def test_service_limits(pair: tuple[Conversation, Conversation], qms: tuple[QueueManager, QueueManager]) -> None:
    snd, _ = pair
    snd.send(LIMITED, b"1")
    snd.send(LIMITED, b"2")
    with pytest.raises(UowLimitError, match="MAX-MESSAGES-IN-UOW"):
        snd.send(LIMITED, b"3")
    snd.commit()
    other = Conversation(qms[0], "erin")
    other.send(LIMITED, b"1", commit=True)
    with pytest.raises(UowLimitError, match="MAX-UOWS"):
        Conversation(qms[0], "frank").send(LIMITED, b"1")
    admin = qms[0].admin
    admin.define_queue("NONE", S, uow={"max_uows": 0})
    with pytest.raises(UowLimitError, match="takes no units of work"):
        snd.send("NONE", b"x")


def test_bad_input_is_refused_with_the_reason(qms: tuple[QueueManager, QueueManager]) -> None:
    with pytest.raises(BadRequestError, match="user id must be"):
        Conversation(qms[0], "u" * 33)
    with pytest.raises(BadRequestError, match="token must be"):
        Conversation(qms[0], "u", "bad\ntoken")
    conv = Conversation(qms[0], "u")
    with pytest.raises(UowStatusError, match="is not a service"):
        conv.send("BQ", b"x")
    with pytest.raises(BadRequestError, match="UWSTATP"):
        conv.send(SVC, b"x", status_lifetime=256)
    with pytest.raises(BadRequestError, match="must be bytes"):
        conv.send(SVC, "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_messages"):
        qms[0].admin.define_queue("BAD", S, uow={"max_messages": 0})
    with pytest.raises(ValueError, match="unknown UOW attribute"):
        qms[0].admin.define_queue("BAD", S, uow={"colour": 1})


def test_close_backs_out_what_the_session_holds(pair: tuple[Conversation, Conversation],
                                                qms: tuple[QueueManager, QueueManager]) -> None:
    snd, rcv = pair
    uow = sent_uow(snd, 1)
    rcv.receive(SVC, option=SYNC)
    sending = snd.send(SVC, b"never committed").uow
    rcv.close()
    snd.close()
    check = Conversation(qms[0], "x")
    assert (status(check, uow), status(check, sending)) == ("ACCEPTED", "BACKEDOUT")
    assert check.query(uow)["deliveries"] == 1


# --- the sweeper: lifetimes on the pseudo-clock, status lifetimes, orphans ----------------------------------------
def test_an_accepted_uow_times_out_and_a_received_or_delivered_one_does_not(
        pair: tuple[Conversation, Conversation], qms: tuple[QueueManager, QueueManager]) -> None:
    snd, rcv = pair
    accepted = sent_uow(snd, 2, lifetime_s=1)
    delivered = sent_uow(snd, 1, lifetime_s=1)
    other = Conversation(qms[1], "grace")
    sweeper = Sweeper(qms[0])
    sweeper.sweep()
    rcv.receive(SVC, option=SYNC)  # the first committed: accepted
    received = other.send(SVC, b"open", lifetime_s=1).uow
    time.sleep(1.2)
    done = sweeper.sweep()
    assert done["timed-out"] == 1
    assert status(snd, delivered) == "TIMEOUT"
    assert (status(snd, accepted), status(snd, received)) == ("DELIVERED", "RECEIVED")
    rcv.commit()
    assert status(snd, accepted) == "PROCESSED"
    assert qms[0].structure(S).depths()[SVC + ".UOWDATA"]["CP"] == 0  # the timed-out UOW's message went with it


def test_a_status_outlives_its_uow_by_its_multiple_of_the_lifetime(pair: tuple[Conversation, Conversation],
                                                                    qms: tuple[QueueManager, QueueManager]) -> None:
    snd, rcv = pair
    uow = sent_uow(snd, 1, lifetime_s=1, status_lifetime=1)
    rcv.receive(SVC, option=SYNC)
    rcv.commit()
    sweeper = Sweeper(qms[0])
    sweeper.sweep()
    assert status(snd, uow) == "PROCESSED"
    time.sleep(1.2)
    assert sweeper.sweep()["statuses-expired"] == 1
    with pytest.raises(UnknownUowError):
        snd.query(uow)


def test_a_uow_whose_holder_vanished_is_settled_by_the_sweeper(pair: tuple[Conversation, Conversation],
                                                                qms: tuple[QueueManager, QueueManager]) -> None:
    """A session dropped without close (its scope's unit of work forgotten by the member, as when a service's client
    leaves and its backout could not reach the CF): two sweeps in a row find its DELIVERED UOW held by nothing."""
    snd, rcv = pair
    uow = sent_uow(snd, 1)
    rcv.receive(SVC, option=SYNC)
    scope = rcv.scope.uow
    assert scope is not None
    qms[1].complete(scope, False)  # its messages back on the queue; the control still says DELIVERED
    rcv.receiving = None
    sweeper = Sweeper(qms[1])
    assert sweeper.sweep()["orphans-settled"] == 0  # first sight: the holder may be settling it itself
    assert status(snd, uow) == "DELIVERED"
    assert sweeper.sweep()["orphans-settled"] == 1
    assert status(snd, uow) == "ACCEPTED"
    assert Conversation(qms[0], "h").receive(SVC, option=SYNC).deliveries == 1


# --- a commit whose outcome is not known ---------------------------------------------------------------------------
def _lose_the_next_reply(qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next completion is applied, and then its caller is told the outcome is unknown (a reply lost on the way)."""
    real = qm.complete

    def complete(uow: Any, commit: bool, **kw: Any) -> Any:
        monkeypatch.setattr(qm, "complete", real)
        real(uow, commit, **kw)
        raise OutcomeUnknownError("reply lost (test)")
    monkeypatch.setattr(qm, "complete", complete)


def test_after_a_commit_of_unknown_outcome_the_session_holds_nothing(
        pair: tuple[Conversation, Conversation], monkeypatch: pytest.MonkeyPatch) -> None:
    snd, _ = pair
    first = snd.send(SVC, b"a").uow
    _lose_the_next_reply(snd.qm, monkeypatch)
    with pytest.raises(OutcomeUnknownError):
        snd.commit()
    assert snd.last()["status"] == "ACCEPTED"  # LAST tells what happened
    second = snd.send(SVC, b"b").uow  # a new UOW: before, the session went on adding to the first
    assert second != first and snd.query(second)["messages"] == 1


def test_a_receive_whose_delivery_has_an_unknown_outcome_gives_the_uow_back(
        pair: tuple[Conversation, Conversation], monkeypatch: pytest.MonkeyPatch) -> None:
    snd, rcv = pair
    uow = sent_uow(snd, 1)
    _lose_the_next_reply(rcv.qm, monkeypatch)
    with pytest.raises(OutcomeUnknownError):
        rcv.receive(SVC, option=SYNC)
    assert rcv.receiving is None
    assert (status(snd, uow), snd.query(uow)["deliveries"]) == ("ACCEPTED", 1)  # not held by an idle session
    assert Conversation(snd.qm, "ivan").receive(SVC, option=SYNC).uow == uow


def test_a_receive_of_a_message_outside_a_uow_whose_commit_is_pending_delivers_it_with_the_error(
        pair: tuple[Conversation, Conversation], qms: tuple[QueueManager, QueueManager],
        monkeypatch: pytest.MonkeyPatch) -> None:
    snd, rcv = pair
    snd.send(SVC, b"plain", option=MSG)
    admin = Admin(qms[1].redis)
    real = QueueManager.apply

    def fails_first(self: QueueManager, uow: Any, commit: bool, *, for_member: str | None = None) -> None:
        monkeypatch.setattr(QueueManager, "apply", real)
        admin.set_state(S, "FAILED")  # between the get's forced COMMIT and its application
        real(self, uow, commit, for_member=for_member)

    monkeypatch.setattr(QueueManager, "apply", fails_first)
    with pytest.raises(OutcomePendingError) as told:
        rcv.receive(SVC, option=MSG)
    got = told.value.message
    assert (got.body, got.recv, got.uow) == (b"plain", "RECV_NONE", "")  # delivered: never consumed for nobody
    admin.set_state(S, "ACTIVE")
    qms[1].retry_pending()
    assert not qms[1].pending
    with pytest.raises(NoMessageError):
        rcv.receive(SVC, option=MSG)


def test_a_receive_of_a_message_outside_a_uow_whose_commit_outcome_is_unknown_delivers_it_with_the_error(
        pair: tuple[Conversation, Conversation], qms: tuple[QueueManager, QueueManager],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiving member's log fails as the get's COMMIT is written (its fdatasync answers EIO): the outcome is
    not known, and the message comes with the error in the receive's own form, never consumed for nobody."""
    snd, rcv = pair
    snd.send(SVC, b"plain", option=MSG)

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(log_writer, "_fdatasync", eio)
    with pytest.raises(OutcomeUnknownError) as told:
        rcv.receive(SVC, option=MSG)
    monkeypatch.undo()
    got = told.value.message
    assert (got.body, got.recv, got.uow) == (b"plain", "RECV_NONE", "")
    assert qms[1].log_failed
