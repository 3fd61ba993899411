"""The chaos workload's publishers and subscribers (durable publish and subscribe, docs/pubsub.md).

A topic (TOPIC, defined by qsg.chaos.group on TOPIC_STRUCTURE): persistent publications, durable subscriptions
allowed, a publication lifetime and a subscription expiration far longer than a run. Subscribers, each owned by one
client thread (so one thread at a time drives it; the threads prefer different members):

    d0, d1, d2, d3   durable; d2 subscribes late (after its first few actions), d3 goes offline now and then (its
                     connection closed, no receive for some seconds) and comes back to a backlog;
    n4               non-durable: it lives as long as the member it subscribed through, so after that member restarts
                     (or the CF is lost) its receive finds no subscription and it subscribes again.

Every client thread publishes: a publication of 1-3 chaos messages (``CHAOS1|<id>|<crc>|...`` bodies, ids unique in
the run), then COMMIT or BACKOUT. An owner thread receives for its subscriber: 1-2 publications, whole, then COMMIT
or BACKOUT. The plan is a pure function of (seed, client), like the rest of the workload.

History operations (each action's key is ``uow``, e.g. ``c3.17``):

    psub   args sub, durable                       result position_lrsn, position_pub, subscribed_pc, home, received
    ppub   args msg, idx (0-based), of (planned)   result pub (the publication id), messages
    precv  args sub                                result pub, lrsn, msgs ([id, crc_ok] per message), persistent
    psync  args option (COMMIT, BACKOUT), role (publisher / subscriber), sub, pub
                                                   result published / received
    psubs  (the drain's listing, after it)         result subs ({name: received})

A failure carries ``reason``, ``error`` (the exception's class) and ``backed_out`` (the session's work was backed out:
BackedOutError, or a refusal that PubSubSession.commit backs out: the persistent store disconnected, no new units of
work, the structure full). After healing, the drain (client ``pdrain``) has every durable subscriber receive and
commit until nothing is left (qsg.chaos.pubsubcheck has the rules).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from cfemu.errors import (
    BackedOutError,
    NoMessageError,
    NoNewUowsError,
    PstoreUnavailableError,
    StructureFullError,
    UnknownObjectError,
)
from cfemu.topic_attributes import publication_queue, subscription_queue
from qsg.chaos.bodies import make_body, parse_body
from qsg.chaos.client_session import ClientSession
from qsg.chaos.history import FAIL, OK, History
from qsg.chaos.recorded import RecordedRunner
from sqm.service.client import Client

TOPIC = "NEWS"
TOPIC_STRUCTURE = "APP1"
# Persistent publications, durable subscriptions allowed; lifetimes far longer than a run (on the pseudo-clock), so
# nothing expires unless a test means it to.
TOPIC_ATTRS: dict[str, Any] = {"persistent": True, "durable": True, "lifetime_s": 3600,
                               "subscription_expiration_s": 3600, "max_messages": 8}
# client thread number -> (subscriber name, durable)
SUBSCRIBERS: dict[int, tuple[str, bool]] = {0: ("d0", True), 1: ("d1", True), 2: ("d2", True), 3: ("d3", True),
                                            4: ("n4", False)}
DURABLE = tuple(name for name, durable in SUBSCRIBERS.values() if durable)
LATE = "d2"  # subscribes only after LATE_AFTER actions of its own
LATE_AFTER = 3
OFFLINE = "d3"  # goes away now and then
PUBLISHER, SUBSCRIBER = "publisher", "subscriber"
DRAIN_CLIENT = "pdrain"
RECEIVE_WAIT_MS = 200
DRAIN_S = 40.0
DRAIN_BATCH = 20  # publications the drain receives before each COMMIT
# Refusals after which PubSubSession.commit (or the put that failed) has backed the session out.
BACKED_OUT = (BackedOutError, PstoreUnavailableError, NoNewUowsError, StructureFullError)


@dataclass(frozen=True)
class Pub:
    role: str  # publish, receive, away
    msgs: tuple[tuple[str, int], ...] = ()  # publish: (message id, payload size)
    commit: bool = True  # publish / receive: COMMIT, else BACKOUT
    receives: int = 1  # receive: publications before the syncpoint
    away_s: float = 0.0  # away: seconds offline
    n: int = 0  # the thread's publish/subscribe action number (from 1)


def pub_plan(rnd: random.Random, next_msg: Callable[[], str], client: int, n: int) -> Pub:
    """The ``n``-th publish/subscribe action of a client thread, drawn from its plan's generator."""
    owns = SUBSCRIBERS.get(client)
    r = rnd.random()
    if owns is not None and owns[0] == OFFLINE and r < 0.08:
        return Pub("away", away_s=rnd.choice((3.0, 5.0, 8.0)), n=n)
    if owns is not None and r < 0.65 and not (owns[0] == LATE and n <= LATE_AFTER):
        return Pub("receive", commit=rnd.random() < 0.85, receives=rnd.choice((1, 2, 3)), n=n)
    msgs = tuple((next_msg(), rnd.randint(32, 400)) for _ in range(rnd.randint(1, 3)))
    return Pub("publish", msgs, commit=rnd.random() < 0.85, n=n)



