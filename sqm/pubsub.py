"""Durable publish and subscribe (seed 004): publishers publish *publications* (one or more messages, an atomic
unit) to a *topic*; subscribers subscribe by name, durably or not, and receive every publication committed after
they subscribed, whole and in commit order, under syncpoint.

Everything is kept as entries on the topic's two companion queues (cfemu.topic_attributes), and every change is a
put or a get inside a queue-manager unit of work, so it is logged, backed up, restored and peer-recovered like any
message, with no record kind of its own:

- ``<T>.PUB``: each publication's messages, once, whatever the number of subscribers (correlation id = the
  publication id; properties pub.index, pub.count, pub.created (pseudo-clock ms)). A publication's messages are
  put and committed together at the publisher's COMMIT: the CF stamps each with the LRSN the commit counts at (o1),
  which is the publication's place in commit order.
- ``<T>.SUB``: one entry per subscription (message id = a hash of topic and name, correlation id "S"); its body is
  a Subscription: the position (the commit LRSN and id of the last publication the subscriber committed), the
  pseudo-clock of its last activity, its home member incarnation. Persistent iff durable.

A receive takes the subscription's entry under the session's unit of work (so one session at a time receives for a
subscription, on any member) and reads the next publication after its position without taking it (the CF op
topic_next); COMMIT puts the entry back with the position advanced, BACKOUT gives it back unchanged, so the
publication is received again. The sweeper (sqm.pubsub_sweeper) removes the publications every subscription has
passed, and those past their lifetime. docs/pubsub.md has the model.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import msgpack

from cfemu.admin import QueueDef
from cfemu.cf import TopicNext
from cfemu.errors import (
    BadRequestError,
    ClientGoneError,
    NoMessageError,
    ResourceProblemError,
    UnknownObjectError,
)
from cfemu.topic_attributes import TopicAttributes, publication_queue, subscription_queue
from sqm import uowcontrols as ctl
from sqm.connection import Connection
from sqm.manager import QueueManager

SUB_LETTER = b"S"  # every subscription entry's correlation id: subscriptions() peeks them all by it
AFTER_ALL = "~"  # a position's publication id after every id at its LRSN (ids are hex): a subscribe's position
MAX_NAME = 64
MAX_SUBSCRIPTIONS = 10_000  # what one listing reads
POLL_S = 0.05  # a waiting receive looks again this often


@dataclass(frozen=True)
class Topic:
    name: str
    structure: str
    attributes: TopicAttributes
    max_msg_length: int

    @property
    def pub_queue(self) -> str:
        return publication_queue(self.name)

    @property
    def sub_queue(self) -> str:
        return subscription_queue(self.name)


def topic_of(qdef: QueueDef) -> Topic:
    attrs = qdef.topic_attributes
    if attrs is None:
        raise BadRequestError(f"queue {qdef.name} is not a topic: define it with topic attributes "
                              "(cfemu topic define NAME ...)")
    return Topic(qdef.name, qdef.structure, attrs, qdef.max_msg_length)


def topic(qm: QueueManager, name: str) -> Topic:
    return topic_of(qm.queue_def(name))


def topics(qm: QueueManager) -> Iterator[Topic]:
    for qdef in qm.admin.queues():
        if qdef.topic:
            yield topic_of(qdef)


@dataclass(frozen=True)
class Subscription:
    """A subscription entry's body."""

    topic: str
    name: str
    durable: bool
    lrsn: int  # position: the commit LRSN of the last publication committed (the structure's clock at subscribe)
    pub: str  # position: that publication's id ("~" after every publication at lrsn)
    subscribed_pc: int  # pseudo-clock (ms) at subscribe
    active_pc: int  # pseudo-clock (ms) of the last subscribe or committed receive: SUBSCRIPTION-EXPIRATION counts
    home: str  # the member incarnation it was made through ("QM1.<epoch hex>"): a non-durable one ends with it
    received: int = 0  # publications received and committed

    @property
    def position(self) -> tuple[int, str]:
        return self.lrsn, self.pub

    def home_gone(self, epochs: dict[str, int]) -> bool:
        member, _, epoch = self.home.partition(".")
        return not epoch or int(epoch, 16) != epochs.get(member, 0)

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> Subscription:
        d = msgpack.unpackb(raw, raw=False)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def public(self) -> dict[str, Any]:
        return {"topic": self.topic, "name": self.name, "durable": self.durable, "position_lrsn": self.lrsn,
                "position_pub": self.pub, "subscribed_pc": self.subscribed_pc, "active_pc": self.active_pc,
                "home": self.home, "received": self.received}


