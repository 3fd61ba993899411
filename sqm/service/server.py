"""An SQM as a network service: an asyncio TCP server (optionally TLS) in front of one QueueManager.

The QueueManager API is synchronous (blocking Redis calls, fsync), so each client connection gets one worker
thread: its requests run there one after another, on one sqm.connection.Connection, which keeps the connection's
unit of work on one handle, like an MQ connection handle. When the connection goes away its open UOW is backed
out (MQ backs out on an abnormal end); a prepared (in-doubt) UOW stays in doubt for its coordinator.

Health, readiness and Prometheus metrics are served over HTTP on a second port: /healthz, /readyz, /metrics.

Exit codes of ``sqm run``: 0 after a graceful shutdown (SIGTERM/SIGINT, with a checkpoint), 1 on a failure,
2 for a bad configuration, 3 when peer recovery fenced this queue manager (restart it), 4 when its record log
cannot be written (disk full, I/O error: fix the disk, then restart it; meanwhile a peer recovers its work).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cfemu import repository
from cfemu.admin import AdminError
from cfemu.errors import BadRequestError, FencedError, MQError, StructureFailedError
from cfemu.repository import RepositoryError
from sqm.connection import Connection
from sqm.log import LogLockedError
from sqm.manager import CF_DOWN, QueueManager, QueueManagerConfig
from sqm.service import metrics
from sqm.service.protocol import (
    DEFAULT_MAX_FRAME,
    OPS,
    PROTOCOL_VERSION,
    FrameTooLargeError,
    NotAuthorizedError,
    ProtocolError,
    QuiescingError,
    arg,
    decode_body,
    encode_frame,
    error_reply,
    message_to_wire,
    ok_reply,
    parse_request,
    read_frame,
)

log = logging.getLogger("sqm.service.server")

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_FENCED, EXIT_LOG_FAILED = 0, 1, 2, 3, 4
MAX_BROWSE = 10_000


class ServerConfigError(ValueError):
    """A server option that cannot work (a missing TLS file, a token and no TLS on a non-loopback host...)."""


@dataclass
class ServerConfig:
    name: str
    log_root: Path
    redis_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (see ready_file)
    token: str | None = None  # when set, a connection's first frame must be hello with this token
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # with cert and key: mutual TLS, clients must present a certificate from this CA
    metrics_port: int | None = None  # /healthz, /readyz and /metrics; None: no HTTP endpoint
    lease_ms: int = 5000
    cf_connections: int = 64
    logload: int = 10000  # LOGLOAD: a checkpoint every this many log records
    max_frame: int = DEFAULT_MAX_FRAME
    max_wait_ms: int = 60_000  # longest get wait a request may ask for
    shutdown_grace_s: float = 10.0  # in-flight requests get this long to finish at shutdown
    cf_wait_s: float = 30.0  # how long to wait for the CF to answer at start
    ready_file: Path | None = None  # JSON {pid, host, port, metrics_port} written once serving
    clock_skew_ms: int = 0  # added to the physical time the LRSN clock reads (tests of a skewed member)

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
    client_name: str = ""
    conn: Connection | None = None
    gone: threading.Event = field(default_factory=threading.Event)  # the client disconnected
    reading: asyncio.Task[bytes | None] | None = None  # the read of the next frame, when one is pending

    def uow_open(self) -> bool:
        """Has the connection's UOW done anything (an empty UOW is not worth reporting as open)?"""
        return self.conn is not None and self.conn.uow is not None and self.conn.uow.operations > 0


@dataclass
class _Stats:
    connections: int = 0
    accepted: int = 0
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)


