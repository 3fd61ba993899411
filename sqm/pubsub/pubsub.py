"""Durable publish and subscribe (EntireX's, docs/pubsub.md): publishers publish *publications* (one or more messages, an atomic
unit) to a *topic*; subscribers subscribe by name, durably or not, and receive every publication committed after
they subscribed, whole and in commit order, under syncpoint.

Everything is kept as entries on the topic's two companion queues (cfemu.topic_attributes), and every change is a
put or a get inside a queue-manager unit of work, so it is logged, backed up, restored and peer-recovered like any
message, with no record kind of its own:

- ``<T>.PUB``: each publication's messages, once, whatever the number of subscribers (correlation id = the
  publication id; properties pub.index, pub.count, pub.created (pseudo-clock ms)). A publication's messages are
  put and committed together at the publisher's COMMIT: the CF stamps each with the LRSN the commit counts at (o1),
  which is the publication's place in commit order.
- ``<T>.SUB``: one entry per subscription (message id = a hash of topic, name and owner, correlation id "S"); its
  body is a Subscription: the position (the commit LRSN and id of the last publication the subscriber committed),
  the pseudo-clock of its last activity, its home member incarnation, its owner. Persistent iff durable. Beside it
  one *roster* entry (correlation id "R"), put by the subscribe and taken by the unsubscribe, never replaced in
  between: the sweeper's complete list of subscriptions, whatever receives commit while it reads (a receive's
  COMMIT replaces the subscription entry with a new one, which a paged read of the "S" entries can miss).

A subscription belongs to its owner: the user id and token the connection logged on with (sqm.service's logon),
the token kept only in its stored form (sqm.core.logon_token), part of the entry's message id, so another user cannot
name it, receive for it nor remove it. A connection that has
not logged on uses the anonymous owner ("", ""), whose subscriptions every such connection shares (docs/pubsub.md,
"Who may use a subscription").

A receive takes the subscription's entry under the session's unit of work (so one session at a time receives for a
subscription, on any member) and reads the next publication after its position without taking it (the CF op
topic_next); COMMIT puts the entry back with the position advanced, BACKOUT gives it back unchanged, so the
publication is received again. The sweeper (sqm.pubsub.pubsub_sweeper) removes the publications every subscription has
passed, and those past their lifetime. docs/pubsub.md has the model.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from cfemu.admin import QueueDef
from cfemu.cf import TopicHead, TopicNext
from cfemu.entry import Entry
from cfemu.errors import (
    BadRequestError,
    ClientGoneError,
    MQError,
    NoMessageError,
    PstoreUnavailableError,
    ResourceProblemError,
    TruncatedMessageError,
    UnknownObjectError,
)
from cfemu.pstore import WARM
from cfemu.topic_attributes import TopicAttributes, publication_queue, subscription_queue
from sqm.core import logon_token
from sqm.core.cfcall import CFCaller
from sqm.core.client_watch import ClientWatch
from sqm.core.connection import Connection
from sqm.core.member import Member
from sqm.core.packed_body import PackedBody
from sqm.core.pclock import member_epochs, pseudo_clock
from sqm.pubsub.publication_bounds import DraftBudget, check_fits
from sqm.request_slots import nap

SUB_LETTER = b"S"  # every subscription entry's correlation id: subscriptions() scans them all by it
ROSTER_LETTER = b"R"  # every roster entry's correlation id (one per subscription, never replaced)
AFTER_ALL = "~"  # a position's publication id after every id at its LRSN (ids are hex): a subscribe's position
MAX_NAME = 64
MAX_LISTED = 10_000  # subscriptions one listing (the service's `subscriptions`) returns
SCAN_BATCH = 500  # entries one CF call of a scan reads (peek_scan.lua): the CF's cost per call is bounded by it
MAX_DUPLICATES = 16  # entries of one subscription a receive merges (more than one only after subscribes raced)
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


def topic(qm: Member, name: str) -> Topic:
    return topic_of(qm.queue_def(name))


def topics(qm: Member) -> Iterator[Topic]:
    for qdef in qm.admin.queues():
        if qdef.topic:
            yield topic_of(qdef)


@dataclass(frozen=True)
class Subscription(PackedBody):
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
    user: str = ""  # its owner: the user id and token of the logon it was made under ("" for the anonymous owner)
    token: str = ""  # the token's stored form (sqm.core.logon_token), never the token

    @property
    def position(self) -> tuple[int, str]:
        return self.lrsn, self.pub

    def home_gone(self, epochs: dict[str, int]) -> bool:
        member, _, epoch = self.home.partition(".")
        return not epoch or int(epoch, 16) != epochs.get(member, 0)

    def public(self) -> dict[str, Any]:
        return {"topic": self.topic, "name": self.name, "durable": self.durable, "position_lrsn": self.lrsn,
                "position_pub": self.pub, "subscribed_pc": self.subscribed_pc, "active_pc": self.active_pc,
                "home": self.home, "received": self.received, "user": self.user, "token": bool(self.token),
                "id": self.sid.hex()}

    @property
    def sid(self) -> bytes:
        return subscription_id(self.topic, self.name, self.user, self.token)


def merged(subs: list[Subscription]) -> Subscription:
    """One subscription from the entries two racing subscribes of one name made: the furthest position (what the
    subscriber has committed), the latest activity, the earliest subscribe."""
    best = max(subs, key=lambda s: (s.position, s.received))
    return replace(best, subscribed_pc=min(s.subscribed_pc for s in subs), active_pc=max(s.active_pc for s in subs),
                   received=max(s.received for s in subs))


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


def subscription_id(topic_name: str, name: str, user: str = "", token: str = "") -> bytes:
    """The message id of a subscription's entry: its owner is part of it, so one owner cannot name another's.
    ``token``: the owner's token in its stored form (sqm.core.logon_token), as every function here but the API's
    (subscribe, unsubscribe, subscriptions, PubSubSession.receive) takes it."""
    key = f"{topic_name}\0{name}" if not (user or token) else f"{topic_name}\0{name}\0{user}\0{token}"
    return hashlib.sha256(key.encode()).digest()[:24]


def roster_id(sid: bytes) -> bytes:
    """The message id of a subscription's roster entry."""
    return hashlib.sha256(b"roster\0" + sid).digest()[:24]


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or not name.isprintable():
        raise BadRequestError(f"subscription name must be 1-{MAX_NAME} printable characters, not {name!r}")
    return name


