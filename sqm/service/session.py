"""A connection's session and the server's counts of its connections, requests and refusals.

The counts are what the metrics show (sqm.service.metrics), with bounded label values: an op label is never taken
from what a peer sent (``op_label``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sqm.conversations.conversation import Conversation
from sqm.core.client_watch import ClientWatch
from sqm.core.connection import Connection
from sqm.core.lifecycles import Begun
from sqm.operations import short
from sqm.pubsub.publication_bounds import Holder
from sqm.pubsub.pubsub import PubSubSession
from sqm.service.ops import OPS
from sqm.service.protocol import ENVELOPE, MESSAGE_COST

log = logging.getLogger("sqm.service.server")

# The bounded label values of the security metrics (sqm.service.metrics).
AUTH_FAILURE_REASONS = ("bad_proof", "bearer_in_clear", "not_authenticated", "malformed", "frame_too_large",
                        "timeout")
LIMITS = ("server", "peer")  # a full pool of unauthenticated connections makes room instead (evicted)
CLOSE_REASONS = ("auth_timeout", "idle_timeout", "evicted")
AUTH_METHODS = ("challenge", "bearer", "none")
OP_LABEL_UNKNOWN = "?"  # any op name not in OPS: a label is never taken from what a peer sent
_KNOWN = frozenset(OPS)


def op_label(op: str) -> str:
    return op if op in _KNOWN else OP_LABEL_UNKNOWN


def certificate_subject(cert: dict[str, Any] | None) -> str | None:
    """The subject of the certificate a client presented, as verified by mutual TLS (``peercert`` of the
    connection's SSL object: filled only when the member required and checked one), e.g. ``CN=payroll,O=Bank``;
    None without one."""
    if not cert:
        return None
    short_names = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
                   "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST"}
    parts = [f"{short_names.get(k, k)}={v}" for rdn in cert.get("subject", ()) for k, v in rdn]
    return ",".join(parts) or None


@dataclass
class Session:
    """One client connection: its worker thread and its MQ connection handle."""

    number: int
    peer: str
    executor: ThreadPoolExecutor
    authenticated: bool
    request_limit: int  # the longest frame accepted from the client: small until it has authenticated
    reply_limit: int  # the longest frame sent to it: the server's limit, or the client's when smaller
    peer_ip: str = "?"
    tls: bool = False
    certificate: str | None = None  # the subject of its client certificate, verified by mutual TLS (--tls-ca)
    opened: float = 0.0  # loop time of the accept
    role: str | None = None  # once authenticated: APPLICATION or OPERATOR
    auth_method: str | None = None  # how the role was established, once authenticated (AUTH_METHODS)
    said_hello: bool = False
    client_name: str = ""  # what the client's hello says it is: claimed, never checked (any name, any connection)
    client_max: int = 0  # the client's frame limit from its hello (0: it gave none)
    nonce: bytes = b""  # the challenge of this connection (the server's, fresh at each hello)
    client_nonce: bytes = b""
    conn: Connection | None = None
    conversation: Conversation | None = None  # made by logon (sqm.conversations.conversation); closed with the connection
    pubsub: PubSubSession | None = None  # made by the first publish or receive_pub; backed out with it
    gone: ClientWatch = field(default_factory=ClientWatch)  # the client disconnected
    reading: asyncio.Task[Any] | None = None  # the read of the next frame, when one is pending
    reserved: int = 0  # bytes of the member's budget this connection holds (ByteBudget; under its lock)
    # What DISPLAY CONN shows of it (sqm.service.conn_ops): wall-clock times, its requests, the queues it used.
    connected: float = field(default_factory=time.time)
    last_request: float = 0.0
    served: int = 0  # requests dispatched to a handler (refused ones are not counted)
    queues: set[str] = field(default_factory=set)  # queues it put to, got from or browsed

    @property
    def named(self) -> str:
        """The client's name as a log line repeats it: quoted, bounded, escaped (it is whatever the client said)."""
        return short(self.client_name) if self.client_name else "no name"

    def uow_open(self) -> bool:
        """Has the connection's UOW done anything (an empty UOW is not worth reporting as open)?"""
        return self.conn is not None and self.conn.uow is not None and self.conn.uow.operations > 0

    def flags(self) -> dict[str, bool]:
        """What every reply tells the client of the connection's state: its UOW open, its session holding one."""
        flags = {"uow": self.uow_open()}
        if self.conversation is not None:
            c = self.conversation
            flags["held"] = c.sending is not None or c.receiving is not None
        if self.pubsub is not None:
            flags["ps_held"] = self.pubsub.draft is not None or bool(self.pubsub.held)
        return flags


    def reply_room(self, messages: int = 1) -> int:
        """The bytes of message data a reply carrying ``messages`` messages has room for."""
        return self.reply_limit - ENVELOPE - MESSAGE_COST * messages


@dataclass
class Stats:
    """Counts shared by the event loop and the connections' threads (those a thread changes: under ``lock``)."""

    connections: int = 0
    accepted: int = 0
    unauthenticated: int = 0  # connections open that have not authenticated
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)  # (op label, result)
    auth_failures: Counter[str] = field(default_factory=Counter)  # reason (AUTH_FAILURE_REASONS)
    authenticated: Counter[tuple[str, str]] = field(default_factory=Counter)  # (role, method)
    refused: Counter[str] = field(default_factory=Counter)  # limit (LIMITS)
    closed: Counter[str] = field(default_factory=Counter)  # reason (CLOSE_REASONS)
    peers: Counter[str] = field(default_factory=Counter)  # open connections per address (no zero entries)
    inflight: int = 0  # requests running (the shutdown waits for them, up to its grace)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, key: tuple[str, str]) -> None:
        """One more request of (op label, result)."""
        with self.lock:
            self.requests[key] += 1


