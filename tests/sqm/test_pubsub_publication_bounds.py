"""A publication's bounds, each a regression test against a real redis-server (the service's over real sockets of a
real `sqm run`): the sweeper's look at a large publication nobody has received yet costs the CF a head, not the
publication's data; a publication being published counts its bytes against the member's budget of bytes in flight
until COMMIT, BACKOUT or the end of its connection, and a message the budget has no room for is refused; a
publication larger than one receive_pub reply at the default frame is refused at publish, before anything of it is
committed, and one exactly at that size reaches a default Client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import BadRequestError, NoMessageError, ResourceProblemError, TruncatedMessageError
from cfemu.limits import MAX_MSG_LENGTH
from sqm.core.manager import QueueManager
from sqm.pubsub import pubsub as ps
from sqm.pubsub.publication_bounds import PUBLICATION_MESSAGE_COST, PUBLICATION_ROOM
from sqm.pubsub.pubsub_sweeper import PubSubSweeper
from sqm.service.client import Client
from sqm.service.protocol import ENVELOPE, MAX_FRAME, MESSAGE_COST
from tests.support.group import two_members
from tests.support.service_proc import TOKEN, start_server

S, T, BIG = "APP1", "NEWS", "BIGNEWS"
MIB = 2**20


@pytest.fixture
def qms(redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, QueueManager]]:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    admin.define_queue(T, S, topic={}, max_msg_length=4 * MIB)
    with two_members(redis_url, tmp_path / "logs") as pair:
        yield pair


def sent_by_cf(redis_url: str) -> int:
    return int(connect(redis_url).info("stats")["total_net_output_bytes"])


def test_a_sweep_reads_the_head_of_a_large_unreceived_publication_not_its_data(
        qms: tuple[QueueManager, QueueManager], redis_url: str) -> None:
    a, b = qms
    ps.subscribe(a, T, "slow")  # durable; never receives
    size = 12 * 2 * MIB
    ps.publish(a, T, [b"y" * (2 * MIB)] * 12)
    sweeper = PubSubSweeper(b)
    before = sent_by_cf(redis_url)
    for _ in range(3):
        assert sweeper.sweep() == {}  # not received, not expired: kept
    sent = sent_by_cf(redis_url) - before
    assert sent < size // 20, f"three sweeps made the CF send {sent} bytes for a {size}-byte publication"
    ps.unsubscribe(a, T, "slow")
    assert sweeper.sweep()["publications-received"] == 1  # what it found by its head, it removes whole
    assert ps.next_publication(a, ps.topic(a, T), (0, "")).state == "N"


def test_the_publication_room_is_what_a_default_reply_carries() -> None:
    """publication_bounds restates the service's frame arithmetic (it may not import it): they must agree."""
    assert PUBLICATION_ROOM == MAX_FRAME - ENVELOPE
    assert PUBLICATION_MESSAGE_COST == MESSAGE_COST


def test_a_publication_too_large_for_a_reply_is_refused_before_anything_commits(
        qms: tuple[QueueManager, QueueManager]) -> None:
    a, _ = qms
    t = ps.topic(a, T)
    ps.subscribe(a, T, "bob")
    position = ps.peek_subscription(a, t, "bob")
    body = b"z" * (4 * MIB)  # the topic's largest message; 25 of them, with their reply costs, fit one reply
    session = ps.PubSubSession(a)
    for _ in range(25):
        session.publish(T, body)
    with pytest.raises(BadRequestError, match="more than one receive_pub reply carries.*keeps its 25 messages"):
        session.publish(T, body, commit=True)  # refused before its commit
    assert session.draft is not None and len(session.draft.bodies) == 25
    assert ps.next_publication(a, t, (0, "")).state == "N"  # nothing of it committed
    session.backout()
    assert ps.peek_subscription(a, t, "bob") == position
    session.publish(T, body, commit=True)  # a later one goes through
    assert len(ps.PubSubSession(a).receive(T, "bob").messages) == 1


@pytest.mark.slow
def test_a_publication_exactly_at_the_room_of_a_reply_reaches_a_default_client(redis_url: str,
                                                                              tmp_path: Path) -> None:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    admin.define_queue(BIG, S, topic={}, max_msg_length=MAX_MSG_LENGTH)
    first = MAX_MSG_LENGTH  # the largest message, and a second one that fills the room to the byte
    second = PUBLICATION_ROOM - 2 * PUBLICATION_MESSAGE_COST - first
    srv = start_server(redis_url, tmp_path, "QM1", "--token", TOKEN)
    try:
        with Client(srv.endpoint, token=TOKEN) as pub, Client(srv.endpoint, token=TOKEN) as sub:
            sub.subscribe(BIG, "bob")
            pub.publish(BIG, b"a" * first)
            with pytest.raises(BadRequestError, match="more than one receive_pub reply carries"):
                pub.publish(BIG, b"b" * (second + 1))
            pub.publish(BIG, b"b" * second, commit=True)
            got = sub.receive_pub(BIG, "bob")
            assert [len(m) for m in got["messages"]] == [first, second]
            del got
            sub.pub_commit()
    finally:
        assert srv.stop() == 0, srv.log_text()


