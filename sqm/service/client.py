"""The client library: a connection to an SQM server with the same API shape as sqm.core.connection.Connection.

    with Client(["127.0.0.1:7001", "127.0.0.1:7002"], token=settings.token) as c:
        with c.unit_of_work():
            c.put("Q1", b"hello")
        m = c.get("Q1", wait_ms=1000)
        c.commit()

A Client is one connection handle (like MQCONN): it holds at most one unit of work, on the server it is
connected to. It takes a list of endpoints and moves to the next one when its connection dies. What the
application is told then depends on what was at stake, and the library never guesses:

* a UOW was open (or the request was a put or get under syncpoint): the server backs that UOW out (or peer
  recovery does, when the server died), so the call raises BackedOutError; a syncpoint put or get that started
  a new UOW is instead re-sent once on the next endpoint, since its first attempt is backed out either way;
* the connection died while a commit was in flight: OutcomeUnknownError (it may or may not have committed);
  the same for prepare, resolve, define and put/get outside syncpoint, which take effect on their own;
* read-only requests (ping, browse, status, indoubt) are simply re-sent on the next endpoint;
* the server answered that a commit is logged but pending (a structure failed, being restored, or the CF
  unreachable): OutcomePendingError, a kind of OutcomeUnknownError (MQRC_OUTCOME_PENDING, 2124): it completes when
  the structure is back, unless a restore that read the logs before it backed it out. A get outside syncpoint
  (and a conversation's receive of a message outside a unit of work) so answered delivers its message with the
  error, in ``.message`` (a Message; a receive's reply map).

Conversations (sqm.conversations.conversation; docs/uow.md): ``logon(user, token)`` makes this connection's session on the
server; ``send``, ``receive`` and ``syncpoint`` use it. The session lives as long as the connection: when the
connection is lost the server ends it, backing out what it held, and the application logs on again (with the same
user id and token, LAST and QUERY find its work). So a lost connection during a conversation request is never
hidden by a re-send: a COMMIT (or EOC, EOCCANCEL, a send with ``commit``) in flight raises OutcomeUnknownError
(ask QUERY or LAST after logging on again); one that held a UOW, or a send or receive in flight, BackedOutError;
otherwise SessionLostError. Only a logon is re-sent on the next endpoint.

Errors from the server come back as the same exception classes (cfemu.errors), with their MQ reason codes.

Authentication: ``token`` is the token of ``role`` (application, the default, or operator; an application gets
it from the group's secrets, service.token, or $SQM_TOKEN: cfemu.settings). It never leaves this process: the
client answers the server's challenge with an HMAC of it, and checks the server's own answer, so a server that
does not hold the same token is refused (NotAuthorizedError) before any request is sent, and so is a server that
says it needs no authentication, unless ``allow_unauthenticated`` (a member run with --no-auth). A wrong token fails at
once (NotAuthorizedError, not retried); a server at its connection limit (ConnectionLimitError) is treated like
one that does not answer: the next endpoint is tried.

Sizes: ``max_frame`` is the longest frame this client accepts (by default one that carries any message a queue
can hold); the hello tells the server, and the server's reply says the longest request it accepts. A put whose
request is longer than the smaller of the two is refused here, before anything is sent, with
MessageTooBigForChannelError (MQRC_MSG_TOO_BIG_FOR_CHANNEL), and the unit of work is left as it was; a get
whose message a reply could not carry fails with TruncatedMessageError and the message stays on its queue; a
browse returns the messages one reply carries, with ``more`` set when it left some out.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from cfemu.cf import Browsed
from cfemu.errors import BackedOutError, BadRequestError, MQError, OutcomePendingError, OutcomeUnknownError
from sqm.core.connection import Message
from sqm.core.messaging import UnitOfWorkScope
from sqm.service.client_conversations import ConversationCalls
from sqm.service.client_pubsub import PubSubCalls
from sqm.service.client_wire import Wire
from sqm.service.ops import OPERATIONS
from sqm.service.protocol import (
    APPLICATION,
    AUTH_METHOD,
    DEFAULT_MAX_FRAME,
    HEADER,
    MAX_BATCH,
    MIN_FRAME,
    PRE_HELLO_MAX_FRAME,
    PROOF_BYTES,
    PROTOCOL_VERSION,
    ROLES,
    FrameTooLargeError,
    MessageTooBigForChannelError,
    NotAuthorizedError,
    ProtocolError,
    QueueManagerUnavailableError,
    QuiescingError,
    auth_proof,
    auth_transcript,
    encode_frame,
    error_from_wire,
    message_from_wire,
    new_nonce,
    recv_frame,
)

log = logging.getLogger("sqm.service.client")

Endpoint = tuple[str, int]
EndpointSpec = str | Endpoint

# How a request may be treated when the connection dies under it: as its row says (sqm.operations.Operation); a
# conversation's and a publish/subscribe request's by what its session held.
READ_ONLY = frozenset(op.name for op in OPERATIONS if op.read_only)
TAKES_EFFECT_ALONE = frozenset(op.name for op in OPERATIONS if op.alone)
CONVERSATION_OPS = frozenset(OPERATIONS.names("conversation"))
PUBSUB_OPS = frozenset(OPERATIONS.names("pubsub"))


def parse_endpoint(spec: EndpointSpec) -> Endpoint:
    """'host:port' or (host, port) -> (host, port); a bad one raises ValueError naming it."""
    if isinstance(spec, tuple):
        host, port = spec
    else:
        host, sep, port_text = str(spec).rpartition(":")
        if not sep or not port_text.isdigit():
            raise ValueError(f"bad endpoint {spec!r}: use host:port")
        port = int(port_text)
    if not host or not 0 < int(port) < 65536:
        raise ValueError(f"bad endpoint {spec!r}: use host:port with a port 1-65535")
    return str(host), int(port)


def client_tls_context(ca: str | None = None, cert: str | None = None, key: str | None = None, *,
                       check_hostname: bool = True) -> ssl.SSLContext:
    """A TLS context for Client: verify the server with ``ca``; present ``cert``/``key`` for mutual TLS. A file that
    cannot be read or holds no certificate (or key) is a ValueError naming it, in one line."""
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"TLS: the CA file {ca}: {_tls_reason(e)}") from None
    ctx.check_hostname = check_hostname
    if cert:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"TLS: the certificate {cert}" + (f" or its key {key}" if key else "")
                             + f": {_tls_reason(e)}") from None
    return ctx


def _tls_reason(e: OSError) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror and not isinstance(e, ssl.SSLError) else (
        f"not PEM or not a match ({getattr(e, 'reason', None) or e})")


def _result(reply: Any) -> dict[str, Any]:
    """The result of a handshake reply, or its error raised."""
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise error_from_wire(reply.get("error") if isinstance(reply, dict) else reply)
    result = reply.get("result")
    if not isinstance(result, dict):
        raise ProtocolError(f"malformed handshake reply: {reply!r:.200}")
    return result


def handshake(sock: socket.socket, *, token: str | None, role: str = APPLICATION, client_name: str = "",
              max_frame: int = DEFAULT_MAX_FRAME, where: str = "the server",
              allow_unauthenticated: bool = False) -> dict[str, Any]:
    """Say hello on a connected socket and authenticate (sqm.service.protocol): answer the server's challenge with
    the token's HMAC and check the server's answer, which shows it holds the same token. Returns the hello's
    result. For raw clients too (the chaos suite's), which then speak frames themselves.

    A client that holds a token refuses a server that says it needs none, unless allow_unauthenticated: a server
    of the group proves it holds the token, and anything that can answer on the member's address (a local user who
    took its port while it was down, or whoever sits in the path of a connection without TLS) could otherwise say
    "no authentication" and be sent the client's requests, their messages and its logon tokens in clear."""
    nonce = new_nonce()
    sock.sendall(encode_frame({"id": 0, "op": "hello", "args": {
        "client": client_name, "max_frame": max_frame, "version": PROTOCOL_VERSION, "nonce": nonce}}))
    # Until the server has proven it holds the token, its replies are a stranger's: as short as a peer's frames before
    # it authenticates, and decoded within a request's bounds (a handshake reply is a small map).
    hello = _result(recv_frame(sock, PRE_HELLO_MAX_FRAME, trusted=False))
    auth = hello.get("auth") or {}
    where = f"{hello.get('qmgr', '?')} at {where}"
    if not auth.get("required"):
        if token is not None and not allow_unauthenticated:
            raise NotAuthorizedError(
                f"{where} says it needs no authentication, and this client holds a {role} token: refused before "
                "any request was sent (a server of the group proves it holds the token; this one may be an "
                "impostor). For a member run with --no-auth, connect without a token or with allow_unauthenticated")
        return hello  # a server run with --no-auth (loopback only)
    if token is None:
        raise NotAuthorizedError(f"{where} requires authentication and this client has no token: give the {role} "
                                 "token (the group's secrets directory, or $SQM_TOKEN)")
    if AUTH_METHOD not in auth.get("methods", ()) or not isinstance(auth.get("nonce"), bytes):
        raise ProtocolError(f"{where} offers no authentication this client knows: {auth.get('methods')!r:.100}")

    def transcript(side: str) -> bytes:
        return auth_transcript(side, role=role, server_nonce=auth["nonce"], client_nonce=nonce,
                               qmgr=str(hello.get("qmgr", "")), session=int(hello.get("session", 0)),
                               client=client_name, client_max_frame=max_frame,
                               server_max_frame=int(hello.get("max_frame", 0)))

    sock.sendall(encode_frame({"id": 0, "op": "auth", "args": {
        "role": role, "proof": auth_proof(token, transcript("client"))}}))
    done = _result(recv_frame(sock, PRE_HELLO_MAX_FRAME, trusted=False))
    proof = done.get("proof")
    if not (isinstance(proof, bytes) and len(proof) == PROOF_BYTES
            and hmac.compare_digest(proof, auth_proof(token, transcript("server")))):
        raise NotAuthorizedError(f"{where} did not prove it holds the {role} token: not the group's server (or "
                                 "another group's); nothing was sent")
    return {**hello, **done}