@dataclass
class Publication:
    topic: str
    pub: str  # the publication id (hex)
    lrsn: int  # the LRSN its commit counts at (its place in commit order)
    messages: list[bytes]
    created_pc: int
    persistent: bool

    def public(self) -> dict[str, Any]:
        return {"topic": self.topic, "pub": self.pub, "lrsn": self.lrsn, "messages": self.messages,
                "created_pc": self.created_pc, "persistent": self.persistent}


def subscription_id(topic_name: str, name: str) -> bytes:
    return hashlib.sha256(f"{topic_name}\0{name}".encode()).digest()[:24]


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or not name.isprintable():
        raise BadRequestError(f"subscription name must be 1-{MAX_NAME} printable characters, not {name!r}")
    return name


def incarnation(qm: QueueManager) -> str:
    return f"{qm.name}.{qm.caller.epoch:x}"


def peek_subscription(qm: QueueManager, t: Topic, name: str) -> Subscription | None:
    """A subscription as the CF holds it (also while a receiver holds it), without taking it."""
    found = qm.cf_call(lambda: qm.structure(t.structure).peek(t.sub_queue, "m", subscription_id(t.name, name).hex(),
                                                              1))
    return Subscription.unpack(found[0][1]) if found else None


def subscriptions(qm: QueueManager, t: Topic) -> list[Subscription]:
    found = qm.cf_call(lambda: qm.structure(t.structure).peek(t.sub_queue, "c", SUB_LETTER.hex(), MAX_SUBSCRIPTIONS))
    return sorted((Subscription.unpack(data) for _, data in found), key=lambda s: s.name)


def structure_clock(qm: QueueManager, t: Topic) -> int:
    """The structure's LRSN clock: every publication committed so far counts at or below it."""
    return int(qm.cf_call(lambda: qm.structure(t.structure).topic_next(t.pub_queue, 2**53)).clock)


def next_publication(qm: QueueManager, t: Topic, position: tuple[int, str]) -> TopicNext:
    return qm.cf_call(lambda: qm.structure(t.structure).topic_next(t.pub_queue, position[0], position[1]))


def put_subscription(conn: Connection, t: Topic, s: Subscription) -> None:
    conn.put(t.sub_queue, s.pack(), persistent=s.durable, syncpoint=True, msgid=subscription_id(t.name, s.name),
             correlid=SUB_LETTER)


def take_subscription(conn: Connection, t: Topic, name: str) -> Subscription:
    """Get the subscription's entry under the connection's unit of work: one session at a time holds it."""
    try:
        msg = conn.get(t.sub_queue, syncpoint=True, msgid=subscription_id(t.name, name))
    except NoMessageError:
        if peek_subscription(conn.qm, t, name) is not None:
            raise ResourceProblemError(f"subscription {name} of topic {t.name} is being received (or changed) by "
                                       "another session: try again when it commits or backs out") from None
        raise UnknownObjectError(f"topic {t.name} has no subscription {name}") from None
    return Subscription.unpack(msg.body)


