"""What an application is told of a commit that is logged (its COMMIT forced) but that a structure could not take
then (failed, being restored, the CF unreachable): OutcomePendingError (MQRC_OUTCOME_PENDING, 2124), never
"committed", while the member keeps the commit pending and completes it when the structure is back. A get whose own
commit is so pending (outside syncpoint, or a batch with commit) delivers its messages all the same: taken and
logged, they are never consumed for nobody. A backout is acknowledged as before, and so is a coordinator's commit of
a prepared unit of work (a restore keeps it in doubt for its coordinator)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.errors import BackedOutError, NoMessageError, OutcomePendingError, OutcomeUnknownError
from sqm.core.connection import Message
from sqm.core.manager import QueueManager
from sqm.core.uow import UnitOfWork
from sqm.service import queue_ops
from sqm.service.client import Client
from sqm.service.protocol import (
    ENVELOPE,
    HEADER,
    decode_body,
    encode_frame,
    error_from_wire,
    error_reply,
    message_to_wire,
    ok_reply,
)
from sqm.service.rest import RestEndpoint

S = "APP1"


def fails_at_apply_now(qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> Admin:
    """From now on, the structure fails between the next outcome's force and its application (once)."""
    admin = Admin(qm.redis)
    real = QueueManager.apply

    def apply(self: QueueManager, uow: UnitOfWork, commit: bool, *, for_member: str | None = None) -> None:
        monkeypatch.setattr(QueueManager, "apply", real)
        admin.set_state(S, "FAILED")
        real(self, uow, commit, for_member=for_member)

    monkeypatch.setattr(QueueManager, "apply", apply)
    return admin