def incarnation(qm: Member) -> str:
    return f"{qm.name}.{qm.caller.epoch:x}"


def peek_entries(qm: CFCaller, t: Topic, sid: bytes) -> list[tuple[Entry, bytes]]:
    """A subscription's entries (one, but after two subscribes of it raced), committed or held, without taking them."""
    return qm.cf_call(lambda: qm.structure(t.structure).peek(t.sub_queue, "m", sid.hex(), MAX_DUPLICATES))


def peek_subscription(qm: Member, t: Topic, name: str, *, user: str = "",
                      token: str = "") -> Subscription | None:
    """A subscription as the CF holds it (also while a receiver holds it), without taking it."""
    found = peek_entries(qm, t, subscription_id(t.name, name, user, token))
    return merged([Subscription.unpack(data) for _, data in found]) if found else None


def scan_entries(qm: Member, t: Topic, letter: bytes, batch: int = SCAN_BATCH) -> Iterator[tuple[Entry, bytes]]:
    """Every entry of the topic's subscription queue with correlation id ``letter``, a bounded batch per CF call
    (peek_scan.lua), each once. An entry there for the whole scan is returned; one replaced meanwhile may not be."""
    seen: set[str] = set()
    cursor = "0"
    while True:
        with qm.scans.call():  # one of the member's scan slots for each batch (sqm.core.scans)
            cursor, found = qm.cf_call(lambda c=cursor: qm.structure(t.structure).peek_scan(  # type: ignore[misc]
                t.sub_queue, "c", letter.hex(), c, batch))
        for entry, data in found:
            if entry.id not in seen:
                seen.add(entry.id)
                yield entry, data
        if cursor == "0":
            return


