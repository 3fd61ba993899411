"""Conversations bound to the server instance that received them (seed 003: "Sequencing of Messages across
Conversations", "Behavior of Conversation at Broker Restart", "UOWs and Replicated Servers"; docs/uow.md,
"Conversations"), against a real redis-server and real logs: RECEIVE by CONVID NEW, OLD, ANY and by id, the binding
by user id and token, EOC and EOCCANCEL ending a conversation, racing receivers, and a conversation that ends idle.
Member kills and restarts: tests/sqm/test_conversation_restart.py."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import BadRequestError, EndOfUowError, NoMessageError, UowStatusError
from sqm.conversations import bindings
from sqm.conversations import uowcontrols as ctl
from sqm.conversations.conversation import SYNC, Conversation
from sqm.conversations.convrecord import ConvRecord, after_restart
from sqm.conversations.uowstatus import restore_control_entry
from sqm.conversations.uowsweeper import Sweeper
from sqm.core.manager import QueueManager

S, SVC = "APP1", "SVC"  # what the qms fixture (tests/sqm/conftest.py) defines


def send_uow(snd: Conversation, body: bytes, conversation: str = "", **kw: object) -> tuple[str, str]:
    sent = snd.send(SVC, body, commit=True, conversation=conversation, **kw)  # type: ignore[arg-type]
    return sent.uow, sent.conversation


def take(rcv: Conversation, convid: str) -> bytes:
    """Receive one single-message UOW by CONVID and commit it; its body."""
    got = rcv.receive(SVC, option=SYNC, convid=convid)
    rcv.commit()
    return got.body


def test_the_seeds_scenario_new_takes_the_next_conversation_and_old_its_own_uows(
        qms: tuple[QueueManager, QueueManager]) -> None:
    """T1 and T2 in one conversation, T3 in another, committed in that order: CONVID=NEW gives T1 then T3; T2 is the
    bound server's, by OLD (or its id); another instance of the server never gets it."""
    snd = Conversation(qms[0], "alice", "tok-a")
    x = Conversation(qms[1], "server", "instance-1")
    y = Conversation(qms[0], "server", "instance-2")  # a replica: same user id, another token
    _, c1 = send_uow(snd, b"T1")
    send_uow(snd, b"T2", c1)
    send_uow(snd, b"T3")
    assert take(x, "NEW") == b"T1"
    assert take(x, "NEW") == b"T3"
    with pytest.raises(NoMessageError):
        x.receive(SVC, option=SYNC, convid="NEW")  # T2 belongs to a conversation this server has
    with pytest.raises(NoMessageError):
        y.receive(SVC, option=SYNC, convid="ANY")  # nor to the other instance
    assert take(x, "OLD") == b"T2"
    uow, _ = send_uow(snd, b"T4", c1)  # a later UOW of the conversation: the bound instance's only
    with pytest.raises(NoMessageError):
        y.receive(SVC, option=SYNC)  # CONVID=ANY by default
    got = x.receive(SVC, option=SYNC, convid=c1)
    assert (got.uow, got.conversation) == (uow, c1)
    x.commit()


def test_any_takes_old_conversations_first_then_new_ones(qms: tuple[QueueManager, QueueManager]) -> None:
    snd, x = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[1], "server", "i1")
    _, c1 = send_uow(snd, b"c1-first")
    assert take(x, "ANY") == b"c1-first"
    send_uow(snd, b"new-conversation")  # committed first
    send_uow(snd, b"c1-second", c1)
    assert take(x, "ANY") == b"c1-second"  # old before new, whatever the commit order
    assert take(x, "ANY") == b"new-conversation"


def test_a_conversation_is_delivered_one_uow_at_a_time_in_commit_order(
        qms: tuple[QueueManager, QueueManager]) -> None:
    snd, x = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[1], "server", "i1")
    x2 = Conversation(qms[0], "server", "i1")  # a second session of the same instance
    _, c1 = send_uow(snd, b"a")
    send_uow(snd, b"b", c1)
    assert x.receive(SVC, option=SYNC).body == b"a"
    with pytest.raises(NoMessageError):
        x2.receive(SVC, option=SYNC)  # b waits until a is settled
    x.commit()
    assert take(x2, "OLD") == b"b"


