"""An SQM as a network service: an asyncio TCP server (optionally TLS) in front of one QueueManager.

The QueueManager API is synchronous (blocking Redis calls, fsync), so each client connection gets one worker
thread: its requests run there one after another, on one sqm.connection.Connection, which keeps the connection's
unit of work on one handle, like an MQ connection handle. The event loop accepts the connection and runs the
handshake; once a plain (non-TLS) connection has authenticated, its thread reads, runs and answers its requests
itself on blocking socket calls (no hand-off from the loop to the thread and back per request: issue 15), and the
loop only ends it at shutdown. A TLS connection stays on the event loop, which hands each request to its thread. When the connection goes away its open UOW is backed
out (MQ backs out on an abnormal end); a prepared (in-doubt) UOW stays in doubt for its coordinator.

Health, readiness and Prometheus metrics are served over HTTP on a second port: /healthz, /readyz, /metrics. They
have no authentication, so that port listens on loopback (``--metrics-host``, default 127.0.0.1) whatever address
the service itself listens on; another address is the operator's explicit choice, and logged as unauthenticated.

Who may connect (docs/security.md, "The service"): authentication is on unless ``--no-auth`` (refused on a
non-loopback address). A connection proves it holds the token of a role (sqm.service.protocol: challenge and
response; a bearer token only on loopback or TLS) and may then run that role's operations. Until it has
authenticated a peer may send only small frames, must do so within ``auth_timeout_s``, and counts against
``max_unauthenticated``; every connection counts against ``max_connections`` and ``max_connections_per_peer``
(a refused one gets an error naming the limit, then is closed); an authenticated one idle for
``idle_timeout_s`` is closed. A failed authentication is answered after a delay that grows with the failures
from that address (bounded by ``AUTH_DELAY_MAX_S``). All of it is counted in the metrics, with bounded labels.

Exit codes of ``sqm run``: 0 after a graceful shutdown (SIGTERM/SIGINT, with a checkpoint), 1 on a failure,
2 for a bad configuration, 3 when peer recovery fenced this queue manager (restart it), 4 when its record log
cannot be written (disk full, I/O error: fix the disk, then restart it; meanwhile a peer recovers its work).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import logging
import os
import secrets
import select
import signal
import socket
import ssl
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cfemu import repository
from cfemu.admin import AdminError
from cfemu.errors import (
    BadRequestError,
    ClientGoneError,
    EndOfUowError,
    FencedError,
    MQError,
    NoMessageError,
    StructureFailedError,
    TruncatedMessageError,
)
from cfemu.repository import RepositoryError
from cfemu.sockets import set_kernel_timeout
from cfemu.topic_attributes import PUB_SUFFIX, SUB_SUFFIX
from cfemu.uow_attributes import CONTROL_SUFFIX, DATA_SUFFIX
from sqm import pubsub
from sqm.connection import Connection
from sqm.conversation import MAX_USER, OPTIONS, Conversation
from sqm.log import LogLockedError
from sqm.manager import CF_DOWN, QueueManager, QueueManagerConfig
from sqm.recauto import RecoverStructure
from sqm.request_slots import LEASE_S, MAX_SLOTS, RequestSlots, before_wait, default_slots
from sqm.service import metrics
from sqm.service.protocol import (
    APPLICATION,
    AUTH_METHOD,
    CONVERSATION_OPS,
    DEFAULT_MAX_FRAME,
    ENVELOPE,
    HEADER,
    MAX_FRAME,
    MESSAGE_COST,
    MIN_FRAME,
    OPERATOR,
    OPS,
    PRE_HELLO_MAX_FRAME,
    PROOF_BYTES,
    PROTOCOL_VERSION,
    ROLE_OPS,
    ROLES,
    ConnectionLimitError,
    FrameTooLargeError,
    NotAuthorizedError,
    NotLoggedOnError,
    ProtocolError,
    QuiescingError,
    arg,
    auth_proof,
    auth_transcript,
    decode_body,
    encode_frame,
    error_reply,
    message_to_wire,
    new_nonce,
    ok_reply,
    parse_request,
    read_frame,
    recv_body,
)
from sqm.uowstatus import USER_STATUS_MAX

log = logging.getLogger("sqm.service.server")
COMPANION_SUFFIXES = (DATA_SUFFIX, CONTROL_SUFFIX, PUB_SUFFIX, SUB_SUFFIX)

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_FENCED, EXIT_LOG_FAILED = 0, 1, 2, 3, 4
MAX_BROWSE = 10_000
MAX_NAME = 48  # a service (queue) name in a conversation request; the CF refuses a bad one with its own message
MAX_CONVERSATION_ID = 64  # a conversation id a sender chooses (one it is given is 16 hex characters)
MAX_UOW_ATTRIBUTES = 16  # entries of a define's UOW attribute map (UowAttributes has 7)

# A failed authentication is answered after AUTH_DELAY_BASE_S * 2**(n-1) seconds, n the failures from that address
# in a row (forgotten AUTH_FORGET_S after the last), at most AUTH_DELAY_MAX_S; the connection (and its slot
# under the limits) is held meanwhile, so one address gets at most max_connections_per_peer / delay guesses a
# second. Addresses remembered: at most AUTH_TRACKED (the least recent forgotten first).
AUTH_DELAY_BASE_S = 0.1
AUTH_DELAY_MAX_S = 3.0
AUTH_FORGET_S = 60.0
AUTH_TRACKED = 4096
# The bounded label values of the security metrics (sqm.service.metrics).
AUTH_FAILURE_REASONS = ("bad_proof", "bearer_in_clear", "not_authenticated", "malformed", "frame_too_large",
                        "timeout")
LIMITS = ("server", "peer", "unauthenticated")
CLOSE_REASONS = ("auth_timeout", "idle_timeout")
AUTH_METHODS = ("challenge", "bearer", "none")
OP_LABEL_UNKNOWN = "?"  # any op name not in OPS: a label is never taken from what a peer sent


def op_label(op: str) -> str:
    return op if op in OPS else OP_LABEL_UNKNOWN


def is_loopback_ip(address: str) -> bool:
    """Is this peer address on the loopback network (127.0.0.0/8, ::1, or an IPv4-mapped 127.x)?"""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_loopback_host(host: str) -> bool:
    """Does listening on HOST accept loopback connections only? (0.0.0.0, '' and :: listen everywhere.)"""
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(is_loopback_ip(str(info[4][0])) for info in infos)


def _short(text: str, n: int = 40) -> str:
    """A peer-chosen string as it may appear in a message or a log line: bounded."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"...({len(text)} chars)"