def subscriptions(qm: Member, t: Topic, *, user: str | None = None, token: str | None = None,
                  limit: int = MAX_LISTED) -> list[Subscription]:
    """The topic's subscriptions (those of one owner when ``user`` is given), by owner and name, at most ``limit``."""
    by_sid: dict[str, list[Subscription]] = {}
    sealed = logon_token.seal(qm, user or "", token or "")
    for entry, data in scan_entries(qm, t, SUB_LETTER):
        s = Subscription.unpack(data)
        if user is None or s.user == user and logon_token.matches(s.token, token or "", sealed):
            by_sid.setdefault(entry.msgid, []).append(s)
    return sorted((merged(subs) for subs in by_sid.values()), key=lambda s: (s.user, s.name))[:limit]


def roster(qm: Member, t: Topic, batch: int = SCAN_BATCH) -> set[str]:
    """The message ids (hex) of every subscription with a roster entry: a complete list, whatever receives commit
    meanwhile (roster entries are never replaced), but for subscriptions made or removed while it is read."""
    return {msgpack.unpackb(data, raw=False)["sid"] for _, data in scan_entries(qm, t, ROSTER_LETTER, batch)}


def structure_clock(qm: Member, t: Topic) -> int:
    """Where a subscription made now starts: the structure's LRSN clock (every publication committed so far counts at
    or below it), or just below the first put of an open publication when there is one. That one's COMMIT may be
    logged by a member whose clock runs behind another's, and count below the clock: a subscriber whose position
    was the clock would never receive it. So a subscribe's position, and the floor below which the sweeper removes
    publications as received, stay below every open publication."""
    head = qm.cf_call(lambda: qm.structure(t.structure).topic_head(t.pub_queue, 2**53))
    return int(head.clock) if head.open_from is None else min(int(head.clock), int(head.open_from) - 1)


def next_publication(qm: Member, t: Topic, position: tuple[int, str]) -> TopicNext:
    """The next publication after the position, whole (a receive's)."""
    return qm.cf_call(lambda: qm.structure(t.structure).topic_next(t.pub_queue, position[0], position[1]))


def next_publication_head(qm: Member, t: Topic, position: tuple[int, str]) -> TopicHead:
    """The head of the publication next_publication would return, without its data (the sweeper's look: it
    needs a publication's place, creation time and message count, and reads the oldest one every sweep)."""
    return qm.cf_call(lambda: qm.structure(t.structure).topic_head(t.pub_queue, position[0], position[1]))


def put_subscription(conn: Connection, t: Topic, s: Subscription) -> None:
    conn.put(t.sub_queue, s.pack(), persistent=s.durable, syncpoint=True, msgid=s.sid, correlid=SUB_LETTER,
             counted=False)


def _held_elsewhere(t: Topic, name: str) -> ResourceProblemError:
    return ResourceProblemError(f"subscription {name} of topic {t.name} is being received (or changed) by another "
                                "session: try again when it commits or backs out")


def _no_subscription(qm: CFCaller, t: Topic, name: str, user: str) -> MQError:
    """UnknownObjectError, but on a structure that runs from a WARM start: its durable subscriptions are in its
    backups and logs then, not in the CF, and come back with its HOT start (docs/pstore.md), so "no subscription"
    would be untrue, and would send the application to subscribe again, after everything published meanwhile."""
    if qm.cf_call(lambda: qm.structure(t.structure).pstore()).started == WARM:
        return PstoreUnavailableError(f"structure {t.structure} runs from a WARM start: topic {t.name}'s durable "
                                      f"subscriptions (subscription {name} among them, if it is one) come back "
                                      "with its HOT start, their positions with them")
    return UnknownObjectError(f"topic {t.name} has no subscription {name}" + (f" of user {user}" if user else ""))