def test_a_first_uow_given_back_unsettled_makes_the_conversation_new_again(
        qms: tuple[QueueManager, QueueManager]) -> None:
    snd = Conversation(qms[0], "alice", "tok-a")
    x, y = Conversation(qms[1], "server", "i1"), Conversation(qms[0], "server", "i2")
    _, c1 = send_uow(snd, b"first")
    x.receive(SVC, option=SYNC)
    x.backout()  # never settled: not acquired
    assert take(y, "NEW") == b"first"  # y settles it: the conversation is y's now
    send_uow(snd, b"second", c1)
    with pytest.raises(NoMessageError):
        x.receive(SVC, option=SYNC)
    y.receive(SVC, option=SYNC, convid="OLD")
    y.backout()  # a later UOW given back: the binding stays
    with pytest.raises(NoMessageError):
        x.receive(SVC, option=SYNC)
    assert take(y, "OLD") == b"second"


@pytest.mark.parametrize("eoc", ["EOC", "EOCCANCEL"])
def test_eoc_and_eoccancel_end_the_conversation(qms: tuple[QueueManager, QueueManager], eoc: str) -> None:
    snd, x = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[1], "server", "i1")
    _, c1 = send_uow(snd, b"one")
    snd.send(SVC, b"last", conversation=c1)
    assert snd.syncpoint(eoc)["status"] == "ACCEPTED"
    with pytest.raises(UowStatusError, match=f"conversation {c1} of service SVC was ended by {eoc}"):
        snd.send(SVC, b"after the end", conversation=c1)
    assert take(x, "NEW") == b"one"
    got = x.receive(SVC, option=SYNC, convid="OLD")
    assert (got.body, got.eoc) == (b"last", eoc)  # the receiver sees how it ended
    x.commit()
    with pytest.raises(UowStatusError, match="was ended"):
        snd.send(SVC, b"still ended", conversation=c1, commit=True)
    uow, c2 = send_uow(snd, b"a new one")  # no conversation id: a new conversation
    assert c2 != c1 and snd.query(uow)["status"] == "ACCEPTED"


def test_a_send_with_eoc_ends_it_too(qms: tuple[QueueManager, QueueManager]) -> None:
    snd = Conversation(qms[0], "alice", "tok-a")
    sent = snd.send(SVC, b"only", eoc="EOC")
    with pytest.raises(UowStatusError, match="ended by EOC"):
        snd.send(SVC, b"more", conversation=sent.conversation)