def _fields(op: str, r: Any) -> dict[str, Any]:
    """What the history keeps of a call's result."""
    if not isinstance(r, dict):
        return {}
    if op == "precv":
        msgs = []
        for body in r.get("messages") or []:
            msg, crc_ok = parse_body(bytes(body))
            msgs.append([msg, crc_ok])
        return {"pub": r.get("pub"), "lrsn": r.get("lrsn"), "msgs": msgs, "persistent": r.get("persistent")}
    if op == "psub":
        keep = ("position_lrsn", "position_pub", "subscribed_pc", "home", "received", "durable")
        return {k: r[k] for k in keep if k in r}
    if op == "ppub":
        return {"pub": r.get("pub"), "messages": r.get("messages")}
    if op == "psubs":
        return dict(r)
    return {k: r[k] for k in ("published", "received", "dropped", "returned") if k in r}


class PubSession(ClientSession):
    """One client thread's publish/subscribe connection (a Client of its own, made again after a failure) and its
    subscriber's state."""

    def __init__(self, history: History, endpoints: Sequence[tuple[str, int]], name: str, *,
                 token: str | None, sub: tuple[str, bool] | None = None) -> None:
        super().__init__(history, endpoints, name, token=token, client_name=f"{name}-ps")
        self.sub = sub
        self.subscribed = False
        self.away_until = 0.0