@dataclass
class Together:
    """Requests of several connections run as one batch (SQMServer.begin_together, finish_together): each
    one's reply once known (None: to run by dispatch, or not finished yet)."""

    requests: list[tuple[Session, int, str, dict[str, Any]]]
    replies: list[dict[str, Any] | None]
    index: list[int] = field(default_factory=list)  # the requests begun together, in the order of begun's calls
    begun: Begun | None = None
    started: float = 0.0  # perf_counter when they began (their op_seconds)

    @property
    def forces(self) -> bool:
        """Whether finishing the batch forces the log: it decided commits (else, puts and gets under syncpoint and
        refusals, its replies need no fsync and no round trip more)."""
        return self.begun is not None and self.begun.decided is not None and bool(self.begun.decided.uows)


class ByteBudget:
    """The bytes of requests (and replies) in flight on a member, held to ``limit``; with them the bytes of the
    publications being published (sqm.pubsub.publication_bounds), which a member holds from each message's publish
    to the publication's COMMIT or BACKOUT.

    A frame longer than ``free`` bytes reserves its declared length before its body is read and gives it back
    once its reply is sent or its connection ends; a frame of at most ``free`` bytes reserves nothing (each
    connection reads one frame at a time, so those cost at most ``free`` per connection). A reply longer than
    ``free`` is counted too (``hold``), never refused (its work is done): while replies hold the budget, new large
    requests wait. Shared by the event loop and the connections' threads."""

    def __init__(self, limit: int, free: int) -> None:
        self.limit = limit
        self.free = free
        self.used = 0
        self.peak = 0
        self.waits = 0  # reservations that had to wait for bytes to come back
        self.refused = 0  # reservations that waited their bound in vain
        self._cond = threading.Condition()

    def reserve(self, holder: Holder, n: int, wait_s: float) -> bool:
        """Reserve n bytes for holder, waiting up to wait_s for them; False when they did not come back."""
        with self._cond:
            if self.used + n > self.limit:
                self.waits += 1
                deadline = time.monotonic() + wait_s
                while self.used + n > self.limit:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.refused += 1
                        return False
                    self._cond.wait(left)
            self._take(holder, n)
            return True

    def try_reserve(self, holder: Holder, n: int) -> bool:
        """Reserve n bytes for holder if they are free now (the event loop's form: it must not block)."""
        with self._cond:
            if self.used + n > self.limit:
                return False
            self._take(holder, n)
            return True

    def note(self, *, waited: bool = False, refused: bool = False) -> None:
        """Count a wait or a refusal of the event loop's (try_reserve) form."""
        with self._cond:
            self.waits += waited
            self.refused += refused

    def hold(self, holder: Holder, n: int) -> None:
        """Count n bytes for holder whatever the limit (a reply, whose work is done)."""
        with self._cond:
            self._take(holder, n)

    def _take(self, holder: Holder, n: int) -> None:
        self.used += n
        holder.reserved += n
        self.peak = max(self.peak, self.used)

    def release(self, holder: Holder, n: int | None = None) -> None:
        """Give back n of holder's bytes (None: all it holds, at the end of its connection)."""
        with self._cond:
            n = holder.reserved if n is None else min(n, holder.reserved)
            if n <= 0:
                return
            holder.reserved -= n
            self.used -= n
            self._cond.notify_all()


class Warnings:
    """Warnings about what peers do, at most once a second per key (a flood must not flood the log)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(key, 0.0) >= 1.0:
            self._last[key] = now
            log.warning(msg, *args)


__all__ = ["AUTH_FAILURE_REASONS", "ByteBudget", "Holder", "AUTH_METHODS", "CLOSE_REASONS", "LIMITS", "OP_LABEL_UNKNOWN", "Session",
           "Stats", "Together", "Warnings", "op_label"]
