"""A kombu transport for the queue-sharing group: ``cfemu://`` URLs, so kombu and Celery applications run on it.

    import qsg.kombu_transport        # registers the "cfemu" scheme with kombu (kombu has no transport entry points)
    with kombu.Connection("cfemu://:TOKEN@127.0.0.1:40001;cfemu://:TOKEN@127.0.0.1:40002/APP1") as conn:
        q = conn.SimpleQueue("orders")
        q.put({"n": 1})
        m = q.get(timeout=5); m.ack()

The URL: the password is the application's service token (else ``$SQM_TOKEN``); host:port a member (``sqm run``);
more members as kombu's failover list (``;``-separated URLs) or ``transport_options["endpoints"]``; the virtual
host names the structure where a declared queue that does not exist is defined (default APP1). Celery: the same
URL as ``broker_url`` (docs/kombu.md).

The rules (docs/kombu.md says why):

* A publish (``_put``) is one request that puts the message and commits it, forced to the member's log before the
  reply: the producer is never told "sent" before the message is durable. A publish whose connection is lost in
  flight raises OutcomeUnknownError (a connection error to kombu: a retried publish may put the message twice).
* A delivery is a get under syncpoint on a connection of its own, held until the consumer settles it: ``ack``
  commits that unit of work (forced before it returns); ``reject(requeue=True)`` and ``requeue`` back it out (the
  message comes back, its backout count raised, ``delivery_info["redelivered"]`` set); ``reject(requeue=False)``
  commits it (the message is dropped, as AMQP drops it). A channel closed with unacknowledged deliveries backs
  them out; a consumer that dies drops its connections and the member (or, when the member died too, a peer's
  recovery) backs them out: a message is never lost, and is delivered again until one consumer acknowledges it
  (at-least-once: a consumer that dies after its work and before its ack has it done twice).
* One connection per unacknowledged delivery (idle ones are pooled): kombu's prefetch is how many a channel holds
  at once (``prefetch_count``: its first value at most ``max_unacked``, which also applies when the consumer sets
  none, and what the consumer raised it by since, at most ``max_raised``, as Celery does for each task with an ETA it
  holds).
* A held delivery's connection is pinged every ``keepalive_interval`` seconds (60), so that the member does not close
  it as idle (its ``--idle-timeout``) and back the delivery out while its consumer still works on it.
* Failover: every request fails over across all the members the URL names (the client's own failover: a unit of
  work open on a member that died is reported backed out, never guessed). Connecting checks the member of kombu's
  current URL, so kombu moves along its failover list when that one does not answer.
* Declaring a queue that does not exist defines it, which needs the operator token
  (``transport_options["operator_token"]``); without it an undefined queue is a channel error naming the fix.
* Priorities: kombu's 0-9 (9 first) are MQ's 0-9 (9 first), clamped. ``expiration`` is the message's expiry;
  ``delivery_mode=1`` (transient) makes a non-persistent message, anything else a persistent one.
* Exchanges and bindings live in the kombu connection (kombu's virtual broker state), as in every virtual transport
  without a server-side routing table: direct and topic routing of the declaring process; no fanout across
  processes (so Celery runs without remote control: ``--without-gossip --without-mingle --without-heartbeat``).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterable
from queue import Empty
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, virtual
from kombu.utils.json import dumps, loads
from kombu.utils.url import parse_url

from cfemu.credentials import redact
from cfemu.errors import (
    BackedOutError,
    MQError,
    NoMessageError,
    OutcomePendingError,
    OutcomeUnknownError,
    ResourceProblemError,
    StructureFailedError,
    UnknownObjectError,
)
from cfemu.keys import check_name
from cfemu.settings import ENV_TOKEN
from sqm.core.connection import Message as MQMessage
from sqm.service.client import Client, client_tls_context, parse_endpoint
from sqm.service.protocol import (
    OPERATOR,
    ConnectionLimitError,
    ProtocolError,
    QueueManagerUnavailableError,
    QuiescingError,
)

log = logging.getLogger("qsg.kombu_transport")

ALIAS = "cfemu"
DEFAULT_STRUCTURE = "APP1"
# The MQ user property that carries kombu's envelope (content type and encoding, headers, properties).
ENVELOPE_PROPERTY = "kombu"
# Unacknowledged deliveries a channel holds when its consumer sets no prefetch count (each holds a connection).
DEFAULT_MAX_UNACKED = 16
# max_raised by default, per max_unacked: room for the delayed tasks (Celery's ETAs and countdowns, a retry's among
# them) a worker holds, each one connection; more stall the tasks due now until one is due, fewer bound connections.
RAISED_PER_UNACKED = 4
# Idle connections a kombu connection keeps for its next deliveries.
IDLE_CLIENTS = 8
# Seconds between the pings that keep a held delivery's connection from the member's idle timeout (sqm run
# --idle-timeout, an hour by default), which would close it and so back the delivery out under its consumer.
DEFAULT_KEEPALIVE_INTERVAL = 60.0
MAX_PRIORITY = 9

# A member or the CF not answering: the request is retried (a publish) or the poll finds nothing this time (a get).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError, QueueManagerUnavailableError, ConnectionLimitError, QuiescingError, ProtocolError, BackedOutError,
    OutcomeUnknownError, StructureFailedError, ResourceProblemError)
# A commit that fails with one of these did not commit (or may not have: the unit of work is then left to the member).
COMMIT_ERRORS: tuple[type[BaseException], ...] = (MQError, *CONNECTION_ERRORS)
# A poll that meets one of these finds no message this time; the next poll tries again.
TRANSIENT_GET_ERRORS: tuple[type[BaseException], ...] = CONNECTION_ERRORS


def register() -> None:
    """Make ``cfemu://`` URLs resolve to this transport (done when this module is imported)."""
    TRANSPORT_ALIASES.setdefault(ALIAS, f"{__name__}:Transport")


