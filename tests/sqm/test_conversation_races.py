"""Races on one conversation's record, against a real redis-server and real logs (docs/uow.md, "Conversations"): two
first sends on one conversation id, EOC racing a send, and the sweeper racing a sender that holds a UOW open must
leave one record, so that the conversation stays with one server instance."""

from __future__ import annotations

import threading

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import NoMessageError, UowStatusError
from sqm.conversations import bindings
from sqm.conversations import uowcontrols as ctl
from sqm.conversations.conversation import SYNC, Conversation
from sqm.conversations.convrecord import ConvRecord, idle, idle_unless_held_open, record_id
from sqm.conversations.uowsweeper import Sweeper
from sqm.core.manager import QueueManager

S, SVC = "APP1", "SVC"  # what the qms fixture (tests/sqm/conftest.py) defines


def records(qm: QueueManager, conversation: str) -> list[ConvRecord]:
    svc = ctl.service(qm, SVC)
    found = qm.structure(svc.structure).peek(svc.control, "m", record_id(conversation).hex(), 10)
    return [ConvRecord.unpack(data) for _, data in found]


def test_two_first_sends_racing_on_one_conversation_id_make_one_record(
        qms: tuple[QueueManager, QueueManager], monkeypatch: pytest.MonkeyPatch) -> None:
    both_looked = threading.Barrier(2, timeout=30)
    real_take = bindings.take

    def take_then_meet(conn: object, svc: ctl.Service, conversation: str, **kw: object) -> ConvRecord | None:
        rec = real_take(conn, svc, conversation, **kw)  # type: ignore[arg-type]
        if conversation == "shared" and rec is None and not both_looked.broken:
            both_looked.wait()  # each sender has looked for the record before either puts one
        return rec

    monkeypatch.setattr(bindings, "take", take_then_meet)
    sent: list[str] = []

    def send(qm: QueueManager, body: bytes) -> None:
        sent.append(Conversation(qm, "alice", "tok-a").send(SVC, body, commit=True, conversation="shared").uow)

    threads = [threading.Thread(target=send, args=(qm, body)) for qm, body in zip(qms, (b"T1", b"T2"), strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(sent) == 2
    monkeypatch.setattr(bindings, "take", real_take)
    x, y = Conversation(qms[0], "server", "instance-1"), Conversation(qms[1], "server", "instance-2")
    x.receive(SVC, option=SYNC, convid="NEW")  # the conversation is x's, one UOW at a time
    with pytest.raises(NoMessageError):
        y.receive(SVC, option=SYNC, convid="NEW")  # its other UOW is neither new nor y's
    x.commit()
    assert len(records(qms[0], "shared")) == 1


def test_eoc_racing_a_send_on_the_conversation_lets_one_of_them_win(qms: tuple[QueueManager, QueueManager]) -> None:
    """The EOC and a new UOW's creation serialize on the record: the new UOW was made before the EOC (it is part of
    the conversation, and may still be committed), or it is refused; never a UOW made after the EOC."""
    alice1, alice2 = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[1], "alice", "tok-a")
    conv = alice1.send(SVC, b"T1", commit=True).conversation
    alice1.send(SVC, b"last", conversation=conv)
    outcome: dict[str, object] = {}
    go = threading.Barrier(2, timeout=30)

    def end() -> None:
        go.wait()
        outcome["eoc"] = alice1.syncpoint("EOC")["status"]

    def more() -> None:
        go.wait()
        try:
            outcome["send"] = alice2.send(SVC, b"racer", conversation=conv).uow
        except UowStatusError as e:
            outcome["send"] = e

    threads = [threading.Thread(target=end), threading.Thread(target=more)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcome["eoc"] == "ACCEPTED"
    [rec] = records(qms[0], conv)
    assert rec.eoc == "EOC"
    if isinstance(outcome["send"], UowStatusError):
        assert "ended by EOC" in str(outcome["send"])
        assert rec.active == 2  # T1 and the last one
    else:
        assert rec.active == 3  # made before the EOC: it counts
        alice2.backout()
        [rec] = records(qms[0], conv)
        assert rec.active == 2  # backed out: counted off
    with pytest.raises(UowStatusError, match="ended by EOC"):
        alice2.send(SVC, b"after", conversation=conv)


def test_a_bound_conversation_whose_sender_holds_a_uow_open_past_its_lifetime_stays_bound(
        qms: tuple[QueueManager, QueueManager]) -> None:
    admin = Admin(connect(qms[0].config.redis_url))
    admin.define_queue("SHORT", S, uow={"lifetime_s": 1, "conv_nonact_s": 3600})
    alice = Conversation(qms[0], "alice", "tok-a")
    x, y = Conversation(qms[1], "server", "instance-1"), Conversation(qms[0], "server", "instance-2")
    conv = alice.send("SHORT", b"T1", commit=True).conversation
    x.receive("SHORT", option=SYNC, convid="NEW")
    x.commit()  # bound to x for good
    alice.send("SHORT", b"T2", conversation=conv)  # held open by its sender
    sweeper, svc = Sweeper(qms[1]), ctl.service(qms[0], "SHORT")
    start = ctl.pseudo_clock(qms[0], svc.structure)
    while ctl.pseudo_clock(qms[0], svc.structure) < start + 3000:  # past the lifetime of both on the pseudo-clock
        sweeper.sweep()
        threading.Event().wait(0.2)
    sweeper.sweep()
    alice.commit()
    with pytest.raises(NoMessageError):
        y.receive("SHORT", option=SYNC, convid="NEW")  # T2 is x's conversation's


def test_no_uow_of_a_conversation_is_delivered_after_its_eoc(qms: tuple[QueueManager, QueueManager]) -> None:
    alice1, alice2 = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[1], "alice", "tok-a")
    x = Conversation(qms[1], "server", "instance-1")
    conv = alice1.send(SVC, b"T1", commit=True).conversation
    alice2.send(SVC, b"opened before the end", conversation=conv)
    alice1.send(SVC, b"the end", conversation=conv, eoc="EOC")
    try:
        alice2.commit()
    except UowStatusError:
        alice2.backout()  # refused: the conversation was ended
    seen = []
    for _ in range(3):
        try:
            got = x.receive(SVC, option=SYNC, convid="ANY")
        except NoMessageError:
            break
        x.commit()
        seen.append(got.eoc)
    assert seen[-1] == "EOC", seen  # the UOW that ended it is the last one delivered


def test_uows_of_conversations_bound_elsewhere_do_not_hide_a_new_conversation(
        qms: tuple[QueueManager, QueueManager], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bindings, "FIRST_LOOK", 2)  # the window, made small: 1000 UOWs in the product
    monkeypatch.setattr(ctl, "PEEK_LIMIT", 4)
    alice = Conversation(qms[0], "alice", "tok-a")
    x, y = Conversation(qms[1], "server", "instance-5"), Conversation(qms[0], "server", "instance-1")
    conv = alice.send(SVC, b"first", commit=True).conversation
    x.receive(SVC, option=SYNC, convid="NEW")
    x.commit()  # the conversation is instance 5's, which then goes away
    for i in range(5):
        alice.send(SVC, b"for instance 5 #%d" % i, commit=True, conversation=conv)
    alice.send(SVC, b"a new conversation", commit=True)
    assert y.receive(SVC, option=SYNC, convid="NEW").body == b"a new conversation"


def test_a_new_conversation_found_past_the_first_window_is_taken_from_its_first_uow(
        qms: tuple[QueueManager, QueueManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """The widened window is one snapshot in get order: a conversation whose UOWs all lie past the first windows is
    still received from its first UOW, one at a time."""
    monkeypatch.setattr(bindings, "FIRST_LOOK", 2)
    monkeypatch.setattr(ctl, "PEEK_LIMIT", 4)
    alice, bob = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[0], "bob", "tok-b")
    x, y = Conversation(qms[1], "server", "instance-5"), Conversation(qms[0], "server", "instance-1")
    conv = alice.send(SVC, b"first", commit=True).conversation
    x.receive(SVC, option=SYNC, convid="NEW")
    x.commit()
    for i in range(5):
        alice.send(SVC, b"for instance 5 #%d" % i, commit=True, conversation=conv)
    late = bob.send(SVC, b"late 1", commit=True).conversation
    bob.send(SVC, b"late 2", commit=True, conversation=late)
    assert y.receive(SVC, option=SYNC, convid="NEW").body == b"late 1"
    with pytest.raises(NoMessageError):
        Conversation(qms[1], "server", "instance-2").receive(SVC, option=SYNC, convid="NEW")  # late 2 waits for y
    y.commit()
    assert y.receive(SVC, option=SYNC, convid="OLD").body == b"late 2"
    y.commit()


def test_a_record_idle_past_the_lifetime_of_its_uows_ends_unless_its_sender_holds_one_open() -> None:
    rec = ConvRecord("c", SVC, active=2, changed_pc=0, nonact_ms=10_000, lifetime_ms=1_000)
    assert idle(rec, 1_000)  # a count a CF loss left high does not keep it
    assert not idle(rec, 1_000, held_open=True)
    assert idle_unless_held_open(rec, 1_000)
    assert not idle(rec, 999)
    unheld = ConvRecord("c", SVC, active=0, changed_pc=0, nonact_ms=500, lifetime_ms=1_000)
    assert idle(unheld, 600, held_open=True)  # no active UOW: CONV-NONACT ends it
    assert not idle_unless_held_open(unheld, 600)


def test_a_first_send_that_finds_the_conversation_being_begun_past_its_wait_is_refused_and_changes_nothing(
        qms: tuple[QueueManager, QueueManager], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctl, "HELD_WAIT_S", 0.3)
    svc = ctl.service(qms[0], SVC)
    assert qms[0].admin.try_conversation_lock(svc.structure, SVC, record_id("shared").hex(), "another-send", 60_000)
    alice = Conversation(qms[0], "alice", "tok-a")
    with pytest.raises(UowStatusError, match="conversation shared of service SVC is being begun by another send"):
        alice.send(SVC, b"T1", commit=True, conversation="shared")
    assert records(qms[0], "shared") == []
    assert ctl.peek_status(qms[0], svc, "RECEIVED") == []
    assert qms[0].admin.release_conversation_lock(svc.structure, SVC, record_id("shared").hex(), "another-send")
    alice.send(SVC, b"T1", commit=True, conversation="shared")  # the other send is over: this one begins it
    assert len(records(qms[0], "shared")) == 1