def subscribe(qm: QueueManager, topic_name: str, name: str, *, durable: bool | None = None) -> Subscription:
    """SUBSCRIBE: a new subscription whose position is the structure's clock now (it receives the publications
    committed after it), or the subscription already there (a user subscribes once: seed 004). ``durable``: None
    for the topic's characteristic (durable when the topic allows it)."""
    t = topic(qm, topic_name)
    _check_name(name)
    want = t.attributes.durable if durable is None else bool(durable)
    if want and not t.attributes.durable:
        raise BadRequestError(f"topic {t.name} does not allow durable subscriptions (define it with durable)")
    old = peek_subscription(qm, t, name)
    if old is not None:
        if old.durable != want:
            raise BadRequestError(f"subscription {name} of topic {t.name} exists and is "
                                  f"{'durable' if old.durable else 'not durable'}: unsubscribe it first")
        return old
    pc = ctl.pseudo_clock(qm, t.structure)
    s = Subscription(t.name, name, want, structure_clock(qm, t), AFTER_ALL, pc, pc, incarnation(qm))
    conn = qm.connect()
    try:
        put_subscription(conn, t, s)
        conn.commit()
    except BaseException:
        conn.backout()
        raise
    return s


def unsubscribe(qm: QueueManager, topic_name: str, name: str) -> Subscription:
    """UNSUBSCRIBE: the subscription's entry is removed (its position with it)."""
    t = topic(qm, topic_name)
    conn = qm.connect()
    try:
        s = take_subscription(conn, t, _check_name(name))
        conn.commit()
    except BaseException:
        conn.backout()
        raise
    return s


@dataclass
class _Held:
    sub: Subscription  # as taken
    position: tuple[int, str]  # advanced by this unit of work's receives
    received: int = 0


@dataclass
class _Draft:
    topic: Topic
    pub: str
    bodies: list[bytes] = field(default_factory=list)