def _endpoint_of_url(url: str) -> tuple[str, int]:
    if "://" in url:
        p = parse_url(url)
        if not p.get("hostname") or not p.get("port"):
            # the token hidden: an application logs the exception it is raised
            raise ValueError(f"bad cfemu URL {redact(url)!r}: use cfemu://:TOKEN@HOST:PORT/STRUCTURE")
        return str(p["hostname"]), int(p["port"])
    return parse_endpoint(url.rstrip("/"))


def _count_option(opts: dict[str, Any], name: str, default: int) -> int:
    """A transport option that counts (an int, or its text, at least 1): a bad one raises, naming it."""
    value = opts.get(name, default)
    try:
        if isinstance(value, bool | float):
            raise ValueError
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise ValueError(f"cfemu: transport option {name}={value!r}: not a whole number of at least 1")
    return n


MAX_SECONDS_OPTION = 86400.0


def _seconds_option(opts: dict[str, Any], name: str, default: float, *, positive: bool = False) -> float:
    """A transport option in seconds (a number, or its text; at least 0, or above 0 when ``positive``)."""
    value = opts.get(name, default)
    try:
        if isinstance(value, bool):
            raise ValueError
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    # At most a day: a thread waiting longer (the keep-alive's) overflows the clock, dying at its first wait.
    if not (seconds > 0 if positive else seconds >= 0) or seconds > MAX_SECONDS_OPTION:
        need = ("above 0" if positive else "0 or more") + f", at most {MAX_SECONDS_OPTION:.0f}"
        raise ValueError(f"cfemu: transport option {name}={value!r}: not a number of seconds {need}")
    return seconds


def _text_option(opts: dict[str, Any], name: str) -> str | None:
    """A transport option that is text (a token, a name), or None when not given; a token is never shown."""
    value = opts.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"cfemu: transport option {name}: not text but {type(value).__name__}")
    return value


def _clamp_priority(value: Any) -> int:
    try:
        return max(0, min(MAX_PRIORITY, int(value)))
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite float
        return MAX_PRIORITY if isinstance(value, float) and value > 0 else 0


