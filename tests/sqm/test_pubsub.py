"""Publish and subscribe (sqm.pubsub.pubsub, sqm.pubsub.pubsub_sweeper) against a real redis-server and real logs, two members:
publications received whole, in commit order, once per subscription; invisible until commit; backout redelivers;
one receiver per subscription; removal when every subscriber has passed and when the lifetime passes; expiry of
idle subscriptions; storage counted once. Member kills, CF loss: tests/sqm/test_pubsub_failures.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu.admin import Admin, AdminError
from cfemu.connection import connect
from cfemu.errors import BadRequestError, NoMessageError, ResourceProblemError, UnknownObjectError
from sqm.core.manager import QueueManager
from sqm.core.pclock import pseudo_clock
from sqm.pubsub import pubsub as ps
from sqm.pubsub.pubsub_sweeper import PubSubSweeper
from tests.support.group import start_qm, two_members

S, T, SHORT, NONDUR = "APP1", "NEWS", "FLASH", "CHAT"


@pytest.fixture
def qms(redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, QueueManager]]:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    admin.define_queue(T, S, topic={})
    admin.define_queue(SHORT, S, topic={"lifetime_s": 1, "subscription_expiration_s": 3})
    admin.define_queue(NONDUR, S, topic={"durable": False, "persistent": False})
    with two_members(redis_url, tmp_path / "logs") as pair:
        yield pair


def drain(session: ps.PubSubSession, topic: str, name: str) -> list[list[bytes]]:
    out = []
    while True:
        try:
            out.append(session.receive(topic, name).messages)
        except NoMessageError:
            return out


def test_definition_refusals(redis_url: str) -> None:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    with pytest.raises(AdminError, match="lifetime_s"):
        admin.define_queue("BAD", S, topic={"lifetime_s": 0})
    with pytest.raises(AdminError, match="unknown topic attribute"):
        admin.define_queue("BAD", S, topic={"colour": 1})
    with pytest.raises(AdminError, match="service too"):
        admin.define_queue("BAD", S, topic={}, uow={})
    q = admin.define_queue("OK", S, topic={"persistent": False})
    assert q.companions == ("OK.PUB", "OK.SUB") and admin.queue_def("OK.SUB").structure == S
    assert q.topic_attributes is not None and not q.topic_attributes.persistent


def test_publications_reach_every_subscriber_on_both_members_whole_in_commit_order(
        qms: tuple[QueueManager, QueueManager]) -> None:
    a, b = qms
    ps.publish(a, T, [b"before"])  # committed before anyone subscribed: nobody receives it
    ps.subscribe(a, T, "alice")
    ps.subscribe(b, T, "bob")
    pub_a, pub_b = ps.PubSubSession(a), ps.PubSubSession(b)
    pub_a.publish(T, b"a1")
    pub_a.publish(T, b"a2")
    pub_b.publish(T, b"b1", commit=True)  # committed first
    subscriber = ps.PubSubSession(b)
    assert drain(subscriber, T, "alice") == [[b"b1"]]  # a's publication is invisible until its commit
    subscriber.commit()
    pub_a.commit()
    for qm, name in ((a, "alice"), (b, "bob"), (a, "bob")):
        s = ps.PubSubSession(qm)
        got = drain(s, T, name)
        s.commit()
        if (qm, name) == (a, "bob"):
            assert got == []  # bob committed them on b already
        else:
            assert got == ([[b"a1", b"a2"]] if name == "alice" else [[b"b1"], [b"a1", b"a2"]])


def test_backout_redelivers_and_one_receiver_at_a_time(qms: tuple[QueueManager, QueueManager]) -> None:
    a, b = qms
    ps.subscribe(a, T, "alice")
    ps.publish(a, T, [b"x"])
    first, second = ps.PubSubSession(a), ps.PubSubSession(b)
    assert first.receive(T, "alice").messages == [b"x"]
    with pytest.raises(ResourceProblemError, match="another session"):
        second.receive(T, "alice")
    first.backout()
    assert second.receive(T, "alice").messages == [b"x"]  # given back unchanged: received again, on b
    second.commit()
    with pytest.raises(NoMessageError):
        first.receive(T, "alice")
    assert ps.peek_subscription(a, ps.topic(a, T), "alice").received == 1  # type: ignore[union-attr]


def test_subscribe_refusals_and_unsubscribe(qms: tuple[QueueManager, QueueManager]) -> None:
    a, _ = qms
    with pytest.raises(BadRequestError, match="does not allow durable"):
        ps.subscribe(a, NONDUR, "x", durable=True)
    with pytest.raises(BadRequestError, match="not a topic"):
        ps.subscribe(a, "NEWS.PUB", "x")
    with pytest.raises(BadRequestError, match="printable"):
        ps.subscribe(a, T, "")
    s = ps.subscribe(a, T, "alice")
    assert ps.subscribe(a, T, "alice") == s  # subscribe once
    ps.unsubscribe(a, T, "alice")
    with pytest.raises(UnknownObjectError, match="no subscription alice"):
        ps.unsubscribe(a, T, "alice")
    with pytest.raises(UnknownObjectError):
        ps.PubSubSession(a).receive(T, "alice")


def test_publications_removed_when_the_last_subscriber_commits_counted_once(
        qms: tuple[QueueManager, QueueManager]) -> None:
    a, b = qms
    for name in ("s1", "s2", "s3"):
        ps.subscribe(a, T, name)
    before = int(a.structure(S).info()["entries"])
    ps.publish(a, T, [b"m1", b"m2"])
    assert int(a.structure(S).info()["entries"]) == before + 2  # one copy for three subscribers
    sweeper = PubSubSweeper(b)
    for name in ("s1", "s2"):
        s = ps.PubSubSession(a)
        s.receive(T, name)
        s.commit()
        assert sweeper.sweep()["publications-received"] == 0
    s = ps.PubSubSession(b)
    s.receive(T, "s3")
    assert sweeper.sweep()["publications-received"] == 0  # received, not committed
    s.commit()
    assert sweeper.sweep()["publications-received"] == 1
    assert int(a.structure(S).info()["entries"]) == before


def test_lifetime_and_subscription_expiration_on_the_pseudo_clock(qms: tuple[QueueManager, QueueManager]) -> None:
    """Each sweep's removals are checked against the pseudo-clock read just before and just after it: a thing is
    removed once its time has passed on the clock (never before, never later), and the test waits on the clock, not
    on a fixed sleep, so it holds however slowly the machine runs."""
    a, _ = qms
    t = ps.topic(a, SHORT)
    lifetime, expiration = t.attributes.lifetime_s * 1000, t.attributes.subscription_expiration_s * 1000

    def clock() -> int:
        return pseudo_clock(a, t.structure)

    def wait_clock(at_least: int) -> None:  # the clock runs while it is ticked (members tick it about every second)
        deadline = time.monotonic() + 60
        while clock() <= at_least:
            assert time.monotonic() < deadline, f"the pseudo-clock never passed {at_least}"
            time.sleep(0.05)

    def active() -> dict[str, int]:
        return {s.name: s.active_pc for s in ps.subscriptions(a, t)}

    ps.subscribe(a, SHORT, "idle")
    ps.subscribe(a, SHORT, "slow")
    subscribed = active()
    published_after = clock()
    ps.publish(a, SHORT, [b"old"])
    published_by = clock()
    sweeper = PubSubSweeper(a)

    def sweep() -> None:
        before = clock()
        expired = sweeper.sweep()["publications-expired"]
        after = clock()
        gone = sweeper.counts["publications-expired"] - expired > 0  # expired by an earlier sweep
        if not gone and before >= published_by + lifetime:  # past its lifetime: expired, never before
            assert expired == 1, (before, published_by)
        if after < published_after + lifetime:
            assert expired == 0, (after, published_after)
        left = active()
        for name, pc in subscribed.items():  # idle past SUBSCRIPTION-EXPIRATION: removed, never before
            if before >= pc + expiration:
                assert name not in left, (name, pc, before)
            elif after < pc + expiration:
                assert name in left, (name, pc, after)

    sweep()
    wait_clock(published_by + lifetime)
    sweep()
    assert sweeper.counts["publications-expired"] == 1  # past its lifetime though nobody received it
    # A receive that finds nothing is activity once half the expiration has passed since the last (it commits).
    wait_clock(subscribed["slow"] + expiration // 2)
    with pytest.raises(NoMessageError):
        ps.PubSubSession(a).receive(SHORT, "slow")
    assert active()["slow"] > subscribed["slow"] + expiration // 2
    subscribed["slow"] = active()["slow"]
    wait_clock(subscribed["idle"] + expiration)
    sweep()
    assert sweeper.counts["subscriptions-expired"] == 1  # idle past SUBSCRIPTION-EXPIRATION
    assert [s.name for s in ps.subscriptions(a, t)] == ["slow"]  # its receive was activity


def test_a_non_durable_subscription_ends_with_its_member(qms: tuple[QueueManager, QueueManager],
                                                         redis_url: str, tmp_path: Path) -> None:
    a, b = qms
    ps.subscribe(b, NONDUR, "temp")
    ps.subscribe(a, NONDUR, "stays")
    b.stop()
    b2 = start_qm(redis_url, tmp_path / "logs", "QM2", background=False)
    try:
        done = PubSubSweeper(a).sweep()
        assert done["non-durable-dropped"] == 1
        assert [s.name for s in ps.subscriptions(a, ps.topic(a, NONDUR))] == ["stays"]
    finally:
        b2.stop()


def test_a_subscriber_that_polls_an_idle_topic_does_not_expire(qms: tuple[QueueManager, QueueManager]) -> None:
    a, b = qms
    a.admin.define_queue("POLL", S, topic={"subscription_expiration_s": 1})
    ps.subscribe(a, "POLL", "poller")
    ps.subscribe(a, "POLL", "idle")
    sweeper, session = PubSubSweeper(a), ps.PubSubSession(b)
    for _ in range(20):
        with pytest.raises(NoMessageError):
            session.receive("POLL", "poller")
        sweeper.sweep()
        time.sleep(0.1)
    assert [s.name for s in ps.subscriptions(a, ps.topic(a, "POLL"))] == ["poller"]


def test_a_subscribe_after_its_member_restarted_makes_a_live_non_durable_subscription(
        qms: tuple[QueueManager, QueueManager], redis_url: str, tmp_path: Path) -> None:
    # A non-durable subscription ends with its member's incarnation: the application's subscribe once the member is
    # back must give it one that lives, not hand back the ended one for the next sweep to drop.
    a, b = qms
    ps.subscribe(b, NONDUR, "temp")
    b.stop()
    b2 = start_qm(redis_url, tmp_path / "logs", "QM2", background=False)
    try:
        s = ps.subscribe(b2, NONDUR, "temp")
        assert s.home == ps.incarnation(b2)
        ps.publish(a, NONDUR, [b"after"])
        PubSubSweeper(a).sweep()
        session = ps.PubSubSession(b2)
        assert session.receive(NONDUR, "temp").messages == [b"after"]
        session.commit()
    finally:
        b2.stop()


def test_a_subscribe_of_an_expired_subscription_makes_a_new_one(qms: tuple[QueueManager, QueueManager]) -> None:
    # A subscription idle past SUBSCRIPTION-EXPIRATION has ended: a subscribe of its name starts a new one (after
    # everything committed so far), not the ended one, which the next sweep would drop.
    a, b = qms
    ps.subscribe(a, SHORT, "late")
    ps.publish(a, SHORT, [b"while idle"])
    time.sleep(3.5)
    s = ps.subscribe(b, SHORT, "late")
    ps.publish(a, SHORT, [b"after"])
    PubSubSweeper(a).sweep()
    assert [x.name for x in ps.subscriptions(a, ps.topic(a, SHORT))] == ["late"]
    session = ps.PubSubSession(b)
    assert drain(session, SHORT, "late") == [[b"after"]]
    session.commit()
    assert s.active_pc >= pseudo_clock(a, S) - 1000


def test_a_receive_on_an_expired_subscription_is_refused_and_its_commit_does_not_revive_it(
        qms: tuple[QueueManager, QueueManager]) -> None:
    # Idle past SUBSCRIPTION-EXPIRATION, a subscription has ended, swept or not: a receive must not deliver from it,
    # and the COMMIT of the session's other work must leave it ended (for the sweeper), not make it active again.
    a, b = qms
    ps.subscribe(a, SHORT, "gone")
    ps.subscribe(a, SHORT, "alive")
    time.sleep(3.5)
    ps.publish(a, SHORT, [b"after it ended"])
    session = ps.PubSubSession(b)
    with pytest.raises(UnknownObjectError, match="has ended \\(subscriptions-expired\\): subscribe again"):
        session.receive(SHORT, "gone")
    session.publish(T, b"other work")  # the session holds other work: its COMMIT puts the ended entry back
    with pytest.raises(UnknownObjectError, match="has ended"):
        session.receive(SHORT, "alive")  # expired too (idle as long)
    with pytest.raises(UnknownObjectError, match="has ended"):
        session.receive(SHORT, "alive")  # asked again in the same unit of work: still refused
    session.commit()
    assert PubSubSweeper(a).sweep()["subscriptions-expired"] == 2
    assert ps.subscriptions(a, ps.topic(a, SHORT)) == []


def test_a_topic_is_not_defined_over_a_queue_that_has_its_companion_name(
        qms: tuple[QueueManager, QueueManager], redis_url: str) -> None:
    # A plain queue may end in .PUB or .SUB: a topic defined over it would take its messages for publications (the
    # sweeper removes them as received), close it to its applications and change its attributes.
    a, _ = qms
    admin = Admin(connect(redis_url))
    admin.define_queue("ORDERS.PUB", S)
    conn = a.connect()
    conn.put("ORDERS.PUB", b"order 1", syncpoint=True)
    conn.commit()
    with pytest.raises(AdminError, match="ORDERS.PUB is already defined"):
        admin.define_queue("ORDERS", S, topic={})
    PubSubSweeper(a).sweep()
    assert conn.get("ORDERS.PUB", syncpoint=False).body == b"order 1"
    admin.define_queue(T, S, topic={"lifetime_s": 60}, replace=True)  # a topic's own companions: redefined with it


def test_a_publication_past_its_lifetime_is_not_received(qms: tuple[QueueManager, QueueManager]) -> None:
    # A publication lives, available to subscribers, for its topic's lifetime: past it, a subscriber that has not
    # received it does not, whether or not a sweep has removed it yet (the sweeps run every second or so, and a
    # long backlog takes many of them), and receives what comes after it.
    a, b = qms
    ps.subscribe(a, SHORT, "late")
    ps.publish(a, SHORT, [b"stale"])
    published = pseudo_clock(a, S)
    while pseudo_clock(a, S) < published + 1200:
        time.sleep(0.1)
    ps.publish(a, SHORT, [b"fresh"])
    session = ps.PubSubSession(b)
    assert drain(session, SHORT, "late") == [[b"fresh"]]
    session.commit()
