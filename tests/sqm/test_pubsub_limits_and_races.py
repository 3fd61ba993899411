"""Publish and subscribe at their limits and in races, each a regression test (real redis-server, real logs, in-process
members; the service's owner binding on a real `sqm run` over real sockets): a subscriber beyond the 10,000th, or
one whose receiver commits while a sweep reads the subscriptions, loses nothing; two subscribes of one name racing
on two members deliver each publication once; a subscription belongs to the user that made it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.cf import TopicNext
from cfemu.connection import connect
from cfemu.errors import BadRequestError, NoMessageError, ResourceProblemError, UnknownObjectError
from sqm.conversations import uowcontrols as ctl
from sqm.core.manager import QueueManager
from sqm.pubsub import pubsub as ps
from sqm.pubsub.pubsub_sweeper import PubSubSweeper
from sqm.service.client import Client
from tests.support.group import two_members
from tests.support.service_proc import TOKEN, ServerProc, start_server

S, T = "APP1", "NEWS"


@pytest.fixture
def qms(redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, QueueManager]]:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    admin.define_queue(T, S, topic={})
    with two_members(redis_url, tmp_path / "logs") as pair:
        yield pair


def drain(session: ps.PubSubSession, topic: str, name: str, **owner: str) -> list[list[bytes]]:
    out = []
    while True:
        try:
            out.append(session.receive(topic, name, **owner).messages)
        except NoMessageError:
            return out


def put_many(qm: QueueManager, t: ps.Topic, names: list[str], position: tuple[int, str]) -> None:
    """Subscription entries as subscribe() and a receive's COMMIT make them, in one unit of work to save time (no
    roster entries: the sweeper must not depend on them for a subscription whose entry stays put)."""
    pc, home = ctl.pseudo_clock(qm, S), ps.incarnation(qm)
    c = qm.connect()
    for n in names:
        ps.put_subscription(c, t, ps.Subscription(T, n, True, position[0], position[1], pc, pc, home))
    c.commit()


def publish_n(qm: QueueManager, n: int) -> list[TopicNext]:
    t = ps.topic(qm, T)
    start = (ps.structure_clock(qm, t), ps.AFTER_ALL)
    for i in range(n):
        ps.publish(qm, T, [f"p{i}".encode()])
    pubs, pos = [], start
    for _ in range(n):
        nxt = ps.next_publication(qm, t, pos)
        pubs.append(nxt)
        pos = (nxt.lrsn, nxt.pub)
    return pubs


@pytest.mark.slow
def test_a_subscriber_beyond_the_10000th_loses_nothing_to_the_sweeper(
        qms: tuple[QueueManager, QueueManager]) -> None:
    """The sweeper takes its removal floor from every subscription, read in bounded batches: a floor taken from
    the first 10,000 only would let the 10,001st (the one that committed last: a slow one catching up) lose p2."""
    a, _ = qms
    t = ps.topic(a, T)
    start = (ps.structure_clock(a, t), ps.AFTER_ALL)
    names = [f"s{i:05d}" for i in range(10_000)]
    put_many(a, t, names, start)
    ps.subscribe(a, T, "slow")  # the 10,001st
    _, p2 = publish_n(a, 2)
    c = a.connect()  # 10,000 subscribers received and committed p1 and p2
    for n in names:
        ps.take_subscription(c, t, n)
    c.commit()
    put_many(a, t, names, (p2.lrsn, p2.pub))
    r = ps.PubSubSession(a)  # the slow one processes p1, and commits: its entry is now the newest
    assert r.receive(T, "slow").messages == [b"p0"]
    r.commit()
    done = PubSubSweeper(a).sweep_topic(t)
    assert done["publications-received"] == 1  # p1: every subscriber has it
    r = ps.PubSubSession(a)
    got = drain(r, T, "slow")
    r.commit()
    assert got == [[b"p1"]], "the 10,001st subscriber lost p2"
    assert len(ps.subscriptions(a, t, limit=20_000)) == 10_001


def test_a_sweep_while_the_slowest_subscriber_commits_removes_nothing_it_has_not_received(
        qms: tuple[QueueManager, QueueManager]) -> None:
    """A paged read of the subscription entries can miss one whose receiver commits meanwhile (its COMMIT replaces
    the entry: the old one goes from a part not yet read, the new one lands in a part already read); without the
    roster the floor came from the others and the slow subscriber lost what they had passed."""
    a, b = qms
    t = ps.topic(a, T)
    start = (ps.structure_clock(a, t), ps.AFTER_ALL)
    ps.subscribe(b, T, "slow")
    pubs = publish_n(a, 120)
    last = pubs[-1]
    put_many(a, t, [f"f{i:03d}" for i in range(300)], (last.lrsn, last.pub))  # the fast ones: all received
    assert start < (pubs[0].lrsn, pubs[0].pub)
    stop = threading.Event()
    sweeps = []

    def sweep() -> None:
        sweeper = PubSubSweeper(a, batch=10)  # many CF calls per read: commits land in the middle of it
        while not stop.is_set():
            sweeps.append(sweeper.sweep_topic(t))

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    got = []
    try:
        for _ in range(len(pubs)):
            r = ps.PubSubSession(b)
            try:
                got.append(r.receive(T, "slow", wait_ms=0).messages[0])
            except NoMessageError:
                break
            r.commit()
    finally:
        stop.set()
        sweeper.join()
    assert got == [f"p{i}".encode() for i in range(120)]
    assert len(sweeps) > 3 and sum(s["publications-received"] for s in sweeps) > 0  # it did remove, behind
    PubSubSweeper(a).sweep_topic(t)
    assert ps.next_publication(a, t, (0, "")).state == "N"  # all received by all: all removed


def test_two_subscribes_of_one_name_racing_on_two_members_deliver_once(
        qms: tuple[QueueManager, QueueManager]) -> None:
    """Subscribe peeks, then puts, so two at once on two members can both make an entry: raced entries are merged,
    and a publication is never delivered from both."""
    a, b = qms
    names = [f"u{k}" for k in range(30)]
    for name in names:
        gate = threading.Barrier(2)

        def sub(qm: QueueManager, n: str = name, g: threading.Barrier = gate) -> None:
            g.wait()
            ps.subscribe(qm, T, n)

        ts = [threading.Thread(target=sub, args=(qm,)) for qm in (a, b)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
    ps.publish(a, T, [b"once"])
    for name in names:
        got = []
        for qm in (a, b, a):
            r = ps.PubSubSession(qm)
            got += drain(r, T, name)
            r.commit()
        assert got == [[b"once"]], (name, got)
    t = ps.topic(a, T)
    assert all(len(ps.peek_entries(a, t, ps.subscription_id(T, n))) == 1 for n in names)


def test_raced_entries_are_merged_at_the_furthest_position_and_never_received_from_at_once(
        qms: tuple[QueueManager, QueueManager]) -> None:
    """The late entry of a raced subscribe (made after a session took the first one): a second session takes it,
    finds the first one held and receives nothing; once the first commits, the next receive merges both and goes on
    from the furthest position."""
    a, b = qms
    t = ps.topic(a, T)
    ps.subscribe(a, T, "dup")
    publish_n(a, 3)
    first = ps.PubSubSession(a)
    assert first.receive(T, "dup").messages == [b"p0"]
    late = ps.peek_subscription(a, t, "dup")
    assert late is not None
    put_many(b, t, ["dup"], late.position)  # the raced subscribe's entry, committed late
    second = ps.PubSubSession(b)
    with pytest.raises(ResourceProblemError, match="another entry held by another session"):
        second.receive(T, "dup")
    assert not second.held  # it held nothing else: what it took went back at once
    assert first.receive(T, "dup").messages == [b"p1"]
    first.commit()
    assert len(ps.peek_entries(a, t, ps.subscription_id(T, "dup"))) == 2
    third = ps.PubSubSession(b)
    assert drain(third, T, "dup") == [[b"p2"]]
    third.commit()
    entries = ps.peek_entries(a, t, ps.subscription_id(T, "dup"))
    assert len(entries) == 1 and ps.Subscription.unpack(entries[0][1]).received == 3


def test_a_subscription_is_its_owners_alone(qms: tuple[QueueManager, QueueManager]) -> None:
    """Through the API, the owner (user and token) is part of the subscription's identity: another user, the
    same user with another token and the anonymous owner can neither receive for it nor remove it."""
    a, b = qms
    ps.subscribe(a, T, "inbox", user="alice", token="t1")
    ps.subscribe(a, T, "inbox")  # the anonymous owner's "inbox": another subscription
    ps.publish(a, T, [b"hello"])
    for owner in ({"user": "bob", "token": "t1"}, {"user": "alice", "token": "t2"}):
        with pytest.raises(UnknownObjectError, match="no subscription inbox"):
            ps.PubSubSession(b).receive(T, "inbox", **owner)
        with pytest.raises(UnknownObjectError, match="no subscription inbox"):
            ps.unsubscribe(b, T, "inbox", **owner)
    r = ps.PubSubSession(b)
    assert drain(r, T, "inbox", user="alice", token="t1") == [[b"hello"]]
    r.commit()
    r = ps.PubSubSession(b)
    assert drain(r, T, "inbox") == [[b"hello"]]  # the anonymous one got it too, once
    r.commit()
    t = ps.topic(a, T)
    assert [s.name for s in ps.subscriptions(a, t, user="alice", token="t1")] == ["inbox"]
    assert ps.unsubscribe(b, T, "inbox", user="alice", token="t1").user == "alice"
    assert [(s.user, s.name) for s in ps.subscriptions(a, t)] == [("", "inbox")]


def _topic_and_operator_server(redis_url: str, tmp_path: Path) -> ServerProc:
    """Topic T defined, and a member QM1 serving it that takes the operator token "op-tok"."""
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    admin.define_queue(T, S, topic={})
    return start_server(redis_url, tmp_path, "QM1", "--token", TOKEN, env={"SQM_OPERATOR_TOKEN": "op-tok"})


def test_the_service_binds_a_subscription_to_the_logged_on_user(redis_url: str, tmp_path: Path) -> None:
    """Through the service, a subscription made after a logon belongs to that user and token: another
    logged-on user, a connection without a logon, and the same user with another token cannot receive for it,
    remove it or list it; an operator can remove it by naming its owner."""
    srv = _topic_and_operator_server(redis_url, tmp_path)
    try:
        with Client(srv.endpoint, token=TOKEN) as alice, Client(srv.endpoint, token=TOKEN) as bob, \
                Client(srv.endpoint, token=TOKEN) as anon, \
                Client(srv.endpoint, token="op-tok", role="operator") as op:
            alice.logon("alice", "secret")
            assert alice.subscribe(T, "inbox")["user"] == "alice"
            bob.logon("bob", "secret")
            anon.publish(T, b"for alice", commit=True)
            for c in (bob, anon):
                with pytest.raises(UnknownObjectError):
                    c.receive_pub(T, "inbox")
                with pytest.raises(UnknownObjectError):
                    c.unsubscribe(T, "inbox")
                assert c.subscriptions(T) == []
            bob.logon("alice", "guess")  # the right user id with the wrong token
            with pytest.raises(UnknownObjectError):
                bob.receive_pub(T, "inbox")
            assert alice.receive_pub(T, "inbox")["messages"] == [b"for alice"]
            alice.pub_commit()
            assert [s["name"] for s in alice.subscriptions(T)] == ["inbox"]
            assert [s["user"] for s in op.subscriptions(T)] == ["alice"]
            with pytest.raises(UnknownObjectError):
                op.unsubscribe(T, "inbox")  # the anonymous owner's: there is none
            assert op.unsubscribe(T, "inbox", user="alice", token="secret")["received"] == 1
            assert alice.subscriptions(T) == []
    finally:
        assert srv.stop() == 0, srv.log_text()


def test_an_operator_removes_a_subscription_by_its_id_without_its_owners_token(redis_url: str, tmp_path: Path) -> None:
    """A durable subscription whose owner is gone, or whose token no longer matches (the group's logon key was
    replaced), keeps every publication after its position until it expires: an operator removes it by the id the
    listing shows, without the owner's token; an application cannot name another's that way."""
    srv = _topic_and_operator_server(redis_url, tmp_path)
    try:
        with Client(srv.endpoint, token=TOKEN) as alice, Client(srv.endpoint, token=TOKEN) as bob, \
                Client(srv.endpoint, token="op-tok", role="operator") as op:
            alice.logon("alice", "forgotten")
            alice.subscribe(T, "inbox")
            bob.publish(T, b"kept for alice", commit=True)
            [listed] = op.subscriptions(T)
            assert listed["user"] == "alice" and "forgotten" not in str(listed)
            bob.logon("bob", "secret")
            with pytest.raises(BadRequestError, match="operator's connection only"):
                bob.unsubscribe(T, id=listed["id"])
            with pytest.raises(BadRequestError, match="hex digits"):
                op.unsubscribe(T, id="not hex")
            with pytest.raises(UnknownObjectError, match="no subscription with id"):  # its roster entry's id
                op.unsubscribe(T, id=ps.roster_id(bytes.fromhex(listed["id"])).hex())
            removed = op.unsubscribe(T, id=listed["id"])
            assert (removed["user"], removed["name"]) == ("alice", "inbox")
            assert op.subscriptions(T) == [] and alice.subscriptions(T) == []
            with pytest.raises(UnknownObjectError):
                op.unsubscribe(T, id=listed["id"])
    finally:
        assert srv.stop() == 0, srv.log_text()
