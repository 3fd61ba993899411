"""A receive that waits on a service whose backlog it may not take (docs/uow.md, "A waiting receive"), against a
real redis-server and real logs: UOWs of conversations bound to a receiver that has left wait for it until their
lifetime ends, and must cost another receiver's wait a bounded number of CF calls however many they are, while a UOW
that becomes receivable during the wait is still taken promptly, once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from cfemu.cf import Structure
from cfemu.errors import MQError, NoMessageError
from sqm.conversations import bindings, ops, receive_watch
from sqm.conversations.conversation import SYNC, Conversation, Received
from sqm.core.manager import QueueManager

SVC = "SVC"  # what the qms fixture (tests/sqm/conftest.py) defines
BOUND = 100  # conversations bound to a receiver that has left, one ACCEPTED UOW each
MAX_CALLS = 200  # CF calls one receive waiting 1 s may make (about 2,000 when every poll read every record)


def send_uow(snd: Conversation, body: bytes, conversation: str = "") -> tuple[str, str]:
    sent = snd.send(SVC, body, commit=True, conversation=conversation)
    return sent.uow, sent.conversation


@pytest.fixture
def left_backlog(qms: tuple[QueueManager, QueueManager]) -> Iterator[tuple[QueueManager, QueueManager]]:
    """BOUND conversations whose first UOW mallory received and committed (each bound to it for good), with a
    second UOW ACCEPTED in each; then mallory leaves."""
    alice, mallory = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[0], "mallory", "tok-m")
    convs = [send_uow(alice, b"first")[1] for _ in range(BOUND)]
    for _ in convs:
        mallory.receive(SVC, option=SYNC, convid="NEW")
        mallory.commit()
    for conv in convs:
        send_uow(alice, b"second", conv)
    mallory.close()
    yield qms


@dataclass
class _Server:
    """What ops.receive reads of the service it runs in."""
    qm: QueueManager
    max_wait_ms: int = 60_000
    stopping: bool = False

    def quiescing(self, op: str) -> MQError:
        return MQError(f"{op}: stopping")


@dataclass
class _Session:
    """What ops.receive reads of the connection's session."""
    conversation: Conversation
    reply_limit: int = 1 << 20
    gone: threading.Event = field(default_factory=threading.Event)

    def reply_room(self) -> int:
        return self.reply_limit


def through_the_service(qm: QueueManager, conv: Conversation, **args: Any) -> dict[str, Any]:
    """The service's receive operation (sqm.conversations.ops.receive: the loop that polls while the request
    waits)."""
    return ops.receive(_Server(qm), _Session(conv), {"service": SVC, **args})  # type: ignore[arg-type]


def cf_calls_of(qm: QueueManager, wait: Any) -> int:
    before = qm.cf.calls  # type: ignore[attr-defined]  # the member's CFGroup counts every CF call it makes
    with pytest.raises(NoMessageError):
        wait()
    return int(qm.cf.calls) - before  # type: ignore[attr-defined]


def test_a_waiting_receive_does_not_read_a_backlog_bound_to_a_receiver_that_left_at_every_poll(
        left_backlog: tuple[QueueManager, QueueManager]) -> None:
    qm = left_backlog[1]
    carol = Conversation(qm, "carol", "tok-c")
    calls = cf_calls_of(qm, lambda: carol.receive(SVC, option=SYNC, wait_ms=1000))
    served = cf_calls_of(qm, lambda: through_the_service(qm, carol, option="SYNC", wait_ms=1000))
    assert calls < MAX_CALLS and served < MAX_CALLS, (calls, served)


def test_a_waiting_receive_looks_at_the_backlog_again_only_when_the_control_queue_changed_or_once_a_second(
        left_backlog: tuple[QueueManager, QueueManager], monkeypatch: pytest.MonkeyPatch) -> None:
    """A look reads the whole backlog on the CF, however few calls it makes: a 2 s wait on a quiet service makes the
    first look and one a second after it, not one every poll (about 40)."""
    looks: list[float] = []
    real = bindings.take_next

    def counted(*args: Any, **kw: Any) -> Any:
        looks.append(time.monotonic())
        return real(*args, **kw)

    monkeypatch.setattr(bindings, "take_next", counted)
    carol = Conversation(left_backlog[1], "carol", "tok-c")
    with pytest.raises(NoMessageError):
        through_the_service(left_backlog[1], carol, option="SYNC", wait_ms=2000)
    assert 2 <= len(looks) <= 2 / receive_watch.RECHECK_S + 1, looks