@pytest.fixture
def fails_at_apply(qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> Admin:
    return fails_at_apply_now(qm, monkeypatch)


def back(qm: QueueManager, admin: Admin) -> None:
    admin.set_state(S, "ACTIVE")
    assert qm.retry_pending() == 1 and not qm.pending


def available(qm: QueueManager) -> list[bytes]:
    return [m.body for m in qm.connect().browse("Q1")]


def test_a_commit_the_structure_cannot_take_is_pending_and_completes_when_it_is_back(
        qm: QueueManager, fails_at_apply: Admin) -> None:
    c = qm.connect()
    c.put("Q1", b"m")
    with pytest.raises(OutcomePendingError, match=r"^MQRC_OUTCOME_PENDING \(2124\): the commit of unit of work "):
        c.commit()
    assert len(qm.pending) == 1
    back(qm, fails_at_apply)
    assert available(qm) == [b"m"]


def test_a_put_outside_syncpoint_whose_commit_is_pending_says_so(qm: QueueManager, fails_at_apply: Admin) -> None:
    with pytest.raises(OutcomePendingError):
        qm.connect().put("Q1", b"alone", syncpoint=False)
    back(qm, fails_at_apply)
    assert available(qm) == [b"alone"]


def test_a_get_outside_syncpoint_whose_commit_is_pending_delivers_its_message(
        qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    qm.connect().put("Q1", b"taken", syncpoint=False)
    admin = fails_at_apply_now(qm, monkeypatch)
    gets = qm.counters["gets"]
    with pytest.raises(OutcomePendingError) as told:  # its get is not known done
        qm.connect().get("Q1", syncpoint=False)
    assert told.value.message.body == b"taken"  # delivered with the error: never consumed for nobody
    assert qm.counters["gets"] == gets + 1  # a message delivered: one get, counted once
    assert len(qm.pending) == 1
    back(qm, admin)
    with pytest.raises(NoMessageError):
        qm.connect().get("Q1", syncpoint=False)


def test_a_get_batch_whose_commit_is_pending_delivers_its_messages_with_the_error(
        qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    c = qm.connect()
    for body in (b"a", b"b"):
        c.put("Q1", body, syncpoint=False)
    admin = fails_at_apply_now(qm, monkeypatch)
    result = c.get_batch("Q1", 10, commit=True)
    assert [m.body for m in result.messages] == [b"a", b"b"] and not result.committed
    assert isinstance(result.error, OutcomePendingError)
    back(qm, admin)
    assert available(qm) == []


def test_a_backout_is_acknowledged_and_finished_when_the_structure_is_back(
        qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    c = qm.connect()
    c.put("Q1", b"backed out")
    admin = fails_at_apply_now(qm, monkeypatch)
    c.backout()  # no error: a backout is the outcome every recovery gives an unfinished unit of work
    back(qm, admin)
    assert available(qm) == []



def test_a_coordinator_s_commit_of_a_prepared_unit_of_work_is_acknowledged(
        qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    c = qm.connect()
    c.put("Q1", b"prepared")
    uow = c.prepare("xid-1")
    admin = fails_at_apply_now(qm, monkeypatch)
    qm.resolve(uow, True)  # the coordinator decided; a restore keeps the unit of work in doubt for it
    back(qm, admin)
    assert available(qm) == [b"prepared"]


def test_the_rest_door_delivers_a_message_whose_get_commit_is_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    """The REST DELETE's commit (RestEndpoint._commit_taken, called after the get): a pending one, or one whose
    outcome is not known (the log failed as its COMMIT was written), still sends the 200 with the message, as a get
    outside syncpoint delivers it; any other refusal is the request's error."""
    endpoint: Any = types.SimpleNamespace(server=None)
    # The caller is still there: its connection open (the commit is made only then).
    there: Any = types.SimpleNamespace(transport=types.SimpleNamespace(is_closing=lambda: False,
                                                                       get_protocol=lambda: None))

    def pending(*_: Any) -> None:
        raise OutcomePendingError("logged, pending")

    def unknown(*_: Any) -> None:
        raise OutcomeUnknownError("the log failed as the COMMIT was written")

    monkeypatch.setattr(queue_ops, "commit", pending)
    assert RestEndpoint._commit_taken(endpoint, None, there) == "pending"  # the reply says so (ibm-mq-outcome)
    monkeypatch.setattr(queue_ops, "commit", unknown)
    assert RestEndpoint._commit_taken(endpoint, None, there) == "unknown"
    monkeypatch.setattr(queue_ops, "commit", lambda *_: None)
    assert RestEndpoint._commit_taken(endpoint, None, there) == ""

    def backed_out(*_: Any) -> None:
        raise BackedOutError("backed out")

    monkeypatch.setattr(queue_ops, "commit", backed_out)
    with pytest.raises(BackedOutError):
        RestEndpoint._commit_taken(endpoint, None, there)


def test_a_pending_get_s_message_crosses_the_network_door_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's error reply carries the message a pending get delivered (encoded as a real frame), and the
    client's get raises OutcomePendingError with it as a Message: the application has both the message and the news
    that its get is not known done."""
    taken = Message(body=b"over the wire", queue="Q1", msgid=b"m" * 24, persistent=True)
    err = OutcomePendingError("the commit of unit of work u1 is logged, but APP1 could not take it now")
    err.message = taken
    frame = encode_frame(error_reply(7, err))
    reply = decode_body(frame[HEADER.size:])

    def call(self: Client, op: str, args: dict[str, Any], **_: Any) -> Any:
        assert op == "get" and args["syncpoint"] is False
        raise error_from_wire(reply["error"])

    monkeypatch.setattr(Client, "_call", call)
    client = Client.__new__(Client)
    with pytest.raises(OutcomePendingError, match=r"MQRC_OUTCOME_PENDING \(2124\)") as told:
        client.get("Q1", syncpoint=False)
    assert told.value.message == taken
    # The largest message a get takes still fits its reply with the error (the get is bounded to ENVELOPE and
    # MESSAGE_COST beside its data and descriptor), however long the error's text.
    err = OutcomePendingError("x" * 5000)
    err.message = Message(body=b"b" * 1000, queue="Q" * 48, msgid=b"m" * 24, correlid=b"c" * 24)
    plain = len(encode_frame(ok_reply(7, message_to_wire(err.message))))
    assert len(encode_frame(error_reply(7, err))) <= plain + ENVELOPE
    # An error that delivered nothing carries nothing.
    assert "delivered" not in error_reply(1, OutcomePendingError("a commit"))["error"]


def test_the_rest_door_commits_no_get_for_a_caller_that_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that hung up while its get's commit waited for a thread: nothing is committed (the handle's end
    backs the get out), so the message is never consumed for nobody."""
    committed: list[bool] = []
    monkeypatch.setattr(queue_ops, "commit", lambda *_: committed.append(True))
    gone: Any = types.SimpleNamespace(transport=None)
    assert RestEndpoint._commit_taken(types.SimpleNamespace(server=None), None, gone) is None
    assert committed == []