class PubRunner(RecordedRunner):
    """Carries out one publish/subscribe action, recording each call (ops psub, ppub, precv, psync)."""

    def __init__(self, history: History, session: PubSession, key: str) -> None:
        super().__init__(history, session, key, tags={"topic": TOPIC}, fields=_fields,
                         backed_out=BACKED_OUT)
        self.s: PubSession = session

    def sync(self, c: Client, commit: bool, role: str, **args: Any) -> str:
        op = c.pub_commit if commit else c.pub_backout
        return self.call("psync", op, option="COMMIT" if commit else "BACKOUT", role=role, **args)[0]

    def run(self, a: Pub) -> bool:
        if a.role == "away":
            if time.monotonic() < self.s.away_until:
                return True  # away already
            self.s.away_until = time.monotonic() + a.away_s
            self.s.close()  # offline: its connection goes too
            self.h.note(what="subscriber away", client=self.s.name, sub=self.s.sub[0] if self.s.sub else "",
                        seconds=a.away_s)
            return True
        if a.role == "receive" and time.monotonic() < self.s.away_until:
            return True  # still away
        c = self.s.client()
        if c is None:
            return False
        if a.role == "receive":
            return self.receive(c, a)
        return self.publish(c, a)

    def subscribe(self, c: Client) -> bool:
        assert self.s.sub is not None
        name, durable = self.s.sub
        outcome, _ = self.call("psub", partial(c.subscribe, TOPIC, name, durable=durable), sub=name, durable=durable)
        self.s.subscribed = outcome == OK
        return self.s.subscribed

    def _abandon(self, c: Client, role: str, e: Any, **args: Any) -> bool:
        """A call inside the session failed: back out what it may hold (a lost session was backed out already)."""
        if not isinstance(e, BACKED_OUT):
            self.sync(c, False, role, **args)
        return False

    def publish(self, c: Client, a: Pub) -> bool:
        pub = ""
        for i, (msg, size) in enumerate(a.msgs):
            outcome, r = self.call("ppub", partial(c.publish, TOPIC, make_body(msg, size)), msg=msg, idx=i,
                                   of=len(a.msgs))
            if outcome != OK:
                return self._abandon(c, PUBLISHER, r, pub=pub)
            pub = str(r["pub"])
        return self.sync(c, a.commit, PUBLISHER, pub=pub) == OK

    def receive(self, c: Client, a: Pub) -> bool:
        assert self.s.sub is not None
        name = self.s.sub[0]
        if not self.s.subscribed and not self.subscribe(c):
            return False
        got = 0
        for _ in range(a.receives):
            outcome, r = self.call("precv", partial(c.receive_pub, TOPIC, name, wait_ms=RECEIVE_WAIT_MS), sub=name)
            if outcome == FAIL and isinstance(r, NoMessageError):
                break
            if outcome == FAIL and isinstance(r, UnknownObjectError) and not got:
                # The subscription is gone: a non-durable one whose member restarted, a durable one a purge of the
                # topic's structure discarded (the checker ends it there), or a lost durable one (the checker finds
                # what it missed). Subscribe again at the next receive.
                self.s.subscribed = False
                return False
            if outcome != OK:
                return self._abandon(c, SUBSCRIBER, r, sub=name)
            got += 1
        if not got:
            return True
        return self.sync(c, a.commit, SUBSCRIBER, sub=name) == OK


def drain_subscribers(history: History, endpoints: Sequence[tuple[str, int]], token: str | None, *,
                      limit_s: float = DRAIN_S) -> dict[str, int]:
    """After healing: every durable subscriber receives and commits until nothing is left (a subscription held by
    a session a member has not yet ended refuses for a moment: tried again), then the subscriptions are listed."""
    deadline = time.monotonic() + limit_s
    s = PubSession(history, endpoints, DRAIN_CLIENT, token=token)
    drained = receipts = 0
    left: list[str] = []
    try:
        for name in DURABLE:
            while time.monotonic() < deadline:
                c = s.client()
                if c is None:
                    time.sleep(0.5)
                    continue
                receipts += 1
                runner = PubRunner(history, s, f"{DRAIN_CLIENT}.{receipts}")
                got, outcome, r = 0, OK, None
                while got < DRAIN_BATCH:
                    outcome, r = runner.call("precv", partial(c.receive_pub, TOPIC, name), sub=name)
                    if outcome != OK:
                        break
                    got += 1
                if outcome != OK and not (outcome == FAIL and isinstance(r, NoMessageError | UnknownObjectError)):
                    runner._abandon(c, SUBSCRIBER, r, sub=name)
                    time.sleep(0.3)
                    continue
                if got and runner.sync(c, True, SUBSCRIBER, sub=name) == OK:
                    drained += got
                if outcome != OK:
                    break  # nothing left for this subscriber
            else:
                left.append(name)
        c = s.client()
        if c is not None:
            PubRunner(history, s, f"{DRAIN_CLIENT}.list").call(
                "psubs", lambda: {"subs": {x["name"]: x["received"] for x in c.subscriptions(TOPIC)}})
    finally:
        s.close()
    return {"publications drained": drained, "subscribers not drained": len(left)}


def topic_queues() -> tuple[str, ...]:
    """The topic's companion queues (its publications, its subscriptions)."""
    return publication_queue(TOPIC), subscription_queue(TOPIC)


__all__ = ["DRAIN_CLIENT", "DURABLE", "LATE", "OFFLINE", "PUBLISHER", "SUBSCRIBER", "SUBSCRIBERS", "TOPIC",
           "TOPIC_ATTRS", "TOPIC_STRUCTURE", "Pub", "PubRunner", "PubSession", "drain_subscribers", "pub_plan",
           "topic_queues"]