def take_all(conn: Connection, t: Topic, name: str, *, user: str = "", token: str = "") -> tuple[Subscription, bool]:
    """Get every entry of the subscription under the connection's unit of work (one, but after two subscribes of it
    raced: they are merged), and whether another session holds one of them (then the caller must not receive: two
    sessions would each deliver from their own entry). One session at a time holds a subscription: of two that each
    took one entry, the later one's look finds the other's held."""
    sid = subscription_id(t.name, name, user, token)
    try:
        taken = [conn.get(t.sub_queue, syncpoint=True, msgid=sid, counted=False)]
    except NoMessageError:
        if peek_entries(conn.qm, t, sid):
            raise _held_elsewhere(t, name) from None
        raise _no_subscription(conn.qm, t, name, user) from None
    elsewhere = False
    for _ in range(MAX_DUPLICATES):
        mine = {m.entry_id for m in taken}
        others = [e for e, _ in peek_entries(conn.qm, t, sid) if e.id not in mine]
        if not others:
            break
        if any(e.state != "CP" for e in others):
            elsewhere = True
            break
        try:  # a duplicate nobody holds: merge it in
            taken.append(conn.get(t.sub_queue, syncpoint=True, msgid=sid, counted=False))
        except NoMessageError:
            elsewhere = True  # another session took it meanwhile
            break
    return merged([Subscription.unpack(m.body) for m in taken]), elsewhere


def take_subscription(conn: Connection, t: Topic, name: str, *, user: str = "", token: str = "") -> Subscription:
    """Get the subscription's entries under the connection's unit of work (ResourceProblemError when another session
    holds one: the caller backs out): one session at a time holds it."""
    s, elsewhere = take_all(conn, t, name, user=user, token=token)
    if elsewhere:
        raise _held_elsewhere(t, name)
    return s


def take_roster(conn: Connection, t: Topic, sid: bytes) -> None:
    """Get the subscription's roster entries (one, or one per raced subscribe) under the connection's unit of work."""
    for _ in range(MAX_DUPLICATES):
        try:
            conn.get(t.sub_queue, syncpoint=True, msgid=roster_id(sid), counted=False)
        except NoMessageError:
            return


def _put_roster(conn: Connection, t: Topic, s: Subscription) -> None:
    body = msgpack.packb({"sid": s.sid.hex(), "name": s.name, "user": s.user}, use_bin_type=True)
    conn.put(t.sub_queue, body, persistent=s.durable, syncpoint=True, msgid=roster_id(s.sid), correlid=ROSTER_LETTER,
             counted=False)


def _put_listed(conn: Connection, t: Topic, s: Subscription) -> None:
    """The subscription's entry and its roster entry, under the connection's unit of work."""
    put_subscription(conn, t, s)
    _put_roster(conn, t, s)