def _expiry_ms(queue: str, expiration: Any) -> int:
    """A publish's ``expiration`` (ms, a number or its text, as AMQP's) as the message's expiry (0: none). One that
    is not a whole number of 0 or more is refused, as RabbitMQ refuses it: a negative one had the message expire
    before any get, the publish returning as if it were kept."""
    if expiration in (None, ""):
        return 0
    try:
        ms = float(expiration)
        if isinstance(expiration, bool) or not 0 <= ms < 2**62:
            raise ValueError
    except (TypeError, ValueError):
        raise ChannelError(f"cfemu: publish to {queue}: expiration {str(expiration)[:40]!r} is not a number of "
                           "milliseconds of 0 or more") from None
    return max(int(ms), 1)


# The envelope's fields and the types _put writes (None: absent).
_ENVELOPE_TYPES: dict[str, tuple[type, ...]] = {
    "content-type": (str, type(None)), "content-encoding": (str, type(None)), "headers": (dict, type(None)),
    "properties": (dict, type(None)), "text": (bool, type(None))}


def _envelope(m: MQMessage) -> tuple[dict[str, Any], str]:
    """The envelope ``m`` carries ({} when it has none), or ({}, the problem) when its property is not one that
    _put writes: JSON text of an object with those fields of those types, and no body encoding of its own (the
    body is the MQ message's as it is). Whether a text body decodes is _payload's to see (it decodes it)."""
    raw = m.properties.get(ENVELOPE_PROPERTY)
    if raw is None:
        return {}, ""
    if not isinstance(raw, str):
        return {}, f"not text but {type(raw).__name__}"
    try:
        env = loads(raw)
    except Exception as e:  # not JSON, or JSON kombu's decoding hooks refuse (a tagged value that is not one)
        return {}, f"not kombu's JSON: {e}"
    if not isinstance(env, dict):
        return {}, f"JSON {type(env).__name__}, not an object"
    for name, types in _ENVELOPE_TYPES.items():
        if not isinstance(env.get(name), types):
            return {}, f"its {name!r} is {type(env.get(name)).__name__}"
    props = env.get("properties") or {}
    if not isinstance(props.get("delivery_info"), dict | None):
        return {}, f"its delivery_info is {type(props.get('delivery_info')).__name__}"
    if props.get("body_encoding") is not None:
        return {}, f"its body_encoding is {props.get('body_encoding')!r}"
    return env, ""


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


class QoS(virtual.QoS):
    """Settles each delivery's unit of work: ack commits it, reject backs it out (requeue) or commits it (drop),
    and what is unacknowledged when the channel closes is backed out (never re-put: the message is still in its
    unit of work, and backing out returns it)."""

    _prefetch = 0  # the prefetch count the consumer set last (0: none)
    _first_prefetch = 0  # the first prefetch count the consumer set (0: none yet)

    @property
    def prefetch_count(self) -> int:
        return self._prefetch

    @prefetch_count.setter
    def prefetch_count(self, value: int) -> None:
        self._prefetch = value or 0
        if not self._first_prefetch:
            self._first_prefetch = self._prefetch

    def _limit(self) -> int:
        """Unacknowledged deliveries the channel may hold (each holds a connection to a member, which counts them
        against its connections per address): the consumer's first prefetch count, never more than
        ``max_unacked``, plus what it raised the count by since, at most ``max_raised`` (one consumer's rises must
        not take every connection its host may open to the member). Celery raises it by one for each task with an ETA
        or a countdown it holds unacknowledged until due, and lowers it again once the task ran, so that tasks due
        now keep coming (as kombu's own virtual transports, which honour any prefetch count): capped at
        ``max_unacked``, as many delayed tasks stalled every task due now behind them. Celery's
        ``worker_eta_task_limit`` bounds the rise (and so the connections delayed tasks hold)."""
        transport = self.channel.transport
        cap: int = transport.max_unacked
        first = self._first_prefetch or cap
        now = self._prefetch or cap
        return min(now, first, cap) + min(max(0, now - first), transport.max_raised)

    def can_consume(self) -> bool:
        return len(self._delivered) - len(self._dirty) < self._limit()

    def can_consume_max_estimate(self) -> int:
        return max(self._limit() - (len(self._delivered) - len(self._dirty)), 0)

    def ack(self, delivery_tag: str) -> None:
        try:
            self._open_transport("ack").settle(delivery_tag, commit=True)
        finally:
            self._quick_ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            self._open_transport("reject").settle(delivery_tag, commit=not requeue)
        finally:
            self._quick_ack(delivery_tag)

    def _open_transport(self, what: str) -> Transport:
        """The transport of the channel, or a connection error when the channel was closed: closing it backed its
        deliveries out, so an ack now acknowledges nothing (Celery logs "Couldn't ack" for a connection error)."""
        transport: Transport | None = self.channel.connection
        if transport is None:
            raise BackedOutError(f"cfemu: {what} of a delivery whose channel was closed: closing it backed the "
                                 "delivery out, and the message is delivered again")
        return transport

    def restore_unacked(self) -> list[Any]:
        self._flush()
        for tag in list(self._delivered):
            self.channel.transport.settle(tag, commit=False)
        self._delivered.clear()
        return []