class PubSubSession:
    """One participant's publish and subscribe session: one queue-manager unit of work carries the publication it
    is publishing and the subscriptions it is receiving for, so COMMIT settles them all atomically."""

    def __init__(self, qm: QueueManager, gone: threading.Event | None = None) -> None:
        self.qm = qm
        self.scope: Connection = qm.connect() if gone is None else Connection(qm, gone)
        self.draft: _Draft | None = None
        self.held: dict[tuple[str, str], _Held] = {}

    # --- publish ----------------------------------------------------------------------------------------------
    def publish(self, topic_name: str, body: bytes, *, commit: bool = False) -> dict[str, Any]:
        """One message of the publication being published (begun by the first); ``commit``: COMMIT after it.
        The messages stay with the session until COMMIT puts them together, so no subscriber (nor a publication
        committed meanwhile) waits on an open one (docs/pubsub.md, "Commit order")."""
        t = topic(self.qm, topic_name)
        if not isinstance(body, bytes | bytearray):
            raise BadRequestError(f"publication message must be bytes, not {type(body).__name__}")
        if len(body) > t.max_msg_length:
            raise BadRequestError(f"publication message of {len(body)} bytes exceeds topic {t.name}'s limit of "
                                  f"{t.max_msg_length}")
        if self.draft is None:
            self.draft = _Draft(t, os.urandom(16).hex())
        elif self.draft.topic.name != t.name:
            raise BadRequestError(f"publication {self.draft.pub} is being published to {self.draft.topic.name}: "
                                  f"commit or back it out before publishing to {t.name}")
        if len(self.draft.bodies) >= t.attributes.max_messages:
            raise BadRequestError(f"publication {self.draft.pub} holds {len(self.draft.bodies)} messages, topic "
                                  f"{t.name}'s max_messages")
        self.draft.bodies.append(bytes(body))
        out = {"pub": self.draft.pub, "topic": t.name, "messages": len(self.draft.bodies), "committed": False}
        if commit:
            self.commit()
            out["committed"] = True
        return out

    def _stage_publication(self) -> None:
        d = self.draft
        if d is None:
            return
        pc = ctl.pseudo_clock(self.qm, d.topic.structure)
        n = len(d.bodies)
        for i, body in enumerate(d.bodies):
            self.scope.put(d.topic.pub_queue, body, persistent=d.topic.attributes.persistent, syncpoint=True,
                           correlid=bytes.fromhex(d.pub),
                           properties={"pub.index": i, "pub.count": n, "pub.created": pc})

    # --- subscribe ----------------------------------------------------------------------------------------------
    def receive(self, topic_name: str, name: str, *, wait_ms: int = 0) -> Publication:
        """The next publication for the subscription, whole (NoMessageError: none within ``wait_ms``). Its
        entry stays taken by this session until COMMIT (the position advances) or BACKOUT (it is received again)."""
        t = topic(self.qm, topic_name)
        key = (t.name, _check_name(name))
        if not 0 <= wait_ms <= 3_600_000:
            raise BadRequestError(f"wait must be 0-3600000 ms, not {wait_ms}")
        took = key not in self.held
        if took:
            s = take_subscription(self.scope, t, name)
            self.held[key] = _Held(s, s.position)
        h = self.held[key]
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            nxt = next_publication(self.qm, t, h.position)
            if nxt.state == "P":
                h.position = (nxt.lrsn, nxt.pub)
                h.received += 1
                props = nxt.messages[0][0].properties
                return Publication(t.name, nxt.pub, nxt.lrsn, [data for _, data in nxt.messages],
                                   int(props.get("pub.created", 0)), nxt.messages[0][0].persistent)
            if time.monotonic() >= deadline or self.scope.gone.is_set():
                break
            time.sleep(POLL_S)
        if self.scope.gone.is_set():
            raise ClientGoneError("the client left while its receive waited")
        if not any(x.received for x in self.held.values()) and self.draft is None:
            # It took nothing: give the entry back, so that another session (on any member) may receive for the
            # subscription. A subscriber that polls an idle topic is active: its activity is recorded when half its
            # SUBSCRIPTION-EXPIRATION has passed, so that it does not expire while it polls.
            if ctl.pseudo_clock(self.qm, t.structure) - h.sub.active_pc > t.attributes.subscription_expiration_s * 500:
                self.commit()
            else:
                self.backout()
        raise NoMessageError(f"no publication for subscription {name} of topic {t.name}")

    # --- syncpoint ----------------------------------------------------------------------------------------------
    def commit(self) -> dict[str, Any]:
        """COMMIT: the publication being published becomes visible, whole, in commit order; every subscription
        received for moves past what it received (the entries are put back, advanced, in the same unit of work)."""
        pub = self.draft.pub if self.draft else ""
        received = sum(h.received for h in self.held.values())
        try:
            self._stage_publication()
            for h in self.held.values():
                t = topic(self.qm, h.sub.topic)
                pc = ctl.pseudo_clock(self.qm, t.structure)
                put_subscription(self.scope, t, replace(h.sub, lrsn=h.position[0], pub=h.position[1],
                                                        active_pc=max(pc, h.sub.active_pc),
                                                        received=h.sub.received + h.received))
            self.scope.commit()
        except BaseException:
            self.backout()
            raise
        self.draft = None
        self.held = {}
        return {"published": pub, "received": received}

    def backout(self) -> dict[str, Any]:
        """BACKOUT: the publication being published is dropped; every subscription received for is given back as it
        was (its publications are received again)."""
        pub = self.draft.pub if self.draft else ""
        received = sum(h.received for h in self.held.values())
        self.draft = None
        self.held = {}
        self.scope.backout()
        return {"dropped": pub, "returned": received}

    def close(self) -> None:
        self.backout()


def publish(qm: QueueManager, topic_name: str, bodies: list[bytes]) -> str:
    """A publication of ``bodies``, committed at once: its id."""
    session = PubSubSession(qm)
    if not bodies:
        raise BadRequestError("a publication holds at least one message")
    for body in bodies:
        out = session.publish(topic_name, body)
    session.commit()
    return str(out["pub"])


__all__ = ["Topic", "topic", "topics", "Subscription", "Publication", "PubSubSession", "subscribe", "unsubscribe",
           "subscriptions", "peek_subscription", "publish", "subscription_id", "structure_clock", "next_publication",
           "take_subscription", "put_subscription"]