class BatchError(MQError):
    """A batch (Client.put_batch, Client.get_batch) one of whose messages was refused. ``cause``: that refusal, the
    exception a single put or get would have raised (its reason code is this one's); ``done``: the messages that
    took effect, in order: in the unit of work, which stays open (commit or back it out), or committed when
    ``committed`` (a batch outside syncpoint, whose done messages are committed as single puts would be). A
    ``get_batch`` with ``commit`` whose commit is logged but pending (``cause`` an OutcomePendingError), or whose
    outcome is not known (``cause`` an OutcomeUnknownError: the log failed as its COMMIT was written), delivers its
    messages in ``done``: taken, their get completing when the structure is back, or decided by the member's
    restart (docs/client.md)."""

    def __init__(self, cause: MQError, done: list[Message], committed: bool) -> None:
        what = ("their commit pending" if isinstance(cause, OutcomePendingError) else
                "their commit's outcome not known" if isinstance(cause, OutcomeUnknownError) else "one refused")
        super().__init__(f"{len(done)} message(s) of the batch done{' and committed' if committed else ''}, "
                         f"{what}: {cause}")
        self.cause, self.done, self.committed = cause, done, committed
        self.reason, self.reason_name = cause.reason, cause.reason_name


class Client(ConversationCalls, PubSubCalls, UnitOfWorkScope):
    """A connection handle to the queue-sharing group through one of its SQM servers."""

    def __init__(self, endpoints: EndpointSpec | Sequence[EndpointSpec], port: int | None = None, *,
                 token: str | None = None, role: str = APPLICATION, tls: ssl.SSLContext | None = None,
                 client_name: str = "",
                 connect_timeout: float = 5.0, request_timeout: float = 30.0, reconnect_timeout: float = 15.0,
                 max_frame: int = DEFAULT_MAX_FRAME, connect: bool = True,
                 allow_unauthenticated: bool = False, first_connect_timeout: float | None = None) -> None:
        if port is not None:
            specs: list[EndpointSpec] = [(str(endpoints), port)]
        elif isinstance(endpoints, str | tuple):
            specs = [endpoints]
        else:
            specs = list(endpoints)
        if not specs:
            raise ValueError("no endpoints given")
        self.endpoints = [parse_endpoint(e) for e in specs]
        if max_frame < MIN_FRAME:
            raise ValueError(f"max_frame must be at least {MIN_FRAME} bytes, not {max_frame}")
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        self.token = token
        self.role = role
        # A member run with --no-auth is refused to a client holding a token unless this says so (handshake).
        self.allow_unauthenticated = allow_unauthenticated
        self.tls = tls
        self.client_name = client_name
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.reconnect_timeout = reconnect_timeout
        # The first connection's whole time (every attempt, each capped at it), where a command line fails at once
        # on a server that is not there; None: reconnect_timeout, as every later connection.
        self.first_connect_timeout = first_connect_timeout
        self._connected = False  # a connection has been made once
        self.own_max_frame = max_frame  # the longest frame this client accepts: told to every server at hello
        self.max_frame = max_frame  # the longest frame either side accepts on the current connection
        self.qmgr = ""  # name of the queue manager currently connected to
        self.endpoint: Endpoint | None = None
        self._index = 0
        self._wire: Wire | None = None  # the connection to the server now, if any
        self._ids = itertools.count(1)
        self._uow_open = False
        self._user: str | None = None  # the user id this connection's session logged on with
        self._ps_held = False  # the publish/subscribe session holds something (the server says, in each reply)
        self._held = False  # the session holds a unit of work (sent or received, not settled): the server says
        self._lock = threading.Lock()
        if connect:
            with self._lock:
                self._connect()

    # --- connection management -------------------------------------------------------------------------
    def _connect(self) -> None:
        """Connect to the next endpoint that answers, round robin, for up to reconnect_timeout seconds
        (first_connect_timeout for the first connection, when given)."""
        first = None if self._connected else self.first_connect_timeout
        deadline = time.monotonic() + (self.reconnect_timeout if first is None else first)
        problems: dict[Endpoint, str] = {}
        while True:
            for _ in range(len(self.endpoints)):
                ep = self.endpoints[self._index % len(self.endpoints)]
                try:
                    self._open(ep, None if first is None else max(deadline - time.monotonic(), 0.05))
                    self._connected = True
                    return
                except NotAuthorizedError:
                    raise
                except (OSError, MQError) as e:
                    problems[ep] = str(e)
                    self._index += 1
            if time.monotonic() >= deadline:
                detail = "; ".join(f"{h}:{p}: {why}" for (h, p), why in problems.items())
                raise QueueManagerUnavailableError(f"no queue manager answered: {detail}")
            time.sleep(0.2)

    def _open(self, ep: Endpoint, within: float | None = None) -> None:
        """Connect to ``ep`` and shake hands; ``within``: the most both may take (None: connect_timeout for the
        connection, request_timeout for the handshake)."""
        sock = socket.create_connection(ep, timeout=self.connect_timeout if within is None else
                                        min(self.connect_timeout, within))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=ep[0])
            sock.settimeout(self.request_timeout if within is None else min(self.request_timeout, within))
            hello = handshake(sock, token=self.token, role=self.role, client_name=self.client_name,
                              max_frame=self.own_max_frame, where=f"{ep[0]}:{ep[1]}",
                              allow_unauthenticated=self.allow_unauthenticated)
            max_frame = min(self.own_max_frame, int(hello.get("max_frame", self.own_max_frame)))
            wire = Wire(sock, request_timeout=self.request_timeout, max_frame=max_frame)
        except BaseException:
            sock.close()
            raise
        self.max_frame = max_frame
        self.qmgr = str(hello.get("qmgr", ""))
        self.endpoint = ep
        self._wire = wire
        log.debug("connected to %s at %s:%d", self.qmgr, *ep)

    def _drop(self) -> None:
        if self._wire is not None:
            self._wire.close()
        self._wire = None
        self._index += 1  # fail over: the next connection tries the next endpoint first

    def close(self) -> None:
        """Disconnect. Like MQDISC after an abnormal end, the server backs out an open unit of work."""
        with self._lock:
            if self._wire is not None:
                self._wire.close()
            self._wire = None
            self._uow_open = False
            self._user, self._held = None, False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def uow_open(self) -> bool:
        return self._uow_open

    # --- requests ------------------------------------------------------------------------------------------
    def _call(self, op: str, args: dict[str, Any], *, syncpoint: bool = True, wait_s: float = 0.0,
              settles: str = "") -> Any:
        with self._lock:
            for _attempt in (1, 2):
                wire = self._wire
                if wire is None:
                    self._connect()
                    wire = self._wire
                    assert wire is not None
                elif wire.closed_while_idle():
                    self._lost(op, syncpoint, in_flight=False, why="the connection was closed", settles=settles)
                    continue
                rid = next(self._ids)
                frame = wire.frame({"id": rid, "op": op, "args": args})
                if len(frame) - HEADER.size > self.max_frame:
                    self._too_long(op, args, len(frame) - HEADER.size)
                try:
                    reply = wire.exchange(frame, rid, self.request_timeout, wait_s)
                except (OSError, ProtocolError, FrameTooLargeError) as e:
                    self._lost(op, syncpoint, in_flight=True, why=str(e) or type(e).__name__, settles=settles)
                    continue
                if type(reply) is not dict or "ok" not in reply:
                    self._drop()
                    raise ProtocolError(f"{op}: malformed reply from {self.qmgr}: {reply!r}")
                flag = reply.get("uow")
                if flag is True or flag is False:
                    self._uow_open = flag
                flag = reply.get("held")
                if flag is True or flag is False:
                    self._held = flag
                flag = reply.get("ps_held")
                if flag is True or flag is False:
                    self._ps_held = flag
                if reply["ok"]:
                    return reply.get("result")
                exc = error_from_wire(reply.get("error"))
                if isinstance(exc, QuiescingError):  # not carried out: as if the connection had died before it
                    self._lost(op, syncpoint, in_flight=False, why=str(exc), settles=settles)
                    continue
                if reply.get("id") is None:  # the server could not parse our frame and may have closed
                    self._drop()
                raise exc
            # Both attempts lost their connection; any UOW the request started is backed out by the server.
            if op in READ_ONLY or op == "logon":
                raise QueueManagerUnavailableError(f"{op}: the connection was lost twice")
            raise BackedOutError(f"{op}: the connection was lost twice; the unit of work was backed out")

    def _too_long(self, op: str, args: dict[str, Any], length: int) -> NoReturn:
        """A request this connection cannot carry: refused before anything is sent (the UOW is as it was)."""
        where = f"the connection to {self.qmgr}" if self.qmgr else "this connection"
        if op == "put":
            raise MessageTooBigForChannelError(
                f"put: a message of {len(args['body'])} bytes makes a request of {length} bytes, longer than "
                f"{where} carries ({self.max_frame} bytes); nothing was sent")
        raise FrameTooLargeError(f"{op}: request of {length} bytes exceeds the limit of {where} "
                                 f"({self.max_frame} bytes); nothing was sent")

    def _lost(self, op: str, syncpoint: bool, *, in_flight: bool, why: str, settles: str = "") -> None:
        """The connection is gone. Return to re-send the request elsewhere, or raise what the caller must know.
        ``settles``: what a conversation request would have settled on its own ("commit", or "alone" for a status
        change or a message outside any UOW), for the outcome of one lost in flight."""
        where = f"{self.qmgr} at {self.endpoint[0]}:{self.endpoint[1]}" if self.endpoint else "the server"
        was_open, self._uow_open = self._uow_open, False
        user, was_held = self._user, self._held
        self._user, self._held = None, False  # the server ends the session with the connection
        self._drop()
        log.warning("connection to %s lost during %s: %s", where, op, why)
        ps_held, self._ps_held = self._ps_held, False
        if op in CONVERSATION_OPS:
            self._session_lost(op, user, was_held, in_flight=in_flight, where=where, why=why, settles=settles)
            return
        if op in PUBSUB_OPS:
            self._pubsub_lost(op, ps_held, in_flight=in_flight, where=where, why=why)
            return
        if op in READ_ONLY:
            return
        if op == "backout":
            return  # the server backs the UOW out when the connection ends: that is what was asked
        if op == "commit":
            if in_flight and was_open:
                raise OutcomeUnknownError(f"connection to {where} lost during commit ({why}): the unit of work "
                                          "may or may not have committed")
            if was_open:
                raise BackedOutError(f"connection to {where} lost before commit ({why}): the unit of work was "
                                     "backed out")
            return
        if in_flight and (op in TAKES_EFFECT_ALONE or not syncpoint):
            raise OutcomeUnknownError(f"connection to {where} lost during {op} ({why}): it may or may not have "
                                      "taken effect")
        if was_open:
            raise BackedOutError(f"connection to {where} lost ({why}): the unit of work was backed out")
        # A syncpoint put/get that would have started a new UOW: any first attempt is backed out; re-send it.

    # --- the Connection API ----------------------------------------------------------------------------------
    def put(self, queue: str, body: bytes, *, persistent: bool = True, syncpoint: bool = True, priority: int = 0,
            msgid: bytes | None = None, correlid: bytes = b"", expiry_ms: int = 0,
            properties: dict[str, Any] | None = None) -> Message:
        args: dict[str, Any] = {"queue": queue, "body": body, "persistent": persistent, "syncpoint": syncpoint,
                                "priority": priority, "correlid": correlid, "expiry_ms": expiry_ms}
        if msgid is not None:
            args["msgid"] = msgid
        if properties:
            args["properties"] = properties
        m = message_from_wire(self._call("put", args, syncpoint=syncpoint))
        m.body = bytes(body)
        return m

    def get(self, queue: str, *, syncpoint: bool = True, wait_ms: int = 0, msgid: bytes | None = None,
            correlid: bytes | None = None) -> Message:
        args: dict[str, Any] = {"queue": queue, "syncpoint": syncpoint, "wait_ms": wait_ms}
        if msgid is not None:
            args["msgid"] = msgid
        if correlid is not None:
            args["correlid"] = correlid
        try:
            return message_from_wire(self._call("get", args, syncpoint=syncpoint, wait_s=wait_ms / 1000))
        except OutcomeUnknownError as e:  # its commit pending or unknown: the message comes with the error (.message)
            if isinstance(e.message, dict):
                e.message = message_from_wire(e.message)
            raise

    def put_batch(self, messages: Sequence[bytes | dict[str, Any]], *, queue: str | None = None,
                  syncpoint: bool = True, commit: bool = False) -> list[Message]:
        """Put several messages in one request, in order (docs/client.md). Each is a body (put on ``queue``) or a
        map of put's arguments ("queue", "body", "persistent", "priority", "msgid", "correlid", "expiry_ms",
        "properties"). Under syncpoint they join the unit of work, and ``commit`` commits it in the same request;
        outside syncpoint the batch commits on its own before the reply. A refused message raises BatchError
        (``done``: the others); a request lost with its connection is treated as a put's, or as a commit's when
        it commits."""
        wire: list[dict[str, Any]] = []
        for m in messages:
            item: dict[str, Any] = {"body": m} if isinstance(m, bytes | bytearray) else dict(m)
            if "queue" not in item:
                if queue is None:
                    raise ValueError("put_batch: a message without a queue, and no queue given")
                item["queue"] = queue
            item["body"] = bytes(item["body"])
            wire.append(item)
        if not 1 <= len(wire) <= MAX_BATCH:  # a longer array is past what a member decodes (ProtocolError)
            raise BadRequestError(f"put_batch: 1-{MAX_BATCH} messages, not {len(wire)}")
        result = self._call("put_batch", {"messages": wire, "syncpoint": syncpoint, "commit": commit},
                            syncpoint=syncpoint and not commit)
        done = [Message(body=item["body"], queue=item["queue"], correlid=item.get("correlid", b""),
                        priority=item.get("priority", 0), persistent=item.get("persistent", True),
                        properties=item.get("properties") or {}, **got)
                for item, got in zip(wire, result["messages"], strict=False)]
        return self._batch_done(result, done)

    def get_batch(self, queue: str, max_messages: int, *, wait_ms: int = 0, commit: bool = False) -> list[Message]:
        """Take up to ``max_messages`` messages of ``queue`` under syncpoint in one request, as many as one reply
        carries (docs/client.md); ``wait_ms``: wait that long for the first when there is none; ``commit``: commit
        the unit of work in the same request. An empty list: no message. A refusal raises BatchError."""
        result = self._call("get_batch", {"queue": queue, "max_messages": max_messages, "wait_ms": wait_ms,
                                          "commit": commit}, syncpoint=not commit, wait_s=wait_ms / 1000)
        return self._batch_done(result, [message_from_wire(m) for m in result["messages"]])

    @staticmethod
    def _batch_done(result: dict[str, Any], done: list[Message]) -> list[Message]:
        if result.get("error") is not None:
            raise BatchError(error_from_wire(result["error"]), done, bool(result.get("committed")))
        return done

    def browse(self, queue: str, limit: int = 100) -> Browsed[Message]:
        """Up to ``limit`` available messages, not taken, as many as one reply carries: ``more`` on the result
        says the server left some out (browse again with a smaller limit, or after taking some)."""
        result = self._call("browse", {"queue": queue, "limit": limit})
        return Browsed((message_from_wire(m) for m in result["messages"]), more=bool(result["more"]))

    def commit(self) -> None:
        self._call("commit", {})

    def backout(self) -> None:
        self._call("backout", {})

    def prepare(self, xid: str) -> str:
        return str(self._call("prepare", {"xid": xid}))


    # --- operator requests -----------------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return dict(self._call("ping", {}))

    def status(self) -> dict[str, Any]:
        return dict(self._call("status", {}))

    def connections(self) -> dict[str, Any]:
        """DISPLAY CONN of the member this client is connected to (an operator's): its open connections (application
        name, role, user, peer, TLS, times, requests, open unit of work) and, per queue, its handle count and the
        last put and get through it (sqm.service.conn_ops)."""
        return dict(self._call("connections", {}))

    def indoubt(self, xids: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """In-doubt UOWs of the queue manager this client is connected to: an operator may list all; an
        application lists its own, those of the ``xids`` it names."""
        if xids is not None and len(xids) > MAX_BATCH:  # a longer array is past what a member decodes
            raise BadRequestError(f"indoubt: at most {MAX_BATCH} xids, not {len(xids)}")
        return list(self._call("indoubt", {} if xids is None else {"xids": list(xids)}))

    def resolve(self, uow: str, commit: bool, xid: str | None = None) -> None:
        """Commit or back out an in-doubt UOW: an operator may resolve any; an application its own, naming the
        ``xid`` it prepared it with."""
        args: dict[str, Any] = {"uow": uow, "commit": commit}
        if xid is not None:
            args["xid"] = xid
        self._call("resolve", args)

    def define_structure(self, name: str, *, max_entries: int = 0, max_bytes: int = 0,
                         replace: bool = False) -> dict[str, Any]:
        return dict(self._call("define", {"kind": "structure", "name": name, "max_entries": max_entries,
                                          "max_bytes": max_bytes, "replace": replace}))

    def define_queue(self, name: str, structure: str, *, backout_threshold: int = 0, backout_queue: str = "",
                     max_msg_length: int = 4 * 2**20, replace: bool = False,
                     uow: dict[str, Any] | None = None, topic: dict[str, Any] | None = None) -> dict[str, Any]:
        """Define a queue; with ``uow`` attributes (cfemu.uow_attributes: store, max_uows, max_messages,
        lifetime_s, status_lifetime, postpone_attempts, postpone_delay_s) a service and its companion queues; with
        ``topic`` attributes (cfemu.topic_attributes: persistent, lifetime_s, durable, subscription_expiration_s,
        max_messages) a topic and its companion queues."""
        args: dict[str, Any] = {"kind": "queue", "name": name, "structure": structure,
                                "backout_threshold": backout_threshold, "backout_queue": backout_queue,
                                "max_msg_length": max_msg_length, "replace": replace}
        if uow is not None:
            args["uow"] = dict(uow)
        if topic is not None:
            args["topic"] = dict(topic)
        return dict(self._call("define", args))


__all__ = ["BatchError", "Client", "Endpoint", "Message", "client_tls_context", "handshake", "parse_endpoint"]