class _PeerWatch(threading.Event):
    """Set when the client of a connection served by its own thread has gone: is_set() looks at the socket (a
    waiting get asks it between polls of the CF), like the event loop's read of the next frame does."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock

    def is_set(self) -> bool:
        if super().is_set():
            return True
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if not readable or self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return False  # nothing to read, or the client's next request (sent ahead): still there
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):
            pass
        self.set()  # end of stream, or a broken connection
        return True


class ServerConfigError(ValueError):
    """A server option that cannot work (a missing TLS file, no token, --no-auth on a non-loopback host...)."""


@dataclass
class ServerConfig:
    name: str
    log_root: Path
    redis_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (see ready_file)
    token: str | None = None  # the application role's token (sqm.service.protocol.ROLES)
    operator_token: str | None = None  # the operator role's token; None: nobody may run operator requests
    auth: bool = True  # False (--no-auth, loopback only): every connection is an operator, unauthenticated
    auth_timeout_s: float = 5.0  # a connection not authenticated by then is closed
    idle_timeout_s: float = 3600.0  # an authenticated connection with no request for this long is closed; 0: never
    max_connections: int = 512  # connections at once, all peers
    max_connections_per_peer: int = 128  # connections at once from one address
    max_unauthenticated: int = 64  # connections at once that have not authenticated yet
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # with cert and key: mutual TLS, clients must present a certificate from this CA
    metrics_port: int | None = None  # /healthz, /readyz and /metrics; None: no HTTP endpoint
    # They have no authentication (what they show: queue names, depths, counters), so they listen on loopback
    # unless the operator says otherwise, whatever ``host`` the service itself listens on.
    metrics_host: str = "127.0.0.1"
    lease_ms: int = 5000
    cf_connections: int = 64
    # requests doing their work at once, up to their first wait (sqm.request_slots); the rest wait for a slot
    request_slots: int = field(default_factory=default_slots)
    slot_lease_ms: int = int(LEASE_S * 1000)  # a request holding its slot this long counts as waiting
    logload: int = 10000  # LOGLOAD: a checkpoint every this many log records
    # Log management (sqm.manager.QueueManagerConfig, docs/log-management.md)
    log_mode: str = "linear"
    log_ring: int = 8
    log_archive_dir: Path | None = None
    segment_bytes: int = 64 * 2**20
    checkpoint_interval_s: float = 300.0
    cpl_entries: int = 3
    max_frame: int = DEFAULT_MAX_FRAME  # MIN_FRAME-MAX_FRAME; less than MAX_FRAME cannot carry every message
    max_wait_ms: int = 60_000  # longest get wait a request may ask for
    shutdown_grace_s: float = 10.0  # in-flight requests get this long to finish at shutdown
    cf_wait_s: float = 30.0  # how long to wait for the CF to answer at start
    ready_file: Path | None = None  # JSON {pid, host, port, metrics_port} written once serving
    clock_skew_ms: int = 0  # added to the physical time the LRSN clock reads (tests of a skewed member)
    recover_structure: RecoverStructure | None = None  # RECAUTO's restore (sqm.recauto), injected by qsg.member

    def check(self) -> None:
        if not MIN_FRAME <= self.max_frame <= MAX_FRAME:
            raise ServerConfigError(f"max frame must be {MIN_FRAME}-{MAX_FRAME} bytes, not {self.max_frame}")
        if self.auth and not (self.token or self.operator_token):
            raise ServerConfigError("authentication is on and no token was given (the application's or the "
                                    "operator's)")
        if self.auth and self.token and self.token == self.operator_token:
            raise ServerConfigError("the application and operator tokens are the same: an application would be "
                                    "an operator; give each role its own")
        if not self.auth and not is_loopback_host(self.host):
            raise ServerConfigError(f"--no-auth is refused on {self.host!r}, which is not a loopback address: anyone "
                                    "who reaches it could do anything; listen on 127.0.0.1, or run with a token")
        if self.auth_timeout_s <= 0 or self.idle_timeout_s < 0:
            raise ServerConfigError("the authentication timeout must be > 0 s and the idle timeout >= 0 s (0: none)")
        if min(self.max_connections, self.max_connections_per_peer, self.max_unauthenticated) < 1:
            raise ServerConfigError("connection limits must be at least 1")
        if not 1 <= self.request_slots <= MAX_SLOTS:
            raise ServerConfigError(f"request slots must be at least 1 and at most {MAX_SLOTS}, not "
                                    f"{self.request_slots}")
        if self.slot_lease_ms < 1:
            raise ServerConfigError(f"a request slot's lease must be at least 1 ms, not {self.slot_lease_ms}")

    def role_tokens(self) -> dict[str, str]:
        return {role: tok for role, tok in ((APPLICATION, self.token), (OPERATOR, self.operator_token)) if tok}

    def ssl_context(self) -> ssl.SSLContext | None:
        if not (self.tls_cert or self.tls_key or self.tls_ca):
            return None
        if not (self.tls_cert and self.tls_key):
            raise ServerConfigError("TLS needs both --tls-cert and --tls-key")
        for what, path in (("certificate", self.tls_cert), ("key", self.tls_key), ("CA", self.tls_ca)):
            if path is not None and not os.path.isfile(path):
                raise ServerConfigError(f"TLS {what} file not found: {path}")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_ca:
            ctx.load_verify_locations(self.tls_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


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
    opened: float = 0.0  # loop time of the accept
    role: str | None = None  # once authenticated: APPLICATION or OPERATOR
    said_hello: bool = False
    client_name: str = ""
    client_max: int = 0  # the client's frame limit from its hello (0: it gave none)
    nonce: bytes = b""  # the challenge of this connection (the server's, fresh at each hello)
    client_nonce: bytes = b""
    conn: Connection | None = None
    conversation: Conversation | None = None  # made by logon (sqm.conversation); closed with the connection
    pubsub: pubsub.PubSubSession | None = None  # made by the first publish or receive_pub; backed out with it
    gone: threading.Event = field(default_factory=threading.Event)  # the client disconnected
    reading: asyncio.Task[bytes | None] | None = None  # the read of the next frame, when one is pending

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


@dataclass
class _Stats:
    connections: int = 0
    accepted: int = 0
    unauthenticated: int = 0  # connections open that have not authenticated
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)  # (op label, result)
    auth_failures: Counter[str] = field(default_factory=Counter)  # reason (AUTH_FAILURE_REASONS)
    authenticated: Counter[tuple[str, str]] = field(default_factory=Counter)  # (role, method)
    refused: Counter[str] = field(default_factory=Counter)  # limit (LIMITS)
    closed: Counter[str] = field(default_factory=Counter)  # reason (CLOSE_REASONS)
    peers: Counter[str] = field(default_factory=Counter)  # open connections per address (no zero entries)


class _Failures:
    """Failed authentications per peer address, for the delay before answering the next one (bounded)."""

    def __init__(self) -> None:
        self._by_ip: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def record(self, ip: str, now: float) -> tuple[int, float]:
        """Count a failure from ip; (failures in a row, seconds to wait before answering it)."""
        n, last = self._by_ip.pop(ip, (0, now))
        n = 1 if now - last > AUTH_FORGET_S else n + 1
        self._by_ip[ip] = (n, now)
        while len(self._by_ip) > AUTH_TRACKED:
            self._by_ip.popitem(last=False)
        return n, min(AUTH_DELAY_MAX_S, AUTH_DELAY_BASE_S * 2 ** min(n - 1, 30))


class SQMServer:
    def __init__(self, config: ServerConfig, qm: QueueManager | None = None) -> None:
        self.config = config
        config.check()
        self.ssl = config.ssl_context()
        self.qm = qm if qm is not None else QueueManager(QueueManagerConfig(
            name=config.name, log_root=Path(config.log_root), redis_url=config.redis_url, lease_ms=config.lease_ms,
            cf_connections=config.cf_connections,
            logload=config.logload, clock_skew_us=config.clock_skew_ms * 1000,
            log_mode=config.log_mode, log_ring=config.log_ring, log_archive_dir=config.log_archive_dir,
            segment_bytes=config.segment_bytes, checkpoint_interval_s=config.checkpoint_interval_s,
            cpl_entries=config.cpl_entries, recover_structure=config.recover_structure))
        self.stats = _Stats()
        self.slots = RequestSlots(config.request_slots, config.slot_lease_ms / 1000)
        self.port = config.port
        self.metrics_port = config.metrics_port
        self.exit_code = EXIT_OK
        self._stop: asyncio.Event | None = None
        self._stopping = False
        self._inflight = 0
        self._lock = threading.Lock()  # counts shared by the event loop and the connections' threads
        self._direct: dict[int, socket.socket] = {}  # session number -> socket served by its own thread
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sessions = 0
        self._failures = _Failures()
        self._tokens = config.role_tokens() if config.auth else {}
        self._decoy = secrets.token_urlsafe(32)  # what a proof naming an unknown role is compared with
        self._last_warned: dict[str, float] = {}
        self._handlers: dict[str, Callable[[Session, dict[str, Any]], Any]] = {
            "ping": self._op_ping, "put": self._op_put, "get": self._op_get, "browse": self._op_browse,
            "commit": self._op_commit, "backout": self._op_backout, "prepare": self._op_prepare,
            "resolve": self._op_resolve, "indoubt": self._op_indoubt, "status": self._op_status,
            "define": self._op_define, "logon": self._op_logon, "send": self._op_send,
            "receive": self._op_receive, "syncpoint": self._op_syncpoint,
            "subscribe": self._op_subscribe, "unsubscribe": self._op_unsubscribe,
            "subscriptions": self._op_subscriptions, "publish": self._op_publish, "receive_pub": self._op_receive_pub,
            "pub_commit": self._op_pub_commit, "pub_backout": self._op_pub_backout,
        }
        self.registry = metrics.make_registry(self.qm, self.server_stats)

    def _count(self, key: tuple[str, str]) -> None:
        with self._lock:
            self.stats.requests[key] += 1

    # --- life cycle --------------------------------------------------------------------------------------
    def server_stats(self) -> dict[str, Any]:
        st = self.stats
        return {"connections": st.connections, "requests": dict(st.requests), "unauthenticated": st.unauthenticated,
                "auth_failures": {r: st.auth_failures[r] for r in AUTH_FAILURE_REASONS},
                "authenticated": {(role, m): st.authenticated[(role, m)] for role in ROLES for m in AUTH_METHODS},
                "refused": {limit: st.refused[limit] for limit in LIMITS},
                "closed": {r: st.closed[r] for r in CLOSE_REASONS},
                "request_slots": self.slots.n, "waiting_for_slot": self.slots.waiting,
                "slot_waits": self.slots.waits, "slot_leases_expired": self.slots.expired}

    def request_stop(self, exit_code: int = EXIT_OK) -> None:
        """Begin a graceful shutdown (thread-safe only from the event loop; signals and the watcher use it)."""
        if exit_code != EXIT_OK:
            self.exit_code = exit_code
        if self._stop is not None:
            self._stop.set()

    async def run(self, *, install_signals: bool = True) -> int:
        """Start the queue manager, serve until stopped, shut down gracefully; return the exit code."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await loop.run_in_executor(None, self._start_queue_manager)
        server = await asyncio.start_server(self._serve_client, self.config.host, self.config.port, ssl=self.ssl,
                                            limit=2**16, backlog=128,
                                            ssl_handshake_timeout=self.config.auth_timeout_s if self.ssl else None)
        self.port = server.sockets[0].getsockname()[1]
        http = None
        if self.config.metrics_port is not None:
            http = await asyncio.start_server(self._serve_http, self.config.metrics_host, self.config.metrics_port)
            self.metrics_port = http.sockets[0].getsockname()[1]
            if not is_loopback_host(self.config.metrics_host):
                log.warning("%s: /metrics, /healthz and /readyz on %s:%d have no authentication: whoever reaches "
                            "them reads queue names, depths and counters (--metrics-host)", self.qm.name,
                            self.config.metrics_host, self.metrics_port)
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        watcher = asyncio.create_task(self._watch_fencing())
        self._write_ready_file()
        log.info("%s serving on %s:%d%s (metrics %s:%s), epoch %d, %s", self.qm.name, self.config.host, self.port,
                 " with TLS" if self.ssl else "", self.config.metrics_host, self.metrics_port, self.qm.caller.epoch,
                 f"authentication on (roles: {', '.join(self._tokens)})" if self.config.auth else
                 "authentication OFF (--no-auth: every local connection is an operator)")
        if self.config.auth and OPERATOR not in self._tokens:
            log.warning("%s: no operator token (operator.token, $SQM_OPERATOR_TOKEN): define, status and resolving "
                        "another's in-doubt UOW are refused to every connection", self.qm.name)
        try:
            await self._stop.wait()
        finally:
            watcher.cancel()
            await self._shutdown(server, http)
        return self.exit_code

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("%s: %s received: shutting down", self.qm.name, sig.name)
        self.request_stop(EXIT_OK)

    def _start_queue_manager(self) -> None:
        # Wait for the CF first: a failed QueueManager.start leaves its log open, so it is started only once.
        deadline = time.monotonic() + self.config.cf_wait_s
        while True:
            try:
                self.qm.redis.ping()
                break
            except CF_DOWN as e:
                if time.monotonic() >= deadline:
                    raise StructureFailedError(f"the CF did not answer within {self.config.cf_wait_s:g}s: {e}") from None
                log.info("%s: waiting for the CF: %s", self.qm.name, e)
                time.sleep(0.5)
        report = self.qm.start()  # sqm.recovery logs each restart phase
        log.info("%s restarted in %.3fs: %d log records read, %d in doubt kept", self.qm.name, report.seconds,
                 report.records_read, report.in_doubt)
        if self.config.max_frame < MAX_FRAME:
            log.warning("%s: frames are limited to %d bytes (--max-frame), less than a message a queue may hold "
                        "needs (%d): a longer put fails at the client with MQRC_MSG_TOO_BIG_FOR_CHANNEL, a get of a "
                        "longer message fails with MQRC_TRUNCATED_MSG_FAILED and leaves it on its queue",
                        self.qm.name, self.config.max_frame, MAX_FRAME)

    def _write_ready_file(self) -> None:
        if self.config.ready_file is None:
            return
        path = Path(self.config.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "name": self.qm.name, "host": self.config.host,
                                   "port": self.port, "metrics_host": self.config.metrics_host,
                                   "metrics_port": self.metrics_port}))
        os.replace(tmp, path)

    async def _watch_fencing(self) -> None:
        while True:
            if self.qm.fenced:
                log.error("%s was fenced by peer recovery (epoch %d is stale); exiting with code %d: restart it",
                          self.qm.name, self.qm.caller.epoch, EXIT_FENCED)
                self.request_stop(EXIT_FENCED)
                return
            if self.qm.log_failed:
                log.error("%s cannot write its record log (%s); exiting with code %d: fix the log disk, then "
                          "restart it (a peer recovers its work meanwhile)", self.qm.name, self.qm.log_failed,
                          EXIT_LOG_FAILED)
                self.request_stop(EXIT_LOG_FAILED)
                return
            await asyncio.sleep(0.25)

    async def _shutdown(self, server: asyncio.Server, http: asyncio.Server | None) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = True
        self.slots.close()  # requests queued for a slot are refused, not run after the grace
        server.close()
        deadline = loop.time() + self.config.shutdown_grace_s
        while self._inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self._inflight:
            log.warning("%s: %d requests still running after %.1fs; closing their connections", self.qm.name,
                        self._inflight, self.config.shutdown_grace_s)
        for sock in list(self._direct.values()):  # wakes each connection thread blocked reading its next request
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=max(1.0, deadline - loop.time()))
        if http is not None:
            http.close()
        checkpoint = self.exit_code not in (EXIT_FENCED, EXIT_LOG_FAILED)
        await loop.run_in_executor(None, lambda: self.qm.stop(checkpoint=checkpoint))
        if checkpoint and not self.qm.fenced:
            log.info("%s stopped: shutdown checkpoint taken", self.qm.name)
        else:
            log.info("%s stopped without a checkpoint (%s)", self.qm.name, "fenced" if self.qm.fenced else "log failed")
        if self.config.ready_file is not None:
            with contextlib.suppress(FileNotFoundError):
                Path(self.config.ready_file).unlink()

    # --- client connections ------------------------------------------------------------------------------
    def _warn(self, key: str, msg: str, *args: Any) -> None:
        """A warning about what peers do, at most once a second per key (a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._last_warned.get(key, 0.0) >= 1.0:
            self._last_warned[key] = now
            log.warning(msg, *args)

    def _over_limit(self, ip: str) -> tuple[str, str] | None:
        """(limit, message) when a new connection from ip would exceed a connection limit."""
        c = self.config
        if self.stats.connections >= c.max_connections:
            return "server", f"{c.max_connections} connections at once (--max-connections)"
        if self.stats.peers[ip] >= c.max_connections_per_peer:
            return "peer", f"{c.max_connections_per_peer} connections at once from {ip} (--max-connections-per-peer)"
        if self.stats.unauthenticated >= c.max_unauthenticated:
            return "unauthenticated", (f"{c.max_unauthenticated} connections at once that have not authenticated "
                                       "(--max-unauthenticated)")
        return None

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ip: str, limit: str,
                      what: str) -> None:
        self.stats.refused[limit] += 1
        self._warn(f"limit-{limit}", "%s: connection from %s refused: the limit of %s is reached (refusals so far: "
                   "%d)", self.qm.name, ip, what, self.stats.refused[limit])
        exc = ConnectionLimitError(f"connection refused by {self.qm.name}: the limit of {what} is reached; try again "
                                   "later")
        with contextlib.suppress(Exception):
            writer.write(encode_frame(error_reply(None, exc)))
            # Half-close and take in what the peer sends meanwhile (its hello), briefly: closing with unread data
            # would reset the connection, and the peer might lose the refusal before it reads it.
            if writer.can_write_eof():
                writer.write_eof()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(reader.read(PRE_HELLO_MAX_FRAME), 0.5)
        with contextlib.suppress(Exception):
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = writer.get_extra_info("peername")
        ip = str(peer[0]) if peer else "?"
        refusal = self._over_limit(ip)
        if refusal is not None:
            await self._refuse(reader, writer, ip, *refusal)
            return
        self._tasks.add(task)
        self._sessions += 1
        session = Session(self._sessions, f"{ip}:{peer[1]}" if peer else "?",
                          ThreadPoolExecutor(1, thread_name_prefix=f"{self.qm.name}-c{self._sessions}"),
                          authenticated=False, request_limit=min(PRE_HELLO_MAX_FRAME, self.config.max_frame),
                          reply_limit=self.config.max_frame, peer_ip=ip,
                          tls=writer.get_extra_info("ssl_object") is not None,
                          opened=asyncio.get_running_loop().time())
        self.stats.connections += 1
        self.stats.unauthenticated += 1
        self.stats.peers[ip] += 1
        self.stats.accepted += 1
        log.debug("%s: connection %d from %s", self.qm.name, session.number, session.peer)
        if not self.config.auth:  # --no-auth (loopback only): every connection is an operator
            self._authenticated(session, OPERATOR, "none")
        try:
            await self._session_loop(session, reader, writer)
        except asyncio.CancelledError:
            pass  # shutdown
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError) as e:
            log.debug("%s: connection %d ended: %s", self.qm.name, session.number, e)
        finally:
            self.stats.connections -= 1
            if not session.authenticated:
                self.stats.unauthenticated -= 1
            self.stats.peers[ip] -= 1
            if self.stats.peers[ip] <= 0:
                del self.stats.peers[ip]
            if session.reading is not None and not session.reading.done():
                session.reading.cancel()
            await self._end_session(session)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            self._tasks.discard(task)

    async def _send(self, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
        writer.write(encode_frame(reply))
        await writer.drain()

    def _read_next(self, session: Session, reader: asyncio.StreamReader) -> asyncio.Task[bytes | None]:
        why = ("" if session.authenticated else " before authentication (send hello and auth first)"
               if session.said_hello else " before hello (send hello first)")
        session.reading = asyncio.ensure_future(read_frame(reader, session.request_limit, why))
        return session.reading

    def _bounded(self, session: Session, rid: int, op: str,
                 reply: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """The reply and its frame, or an error in its place when it would exceed what the client accepts. Gets
        and browses are bounded before they take or read anything, so this is a safety net that should never
        fire. (Encoded once: a reply may carry 100 MiB.)"""
        frame = encode_frame(reply)
        length = len(frame) - HEADER.size
        if length <= session.reply_limit:
            return reply, frame
        log.error("%s: connection %d: the %s reply of %d bytes exceeds the connection's limit of %d; an error is "
                  "sent instead", self.qm.name, session.number, op, length, session.reply_limit)
        reply = error_reply(rid, MQError(f"{op}: the reply of {length} bytes exceeds this connection's limit of "
                                         f"{session.reply_limit} bytes"), uow=session.uow_open())
        return reply, encode_frame(reply)

    def _frame_deadline(self, session: Session) -> float | None:
        """Seconds the next frame may take: what is left of the authentication time, else the idle timeout."""
        if not session.authenticated:
            return max(0.0, session.opened + self.config.auth_timeout_s - asyncio.get_running_loop().time())
        return self.config.idle_timeout_s or None

    def _unauthenticated_refusal(self, session: Session, reason: str) -> None:
        """Count a refusal of a peer that has not authenticated (its connection is closed after the reply)."""
        if not session.authenticated:
            self.stats.auth_failures[reason] += 1

    async def _session_loop(self, session: Session, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        # The next frame is read while a request runs, so that a client that leaves mid-request is noticed at
        # once (a waiting get must end with its connection, not consume a message for nobody).
        next_frame: asyncio.Task[bytes | None] | None = None
        while True:
            if next_frame is None:
                next_frame = self._read_next(session, reader)
            await asyncio.wait([next_frame], timeout=self._frame_deadline(session))
            if not next_frame.done():
                next_frame.cancel()
                with contextlib.suppress(BaseException):
                    await next_frame
                if not session.authenticated:
                    self.stats.auth_failures["timeout"] += 1
                    self.stats.closed["auth_timeout"] += 1
                    self._warn("auth-timeout", "%s: connection %d (%s) did not authenticate within %gs; closing it",
                               self.qm.name, session.number, session.peer, self.config.auth_timeout_s)
                    exc = NotAuthorizedError(f"not authenticated within {self.config.auth_timeout_s:g}s: closing the "
                                             "connection")
                    writer.write(encode_frame(error_reply(None, exc)))
                else:
                    self.stats.closed["idle_timeout"] += 1
                    log.info("%s: connection %d (%s, %s) idle for %gs; closing it (its open UOW is backed out)",
                             self.qm.name, session.number, session.peer, session.client_name or "no name",
                             self.config.idle_timeout_s)
                return
            try:
                body = next_frame.result()
            except FrameTooLargeError as e:
                self._warn("frame", "%s: connection %d (%s): %s; closing it", self.qm.name, session.number,
                           session.peer, e)
                self._count((OP_LABEL_UNKNOWN, e.reason_name))
                if not session.authenticated:
                    self._unauthenticated_refusal(session, "frame_too_large")
                await self._send(writer, error_reply(None, e))
                return
            finally:
                next_frame = None
            if body is None:
                return
            parsed = self._parse(session, body)
            if isinstance(parsed, dict):
                await self._send(writer, parsed)
                if not session.authenticated:
                    self._unauthenticated_refusal(session, "malformed")
                    return
                continue
            rid, op, args = parsed
            if op in ("hello", "auth"):
                if session.authenticated and (self.config.auth or op == "auth"):
                    again = BadRequestError(f"{op}: this connection has already authenticated (as {session.role})")
                    self._count((op, again.reason_name))
                    await self._send(writer, error_reply(rid, again, uow=session.uow_open()))
                    continue
                reply = await (self._hello(session, rid, args) if op == "hello" else self._auth(session, rid, args))
                await self._send(writer, reply)
                if not reply["ok"]:
                    return
                if session.authenticated and not session.tls:
                    await self._serve_direct(session, reader, writer)
                    return
                continue
            if not session.authenticated:
                exc = NotAuthorizedError(f"authenticate first: send hello and auth before {_short(op)}")
                self._count((op_label(op), exc.reason_name))
                self._unauthenticated_refusal(session, "not_authenticated")
                await self._send(writer, error_reply(rid, exc))
                return
            refused = self._refusal(session, rid, op)
            if refused is not None:
                await self._send(writer, refused)
                continue
            with self._lock:
                self._inflight += 1
            try:
                work = loop.run_in_executor(session.executor, self._dispatch, session, rid, op, args)
                next_frame = self._read_next(session, reader)
                both: list[asyncio.Future[Any]] = [work, next_frame]
                await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
                if next_frame.done() and (next_frame.exception() is not None or next_frame.result() is None):
                    session.gone.set()  # the client left (or broke the stream) while its request ran
                reply = await work
            finally:
                with self._lock:
                    self._inflight -= 1
            if session.gone.is_set():
                log.info("%s: connection %d (%s) left during %s; its reply is dropped", self.qm.name,
                         session.number, session.peer, op)
                return
            reply, frame = self._bounded(session, rid, op, reply)
            self._count((op, "ok" if reply["ok"] else reply["error"]["reason_name"]))
            writer.write(frame)
            await writer.drain()
            if not reply["ok"] and reply["error"]["type"] == FencedError.__name__:
                self.request_stop(EXIT_FENCED)

    # --- an authenticated connection served by its own thread -------------------------------------------------
    async def _serve_direct(self, session: Session, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        """From here on the connection's thread reads, runs and answers its requests itself, on blocking socket
        calls: no hand-off from the event loop to the thread and back per request (two wake-ups and a self-pipe
        write each), which cost more CPU than the request's own work (issue 15). The event loop keeps the accept,
        the handshake, the limits, TLS connections (whose transport it cannot hand over) and the shutdown."""
        transport = writer.transport
        assert isinstance(transport, asyncio.Transport)
        tsock = transport.get_extra_info("socket")
        if tsock is None:
            raise ConnectionError("no socket to hand over")
        transport.pause_reading()
        buffered = getattr(reader, "_buffer", None)  # what the stream read past the handshake (normally nothing)
        leftover = bytearray(buffered or b"")
        if buffered:
            buffered.clear()
        sock = socket.socket(fileno=os.dup(tsock.fileno()))  # ours; the transport closes its own at the end
        sock.setblocking(True)
        session.gone = _PeerWatch(sock)
        if session.conn is not None:
            session.conn.gone = session.gone
        self._direct[session.number] = sock
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(session.executor, self._direct_loop, session, sock, leftover, loop)
        except asyncio.CancelledError:  # shutdown: the thread ends at its next read (the socket is shut down)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            raise
        finally:
            self._direct.pop(session.number, None)

    def _direct_loop(self, session: Session, sock: socket.socket, buf: bytearray,
                     loop: asyncio.AbstractEventLoop) -> None:
        try:
            set_kernel_timeout(sock, self.config.idle_timeout_s)
            while True:
                try:
                    body = recv_body(sock, buf, session.request_limit)
                except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO: no request for the idle timeout
                    with self._lock:
                        self.stats.closed["idle_timeout"] += 1
                    log.info("%s: connection %d (%s, %s) idle for %gs; closing it (its open UOW is backed out)",
                             self.qm.name, session.number, session.peer, session.client_name or "no name",
                             self.config.idle_timeout_s)
                    return
                except FrameTooLargeError as e:
                    self._warn("frame", "%s: connection %d (%s): %s; closing it", self.qm.name, session.number,
                               session.peer, e)
                    self._count((OP_LABEL_UNKNOWN, e.reason_name))
                    sock.sendall(encode_frame(error_reply(None, e)))
                    return
                if body is None:
                    return
                reply = self._direct_request(session, body)
                if reply is None:
                    log.info("%s: connection %d (%s) left during a request; its reply is dropped", self.qm.name,
                             session.number, session.peer)
                    return
                sock.sendall(reply[0])
                if reply[1]:
                    loop.call_soon_threadsafe(self.request_stop, EXIT_FENCED)
        except OSError as e:  # the client went away (reset, broken pipe) or the shutdown closed its socket
            log.debug("%s: connection %d ended: %s", self.qm.name, session.number, e)
        finally:
            sock.close()

    def _direct_request(self, session: Session, body: bytes) -> tuple[bytes, bool] | None:
        """One request of an authenticated connection: (reply frame, fenced), or None when the client left."""
        parsed = self._parse(session, body)
        if isinstance(parsed, dict):
            return encode_frame(parsed), False
        rid, op, args = parsed
        if op in ("hello", "auth"):
            again = BadRequestError(f"{op}: this connection has already authenticated (as {session.role})")
            self._count((op, again.reason_name))
            return encode_frame(error_reply(rid, again, uow=session.uow_open())), False
        refused = self._refusal(session, rid, op)
        if refused is not None:
            return encode_frame(refused), False
        with self._lock:
            self._inflight += 1
        try:
            reply = self._dispatch(session, rid, op, args)
        finally:
            with self._lock:
                self._inflight -= 1
        if threading.Event.is_set(session.gone):  # only what the request saw (no look at the socket per request)
            return None
        reply, frame = self._bounded(session, rid, op, reply)
        self._count((op, "ok" if reply["ok"] else reply["error"]["reason_name"]))
        return frame, not reply["ok"] and reply["error"]["type"] == FencedError.__name__

    # --- what both paths do with a request before it runs ---------------------------------------------------
    def _parse(self, session: Session, body: bytes) -> tuple[int, str, dict[str, Any]] | dict[str, Any]:
        """The request a frame holds (id, op, args), or the error reply to a malformed one (logged, counted)."""
        obj: Any = None
        try:
            obj = decode_body(body)
            return parse_request(obj)
        except ProtocolError as e:
            known_id = obj.get("id") if isinstance(obj, dict) and isinstance(obj.get("id"), int) else None
            log.info("%s: connection %d: bad request: %.200s", self.qm.name, session.number, e)
            self._count((OP_LABEL_UNKNOWN, e.reason_name))
            return error_reply(known_id, e)

    def _refusal(self, session: Session, rid: int, op: str) -> dict[str, Any] | None:
        """The error reply to an authenticated session's request that must not run (an unknown operation, one its
        role may not do, any while the queue manager stops), counted; None when it may run."""
        if op not in self._handlers:
            bad = BadRequestError(f"unknown operation {_short(op)}; known: {', '.join(OPS)}")
            self._count((OP_LABEL_UNKNOWN, bad.reason_name))
            return error_reply(rid, bad, uow=session.uow_open())
        if op not in ROLE_OPS[session.role or ""]:
            denied = NotAuthorizedError(f"{op}: not authorized for the {session.role} role (an operator's "
                                        "request: connect with the operator token)")
            self._count((op, denied.reason_name))
            self._warn(f"denied-{op}", "%s: connection %d (%s, %s): %s refused to the %s role", self.qm.name,
                       session.number, session.peer, session.client_name or "no name", op, session.role)
            return error_reply(rid, denied, uow=session.uow_open())
        if self._stopping:
            return error_reply(rid, self._quiescing(op), **session.flags())
        if op in CONVERSATION_OPS and op != "logon" and session.conversation is None:
            alone = NotLoggedOnError(f"{op}: this connection has not logged on: send logon with a user id (and a "
                                     "token) first; a session ends with its connection")
            self._count((op, alone.reason_name))
            return error_reply(rid, alone, **session.flags())
        return None

    # --- authentication ---------------------------------------------------------------------------------------
    def _authenticated(self, session: Session, role: str, method: str) -> None:
        session.authenticated = True
        session.role = role
        session.request_limit = self.config.max_frame
        self.stats.unauthenticated -= 1
        self.stats.authenticated[(role, method)] += 1
        log.debug("%s: connection %d (%s, %s) authenticated as %s (%s)", self.qm.name, session.number,
                  session.peer, session.client_name or "no name", role, method)

    async def _failed(self, session: Session, rid: int, reason: str, why: str,
                      message: str = "authentication failed") -> dict[str, Any]:
        """A failed authentication: counted, logged (throttled), answered after the address's delay."""
        self.stats.auth_failures[reason] += 1
        self._count(("auth", NotAuthorizedError.reason_name))
        n, delay = self._failures.record(session.peer_ip, time.monotonic())
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th... failure in a row from that address
            log.warning("%s: connection %d (%s, %s): authentication failed: %s (%d failures in a row from %s; "
                        "answers to it now wait %.1fs)", self.qm.name, session.number, session.peer,
                        _short(session.client_name), why, n, session.peer_ip, delay)
        await asyncio.sleep(delay)
        return error_reply(rid, NotAuthorizedError(message))

    async def _hello(self, session: Session, rid: int, args: dict[str, Any]) -> dict[str, Any]:
        try:
            token = arg(args, "hello", "token", str, None)  # version 2's bearer token
            session.client_name = arg(args, "hello", "client", str, "")
            client_max = arg(args, "hello", "max_frame", int, None)  # the longest frame the client accepts
            client_nonce = arg(args, "hello", "nonce", bytes, None)
            if client_max is not None and client_max < MIN_FRAME:
                raise BadRequestError(f"hello: max_frame must be at least {MIN_FRAME} bytes, not {client_max}")
            if len(session.client_name) > 256:
                raise BadRequestError("hello: a client name is at most 256 characters")
            if client_nonce is not None and not 16 <= len(client_nonce) <= 64:
                raise BadRequestError("hello: nonce must be 16-64 bytes")
        except MQError as e:
            self._unauthenticated_refusal(session, "malformed")
            return error_reply(rid, e)
        session.said_hello = True
        session.client_max = client_max or 0
        session.reply_limit = min(self.config.max_frame, client_max or self.config.max_frame)
        session.client_nonce = client_nonce or b""
        session.nonce = new_nonce()
        if token is not None and self.config.auth:
            return await self._bearer(session, rid, token)
        self._count(("hello", "ok"))
        return ok_reply(rid, self._hello_result(session))

    def _hello_result(self, session: Session) -> dict[str, Any]:
        result: dict[str, Any] = {
            "qmgr": self.qm.name, "version": PROTOCOL_VERSION, "max_frame": self.config.max_frame,
            "reply_frame": session.reply_limit, "session": session.number,
            "auth": {"required": not session.authenticated, "methods": [AUTH_METHOD] if self.config.auth else [],
                     "nonce": session.nonce}}
        if session.authenticated:
            result.update(role=session.role, epoch=self.qm.caller.epoch)
        return result

    async def _bearer(self, session: Session, rid: int, token: str) -> dict[str, Any]:
        """Version 2's hello with the token itself: accepted only where it did not travel in clear off the host."""
        matched = [role for role, tok in self._tokens.items() if hmac.compare_digest(tok.encode(), token.encode())]
        if not (session.tls or is_loopback_ip(session.peer_ip)):
            self._warn("bearer", "%s: connection %d (%s) sent a token in clear on a non-loopback connection%s; "
                       "refused", self.qm.name, session.number, session.peer,
                       ": IT WAS VALID, treat it as exposed and rotate it (docs/security.md)" if matched else "")
            return await self._failed(session, rid, "bearer_in_clear", "a token in clear off loopback",
                                      "a token sent in clear is refused on a non-loopback connection without TLS: "
                                      "use the challenge-response (hello with a nonce, then auth) or TLS")
        if not matched:
            return await self._failed(session, rid, "bad_proof", "wrong token")
        self._authenticated(session, matched[0], "bearer")
        self._count(("hello", "ok"))
        return ok_reply(rid, self._hello_result(session))

    def _transcript(self, session: Session, side: str, role: str) -> bytes:
        return auth_transcript(side, role=role, server_nonce=session.nonce, client_nonce=session.client_nonce,
                               qmgr=self.qm.name, session=session.number, client=session.client_name,
                               client_max_frame=session.client_max, server_max_frame=self.config.max_frame)

    async def _auth(self, session: Session, rid: int, args: dict[str, Any]) -> dict[str, Any]:
        try:
            role = arg(args, "auth", "role", str)
            proof = arg(args, "auth", "proof", bytes)
            if not session.said_hello or not session.client_nonce:
                raise BadRequestError("auth: send hello with a nonce first")
        except MQError as e:
            self._unauthenticated_refusal(session, "malformed")
            return error_reply(rid, e)
        # The same work and the same answer for an unknown role, a role with no token here and a wrong proof.
        token = self._tokens.get(role)
        expected = auth_proof(token or self._decoy, self._transcript(session, "client", role))
        if token is None or len(proof) != PROOF_BYTES or not hmac.compare_digest(expected, proof):
            why = "wrong proof" if token is not None else f"no such role here: {_short(role)}"
            return await self._failed(session, rid, "bad_proof", why)
        self._authenticated(session, role, "challenge")
        self._count(("auth", "ok"))
        return ok_reply(rid, {"role": role, "epoch": self.qm.caller.epoch,
                              "proof": auth_proof(token, self._transcript(session, "server", role))})

    async def _end_session(self, session: Session) -> None:
        """Like MQDISC after an abnormal end: the connection's in-flight UOW is backed out, in its own thread."""
        loop = asyncio.get_running_loop()
        conn = session.conn
        if (conn is not None and conn.uow is not None) or session.conversation is not None or session.pubsub:
            def backout() -> None:
                self._logoff(session, "closed connection")
                self._end_pubsub(session)
                try:
                    if conn is not None:
                        conn.close()
                except MQError as e:
                    log.warning("%s: backing out the UOW of closed connection %d: %s", self.qm.name,
                                session.number, e)
            with contextlib.suppress(asyncio.CancelledError):
                await loop.run_in_executor(session.executor, backout)
        session.executor.shutdown(wait=False)

    # --- requests (each runs in its connection's worker thread) -------------------------------------------------
    def _dispatch(self, session: Session, rid: int, op: str, args: dict[str, Any]) -> dict[str, Any]:
        try:
            with self.slots.running() as waited:
                if waited:
                    self._still_wanted(session, op)
                result = self._handlers[op](session, args)
            return ok_reply(rid, result, **session.flags())
        except MQError as e:
            error: MQError = e
        except AdminError as e:
            error = BadRequestError(str(e))
        except ValueError as e:  # names and values the CF layer refuses
            error = BadRequestError(f"{op}: {e}")
        except CF_DOWN as e:
            error = StructureFailedError(f"the CF is unavailable: {e}")
        except Exception as e:  # the server stays up; the failure is in its log
            log.exception("%s: %s failed", self.qm.name, op)
            error = MQError(f"internal error in {op}: {type(e).__name__}: {e}")
        return error_reply(rid, error, **session.flags())

    def _still_wanted(self, session: Session, op: str) -> None:
        """A request that waited for its slot runs only if the server is not stopping and its client is still
        there: queued, it may have outlived both (its client, told the outcome is unknown, may send it again)."""
        if self._stopping:
            raise self._quiescing(op)
        if session.gone.is_set():
            raise ClientGoneError(f"{op}: the client left while the request waited for a request slot")

    def _quiescing(self, op: str) -> QuiescingError:
        """The refusal of a request the server does not carry out because it is stopping."""
        return QuiescingError(f"queue manager {self.qm.name} is shutting down; {op} not carried out")

    def _connection(self, session: Session) -> Connection:
        if session.conn is None:
            session.conn = self.qm.connect()
            session.conn.gone = session.gone
        return session.conn

    def _op_ping(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        return {"qmgr": self.qm.name, "time": time.time()}

    def _plain(self, queue: str, op: str) -> str:
        """A queue an application may put to, get from or browse: not a companion queue of a service or a topic,
        whose entries are the product's own state and every user's (a status and its owner, a UOW's messages, a
        subscription's position, a publication): a put there by hand would block a service's receives, a get take a
        UOW's status away, a browse show other users' units of work. An operator may browse them."""
        base, dot, suffix = queue.rpartition(".")
        if dot and f".{suffix}" in COMPANION_SUFFIXES:
            try:
                qdef = self.qm.queue_def(base)
            except MQError:  # no such service or topic: a plain queue that happens to end so
                return queue
            if qdef.uow or qdef.topic:
                raise NotAuthorizedError(f"{op} on {queue}: it holds the state of {base}'s units of work or "
                                             "publications; use send/receive/syncpoint or the publish/subscribe ops")
        return queue

    def _op_put(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        conn = self._connection(session)
        m = conn.put(self._plain(arg(args, "put", "queue", str), "put"), arg(args, "put", "body", bytes),
                     persistent=arg(args, "put", "persistent", bool, True),
                     syncpoint=arg(args, "put", "syncpoint", bool, True),
                     priority=arg(args, "put", "priority", int, 0),
                     msgid=arg(args, "put", "msgid", bytes, None),
                     correlid=arg(args, "put", "correlid", bytes, b""),
                     expiry_ms=arg(args, "put", "expiry_ms", int, 0),
                     properties=arg(args, "put", "properties", dict, None))
        m.body = b""  # the client has the body; do not send it back
        return message_to_wire(m)

    def _op_get(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        conn = self._connection(session)
        wait_ms = arg(args, "get", "wait_ms", int, 0)
        if not 0 <= wait_ms <= self.config.max_wait_ms:
            raise BadRequestError(f"get: wait_ms must be 0-{self.config.max_wait_ms}, not {wait_ms}")
        queue = self._plain(arg(args, "get", "queue", str), "get")
        try:  # the CF refuses, untouched, a message the reply could not carry: nothing is taken for nobody
            m = conn.get(queue, syncpoint=arg(args, "get", "syncpoint", bool, True),
                         wait_ms=wait_ms, msgid=arg(args, "get", "msgid", bytes, None),
                         correlid=arg(args, "get", "correlid", bytes, None),
                         max_length=session.reply_limit - ENVELOPE - MESSAGE_COST)
        except TruncatedMessageError as e:
            raise self._too_long(session, "get", queue, e) from None
        return message_to_wire(m)

    def _op_browse(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        limit = arg(args, "browse", "limit", int, 100)
        if not 1 <= limit <= MAX_BROWSE:
            raise BadRequestError(f"browse: limit must be 1-{MAX_BROWSE}, not {limit}")
        queue = arg(args, "browse", "queue", str)
        if session.role != OPERATOR:
            self._plain(queue, "browse")
        conn = self._connection(session)
        try:  # as many as one reply carries; "more" tells the client it did not get them all
            found = conn.browse(queue, limit, max_bytes=session.reply_limit - ENVELOPE, each=MESSAGE_COST)
        except TruncatedMessageError as e:
            raise self._too_long(session, "browse", queue, e) from None
        return {"messages": [message_to_wire(m) for m in found], "more": found.more}

    def _too_long(self, session: Session, op: str, queue: str, e: TruncatedMessageError) -> TruncatedMessageError:
        detail = e.args[0] if e.args else ""
        return TruncatedMessageError(f"{op} on {queue}: {detail}: replies on this connection to {self.qm.name} are "
                                     f"limited to {session.reply_limit} bytes; the message stays on the queue")

    def _op_commit(self, session: Session, args: dict[str, Any]) -> None:
        if session.conn is not None:
            session.conn.commit()

    def _op_backout(self, session: Session, args: dict[str, Any]) -> None:
        if session.conn is not None:
            session.conn.backout()

    def _op_prepare(self, session: Session, args: dict[str, Any]) -> str:
        return self._connection(session).prepare(arg(args, "prepare", "xid", str))

    def _op_resolve(self, session: Session, args: dict[str, Any]) -> None:
        uow_id = arg(args, "resolve", "uow", str)
        commit = arg(args, "resolve", "commit", bool)
        if session.role != OPERATOR:
            # An application resolves its own in-doubt UOWs: those it names by the xid it prepared them with.
            xid = arg(args, "resolve", "xid", str, None)
            if xid is None:
                raise NotAuthorizedError("resolve: an application resolves only its own in-doubt units of work: give "
                                         "the xid it prepared the unit of work with (an operator may resolve any)")
            mine = [u for u in self.qm.indoubt() if u.id == uow_id]
            if mine and not hmac.compare_digest(mine[0].xid.encode(), xid.encode()):
                raise NotAuthorizedError(f"resolve: unit of work {_short(uow_id)} was not prepared with that xid: an "
                                         "application resolves only its own (an operator may resolve any)")
        self.qm.resolve(uow_id, commit)

    def _op_indoubt(self, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
        found = self.qm.indoubt()
        if session.role != OPERATOR:
            # An application lists its own: the in-doubt UOWs of the xids it names.
            xids = arg(args, "indoubt", "xids", list, None)
            if xids is None:
                raise NotAuthorizedError("indoubt: an application lists only its own in-doubt units of work: give "
                                         "their xids (an operator may list all)")
            wanted = {x for x in xids if isinstance(x, str)}
            found = [u for u in found if u.xid in wanted]
        return [{"uow": u.id, "xid": u.xid, "owner": u.owner, "structures": sorted(u.structures)} for u in found]

    def _op_status(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        c = self.config
        return {**self.qm.status(), "host": c.host, "port": self.port, "metrics_port": self.metrics_port,
                "connections": self.stats.connections, "unauthenticated": self.stats.unauthenticated,
                "tls": self.ssl is not None, "auth": c.auth, "roles": sorted(self._tokens),
                "limits": {"max_connections": c.max_connections, "max_connections_per_peer":
                           c.max_connections_per_peer, "max_unauthenticated": c.max_unauthenticated,
                           "auth_timeout_s": c.auth_timeout_s, "idle_timeout_s": c.idle_timeout_s}}

    def _op_define(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        kind = arg(args, "define", "kind", str)
        name = arg(args, "define", "name", str)
        replace = arg(args, "define", "replace", bool, False)
        admin, repo = self.qm.admin, self.qm.repository
        if repo is None:
            raise BadRequestError(f"queue manager {self.qm.name} is not running")
        if kind == "structure":  # in the CF and, durably, in the group repository (cfemu.repository)
            sdef = repository.define_structure(admin, repo, name,
                                               max_entries=arg(args, "define", "max_entries", int, 0),
                                               max_bytes=arg(args, "define", "max_bytes", int, 0), replace=replace,
                                               recauto=arg(args, "define", "recauto", bool, True))
            return vars(sdef)
        if kind == "queue":
            qdef = repository.define_queue(admin, repo, name, arg(args, "define", "structure", str),
                                           backout_threshold=arg(args, "define", "backout_threshold", int, 0),
                                           backout_queue=arg(args, "define", "backout_queue", str, ""),
                                           max_msg_length=arg(args, "define", "max_msg_length", int, 4 * 2**20),
                                           replace=replace, uow=self._uow_attributes(args),
                                           topic=self._uow_attributes(args, "topic"))
            for queue in (name, *qdef.companions):
                self.qm.forget_queue_def(queue)
            return vars(qdef)
        raise BadRequestError(f"define: kind must be 'structure' or 'queue', not {kind!r}")

    @staticmethod
    def _uow_attributes(args: dict[str, Any], field: str = "uow") -> dict[str, Any] | None:
        """A define's UOW attributes (a service: cfemu.uow_attributes) or, with field "topic", a topic's
        (cfemu.topic_attributes), bounded; their values are checked there."""
        uow = arg(args, "define", field, dict, None)
        if uow is None:
            return None
        if len(uow) > MAX_UOW_ATTRIBUTES or not all(isinstance(k, str) and len(k) <= 64 for k in uow):
            raise BadRequestError(f"define: '{field}' must map at most {MAX_UOW_ATTRIBUTES} attribute names to values")
        bad = [k for k, v in uow.items() if not isinstance(v, bool | int)]
        if bad:
            raise BadRequestError(f"define: {field} attribute {_short(bad[0])} must be an integer or a boolean")
        return dict(uow)

    # --- conversations (sqm.conversation): one session per connection, made by logon -------------------------
    def _logoff(self, session: Session, why: str) -> None:
        """End the connection's session: what it holds is backed out (a sent UOW BACKEDOUT, a received one ACCEPTED
        again with its delivery counted); what the CF cannot settle now the sweeper settles later."""
        conv, session.conversation = session.conversation, None
        if conv is None:
            return
        try:
            conv.close()
        except Exception as e:  # noqa: BLE001 - the session ends whatever happens; the sweeper settles the rest
            log.warning("%s: ending the session of user %s on connection %d (%s): %s", self.qm.name,
                        _short(conv.user), session.number, why, e)

    def _op_logon(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        user = _identity(args, "user", required=True)
        token = _identity(args, "token", required=False)
        self._logoff(session, "a new logon")  # one session per connection: the new one replaces it
        session.conversation = Conversation(self.qm, user, token)
        return {"user": user, "token": bool(token), "qmgr": self.qm.name}

    def _op_send(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        conv = self._logged_on(session)
        eoc = arg(args, "send", "eoc", str, "")
        if eoc not in ("", "EOC", "EOCCANCEL"):
            raise BadRequestError(f"send: 'eoc' must be EOC or EOCCANCEL, not {_short(eoc)}")
        sent = conv.send(_service(args, "send"), arg(args, "send", "body", bytes),
                         option=_choice(args, "send", "option", ("SYNC", "MSG"), "SYNC"),
                         commit=arg(args, "send", "commit", bool, False),
                         store=arg(args, "send", "store", bool, None),
                         status_lifetime=arg(args, "send", "status_lifetime", int, 0),
                         lifetime_s=arg(args, "send", "lifetime_s", int, 0),
                         user_status=_user_status(args, "send"),
                         conversation=_bounded_str(args, "send", "conversation", MAX_CONVERSATION_ID), eoc=eoc)
        return dataclasses.asdict(sent)

    def _op_receive(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        """A receive that may wait: polled here (not in Conversation.receive) so that it ends with its connection
        and takes nothing for a client that has gone."""
        conv = self._logged_on(session)
        service = _service(args, "receive")
        option = _choice(args, "receive", "option", ("ANY", "SYNC", "MSG"), "ANY")
        wait_ms = arg(args, "receive", "wait_ms", int, 0)
        if not 0 <= wait_ms <= self.config.max_wait_ms:
            raise BadRequestError(f"receive: wait_ms must be 0-{self.config.max_wait_ms}, not {wait_ms}")
        deadline = time.monotonic() + wait_ms / 1000
        delay = 0.005
        while True:
            if session.gone.is_set():
                raise ClientGoneError(f"receive on {service}: the client has gone")
            if self._stopping:  # not carried out: the client may go on elsewhere (nothing was taken)
                raise self._quiescing("receive")
            try:
                got = conv.receive(service, option=option,
                                   max_length=session.reply_limit - ENVELOPE - MESSAGE_COST)
                break
            except EndOfUowError:
                raise
            except NoMessageError:
                if time.monotonic() >= deadline:
                    raise
            before_wait()
            threading.Event.wait(session.gone, delay)  # a plain wait: a _PeerWatch looks at its socket above
            delay = min(delay * 2, 0.05)
        if len(got.body) > session.reply_limit - ENVELOPE - MESSAGE_COST:
            raise TruncatedMessageError(
                f"receive on {service}: a message of {len(got.body)} bytes does not fit the replies of this "
                f"connection to {self.qm.name} ({session.reply_limit} bytes)"
                + (f"; unit of work {got.uow} stays held by this session: BACKOUT returns it" if got.uow else ""))
        return dataclasses.asdict(got)

    def _op_syncpoint(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        conv = self._logged_on(session)
        option = _choice(args, "syncpoint", "option", OPTIONS)
        uow = _bounded_str(args, "syncpoint", "uow", MAX_USER)
        return conv.syncpoint(option, uow, user_status=_user_status(args, "syncpoint"))

    # --- publish and subscribe (sqm.pubsub): one session per connection, made by its first publish or receive ---
    def _pubsub(self, session: Session) -> pubsub.PubSubSession:
        if session.pubsub is None:
            session.pubsub = pubsub.PubSubSession(self.qm, session.gone)
        return session.pubsub

    def _end_pubsub(self, session: Session) -> None:
        ps, session.pubsub = session.pubsub, None
        if ps is None:
            return
        try:
            ps.close()
        except Exception as e:  # noqa: BLE001 - the connection ends whatever happens; recovery backs it out
            log.warning("%s: backing out the publish/subscribe session of connection %d: %s", self.qm.name,
                        session.number, e)

    @staticmethod
    def _owner(session: Session, args: dict[str, Any], op: str) -> tuple[str, str]:
        """Whose subscription a request names (docs/pubsub.md, "Who may use a subscription"): the logged-on user's
        (user id and token); an operator may name any owner with 'user' and 'token'; a connection that has not
        logged on names the anonymous owner's."""
        if session.role == OPERATOR and "user" in args:
            return _bounded_str(args, op, "user", MAX_USER), _bounded_str(args, op, "token", MAX_USER)
        conv = session.conversation
        return (conv.user, conv.token) if conv is not None else ("", "")

    def _op_subscribe(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        durable = arg(args, "subscribe", "durable", bool, None)
        user, token = self._owner(session, args, "subscribe")
        return pubsub.subscribe(self.qm, _service(args, "subscribe", "topic"),
                                _bounded_str(args, "subscribe", "name", pubsub.MAX_NAME), durable=durable,
                                user=user, token=token).public()

    def _op_unsubscribe(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        user, token = self._owner(session, args, "unsubscribe")
        return pubsub.unsubscribe(self.qm, _service(args, "unsubscribe", "topic"),
                                  _bounded_str(args, "unsubscribe", "name", pubsub.MAX_NAME), user=user,
                                  token=token).public()

    def _op_subscriptions(self, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
        t = pubsub.topic(self.qm, _service(args, "subscriptions", "topic"))
        if session.role == OPERATOR and "user" not in args:  # an operator sees every owner's
            return [s.public() for s in pubsub.subscriptions(self.qm, t)]
        user, token = self._owner(session, args, "subscriptions")
        return [s.public() for s in pubsub.subscriptions(self.qm, t, user=user, token=token)]

    def _op_publish(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        return self._pubsub(session).publish(_service(args, "publish", "topic"), arg(args, "publish", "body", bytes),
                                             commit=arg(args, "publish", "commit", bool, False))

    def _op_receive_pub(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        wait_ms = arg(args, "receive_pub", "wait_ms", int, 0)
        if not 0 <= wait_ms <= self.config.max_wait_ms:
            raise BadRequestError(f"receive_pub: wait_ms must be 0-{self.config.max_wait_ms}, not {wait_ms}")
        topic = _service(args, "receive_pub", "topic")
        user, token = self._owner(session, {}, "receive_pub")  # only the logged-on user's (never another's)
        got = self._pubsub(session).receive(topic, _bounded_str(args, "receive_pub", "name", pubsub.MAX_NAME),
                                            wait_ms=wait_ms, user=user, token=token)
        room = session.reply_limit - ENVELOPE - MESSAGE_COST * max(1, len(got.messages))
        if sum(len(m) for m in got.messages) > room:
            raise TruncatedMessageError(
                f"receive_pub on {topic}: publication {got.pub} does not fit the replies of this connection to "
                f"{self.qm.name} ({session.reply_limit} bytes); it stays held by this session: pub_backout returns "
                "it")
        return got.public()

    def _op_pub_commit(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        return self._pubsub(session).commit()

    def _op_pub_backout(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        return self._pubsub(session).backout()

    @staticmethod
    def _logged_on(session: Session) -> Conversation:
        if session.conversation is None:  # _refusal refuses it first; a logon that failed leaves none
            raise NotLoggedOnError("this connection has not logged on: send logon first")
        return session.conversation

    # --- HTTP: health, readiness, metrics ----------------------------------------------------------------
    async def _serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].decode(errors="replace").split("?", 1)[0] if len(parts) >= 2 else ""
            status, ctype, body = await self._http_route(path)
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _http_route(self, path: str) -> tuple[str, str, bytes]:
        loop = asyncio.get_running_loop()
        text = "text/plain; charset=utf-8"
        if path == "/healthz":
            if self.qm.fenced:
                return "503 Service Unavailable", text, b"fenced: restart required\n"
            return "200 OK", text, b"ok\n"
        if path == "/readyz":
            problem = await loop.run_in_executor(None, self._not_ready_because)
            if problem:
                return "503 Service Unavailable", text, f"not ready: {problem}\n".encode()
            return "200 OK", text, b"ready\n"
        if path == "/metrics":
            body = await loop.run_in_executor(None, generate_latest, self.registry)
            return "200 OK", CONTENT_TYPE_LATEST, body
        return "404 Not Found", text, b"try /healthz, /readyz or /metrics\n"

    def _not_ready_because(self) -> str:
        if self.qm.fenced:
            return "fenced"
        if self._stopping or not self.qm.running:
            return "stopping" if self._stopping else "starting"
        try:
            self.qm.redis.ping()
        except CF_DOWN as e:
            return f"the CF does not answer: {e}"
        return ""


# --- conversation request arguments, bounded before anything runs --------------------------------------------------
def _bounded_str(args: dict[str, Any], op: str, name: str, longest: int, default: str = "") -> str:
    value = arg(args, op, name, str, default)
    if len(value) > longest:
        raise BadRequestError(f"{op}: '{name}' must be at most {longest} characters, not {len(value)}")
    return str(value)


def _identity(args: dict[str, Any], name: str, *, required: bool) -> str:
    """A logon's user id or token: 1-32 printable characters (EntireX's USER-ID and TOKEN); a token may be empty."""
    value = _bounded_str(args, "logon", name, MAX_USER)
    if (required and not value) or not value.isprintable():
        raise BadRequestError(f"logon: '{name}' must be 1-{MAX_USER} printable characters, not {_short(value)}")
    return value


def _service(args: dict[str, Any], op: str, name: str = "service") -> str:
    service = _bounded_str(args, op, name, MAX_NAME)
    if not service:
        raise BadRequestError(f"{op}: missing argument '{name}'")
    return service


def _choice(args: dict[str, Any], op: str, name: str, allowed: tuple[str, ...], default: str | None = None) -> str:
    value = arg(args, op, name, str) if default is None else arg(args, op, name, str, default)
    if value not in allowed:
        raise BadRequestError(f"{op}: '{name}' must be one of {', '.join(allowed)}, not {_short(value)}")
    return str(value)


def _user_status(args: dict[str, Any], op: str) -> bytes | None:
    value = arg(args, op, "user_status", bytes, None)
    if value is not None and len(value) > USER_STATUS_MAX:
        raise BadRequestError(f"{op}: a user status is at most {USER_STATUS_MAX} bytes, not {len(value)}")
    return None if value is None else bytes(value)


def serve(config: ServerConfig) -> int:
    """Run one SQM server until it is stopped; the return value is the process exit code."""
    try:
        server = SQMServer(config)
    except ServerConfigError as e:
        log.error("%s", e)
        return EXIT_CONFIG
    try:
        return asyncio.run(server.run())
    except LogLockedError as e:
        log.error("%s: its log is in use by another process (is %s already running?): %s", config.name,
                  config.name, e)
        return EXIT_CONFIG
    except RepositoryError as e:  # a log root that is not the group's: a configuration error
        log.error("%s", e)
        return EXIT_CONFIG
    except OSError as e:  # e.g. the port is taken
        log.error("%s: %s", config.name, e)
        return EXIT_ERROR
    except MQError as e:
        log.error("%s: %s", config.name, e)
        return EXIT_FENCED if isinstance(e, FencedError) else EXIT_ERROR


__all__ = ["EXIT_CONFIG", "EXIT_ERROR", "EXIT_FENCED", "EXIT_OK", "SQMServer", "ServerConfig",
           "ServerConfigError", "serve"]