def subscribe(qm: Member, topic_name: str, name: str, *, durable: bool | None = None, user: str = "",
              token: str = "") -> Subscription:
    """SUBSCRIBE: a new subscription whose position is the structure's clock now, or below an open publication
    (structure_clock: it receives the publications committed after it, and those that commit after it), or the
    subscription already there (a user subscribes once: docs/pubsub.md) unless that one has ended (ended_by: it is
    replaced by the new one). ``durable``: None for the topic's characteristic (durable when the topic allows it).
    ``user``, ``token``: its owner."""
    t = topic(qm, topic_name)
    _check_name(name)
    want = t.attributes.durable if durable is None else bool(durable)
    if want and not t.attributes.durable:
        raise BadRequestError(f"topic {t.name} does not allow durable subscriptions (define it with durable)")
    token, clear = logon_token.seal(qm, user, token), token
    old = peek_subscription(qm, t, name, user=user, token=token)
    if old is None and adopt_unsealed(qm, t, name, user, clear, token):
        old = peek_subscription(qm, t, name, user=user, token=token)
    pc = pseudo_clock(qm, t.structure)
    ended = old is not None and bool(ended_by(t, old, member_epochs(qm), pc))
    if old is not None and not ended:
        if old.durable != want:
            raise BadRequestError(f"subscription {name} of topic {t.name} exists and is "
                                  f"{'durable' if old.durable else 'not durable'}: unsubscribe it first")
        return old
    s = Subscription(t.name, name, want, structure_clock(qm, t), AFTER_ALL, pc, pc, incarnation(qm), 0, user, token)
    conn = qm.connect()
    try:
        if old is not None:  # ended: the sweeper would drop it; the new one takes its place in the same unit of work
            try:
                gone: Subscription | None = take_subscription(conn, t, name, user=user, token=token)
            except UnknownObjectError:
                gone = None  # the sweeper removed it meanwhile
            if gone is not None and not ended_by(t, gone, member_epochs(qm), pc):
                conn.backout()  # used meanwhile (a receive committed): it lives, and is the subscription
                return subscribe(qm, topic_name, name, durable=durable, user=user, token=clear)
            take_roster(conn, t, old.sid)
        _put_listed(conn, t, s)
        conn.commit()
    except BaseException:
        conn.backout()
        raise
    return _merge_raced(qm, t, s)


def ended_by(t: Topic, s: Subscription, epochs: dict[str, int], pc: int) -> str:
    """Why the subscription has ended though its entry is still there ("" when it has not): a non-durable one whose
    home member incarnation is gone (it lives as long as the member it was made through), or one idle past the
    topic's SUBSCRIPTION-EXPIRATION at pseudo-clock ``pc``. The sweeper removes such a one, and a subscribe of its
    name makes a new one in its place rather than hand back one the next sweep drops."""
    if not s.durable and s.home_gone(epochs):
        return "non-durable-dropped"
    if s.active_pc + t.attributes.subscription_expiration_s * 1000 <= pc:
        return "subscriptions-expired"
    return ""


def _merge_raced(qm: Member, t: Topic, s: Subscription) -> Subscription:
    """After a subscribe: when another subscribe of the same name raced it (each saw none, each put one), merge the
    entries into one. Best effort: a receive merges them too, and never delivers from two at once (take_all)."""
    for attempt in range(3):
        found = peek_entries(qm, t, s.sid)
        if len(found) <= 1:
            break
        conn = qm.connect()
        try:
            both, elsewhere = take_all(conn, t, s.name, user=s.user, token=s.token)
            if elsewhere:
                conn.backout()
                nap(0.01 * (attempt + 1) * (1 + os.urandom(1)[0] / 255))  # the other racer merges, or we
                continue
            put_subscription(conn, t, both)
            conn.commit()
            return both
        except MQError:
            conn.backout()
            break
    return peek_subscription(qm, t, s.name, user=s.user, token=s.token) or s


def unsubscribe(qm: Member, topic_name: str, name: str, *, user: str = "", token: str = "") -> Subscription:
    """UNSUBSCRIBE: the subscription's entries are removed (its position with them), and its roster entry."""
    t = topic(qm, topic_name)
    sealed = logon_token.seal(qm, user, token)

    def take(conn: Connection) -> Subscription:
        try:
            return take_subscription(conn, t, _check_name(name), user=user, token=sealed)
        except UnknownObjectError:
            if not adopt_unsealed(qm, t, name, user, token, sealed):
                raise
            return take_subscription(conn, t, name, user=user, token=sealed)
    return _removed(qm, t, take)