class SQMServer:
    def __init__(self, config: ServerConfig, qm: QueueManager | None = None) -> None:
        self.config = config
        self.ssl = config.ssl_context()
        self.qm = qm if qm is not None else QueueManager(QueueManagerConfig(
            name=config.name, log_root=Path(config.log_root), redis_url=config.redis_url, lease_ms=config.lease_ms,
            cf_connections=config.cf_connections,
            logload=config.logload, clock_skew_us=config.clock_skew_ms * 1000))
        self.stats = _Stats()
        self.port = config.port
        self.metrics_port = config.metrics_port
        self.exit_code = EXIT_OK
        self._stop: asyncio.Event | None = None
        self._stopping = False
        self._inflight = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sessions = 0
        self._handlers: dict[str, Callable[[Session, dict[str, Any]], Any]] = {
            "ping": self._op_ping, "put": self._op_put, "get": self._op_get, "browse": self._op_browse,
            "commit": self._op_commit, "backout": self._op_backout, "prepare": self._op_prepare,
            "resolve": self._op_resolve, "indoubt": self._op_indoubt, "status": self._op_status,
            "define": self._op_define,
        }
        self.registry = metrics.make_registry(self.qm, self.server_stats)

    # --- life cycle --------------------------------------------------------------------------------------
    def server_stats(self) -> dict[str, Any]:
        return {"connections": self.stats.connections, "requests": dict(self.stats.requests)}

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
                                            limit=2**16)
        self.port = server.sockets[0].getsockname()[1]
        http = None
        if self.config.metrics_port is not None:
            http = await asyncio.start_server(self._serve_http, self.config.host, self.config.metrics_port)
            self.metrics_port = http.sockets[0].getsockname()[1]
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        watcher = asyncio.create_task(self._watch_fencing())
        self._write_ready_file()
        log.info("%s serving on %s:%d%s (metrics %s), epoch %d", self.qm.name, self.config.host, self.port,
                 " with TLS" if self.ssl else "", self.metrics_port, self.qm.caller.epoch)
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

    def _write_ready_file(self) -> None:
        if self.config.ready_file is None:
            return
        path = Path(self.config.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "name": self.qm.name, "host": self.config.host,
                                   "port": self.port, "metrics_port": self.metrics_port}))
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
        server.close()
        deadline = loop.time() + self.config.shutdown_grace_s
        while self._inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self._inflight:
            log.warning("%s: %d requests still running after %.1fs; closing their connections", self.qm.name,
                        self._inflight, self.config.shutdown_grace_s)
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
    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._sessions += 1
        peer = writer.get_extra_info("peername")
        session = Session(self._sessions, f"{peer[0]}:{peer[1]}" if peer else "?",
                          ThreadPoolExecutor(1, thread_name_prefix=f"{self.qm.name}-c{self._sessions}"),
                          authenticated=self.config.token is None)
        self.stats.connections += 1
        self.stats.accepted += 1
        log.debug("%s: connection %d from %s", self.qm.name, session.number, session.peer)
        try:
            await self._session_loop(session, reader, writer)
        except asyncio.CancelledError:
            pass  # shutdown
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError) as e:
            log.debug("%s: connection %d ended: %s", self.qm.name, session.number, e)
        finally:
            self.stats.connections -= 1
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

    async def _session_loop(self, session: Session, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        # The next frame is read while a request runs, so that a client that leaves mid-request is noticed at
        # once (a waiting get must end with its connection, not consume a message for nobody).
        next_frame: asyncio.Task[bytes | None] | None = None
        while True:
            if next_frame is None:
                next_frame = session.reading = asyncio.ensure_future(read_frame(reader, self.config.max_frame))
            try:
                body = await next_frame
            except FrameTooLargeError as e:
                log.warning("%s: connection %d (%s): %s; closing it", self.qm.name, session.number, session.peer,
                            e)
                self.stats.requests[("?", e.reason_name)] += 1
                await self._send(writer, error_reply(None, e))
                return
            finally:
                next_frame = None
            if body is None:
                return
            obj: Any = None
            try:
                obj = decode_body(body)
                rid, op, args = parse_request(obj)
            except ProtocolError as e:
                known_id = obj.get("id") if isinstance(obj, dict) and isinstance(obj.get("id"), int) else None
                log.info("%s: connection %d: bad request: %s", self.qm.name, session.number, e)
                self.stats.requests[("?", e.reason_name)] += 1
                await self._send(writer, error_reply(known_id, e))
                if not session.authenticated:
                    return
                continue
            if op in ("hello", "auth"):
                reply = self._hello(session, rid, args)
                await self._send(writer, reply)
                if not reply["ok"]:
                    return
                continue
            if not session.authenticated:
                exc = NotAuthorizedError(f"authenticate first: send hello with the token before {op!r}")
                self.stats.requests[(op, exc.reason_name)] += 1
                await self._send(writer, error_reply(rid, exc))
                return
            if op not in self._handlers:
                bad = BadRequestError(f"unknown operation {op!r}; known: {', '.join(OPS)}")
                self.stats.requests[("?", bad.reason_name)] += 1
                await self._send(writer, error_reply(rid, bad, uow=session.uow_open()))
                continue
            if self._stopping:
                quiesce = QuiescingError(f"queue manager {self.qm.name} is shutting down; {op} not carried out")
                await self._send(writer, error_reply(rid, quiesce, uow=session.uow_open()))
                continue
            self._inflight += 1
            try:
                work = loop.run_in_executor(session.executor, self._dispatch, session, rid, op, args)
                next_frame = session.reading = asyncio.ensure_future(read_frame(reader, self.config.max_frame))
                both: list[asyncio.Future[Any]] = [work, next_frame]
                await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
                if next_frame.done() and (next_frame.exception() is not None or next_frame.result() is None):
                    session.gone.set()  # the client left (or broke the stream) while its request ran
                reply = await work
            finally:
                self._inflight -= 1
            if session.gone.is_set():
                log.info("%s: connection %d (%s) left during %s; its reply is dropped", self.qm.name,
                         session.number, session.peer, op)
                return
            self.stats.requests[(op, "ok" if reply["ok"] else reply["error"]["reason_name"])] += 1
            await self._send(writer, reply)
            if not reply["ok"] and reply["error"]["type"] == FencedError.__name__:
                self.request_stop(EXIT_FENCED)

    def _hello(self, session: Session, rid: int, args: dict[str, Any]) -> dict[str, Any]:
        try:
            token = arg(args, "hello", "token", str, None)
            session.client_name = arg(args, "hello", "client", str, "")
        except MQError as e:
            return error_reply(rid, e)
        if self.config.token is not None:
            if token is None or not hmac.compare_digest(token.encode(), self.config.token.encode()):
                log.warning("%s: connection %d (%s): authentication failed", self.qm.name, session.number,
                            session.peer)
                self.stats.requests[("hello", NotAuthorizedError.reason_name)] += 1
                return error_reply(rid, NotAuthorizedError("authentication failed: wrong or missing token"))
            session.authenticated = True
        self.stats.requests[("hello", "ok")] += 1
        return ok_reply(rid, {"qmgr": self.qm.name, "version": PROTOCOL_VERSION, "max_frame": self.config.max_frame,
                              "epoch": self.qm.caller.epoch, "session": session.number})

    async def _end_session(self, session: Session) -> None:
        """Like MQDISC after an abnormal end: the connection's in-flight UOW is backed out, in its own thread."""
        loop = asyncio.get_running_loop()
        conn = session.conn
        if conn is not None and conn.uow is not None:
            def backout() -> None:
                try:
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
            result = self._handlers[op](session, args)
            return ok_reply(rid, result, uow=session.uow_open())
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
        return error_reply(rid, error, uow=session.uow_open())

    def _connection(self, session: Session) -> Connection:
        if session.conn is None:
            session.conn = self.qm.connect()
            session.conn.gone = session.gone
        return session.conn

    def _op_ping(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        return {"qmgr": self.qm.name, "time": time.time()}

    def _op_put(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        conn = self._connection(session)
        m = conn.put(arg(args, "put", "queue", str), arg(args, "put", "body", bytes),
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
        m = conn.get(arg(args, "get", "queue", str), syncpoint=arg(args, "get", "syncpoint", bool, True),
                     wait_ms=wait_ms, msgid=arg(args, "get", "msgid", bytes, None),
                     correlid=arg(args, "get", "correlid", bytes, None))
        return message_to_wire(m)

    def _op_browse(self, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
        limit = arg(args, "browse", "limit", int, 100)
        if not 1 <= limit <= MAX_BROWSE:
            raise BadRequestError(f"browse: limit must be 1-{MAX_BROWSE}, not {limit}")
        conn = self._connection(session)
        return [message_to_wire(m) for m in conn.browse(arg(args, "browse", "queue", str), limit)]

    def _op_commit(self, session: Session, args: dict[str, Any]) -> None:
        if session.conn is not None:
            session.conn.commit()

    def _op_backout(self, session: Session, args: dict[str, Any]) -> None:
        if session.conn is not None:
            session.conn.backout()

    def _op_prepare(self, session: Session, args: dict[str, Any]) -> str:
        return self._connection(session).prepare(arg(args, "prepare", "xid", str))

    def _op_resolve(self, session: Session, args: dict[str, Any]) -> None:
        self.qm.resolve(arg(args, "resolve", "uow", str), arg(args, "resolve", "commit", bool))

    def _op_indoubt(self, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"uow": u.id, "xid": u.xid, "owner": u.owner, "structures": sorted(u.structures)}
                for u in self.qm.indoubt()]

    def _op_status(self, session: Session, args: dict[str, Any]) -> dict[str, Any]:
        return {**self.qm.status(), "host": self.config.host, "port": self.port, "metrics_port": self.metrics_port,
                "connections": self.stats.connections, "tls": self.ssl is not None}

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
                                               max_bytes=arg(args, "define", "max_bytes", int, 0), replace=replace)
            return vars(sdef)
        if kind == "queue":
            qdef = repository.define_queue(admin, repo, name, arg(args, "define", "structure", str),
                                           backout_threshold=arg(args, "define", "backout_threshold", int, 0),
                                           backout_queue=arg(args, "define", "backout_queue", str, ""),
                                           max_msg_length=arg(args, "define", "max_msg_length", int, 4 * 2**20),
                                           replace=replace)
            self.qm.forget_queue_def(name)
            return vars(qdef)
        raise BadRequestError(f"define: kind must be 'structure' or 'queue', not {kind!r}")

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