def test_racing_receivers_keep_each_conversation_on_one_instance_in_order(
        qms: tuple[QueueManager, QueueManager]) -> None:
    """Four instances on two members receive ANY at once from 6 conversations of 4 UOWs each: every UOW once, every
    conversation's UOWs by one instance, in the order they were sent."""
    snd = Conversation(qms[0], "alice", "tok-a")
    convs = [send_uow(snd, b"%d-0" % i)[1] for i in range(6)]
    for n in range(1, 4):
        for i, c in enumerate(convs):
            send_uow(snd, b"%d-%d" % (i, n), c)
    got: dict[str, list[bytes]] = defaultdict(list)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def instance(k: int) -> None:
        conv = Conversation(qms[k % 2], "server", f"i{k}")
        idle_until = time.monotonic() + 5.0
        try:
            while time.monotonic() < idle_until:
                try:
                    m = conv.receive(SVC, option=SYNC, wait_ms=200)
                except NoMessageError:
                    continue
                conv.commit()
                with lock:
                    got[f"i{k}"].append(m.body)
                idle_until = time.monotonic() + 3.0
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            conv.close()
    threads = [threading.Thread(target=instance, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    everything = sorted(b for bodies in got.values() for b in bodies)
    assert everything == sorted(b"%d-%d" % (i, n) for i in range(6) for n in range(4))
    for i in range(6):
        owners = [k for k, bodies in got.items() if any(b.startswith(b"%d-" % i) for b in bodies)]
        assert len(owners) == 1, (i, owners)
        assert [b for b in got[owners[0]] if b.startswith(b"%d-" % i)] == [b"%d-%d" % (i, n) for n in range(4)]


def test_a_conversation_with_no_active_uow_ends_after_conv_nonact(qms: tuple[QueueManager, QueueManager]) -> None:
    admin = Admin(connect(qms[0].config.redis_url))
    admin.define_queue("IDLE", S, uow={"conv_nonact_s": 1})
    idle_svc = ctl.service(qms[0], "IDLE")
    snd = Conversation(qms[0], "alice", "tok-a")
    x, y = Conversation(qms[1], "server", "i1"), Conversation(qms[0], "server", "i2")
    snd.send("IDLE", b"done", conversation="job-7", eoc="EOC")
    snd.send("IDLE", b"waiting", conversation="job-8", commit=True)  # never received: active
    assert x.receive("IDLE", option=SYNC, convid="job-7").body == b"done"
    x.commit()
    with pytest.raises(UowStatusError, match="ended by EOC"):
        snd.send("IDLE", b"too soon", conversation="job-7")
    sweeper = Sweeper(qms[1])
    deadline = time.monotonic() + 30
    while sweeper.counts["conversations-ended"] == 0:
        assert time.monotonic() < deadline, "the idle conversation never ended"
        sweeper.sweep()
        time.sleep(0.2)
    assert bindings.peek(qms[0], idle_svc, "job-7") == (None, False)
    kept, _ = bindings.peek(qms[0], idle_svc, "job-8")
    assert kept is not None and kept.active == 1  # a UOW of it waits: it goes on
    snd.send("IDLE", b"again", conversation="job-7", commit=True)  # its id begins a new conversation
    got = y.receive("IDLE", option=SYNC, convid="NEW")  # new to every instance: job-8's first, then job-7's
    y.commit()
    again = y.receive("IDLE", option=SYNC, convid="NEW")
    y.commit()
    assert {got.body, again.body} == {b"waiting", b"again"}


def test_a_receive_by_a_conversation_id_takes_only_that_one(qms: tuple[QueueManager, QueueManager]) -> None:
    snd, x = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[1], "server", "i1")
    send_uow(snd, b"other")
    _, c1 = send_uow(snd, b"wanted")
    assert take(x, c1) == b"wanted"
    with pytest.raises(NoMessageError):
        x.receive(SVC, option=SYNC, convid=c1)
    assert x.receive(SVC, option=SYNC).body == b"other"  # CONVID=ANY: the other, new conversation
    with pytest.raises(EndOfUowError):
        x.receive(SVC, option=SYNC)
    x.commit()
    for bad in ("", "x" * 65, "bad\nid"):
        with pytest.raises(BadRequestError, match="CONVID must be NEW, OLD, ANY or a conversation id"):
            x.receive(SVC, option=SYNC, convid=bad)


def test_the_restart_rule_of_a_record_and_the_restore_fold() -> None:
    tentative = ConvRecord("c", SVC, receiver="server", receiver_token="k1:x", first="u1", delivering="u1")
    firm = ConvRecord("c", SVC, receiver="server", receiver_token="k1:x", first="u1", firm=True, delivering="u2")
    assert after_restart(tentative) == ConvRecord("c", SVC)
    assert after_restart(firm) == ConvRecord("c", SVC, receiver="server", receiver_token="k1:x", first="u1",
                                             firm=True)
    entry = {"cid": b"V".hex(), "mid": "00"}
    assert restore_control_entry(entry, tentative.pack()) == (entry, ConvRecord("c", SVC).pack())


def test_a_receive_looks_past_the_first_controls_when_none_of_them_is_its_own(
        qms: tuple[QueueManager, QueueManager], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bindings, "FIRST_LOOK", 2)
    snd = Conversation(qms[0], "alice", "tok-a")
    x, y = Conversation(qms[1], "server", "i1"), Conversation(qms[0], "server", "i2")
    _, c1 = send_uow(snd, b"x-0")
    assert take(x, "NEW") == b"x-0"
    for i in range(1, 4):
        send_uow(snd, b"x-%d" % i, c1)  # three of x's ahead of the new one
    send_uow(snd, b"new")
    assert take(y, "ANY") == b"new"