def test_a_uow_sent_during_the_wait_is_taken_promptly(left_backlog: tuple[QueueManager, QueueManager]) -> None:
    """Past the first second of the wait (the looks at the backlog are about a second apart by then): a new
    conversation's UOW committed by another member is taken within a few polls."""
    alice, carol = Conversation(left_backlog[0], "alice", "tok-a"), Conversation(left_backlog[1], "carol", "tok-c")
    got: list[tuple[dict[str, Any], float]] = []
    waiter = threading.Thread(target=lambda: got.append(
        (through_the_service(left_backlog[1], carol, option="SYNC", wait_ms=10_000), time.monotonic())))
    waiter.start()
    time.sleep(2.5)
    uow, _ = send_uow(alice, b"new")
    sent = time.monotonic()
    waiter.join(10)
    assert got and got[0][0]["uow"] == uow
    assert got[0][1] - sent < 0.4, f"taken {got[0][1] - sent:.3f} s after its commit"
    carol.commit()


def test_an_old_conversations_next_uow_is_taken_promptly_when_another_session_settles_the_last(
        qms: tuple[QueueManager, QueueManager]) -> None:
    """A commit that makes no UOW ACCEPTED (DELIVERED -> PROCESSED) still ends the wait of the bound receiver's
    other session for the conversation's next UOW."""
    alice = Conversation(qms[0], "alice", "tok-a")
    one, two = Conversation(qms[0], "server", "i1"), Conversation(qms[1], "server", "i1")
    _, conv = send_uow(alice, b"a")
    uow_b, _ = send_uow(alice, b"b", conv)
    assert one.receive(SVC, option=SYNC).body == b"a"
    got: list[tuple[Received, float]] = []
    waiter = threading.Thread(target=lambda: got.append(
        (two.receive(SVC, option=SYNC, convid="OLD", wait_ms=10_000), time.monotonic())))
    waiter.start()
    time.sleep(2.5)
    one.commit()
    settled = time.monotonic()
    waiter.join(10)
    assert got and got[0][0].uow == uow_b
    assert got[0][1] - settled < 0.4, f"taken {got[0][1] - settled:.3f} s after the last was settled"
    two.commit()


def test_a_change_the_mark_does_not_show_is_found_by_the_timer(qms: tuple[QueueManager, QueueManager],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Structure, "queue_mark", lambda self, queue: "never changes")
    alice, carol = Conversation(qms[0], "alice", "tok-a"), Conversation(qms[1], "carol", "tok-c")
    got: list[tuple[Received, float]] = []
    waiter = threading.Thread(target=lambda: got.append(
        (carol.receive(SVC, option=SYNC, wait_ms=10_000), time.monotonic())))
    waiter.start()
    time.sleep(2.5)
    uow, _ = send_uow(alice, b"unseen by the mark")
    sent = time.monotonic()
    waiter.join(10)
    assert got and got[0][0].uow == uow
    assert got[0][1] - sent < receive_watch.RECHECK_S + 0.4
    carol.commit()


def test_waiting_receivers_take_every_uow_sent_during_their_waits_once(
        qms: tuple[QueueManager, QueueManager]) -> None:
    alice = Conversation(qms[0], "alice", "tok-a")
    receivers = [Conversation(qms[i % 2], f"r{i}", f"tok-{i}") for i in range(4)]
    taken: list[bytes] = []
    lock = threading.Lock()

    def serve(conv: Conversation) -> None:
        while True:
            try:
                got = conv.receive(SVC, option=SYNC, wait_ms=1500)
            except NoMessageError:
                return
            conv.commit()
            with lock:
                taken.append(got.body)

    threads = [threading.Thread(target=serve, args=(r,)) for r in receivers]
    for t in threads:
        t.start()
    sent = []
    for i in range(30):
        body = b"uow-%d" % i
        send_uow(alice, body)
        sent.append(body)
        time.sleep(0.02)
    for t in threads:
        t.join(30)
    assert sorted(taken) == sorted(sent)