def _removed(qm: Member, t: Topic, take: Callable[[Connection], Subscription]) -> Subscription:
    """The subscription ``take`` takes, and its roster entry, removed in one unit of work of a connection of its
    own."""
    conn = qm.connect()
    try:
        s = take(conn)
        take_roster(conn, t, s.sid)
        conn.commit()
    except BaseException:
        conn.backout()
        raise
    return s


def unsubscribe_id(qm: Member, topic_name: str, sid: str) -> Subscription:
    """UNSUBSCRIBE by the subscription's id (its entry's message id, hex: ``id`` in its public fields), whoever its
    owner: an operator's. A subscription whose owner is gone, or whose token no longer matches (the group's logon key
    was replaced), holds every publication after its position until it expires; naming it by owner needs the
    owner's token, which the operator does not have, and which only its sealed form in the entry stands for."""
    t = topic(qm, topic_name)
    try:
        raw = bytes.fromhex(sid)
    except ValueError:
        raw = b""
    if len(raw) != len(subscription_id("", "")):
        raise BadRequestError(f"subscription id must be {2 * len(subscription_id('', ''))} hex digits, not {sid!r}")
    found = [(e, data) for e, data in peek_entries(qm, t, raw) if e.correlid == SUB_LETTER.hex()]
    if not found:  # none, or another entry's id (a roster entry's, seen in a browse): not a subscription's
        raise _no_subscription(qm, t, f"with id {sid}", "")
    seen = Subscription.unpack(found[0][1])
    # taken by the identity it is stored under (its sealed token, or the token of an entry made before sealing)
    return _removed(qm, t, lambda conn: take_subscription(conn, t, seen.name, user=seen.user, token=seen.token))


def adopt_unsealed(qm: Member, t: Topic, name: str, user: str, token: str, sealed: str) -> bool:
    """A subscription made before tokens were sealed (its entry and its id hold the token itself) moved to its
    sealed id, position and all, in one unit of work; whether there was one. ResourceProblemError when a session
    receives for it now (try again)."""
    if not token or sealed == token or not peek_entries(qm, t, subscription_id(t.name, name, user, token)):
        return False
    conn = qm.connect()
    try:
        try:
            old = take_subscription(conn, t, name, user=user, token=token)
        except UnknownObjectError:  # another session moved it first
            conn.backout()
            return bool(peek_entries(qm, t, subscription_id(t.name, name, user, sealed)))
        take_roster(conn, t, old.sid)
        new = replace(old, token=sealed)
        _put_listed(conn, t, new)
        conn.commit()
    except BaseException:
        conn.backout()
        raise
    return True


@dataclass
class _Held:
    sub: Subscription  # as taken
    position: tuple[int, str]  # advanced by this unit of work's receives
    received: int = 0
    blocked: bool = False  # another session holds another entry of it: this one receives nothing (take_all)
    pc: int = 0  # the pseudo-clock its last receive read (0: none): the activity its COMMIT records
    ended: str = ""  # why it had ended when taken (ended_by): it receives nothing, and COMMIT puts it back as taken


@dataclass
class _Draft:
    topic: Topic
    pub: str
    bodies: list[bytes] = field(default_factory=list)
    data_bytes: int = 0  # of its bodies