def in_flight(c: Client, expected: int) -> int:
    """The member's bytes in flight once they are ``expected`` (a large reply is counted until the member has
    sent it: a moment after its client has it), or after 10 s."""
    deadline = time.monotonic() + 10
    while (n := int(c.status()["request_bytes_in_flight"])) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_publications_being_published_count_against_the_members_budget(redis_url: str, tmp_path: Path) -> None:
    """Each message's bytes are reserved at publish and given back at COMMIT, BACKOUT and the end of the
    connection; a message the budget has no room for is refused with a one-line error, and its publication keeps
    the messages it had (nothing durable changes)."""
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    admin.define_queue(T, S, topic={}, max_msg_length=MIB)
    srv = start_server(redis_url, tmp_path, "QM1", "--token", TOKEN, "--max-frame", str(2 * MIB),
                       "--max-request-bytes-per-member", str(5 * MIB), "--request-budget-wait", "0.2",
                       env={"SQM_OPERATOR_TOKEN": "op-tok"})
    body = b"m" * MIB
    try:
        with Client(srv.endpoint, token=TOKEN) as first, Client(srv.endpoint, token=TOKEN) as second, \
                Client(srv.endpoint, token=TOKEN) as watcher, \
                Client(srv.endpoint, token="op-tok", role="operator") as op:
            watcher.subscribe(T, "all")
            for _ in range(3):
                first.publish(T, body)
            assert in_flight(op, 3 * MIB) == 3 * MIB
            second.publish(T, b"small")
            with pytest.raises(ResourceProblemError, match="no room for a message of 1048576 bytes") as e:
                second.publish(T, body)
            assert "\n" not in str(e.value) and "keeps its 1 messages" in str(e.value)
            assert in_flight(op, 3 * MIB + len(b"small")) == 3 * MIB + len(b"small")
            first.pub_backout()  # gives its bytes back
            assert in_flight(op, len(b"small")) == len(b"small")
            second.publish(T, body)
            assert second.pub_commit()["published"]
            assert in_flight(op, 0) == 0
            got = watcher.receive_pub(T, "all")  # the refused message left the publication as it was
            assert [len(m) for m in got["messages"]] == [len(b"small"), MIB]
            watcher.pub_commit()
            lost = Client(srv.endpoint, token=TOKEN)
            for _ in range(3):
                lost.publish(T, body)
            assert in_flight(op, 3 * MIB) == 3 * MIB
            lost.close()  # the connection ends: its publication dropped, its bytes given back
            assert in_flight(op, 0) == 0
            with pytest.raises(NoMessageError):
                watcher.receive_pub(T, "all")  # lost's never committed
    finally:
        assert srv.stop() == 0, srv.log_text()


def test_a_publication_a_reply_cannot_carry_is_not_received(redis_url: str, tmp_path: Path) -> None:
    """A receive_pub refused because the connection's replies cannot carry the publication takes nothing, as a get
    does: a COMMIT after it (of the session's other work) does not move the subscription past the publication, which
    a connection with room for it receives next."""
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    admin.define_queue(T, S, topic={}, max_msg_length=MIB)
    srv = start_server(redis_url, tmp_path, "QM1", "--token", TOKEN)
    try:
        with Client(srv.endpoint, token=TOKEN, max_frame=64 * 1024) as small, \
                Client(srv.endpoint, token=TOKEN) as big:
            small.subscribe(T, "x")
            small.subscribe(T, "y")
            big.publish(T, b"s", commit=True)
            big.publish(T, b"b" * (256 * 1024), commit=True)
            assert small.receive_pub(T, "x")["messages"] == [b"s"]
            with pytest.raises(TruncatedMessageError, match="does not fit"):
                small.receive_pub(T, "x")
            assert small.receive_pub(T, "y")["messages"] == [b"s"]
            small.pub_commit()  # what it received: x's small publication, y's
            got = big.receive_pub(T, "x")
            assert [len(m) for m in got["messages"]] == [256 * 1024]
            big.pub_commit()
            with pytest.raises(TruncatedMessageError, match="does not fit"):
                small.receive_pub(T, "y")  # holding nothing else, it gives the subscription back at once
            assert [len(m) for m in big.receive_pub(T, "y")["messages"]] == [256 * 1024]
            big.pub_commit()
    finally:
        assert srv.stop() == 0, srv.log_text()