class Channel(virtual.Channel):
    QoS = QoS
    # The body goes to the MQ message as it is (bytes, or text as UTF-8): no base64 around it.
    body_encoding: str | None = None  # type: ignore[assignment]
    min_priority, max_priority, default_priority = 0, MAX_PRIORITY, 0

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self._no_ack_queues: set[str] = set()

    @property
    def transport(self) -> Transport:
        transport: Transport = self.connection
        return transport

    # --- consuming ---------------------------------------------------------------------------------------------
    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        if queue is not None:
            self._no_ack_queues.discard(queue)
        return super().basic_cancel(consumer_tag)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """The next message of ``queue``, or None. A delivery to acknowledge holds a connection to the member until
        it is settled, so a channel holds at most as many as a consumer's prefetch allows (``max_unacked``):
        past that, ChannelError, before anything is taken (gets without acks once held a connection each, until
        the host's every connection to the member was taken and its other applications refused)."""
        if not no_ack and not self.qos.can_consume():
            raise ChannelError(f"cfemu: get from {queue}: this channel holds {len(self.qos._delivered)} deliveries "
                               f"not yet acknowledged, as many as it may (max_unacked {self.transport.max_unacked}, "
                               "or the prefetch count): acknowledge or reject one first")
        try:
            payload = self._take(queue, no_ack=no_ack)
        except Empty:
            return None
        message = self.Message(payload, channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def basic_recover(self, requeue: bool = False) -> Any:
        if requeue:
            return self.qos.restore_unacked()
        raise NotImplementedError("cfemu: recover(requeue=False) is not supported (a delivery is backed out)")

    def drain_events(self, timeout: float | None = None, callback: Any = None) -> None:
        """Deliver what is there, as many as the prefetch count allows (at least one, or Empty), as AMQP
        brokers push up to the prefetch count."""
        super().drain_events(timeout=timeout, callback=callback)
        callback = callback or self.connection._deliver
        for _ in range(self.transport.max_unacked):
            if self.closed or not self._consumers or not self.qos.can_consume():
                return
            try:
                self._poll(self.cycle, callback, timeout=0)
            except Empty:
                return

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        return self._take(queue, no_ack=queue in self._no_ack_queues)

    def _take(self, queue: str, *, no_ack: bool) -> dict[str, Any]:
        """The next message of ``queue``, taken under syncpoint on a connection of its own that holds it until the
        delivery is settled (``no_ack``: committed at once, as AMQP's no-ack consumers have it)."""
        t = self.transport
        client = t.checkout()
        try:
            m = client.get(queue, wait_ms=0)
        except NoMessageError:
            t.polls_answered()
            if client.uow_open:
                self._commit_backout_moves(client, queue)
            t.checkin(client)
            raise Empty() from None
        except TRANSIENT_GET_ERRORS as e:
            client.close()
            t.poll_failed(queue, e)
            raise Empty() from None
        except BaseException:
            client.close()
            raise
        t.polls_answered()
        tag = uuid.uuid4().hex
        payload = self._payload(m, queue, tag)
        if no_ack:
            try:
                client.commit()
            except OutcomePendingError as e:
                # Logged, completed when the structure is back: delivered, as a get outside syncpoint is
                # (docs/client.md, "Outcome pending"), never consumed for nobody.
                log.warning("cfemu: a no-ack delivery from %s with its commit pending: %s", queue, e)
            except OutcomeUnknownError as e:
                # The commit may have consumed it (the connection or the member's log failed during it): delivered
                # all the same, for a delivery twice is better than none; the connection is not reused.
                log.warning("cfemu: a no-ack delivery from %s with its commit's outcome not known: %s", queue, e)
                client.close()
                return payload
            except BaseException:
                client.close()
                raise
            t.checkin(client)
        else:
            t.hold(tag, client)
        return payload

    @staticmethod
    def _commit_backout_moves(client: Client, queue: str) -> None:
        """A get that found no message with its unit of work open: the get moved poison messages (backout count at
        the queue's threshold) to the backout queue on its way, and that is all the unit of work holds (the
        connection came from the pool with none). Committed, so that they reach the backout queue: backed out, a
        poison message alone on its queue went back to its head at every poll, its count climbing, never moved."""
        try:
            client.commit()
        except COMMIT_ERRORS as e:  # backed out with the connection (closed here): the next poll moves them again
            log.warning("cfemu: poison messages of %s moved to its backout queue, then the commit failed: %s",
                        queue, e)
            client.close()
            return
        log.warning("cfemu: poison messages of %s (backout count at its threshold) moved to its backout queue",
                    queue)

    @staticmethod
    def _payload(m: MQMessage, queue: str, tag: str) -> dict[str, Any]:
        """kombu's message for ``m``: its envelope applied, or none when ``m`` has none or a bad one (any application
        may put any property: a bad envelope is said, and the message delivered as an MQ application's message is,
        for the consumer to settle; it never stops the consumer's polls). Without an envelope the body is kombu's
        untyped data: text when it is UTF-8, else bytes (encoding "binary", which kombu does not decode)."""
        envelope, problem = _envelope(m)
        body: bytes | str = m.body
        if envelope.get("text"):
            try:
                body = m.body.decode()
            except UnicodeDecodeError:
                envelope, problem = {}, "its body is said to be text, and is not UTF-8"
        if problem:
            log.warning("cfemu: message %s on %s has a bad %r property (%s): delivered without kombu's envelope",
                        m.msgid.hex(), queue, ENVELOPE_PROPERTY, problem)
        props = dict(envelope.get("properties") or {})
        props["delivery_tag"] = tag
        props["priority"] = m.priority
        info = dict(props.get("delivery_info") or {})
        info.setdefault("routing_key", queue)
        info.setdefault("exchange", "")
        info["redelivered"] = m.backout_count > 0
        props["delivery_info"] = info
        encoding = envelope.get("content-encoding") if envelope else None if _is_utf8(m.body) else "binary"
        return {"body": body, "content-type": envelope.get("content-type"), "content-encoding": encoding,
                "headers": envelope.get("headers") or {}, "properties": props}

    # --- publishing ----------------------------------------------------------------------------------------------
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        """Put and commit in one request; the reply comes after the commit is forced to the member's log."""
        body = message.get("body")
        text = isinstance(body, str)
        data = body.encode() if isinstance(body, str) else bytes(body or b"")
        props = dict(message.get("properties") or {})
        props.pop("delivery_tag", None)
        envelope = {"content-type": message.get("content-type"),
                    "content-encoding": message.get("content-encoding"),
                    "headers": message.get("headers") or {}, "properties": props, "text": text}
        item = {"body": data, "priority": _clamp_priority(props.get("priority")),
                "persistent": props.get("delivery_mode") not in (1, "1"),
                "expiry_ms": _expiry_ms(queue, props.get("expiration")),
                "properties": {ENVELOPE_PROPERTY: dumps(envelope)}}
        self.transport.producer().put_batch([item], queue=queue, commit=True)

    # --- queues --------------------------------------------------------------------------------------------------
    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        self.transport.declare(queue)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.transport.exists(queue)

    def _size(self, queue: str) -> int:
        """The messages available on ``queue``, counted by a browse of at most ``size_limit`` of them (a queue
        that holds more reports that many)."""
        t = self.transport
        return len(t.producer().browse(queue, limit=t.size_limit))

    def _purge(self, queue: str) -> int:
        """Take every available message off ``queue``, committed batch by batch; returns how many."""
        n, client = 0, self.transport.producer()
        while True:
            got = client.get_batch(queue, 1000, commit=True)
            if not got:
                return n
            n += len(got)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        """Purge ``queue``: its definition stays (the service deletes no queue; an operator does, in the group)."""
        self._purge(queue)


class Transport(virtual.Transport):
    """One kombu connection: its members, its token, its pooled client connections and the deliveries they hold."""

    Channel = Channel
    driver_type = driver_name = "cfemu"
    default_port = None
    polling_interval = 0.1
    connection_errors = (*virtual.Transport.connection_errors, *CONNECTION_ERRORS)
    channel_errors = (*virtual.Transport.channel_errors, MQError, ValueError)  # type: ignore[assignment]
    implements = virtual.Transport.implements.extend(
        asynchronous=False, exchange_type=frozenset(["direct", "topic"]), heartbeats=False)

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        opts = client.transport_options or {}
        self.max_unacked = _count_option(opts, "max_unacked", DEFAULT_MAX_UNACKED)
        # What a consumer's raised prefetch count (Celery's delayed tasks) adds to max_unacked, at most.
        self.max_raised = _count_option(opts, "max_raised", RAISED_PER_UNACKED * self.max_unacked)
        self.size_limit = _count_option(opts, "size_limit", 1000)
        self.keepalive_interval = _seconds_option(opts, "keepalive_interval", DEFAULT_KEEPALIVE_INTERVAL)
        _seconds_option(opts, "polling_interval", self.polling_interval)  # kombu's own: checked here all the same
        self._client_args = self._client_arguments(client, opts)
        self._operator_token = _text_option(opts, "operator_token")
        vhost = (client.virtual_host or "").strip("/")
        try:
            self.structure = check_name("structure", vhost or _text_option(opts, "structure") or DEFAULT_STRUCTURE)
        except ValueError as e:
            raise ValueError(f"cfemu: {e} (the URL's virtual host, or transport option structure)") from None
        self._lock = threading.Lock()
        self._idle: list[Client] = []
        self._held: dict[str, Client] = {}
        self._producer: Client | None = None
        self._known: set[str] = set()
        self._poll_failing = False
        # Deliveries whose unit of work a keepalive found backed out (its connection lost): tag -> why.
        self._lost: dict[str, str] = {}
        # Held by a keepalive across the ping of a held connection and the look at its unit of work after it, and by
        # a settle as it takes the delivery's connection: a ping that reconnected (its unit of work gone with the old
        # connection) is seen before a commit could run on the new connection and report the delivery acknowledged.
        self._alive_lock = threading.Lock()
        self._keepalive: threading.Thread | None = None
        self._keepalive_stop = threading.Event()

    @staticmethod
    def _client_arguments(conninfo: Any, opts: dict[str, Any]) -> dict[str, Any]:
        """The members (kombu's current URL first, then its failover list and ``endpoints``), the token, TLS."""
        endpoints: list[tuple[str, int]] = []
        if conninfo.hostname and conninfo.port:
            endpoints.append((str(conninfo.hostname), int(conninfo.port)))
        more = opts.get("endpoints", ())
        if isinstance(more, str):
            more = [more]
        if not isinstance(more, list | tuple):
            raise ValueError(f"cfemu: transport option endpoints={redact(repr(more))}: not a list of 'HOST:PORT'")
        for alt in conninfo.alt or ():
            ep = _endpoint_of_url(alt) if isinstance(alt, str) else parse_endpoint(alt)
            if ep not in endpoints:
                endpoints.append(ep)
        for alt in more:
            try:
                ep = _endpoint_of_url(alt) if isinstance(alt, str) else parse_endpoint(alt)
            except (TypeError, ValueError) as e:
                raise ValueError(f"cfemu: transport option endpoints: {redact(str(e))}") from None
            if ep not in endpoints:
                endpoints.append(ep)
        if not endpoints:
            raise ValueError("cfemu: no member given: use cfemu://:TOKEN@HOST:PORT/")
        token = conninfo.password or _text_option(opts, "token") or os.environ.get(ENV_TOKEN)
        args: dict[str, Any] = {
            "endpoints": endpoints, "token": token, "client_name": _text_option(opts, "client_name") or "kombu",
            "connect_timeout": _seconds_option(opts, "connect_timeout", conninfo.connect_timeout or 5, positive=True),
            "request_timeout": _seconds_option(opts, "request_timeout", 30.0, positive=True),
            "reconnect_timeout": _seconds_option(opts, "reconnect_timeout", 15.0)}
        ssl = conninfo.ssl
        if ssl:
            if isinstance(ssl, dict):
                args["tls"] = client_tls_context(ssl.get("ca"), ssl.get("cert"), ssl.get("key"),
                                                 check_hostname=bool(ssl.get("check_hostname", True)))
            elif ssl is not True:
                args["tls"] = ssl  # an ssl.SSLContext
            else:
                args["tls"] = client_tls_context()
        return args

    def new_client(self, **overrides: Any) -> Client:
        args = {**self._client_args, **overrides}
        return Client(args.pop("endpoints"), connect=False, **args)

    # --- the connection --------------------------------------------------------------------------------------
    def establish_connection(self) -> Any:
        """Check that the member of kombu's current URL answers (so kombu moves along its failover list when it
        does not), then open channels; requests later fail over across all the members named."""
        with self.new_client(endpoints=self._client_args["endpoints"][:1], reconnect_timeout=0) as probe:
            probe.ping()
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)
        finally:
            self._keepalive_stop.set()
            with self._lock:
                clients = [*self._idle, *self._held.values(), *([self._producer] if self._producer else [])]
                self._idle, self._held, self._producer = [], {}, None
                self._lost.clear()
            for c in clients:
                c.close()  # a unit of work still open is backed out by the member

    def verify_connection(self, connection: Any) -> bool:
        return True

    # --- client connections: one per delivery, pooled -----------------------------------------------------
    def producer(self) -> Client:
        """The connection that publishes, browses and purges (never holds a unit of work between requests)."""
        with self._lock:
            if self._producer is None:
                self._producer = self.new_client()
            return self._producer

    def checkout(self) -> Client:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self.new_client()

    def checkin(self, client: Client) -> None:
        if client.uow_open:
            client.close()
            return
        with self._lock:
            if len(self._idle) < IDLE_CLIENTS:
                self._idle.append(client)
                return
        client.close()

    def poll_failed(self, queue: str, e: BaseException) -> None:
        """A poll that found no member or no CF: said once, then again once polls are answered."""
        if not self._poll_failing:
            log.warning("cfemu: get from %s failed, polling on until the group answers: %s", queue, e)
        self._poll_failing = True

    def polls_answered(self) -> None:
        if self._poll_failing:
            log.warning("cfemu: polls are answered again")
        self._poll_failing = False

    def hold(self, tag: str, client: Client) -> None:
        with self._lock:
            self._held[tag] = client
            keepalive = self._keepalive
            if self.keepalive_interval and (keepalive is None or not keepalive.is_alive()
                                            or self._keepalive_stop.is_set()):
                self._keepalive_stop = threading.Event()
                self._keepalive = threading.Thread(target=self._keep_alive, args=(self._keepalive_stop,),
                                                   name="cfemu-keepalive", daemon=True)
                self._keepalive.start()

    def _keep_alive(self, stop: threading.Event) -> None:
        """Until the kombu connection closes: ping each held delivery's connection every ``keepalive_interval``, so
        that the member never closes it as idle while its consumer works on the message (a Celery task longer than
        the idle timeout, a task with an ETA): closed, its unit of work would be backed out and the message
        delivered to another consumer while the first one still works on it."""
        while not stop.wait(self.keepalive_interval):
            with self._lock:
                held = list(self._held.items())
            for tag, client in held:
                if stop.is_set():
                    return
                self._ping_held(tag, client)

    def _ping_held(self, tag: str, client: Client) -> None:
        with self._alive_lock:
            with self._lock:
                if self._held.get(tag) is not client:
                    return  # settled meanwhile
            problem = ""
            try:
                client.ping()
            except Exception as e:  # the member gone: the unit of work is gone with the connection
                problem = str(e) or type(e).__name__
            with self._lock:
                if self._held.get(tag) is not client:
                    # The kombu connection closed meanwhile (a settle waits for this lock): its clients are closed,
                    # and this one again, should the ping have reconnected it.
                    client.close()
                    return
                if client.uow_open:
                    return
                del self._held[tag]
                why = self._lost[tag] = problem or "the connection was lost, and the ping went to a new one"
        client.close()
        log.warning("cfemu: a held delivery's connection was lost (%s): its unit of work was backed out, and the "
                    "message is delivered again; its ack will raise", why)

    def settle(self, tag: str, *, commit: bool) -> None:
        """End the unit of work of a delivery: commit it (ack, or reject without requeue) or back it out. A commit
        that fails raises (BackedOutError: the message comes back; OutcomeUnknownError: it may have); a backout
        that fails needs nothing more: the member backs the unit of work out when its connection drops."""
        with self._alive_lock, self._lock:
            client = self._held.pop(tag, None)
            lost = self._lost.pop(tag, None)
        if lost is not None:
            if commit:
                raise BackedOutError(f"cfemu: the delivery's connection was lost while it was held ({lost}): its "
                                     "unit of work was backed out, and the message is delivered again")
            return
        if client is None:
            return  # settled already, or its connection was closed (backed out)
        try:
            if commit:
                client.commit()
            else:
                client.backout()
        except CONNECTION_ERRORS as e:
            client.close()
            if commit:
                raise
            log.info("cfemu: backout of a delivery: %s (its connection is closed: backed out)", e)
            return
        except BaseException:
            client.close()
            raise
        self.checkin(client)

    # --- queues ------------------------------------------------------------------------------------------------
    def exists(self, queue: str) -> bool:
        try:
            self.producer().browse(check_name("queue", queue), limit=1)
        except UnknownObjectError:
            return False
        return True

    def declare(self, queue: str) -> None:
        """Make sure ``queue`` is defined in the group: define it in the structure when it is not (operator)."""
        try:
            check_name("queue", queue)
        except ValueError as e:
            raise ChannelError(f"cfemu: {e} (an MQ queue name)") from None
        if queue in self._known or self.exists(queue):
            self._known.add(queue)
            return
        if not self._operator_token:
            raise ChannelError(
                f"cfemu: queue {queue!r} is not defined in the group: define it (cfemu define queue {queue} "
                f"--structure {self.structure}) or give the operator token (transport_options['operator_token']) "
                "so that declaring defines it")
        with self.new_client(token=self._operator_token, role=OPERATOR) as admin:
            try:
                admin.define_queue(queue, self.structure)
            except MQError:
                if not self.exists(queue):  # another declarer may have defined it first
                    raise
        self._known.add(queue)

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"hostname": "127.0.0.1", "port": None}


def members_url(endpoints: Iterable[tuple[str, int]], token: str, structure: str = DEFAULT_STRUCTURE) -> str:
    """A failover URL naming every member: ``cfemu://:TOKEN@h1:p1/S;cfemu://:TOKEN@h2:p2/S``."""
    return ";".join(f"{ALIAS}://:{token}@{h}:{p}/{structure}" for h, p in endpoints)


register()

__all__ = ["ALIAS", "Channel", "QoS", "Transport", "members_url", "register"]