class PubSubSession:
    """One participant's publish and subscribe session: one queue-manager unit of work carries the publication it
    is publishing and the subscriptions it is receiving for, so COMMIT settles them all atomically.

    The publication being published is held to its bounds (sqm.pubsub.publication_bounds): its size, and, with a
    ``budget`` (the service's), its bytes counted against the member's budget until COMMIT or BACKOUT."""

    def __init__(self, qm: Member, gone: ClientWatch | None = None, budget: DraftBudget | None = None) -> None:
        self.qm = qm
        self.scope: Connection = qm.connect() if gone is None else Connection(qm, gone)
        self.draft: _Draft | None = None
        self.held: dict[tuple[str, str], _Held] = {}
        self.budget = budget
        self.reserved = 0  # bytes of the budget the publication being published holds (under the budget's lock)

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
        # A new publication begins with its first message accepted: a refused one leaves the session as it was.
        d = self.draft if self.draft is not None else _Draft(t, os.urandom(16).hex())
        if d.topic.name != t.name:
            raise BadRequestError(f"publication {d.pub} is being published to {d.topic.name}: "
                                  f"commit or back it out before publishing to {t.name}")
        if len(d.bodies) >= t.attributes.max_messages:
            raise BadRequestError(f"publication {d.pub} holds {len(d.bodies)} messages, topic "
                                  f"{t.name}'s max_messages")
        check_fits(t.name, d.pub, d.data_bytes, len(d.bodies), len(body))
        if self.budget is not None:
            self.budget.reserve(self, t.name, d.pub, len(body), len(d.bodies))
        d.bodies.append(bytes(body))
        d.data_bytes += len(body)
        self.draft = d
        out = {"pub": self.draft.pub, "topic": t.name, "messages": len(self.draft.bodies), "committed": False}
        if commit:
            self.commit()
            out["committed"] = True
        return out

    def _stage_publication(self) -> None:
        d = self.draft
        if d is None:
            return
        pc = pseudo_clock(self.qm, d.topic.structure)
        n = len(d.bodies)
        for i, body in enumerate(d.bodies):
            self.scope.put(d.topic.pub_queue, body, persistent=d.topic.attributes.persistent, syncpoint=True,
                           correlid=bytes.fromhex(d.pub),
                           properties={"pub.index": i, "pub.count": n, "pub.created": pc})

    # --- subscribe ----------------------------------------------------------------------------------------------
    def receive(self, topic_name: str, name: str, *, wait_ms: int = 0, user: str = "", token: str = "",
                room: Callable[[int], int] | None = None) -> Publication:
        """The next publication for the subscription of ``user`` and ``token``, whole (NoMessageError: none within
        ``wait_ms``). Its entry stays taken by this session until COMMIT (the position advances) or BACKOUT (it is
        received again). ``room``: the data bytes the caller's reply carries for a number of messages; a
        publication larger than that is not received (TruncatedMessageError, the position left where it was), as a
        get that cannot be carried takes nothing: a COMMIT of the session's other work must not pass it."""
        t = topic(self.qm, topic_name)
        token, clear = logon_token.seal(self.qm, user, token), token
        key = (t.name, subscription_id(t.name, _check_name(name), user, token).hex())
        if not 0 <= wait_ms <= 3_600_000:
            raise BadRequestError(f"wait must be 0-3600000 ms, not {wait_ms}")
        ended = self.held[key].ended if key in self.held else ""
        if key not in self.held:
            try:
                s, elsewhere = take_all(self.scope, t, name, user=user, token=token)
            except UnknownObjectError:
                if not adopt_unsealed(self.qm, t, name, user, clear, token):
                    raise
                s, elsewhere = take_all(self.scope, t, name, user=user, token=token)
            pc = pseudo_clock(self.qm, t.structure)
            ended = ended_by(t, s, member_epochs(self.qm) if not s.durable else {}, pc)
            self.held[key] = _Held(s, s.position, blocked=elsewhere, ended=ended)
            if (elsewhere or ended) and len(self.held) == 1 and self.draft is None:
                self.backout()  # it holds nothing else: give back what it took at once
        if ended:
            # Ended (expired, or a non-durable one whose member is gone): the sweeper removes it, and a subscribe of
            # its name makes a new one. A receive must not deliver from it, nor its COMMIT make it active again.
            raise UnknownObjectError(f"subscription {name} of topic {t.name} has ended ({ended}): subscribe again")
        h = self.held.get(key)
        if h is None or h.blocked:
            raise ResourceProblemError(f"subscription {name} of topic {t.name} has another entry held by another "
                                       "session (two subscribes of it raced): try again when that session commits "
                                       "or backs out" + ("; this session holds the entries it took until it commits "
                                                         "or backs out" if h is not None else ""))
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            nxt = next_publication(self.qm, t, h.position)
            if nxt.state == "P":
                created = int(nxt.messages[0][0].properties.get("pub.created", 0))
                h.pc = pseudo_clock(self.qm, t.structure)
                if created + t.attributes.lifetime_s * 1000 <= h.pc:
                    # Past its lifetime: no longer available to subscribers (the sweeper removes it, at its pace;
                    # the seed: a publication lives, available to subscribers, for the topic's lifetime). The
                    # position passes it, and the next one is looked at at once.
                    h.position = (nxt.lrsn, nxt.pub)
                    continue
                size = sum(len(data) for _, data in nxt.messages)
                if room is not None and size > room(len(nxt.messages)):
                    self._give_back_idle()
                    raise TruncatedMessageError(
                        f"publication {nxt.pub} of topic {t.name} ({size} bytes in {len(nxt.messages)} messages) "
                        f"does not fit a reply of {room(len(nxt.messages))} bytes: not received")
                h.position = (nxt.lrsn, nxt.pub)
                h.received += 1
                return Publication(t.name, nxt.pub, nxt.lrsn, [data for _, data in nxt.messages], created,
                                   nxt.messages[0][0].persistent)
            if time.monotonic() >= deadline or self.scope.gone.is_set():
                break
            nap(POLL_S)
        if self.scope.gone.is_set():
            raise ClientGoneError("the client left while its receive waited")
        if self._holds_nothing():
            # It took nothing: give the entry back, so that another session (on any member) may receive for the
            # subscription. A subscriber that polls an idle topic is active: its activity is recorded when half its
            # SUBSCRIPTION-EXPIRATION has passed, so that it does not expire while it polls.
            if pseudo_clock(self.qm, t.structure) - h.sub.active_pc > t.attributes.subscription_expiration_s * 500:
                self.commit()
            else:
                self.backout()
        raise NoMessageError(f"no publication for subscription {name} of topic {t.name}")

    def _holds_nothing(self) -> bool:
        """Whether the session has received nothing and publishes nothing: what it holds are entries it only took."""
        return not any(x.received for x in self.held.values()) and self.draft is None

    def _give_back_idle(self) -> None:
        """Give back the entries taken when the session holds nothing else (another session may receive for them)."""
        if self._holds_nothing():
            self.backout()

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
                if h.ended:  # as it was taken: ended still, for the sweeper to remove
                    put_subscription(self.scope, t, h.sub)
                    continue
                pc = h.pc or pseudo_clock(self.qm, t.structure)
                put_subscription(self.scope, t, replace(h.sub, lrsn=h.position[0], pub=h.position[1],
                                                        active_pc=max(pc, h.sub.active_pc),
                                                        received=h.sub.received + h.received))
            self.scope.commit()
        except BaseException:
            self.backout()
            raise
        self.draft = None
        self.held = {}
        self._release()
        return {"published": pub, "received": received}

    def backout(self) -> dict[str, Any]:
        """BACKOUT: the publication being published is dropped; every subscription received for is given back as it
        was (its publications are received again)."""
        pub = self.draft.pub if self.draft else ""
        received = sum(h.received for h in self.held.values())
        self.draft = None
        self.held = {}
        self._release()
        self.scope.backout()
        return {"dropped": pub, "returned": received}

    def _release(self) -> None:
        """Give the budget back the bytes of the publication that was being published (committed or dropped)."""
        if self.budget is not None and self.reserved:
            self.budget.release(self)

    def close(self) -> None:
        self.backout()


def publish(qm: Member, topic_name: str, bodies: list[bytes]) -> str:
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
           "next_publication_head", "take_subscription", "take_all", "take_roster", "put_subscription", "roster",
           "roster_id", "scan_entries", "peek_entries", "merged", "adopt_unsealed", "ended_by", "incarnation",
           "unsubscribe_id"]
