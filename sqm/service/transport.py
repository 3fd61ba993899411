"""The service's transport: accepting connections under the limits, the frames, the session loop and the direct
loop, and the bounds of a reply.

The QueueManager API is synchronous (blocking Redis calls, fsync), so each client connection gets one worker
thread: its requests run there one after another, on one sqm.core.connection.Connection. The event loop accepts the
connection and runs the handshake (sqm.service.auth); once a plain (non-TLS) connection has authenticated, its
thread reads, runs and answers its requests itself on blocking socket calls (the direct loop: no hand-off from the
loop to the thread and back per request, which cost more CPU than the request's own work; bench/profile_service.py),
and the loop only ends it at shutdown. By default (``ServerConfig.event_loop``) such a connection joins the
service's event loop instead (sqm.service.batch_loop), which runs the puts and gets (and commits under syncpoint) of all its
connections that arrive together as one batch, and hands the connection to its thread (``direct_step``) for the
requests of other kinds. A TLS connection stays on the asyncio loop, which hands each request to its thread.

Until it has authenticated a peer may send only small frames and must do so within ``auth_timeout_s``; at most
``max_unauthenticated`` such connections are open at once, and when one more comes the pool makes room for it
(``_evict``): the connection closed is one from the address holding most of the pool, of those one that has not
said hello, of those the oldest. So holding the pool keeps nobody out: a client that authenticates at once after
connecting gets in whatever others hold, and a peer that wants to keep its connections must outpace every new one.
Every connection counts against ``max_connections`` and ``max_connections_per_peer`` (a refused one gets an error
naming the limit, then is closed); an authenticated one idle for ``idle_timeout_s`` is closed. A request runs only
once the dispatcher (``Host.refusal``) lets it.

The bytes of requests in flight are bounded per connection by its frame limit and per member by its budget
(``ServerConfig.request_budget``, sqm.service.session.ByteBudget): a frame longer than FREE_FRAME reserves its
declared length before its body is read (waiting up to ``request_budget_wait_s`` for it, its body meanwhile left
in the socket, so the client is held back by TCP), and gives it back once its reply is sent or its connection
ends. A frame the budget cannot take in that time is refused with FrameTooLargeError (MQRC_DATA_LENGTH_ERROR, with
the request's id when its first bytes name one): its body is read and dropped, never kept, so the stream stays in
step and the connection goes on. A reply longer than FREE_FRAME is counted while it is sent (it holds back new
large requests, never itself: its work is done).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import ssl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import msgpack

from cfemu.errors import BadRequestError, FencedError, MQError
from cfemu.sockets import set_kernel_timeout
from sqm.core.client_watch import ClientWatch
from sqm.operations import OPERATOR, short
from sqm.service.auth import Authenticator
from sqm.service.batch_loop import BatchLoop
from sqm.service.config import EXIT_FENCED, ServerConfig
from sqm.service.protocol import (
    HEADER,
    PRE_HELLO_MAX_FRAME,
    ConnectionLimitError,
    FrameTooLargeError,
    NotAuthorizedError,
    ProtocolError,
    decode_request,
    encode_frame,
    error_reply,
    parse_request,
    read_frame_length,
    recv_frame_length,
    recv_until,
)
from sqm.service.session import (
    OP_LABEL_UNKNOWN,
    ByteBudget,
    Session,
    Stats,
    Together,
    Warnings,
    certificate_subject,
    op_label,
)

log = logging.getLogger("sqm.service.server")  # the service's log lines keep one logger name

# A frame of at most this many bytes reserves nothing from the member's budget: a connection reads one frame at a
# time, so those cost at most this much per connection (max_connections of them).
FREE_FRAME = PRE_HELLO_MAX_FRAME
PEEK_BYTES = 256  # the first bytes of a refused frame's body, kept to find the request's id and op
CHUNK = 65536  # what one receive asks for while reading small frames or dropping a refused one
BIG_CHUNK = 2**20  # ... while reading a large frame's body


def peek_request(head: bytes) -> tuple[int | None, str]:
    """The id and op label of a request from the first bytes of its body (the client library sends them first),
    or (None, '?') where they are not there: for the reply to a frame refused without being read."""
    rid: int | None = None
    op = OP_LABEL_UNKNOWN
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=PEEK_BYTES * 2)
    try:
        unpacker.feed(head)
        for _ in range(min(unpacker.read_map_header(), 2)):
            key = unpacker.unpack()
            if key not in ("id", "op"):
                break
            value = unpacker.unpack()
            if key == "id" and isinstance(value, int) and not isinstance(value, bool):
                rid = value
            elif key == "op" and isinstance(value, str):
                op = op_label(value)
    except Exception:  # what msgpack raises on a cut or malformed prefix: unknown, and no more is needed
        pass
    return rid, op


Read = tuple[bytes | bytearray, int] | dict[str, Any] | None  # (body, bytes reserved), a refusal's reply, the end
_END: Any = object()  # what _serve_frame returns when the connection is to end


class Host(Protocol):
    """What the transport needs of the server: its name, the dispatcher, the end of a session, the stop."""

    @property
    def name(self) -> str: ...

    def refusal(self, session: Session, rid: int, op: str) -> dict[str, Any] | None: ...

    def dispatch(self, session: Session, rid: int, op: str, args: dict[str, Any]) -> dict[str, Any]: ...

    def may_run_together(self, op: str, args: dict[str, Any]) -> bool: ...

    def begin_together(self, requests: list[tuple[Session, int, str, dict[str, Any]]]) -> Together: ...

    def finish_together(self, batches: list[Together]) -> None: ...

    async def end_session(self, session: Session) -> None: ...

    def request_stop(self, exit_code: int = ...) -> None: ...


class _PeerWatch(ClientWatch):
    """Set when the client of a connection served by its own thread has gone: is_set() looks at the socket (a
    waiting get asks it between polls of the CF), like the event loop's read of the next frame does;
    seen_to_leave() answers from the flag alone (ClientWatch)."""

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


class Transport:
    """The connections of one server: accepted by ``serve`` (the listener's callback), ended by ``stop``."""

    def __init__(self, host: Host, config: ServerConfig, stats: Stats, auth: Authenticator,
                 warn: Warnings) -> None:
        self.host = host
        self.config = config
        self.stats = stats
        self.auth = auth
        self.warn = warn
        self._direct: dict[int, socket.socket] = {}  # session number -> socket served by its own thread
        self._batch: BatchLoop | None = None  # the event loop of authenticated plain connections (event_loop)
        self._tasks: set[asyncio.Task[Any]] = set()
        # connections that have not authenticated: session number -> (session, its task, its writer)
        self._preauth: dict[int, tuple[Session, asyncio.Task[Any], asyncio.StreamWriter]] = {}
        self._sessions = 0
        self._live: dict[int, Session] = {}  # every open connection, by session number (DISPLAY CONN)
        self.budget = ByteBudget(config.request_budget(), FREE_FRAME)

    def sessions(self) -> list[Session]:
        """The connections open now, in the order they were accepted (a copy: the event loop changes the table)."""
        return list(self._live.values())

    def _over_limit(self, ip: str) -> tuple[str, str] | None:
        """(limit, message) when a new connection from ip would exceed a connection limit."""
        c = self.config
        if self.stats.connections >= c.max_connections:
            return "server", f"{c.max_connections} connections at once (--max-connections)"
        if self.stats.peers[ip] >= c.max_connections_per_peer:
            return "peer", f"{c.max_connections_per_peer} connections at once from {ip} (--max-connections-per-peer)"
        return None

    def _evict(self) -> None:
        """Close one connection that has not authenticated, to make room for a new one: one from the address
        holding most of them, of those one that has not said hello, of those the oldest."""
        waiting = [entry for entry in self._preauth.values() if not entry[0].authenticated]
        if not waiting:
            return
        by_ip: dict[str, int] = {}
        for s, _, _ in waiting:
            by_ip[s.peer_ip] = by_ip.get(s.peer_ip, 0) + 1
        session, task, writer = min(waiting, key=lambda e: (-by_ip[e[0].peer_ip], e[0].said_hello, e[0].opened))
        del self._preauth[session.number]
        self.stats.closed["evicted"] += 1
        c = self.config
        self.warn("evicted", "%s: %d connections at once have not authenticated (--max-unauthenticated): connection "
                  "%d (%s) closed to make room for a new one (closed so far: %d)", self.host.name,
                  c.max_unauthenticated, session.number, session.peer, self.stats.closed["evicted"])
        exc = ConnectionLimitError(f"connection closed by {self.host.name}: the limit of {c.max_unauthenticated} "
                                   "connections at once that have not authenticated (--max-unauthenticated) is "
                                   "reached, and this one was the first to make room for a new one; authenticate "
                                   "at once after connecting")
        with contextlib.suppress(Exception):
            writer.write(encode_frame(error_reply(None, exc)))
        task.cancel()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ip: str, limit: str,
                      what: str) -> None:
        self.stats.refused[limit] += 1
        self.warn(f"limit-{limit}", "%s: connection from %s refused: the limit of %s is reached (refusals so far: "
                  "%d)", self.host.name, ip, what, self.stats.refused[limit])
        exc = ConnectionLimitError(f"connection refused by {self.host.name}: the limit of {what} is reached; try again "
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

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = writer.get_extra_info("peername")
        ip = str(peer[0]) if peer else "?"
        refusal = self._over_limit(ip)
        if refusal is not None:
            await self._refuse(reader, writer, ip, *refusal)
            return
        self._tasks.add(task)
        if len(self._preauth) >= self.config.max_unauthenticated:
            self._evict()
        self._sessions += 1
        session = Session(self._sessions, f"{ip}:{peer[1]}" if peer else "?",
                          ThreadPoolExecutor(1, thread_name_prefix=f"{self.host.name}-c{self._sessions}"),
                          authenticated=False, request_limit=min(PRE_HELLO_MAX_FRAME, self.config.max_frame),
                          reply_limit=self.config.max_frame, peer_ip=ip,
                          tls=writer.get_extra_info("ssl_object") is not None,
                          certificate=certificate_subject(writer.get_extra_info("peercert")),
                          opened=asyncio.get_running_loop().time())
        self._live[session.number] = session
        self.stats.connections += 1
        self.stats.unauthenticated += 1
        self.stats.peers[ip] += 1
        self.stats.accepted += 1
        log.debug("%s: connection %d from %s", self.host.name, session.number, session.peer)
        self._preauth[session.number] = (session, task, writer)
        if not self.config.auth:  # --no-auth (loopback only): every connection is an operator
            self.auth.authenticated(session, OPERATOR, "none")
            del self._preauth[session.number]
        try:
            await self._session_loop(session, reader, writer)
        except asyncio.CancelledError:
            pass  # shutdown
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError) as e:
            log.debug("%s: connection %d ended: %s", self.host.name, session.number, e)
        finally:
            self._live.pop(session.number, None)
            self._preauth.pop(session.number, None)
            self.budget.release(session)  # whatever its frames and replies still held
            self.stats.connections -= 1
            if not session.authenticated:
                self.stats.unauthenticated -= 1
            self.stats.peers[ip] -= 1
            if self.stats.peers[ip] <= 0:
                del self.stats.peers[ip]
            if session.reading is not None and not session.reading.done():
                session.reading.cancel()
            await self.host.end_session(session)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            self._tasks.discard(task)

    async def _send(self, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
        writer.write(encode_frame(reply))
        await writer.drain()

    def _read_next(self, session: Session, reader: asyncio.StreamReader) -> asyncio.Task[Read]:
        why = ("" if session.authenticated else " before authentication (send hello and auth first)"
               if session.said_hello else " before hello (send hello first)")
        task = asyncio.ensure_future(self._read_request(session, reader, why))
        session.reading = task
        return task

    # --- reading a request under the budget ----------------------------------------------------------------
    def _budget_refusal(self, session: Session, head: bytes, length: int) -> dict[str, Any]:
        """The reply to a frame the member's budget could not take (its body read and dropped), counted."""
        rid, op = peek_request(head)
        limit, wait_s = self.budget.limit, self.config.request_budget_wait_s
        exc = FrameTooLargeError(f"a request of {length} bytes is refused: the {limit} bytes this queue manager "
                                 f"takes in at once (--max-request-bytes-per-member) stayed in use for {wait_s:g}s; "
                                 "try again later")
        self.warn("budget", "%s: connection %d (%s): a request of %d bytes refused: %d of the %d bytes of requests in "
                  "flight in use for %gs (refusals so far: %d)", self.host.name, session.number, session.peer, length,
                  self.budget.used, limit, wait_s, self.budget.refused)
        self.stats.count((op, exc.reason_name))
        return error_reply(rid, exc, uow=session.uow_open())

    async def _read_request(self, session: Session, reader: asyncio.StreamReader, why: str) -> Read:
        """The next frame on the event loop: (body, bytes reserved), the reply to one refused for the budget
        (its body dropped), or None at a clean end of stream (between frames). A frame over the connection's
        limit raises FrameTooLargeError from its header, before its body is read."""
        length = await read_frame_length(reader, session.request_limit, why)
        if length is None:
            return None
        if length <= self.budget.free:
            return await reader.readexactly(length), 0
        if not self.budget.try_reserve(session, length):  # wait for it without blocking the loop
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.config.request_budget_wait_s
            self.budget.note(waited=True)
            while not self.budget.try_reserve(session, length):
                if loop.time() >= deadline:
                    self.budget.note(refused=True)
                    return self._budget_refusal(session, await self._drop_async(reader, length), length)
                await asyncio.sleep(0.02)
        try:
            return await reader.readexactly(length), length
        except BaseException:
            self.budget.release(session, length)
            raise

    @staticmethod
    async def _drop_async(reader: asyncio.StreamReader, length: int) -> bytes:
        """Read and drop a frame's body of length bytes; its first PEEK_BYTES."""
        head = b""
        left = length
        while left > 0:
            chunk = await reader.read(min(left, CHUNK))
            if not chunk:
                raise ConnectionError("the peer closed the connection in the middle of a frame")
            if len(head) < PEEK_BYTES:
                head += chunk[:PEEK_BYTES - len(head)]
            left -= len(chunk)
        return head

    def _recv_request(self, session: Session, sock: socket.socket, buf: bytearray) -> Read:
        """The next frame from the connection's blocking socket, reading ahead into buf (kept for the next call;
        a large frame's body is read into a buffer of its own, nothing past it), as ``_read_request``."""
        length = recv_frame_length(sock, buf, session.request_limit, CHUNK)
        if length is None:
            return None
        end = HEADER.size + length
        if length <= self.budget.free:
            recv_until(sock, buf, end, CHUNK)
            body = bytes(buf[HEADER.size:end])
            del buf[:end]
            return body, 0
        have = min(len(buf), end)
        if not self.budget.reserve(session, length, self.config.request_budget_wait_s):
            head = bytes(buf[HEADER.size:min(have, HEADER.size + PEEK_BYTES)])
            left = end - have
            del buf[:have]
            scratch = bytearray(CHUNK)
            while left > 0:  # read and drop the body, so that the stream stays in step
                n = sock.recv_into(scratch, min(left, CHUNK))
                if not n:
                    raise ConnectionError("the peer closed the connection in the middle of a frame")
                if len(head) < PEEK_BYTES:
                    head += bytes(scratch[:min(n, PEEK_BYTES - len(head))])
                left -= n
            return self._budget_refusal(session, head, length)
        large = bytearray(buf[HEADER.size:have])  # grows as the body arrives: memory only for what came
        del buf[:have]
        while len(large) < length:
            chunk = sock.recv(min(length - len(large), BIG_CHUNK))
            if not chunk:
                raise ConnectionError("the peer closed the connection in the middle of a frame")
            large += chunk
        return large, length

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
                  "sent instead", self.host.name, session.number, op, length, session.reply_limit)
        reply = error_reply(rid, MQError(f"{op}: the reply of {length} bytes exceeds this connection's limit of "
                                         f"{session.reply_limit} bytes"), uow=session.uow_open())
        return reply, encode_frame(reply)

    def _frame_deadline(self, session: Session) -> float | None:
        """Seconds the next frame may take: what is left of the authentication time, else the idle timeout."""
        if not session.authenticated:
            return max(0.0, session.opened + self.config.auth_timeout_s - asyncio.get_running_loop().time())
        return self.config.idle_timeout_s or None

    def _closed_idle(self, session: Session) -> None:
        """A connection about to close for its idle timeout, counted (under the lock: a connection's thread counts
        it too) and logged; its open UOW is backed out as it closes."""
        with self.stats.lock:
            self.stats.closed["idle_timeout"] += 1
        log.info("%s: connection %d (%s, %s) idle for %gs; closing it (its open UOW is backed out)",
                 self.host.name, session.number, session.peer, session.named,
                 self.config.idle_timeout_s)

    def _unauthenticated_refusal(self, session: Session, reason: str) -> None:
        """Count a refusal of a peer that has not authenticated (its connection is closed after the reply)."""
        if not session.authenticated:
            self.stats.auth_failures[reason] += 1

    async def _session_loop(self, session: Session, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        # The next frame is read while a request runs, so that a client that leaves mid-request is noticed at
        # once (a waiting get must end with its connection, not consume a message for nobody).
        next_frame: asyncio.Task[Read] | None = None
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
                    self.warn("auth-timeout", "%s: connection %d (%s) did not authenticate within %gs; closing it",
                              self.host.name, session.number, session.peer, self.config.auth_timeout_s)
                    exc = NotAuthorizedError(f"not authenticated within {self.config.auth_timeout_s:g}s: closing the "
                                             "connection")
                    writer.write(encode_frame(error_reply(None, exc)))
                else:
                    self._closed_idle(session)
                return
            try:
                got = next_frame.result()
            except FrameTooLargeError as e:
                self.warn("frame", "%s: connection %d (%s): %s; closing it", self.host.name, session.number,
                          session.peer, e)
                self.stats.count((OP_LABEL_UNKNOWN, e.reason_name))
                if not session.authenticated:
                    self.auth.refused(session, "frame_too_large")
                await self._send(writer, error_reply(None, e))
                return
            finally:
                next_frame = None
            if got is None:
                return
            if isinstance(got, dict):  # refused for the budget, its body dropped: the connection goes on
                await self._send(writer, got)
                continue
            body, reserved = got
            del got
            try:
                next_frame = await self._serve_frame(session, body, reader, writer)
            finally:
                self.budget.release(session, reserved)
            if next_frame is _END:
                return

    async def _serve_frame(self, session: Session, body: bytes | bytearray, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> asyncio.Task[Read] | None:
        """One frame of the event loop's session loop: the read of the next frame when it began while the
        request ran (else None), or _END when the connection is to end."""
        loop = asyncio.get_running_loop()
        parsed = self._parse(session, body)
        del body
        if isinstance(parsed, dict):
            await self._send(writer, parsed)
            if not session.authenticated:
                self.auth.refused(session, "malformed")
                return _END
            return None
        rid, op, args = parsed
        if op in ("hello", "auth"):
            if session.authenticated and (self.config.auth or op == "auth"):
                again = BadRequestError(f"{op}: this connection has already authenticated (as {session.role})")
                self.stats.count((op, again.reason_name))
                await self._send(writer, error_reply(rid, again, uow=session.uow_open()))
                return None
            handshake = self.auth.hello if op == "hello" else self.auth.auth
            reply = await handshake(session, rid, args)
            if session.authenticated:
                self._preauth.pop(session.number, None)
            await self._send(writer, reply)
            if not reply["ok"]:
                return _END
            if session.authenticated and not session.tls:
                await self._serve_direct(session, reader, writer)
                return _END
            return None
        if not session.authenticated:
            exc = NotAuthorizedError(f"authenticate first: send hello and auth before {short(op)}")
            self.stats.count((op_label(op), exc.reason_name))
            self.auth.refused(session, "not_authenticated")
            await self._send(writer, error_reply(rid, exc))
            return _END
        refused = self.host.refusal(session, rid, op)
        if refused is not None:
            await self._send(writer, refused)
            return None
        with self.stats.lock:
            self.stats.inflight += 1
        try:
            work = loop.run_in_executor(session.executor, self.host.dispatch, session, rid, op, args)
            next_frame = self._read_next(session, reader)
            both: list[asyncio.Future[Any]] = [work, next_frame]
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if next_frame.done() and (next_frame.exception() is not None or next_frame.result() is None):
                session.gone.set()  # the client left (or broke the stream) while its request ran
            reply = await work
        finally:
            with self.stats.lock:
                self.stats.inflight -= 1
        if session.gone.is_set():
            log.info("%s: connection %d (%s) left during %s; its reply is dropped", self.host.name,
                     session.number, session.peer, op)
            return _END
        reply, frame = self._bounded(session, rid, op, reply)
        self.stats.count((op, "ok" if reply["ok"] else reply["error"]["reason_name"]))
        held = len(frame) if len(frame) > self.budget.free else 0
        self.budget.hold(session, held)
        try:
            writer.write(frame)
            del frame
            await writer.drain()
        finally:
            self.budget.release(session, held)
        if not reply["ok"] and reply["error"]["type"] == FencedError.__name__:
            self.host.request_stop(EXIT_FENCED)
        return next_frame

    # --- an authenticated connection served by its own thread -------------------------------------------------
    async def _serve_direct(self, session: Session, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        """From here on the connection's thread reads, runs and answers its requests itself, on blocking socket
        calls: no hand-off from the event loop to the thread and back per request (two wake-ups and a self-pipe
        write each), which cost more CPU than the request's own work (bench/profile_service.py). The event loop
        keeps the accept, the handshake, the limits, TLS connections (whose transport it cannot hand over) and the
        shutdown."""
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
        session.gone = _PeerWatch(sock)
        if session.conn is not None:
            session.conn.gone = session.gone
        loop = asyncio.get_running_loop()
        if self.config.event_loop and await self._serve_on_loop(session, sock, leftover, loop):
            return
        await self._serve_own_thread(session, sock, leftover, loop)

    async def _serve_own_thread(self, session: Session, sock: socket.socket, leftover: bytearray,
                               loop: asyncio.AbstractEventLoop) -> None:
        """The connection served by its own thread until it ends."""
        sock.setblocking(True)
        self._direct[session.number] = sock
        try:
            await loop.run_in_executor(session.executor, self._direct_loop, session, sock, leftover, loop)
        except asyncio.CancelledError:  # shutdown: the thread ends at its next read (the socket is shut down)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            raise
        finally:
            self._direct.pop(session.number, None)

    async def _serve_on_loop(self, session: Session, sock: socket.socket, buf: bytearray,
                             loop: asyncio.AbstractEventLoop) -> bool:
        """The connection joins the service's event loop (sqm.service.batch_loop) until it ends; False when the
        loop has ended (it failed: ``loop_counts`` says why), and the connection is served by its own thread."""
        set_kernel_timeout(sock, self.config.idle_timeout_s)  # while its thread has it, reading (the direct path)
        if self._batch is None:
            self._batch = BatchLoop(self, loop, self.config.idle_timeout_s, self.host.request_stop, FREE_FRAME)
        ended: asyncio.Future[None] = loop.create_future()

        def end() -> None:
            loop.call_soon_threadsafe(lambda: None if ended.done() else ended.set_result(None))

        if not self._batch.add(session, sock, buf, end):
            return False
        await ended
        return True

    def loop_counts(self) -> dict[str, Any]:
        """The event loop's batches so far and the requests they carried (their ratio: how many ran together),
        and why it ended when it failed ("": it did not)."""
        b = self._batch
        return {"batches": b.batches if b else 0, "batched_requests": b.batched if b else 0,
                "failed": b.failed if b else ""}

    # --- what the event loop asks of the transport (sqm.service.batch_loop.LoopHost) ------------------------------
    @property
    def name(self) -> str:
        return self.host.name

    def loop_request(self, session: Session, body: bytes) -> tuple[int, str, dict[str, Any]] | dict[str, Any]:
        return self._admit(session, self._parse(session, body))

    def may_run_together(self, op: str, args: dict[str, Any]) -> bool:
        return self.host.may_run_together(op, args)

    def begin_together(self, requests: list[tuple[Session, int, str, dict[str, Any]]]) -> Together:
        with self.stats.lock:  # in flight until finished (the shutdown waits for them)
            self.stats.inflight += len(requests)
        try:
            return self.host.begin_together(requests)
        except BaseException:
            with self.stats.lock:
                self.stats.inflight -= len(requests)
            raise

    def finish_together(self, batches: list[Together]) -> None:
        try:
            self.host.finish_together(batches)
        finally:
            with self.stats.lock:
                self.stats.inflight -= sum(len(t.requests) for t in batches)

    def finish(self, session: Session, rid: int, op: str, reply: dict[str, Any]) -> bytes:
        reply, frame = self._bounded(session, rid, op, reply)
        self.stats.count((op, "ok" if reply["ok"] else reply["error"]["reason_name"]))
        return frame

    def hold(self, session: Session, n: int) -> None:
        self.budget.hold(session, n)

    def release(self, session: Session) -> None:
        self.budget.release(session)

    def closed_idle(self, session: Session) -> None:
        self._closed_idle(session)

    def _direct_loop(self, session: Session, sock: socket.socket, buf: bytearray,
                     loop: asyncio.AbstractEventLoop) -> None:
        try:
            set_kernel_timeout(sock, self.config.idle_timeout_s)
            while self.direct_step(session, sock, buf, loop) is True:
                pass
        finally:
            self.budget.release(session)
            sock.close()

    def direct_step(self, session: Session, sock: socket.socket, buf: bytearray, loop: asyncio.AbstractEventLoop,
                    parsed: tuple[int, str, dict[str, Any]] | None = None,
                    hand_back: Callable[[str, dict[str, Any]], bool] | None = None
                    ) -> bool | tuple[int, str, dict[str, Any]]:
        """One request of a connection served on its blocking socket (its next frame read into buf first, unless
        ``parsed`` is the request, read already), answered; False when the connection is to end. A request read
        here that ``hand_back(op, args)`` wants (a small frame) is returned instead, not run: the event loop runs
        it (sqm.service.batch_loop)."""
        request: tuple[int, str, dict[str, Any]] | dict[str, Any] | None = parsed
        try:
            if request is None:
                try:
                    got = self._recv_request(session, sock, buf)
                except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO: no request for the idle timeout
                    self._closed_idle(session)
                    return False
                except FrameTooLargeError as e:
                    self.warn("frame", "%s: connection %d (%s): %s; closing it", self.host.name, session.number,
                              session.peer, e)
                    self.stats.count((OP_LABEL_UNKNOWN, e.reason_name))
                    sock.sendall(encode_frame(error_reply(None, e)))
                    return False
                if got is None:
                    return False
                if isinstance(got, dict):  # refused for the budget, its body dropped: the connection goes on
                    sock.sendall(encode_frame(got))
                    return True
                request = self._admit(session, self._parse(session, got[0]))
                if hand_back is not None and not got[1] and isinstance(request, tuple) \
                        and hand_back(request[1], request[2]):
                    return request
                del got  # the frame's bytes: its request holds what it needs (its reservation covers both)
            reply = self._direct_request(session, request)
            if reply is None:
                log.info("%s: connection %d (%s) left during a request; its reply is dropped", self.host.name,
                         session.number, session.peer)
                return False
            frame, fenced = reply
            del reply
            if len(frame) > self.budget.free:
                self.budget.hold(session, len(frame))
            sock.sendall(frame)
            del frame
            # One request at a time here: the connection holds nothing now. Only this thread changes what it
            # holds while the request runs, so the look needs no lock (most requests held nothing).
            if session.reserved:
                self.budget.release(session)
            if fenced:
                loop.call_soon_threadsafe(self.host.request_stop, EXIT_FENCED)
            return True
        except OSError as e:  # the client went away (reset, broken pipe) or the shutdown closed its socket
            log.debug("%s: connection %d ended: %s", self.host.name, session.number, e)
            return False

    def _direct_request(self, session: Session,
                        parsed: tuple[int, str, dict[str, Any]] | dict[str, Any]) -> tuple[bytes, bool] | None:
        """One request of an authenticated connection: (reply frame, fenced), or None when the client left."""
        admitted = self._admit(session, parsed)
        if isinstance(admitted, dict):
            return encode_frame(admitted), False
        rid, op, args = admitted
        with self.stats.lock:
            self.stats.inflight += 1
        try:
            reply = self.host.dispatch(session, rid, op, args)
        finally:
            with self.stats.lock:
                self.stats.inflight -= 1
        if session.gone.seen_to_leave():  # only what the request saw (no look at the socket per request)
            return None
        reply, frame = self._bounded(session, rid, op, reply)
        self.stats.count((op, "ok" if reply["ok"] else reply["error"]["reason_name"]))
        return frame, not reply["ok"] and reply["error"]["type"] == FencedError.__name__

    def _admit(self, session: Session, parsed: tuple[int, str, dict[str, Any]] | dict[str, Any]
               ) -> tuple[int, str, dict[str, Any]] | dict[str, Any]:
        """An authenticated connection's request that may run, or the reply to send instead (a malformed one's,
        a second handshake's, the dispatcher's refusal)."""
        if isinstance(parsed, dict):
            return parsed
        rid, op, _ = parsed
        if op in ("hello", "auth"):
            again = BadRequestError(f"{op}: this connection has already authenticated (as {session.role})")
            self.stats.count((op, again.reason_name))
            return error_reply(rid, again, uow=session.uow_open())
        refused = self.host.refusal(session, rid, op)
        return parsed if refused is None else refused

    # --- what both paths do with a request before it runs ---------------------------------------------------
    def _parse(self, session: Session, body: bytes | bytearray) -> tuple[int, str, dict[str, Any]] | dict[str, Any]:
        """The request a frame holds (id, op, args), or the error reply to a malformed one (logged, counted)."""
        obj: Any = None
        try:
            obj = decode_request(body)
            return parse_request(obj)
        except ProtocolError as e:
            if obj is None:  # not decoded (past a request's bounds, or not msgpack): its first bytes may name it
                known_id, _ = peek_request(bytes(body[:PEEK_BYTES]))
            else:
                known_id = obj.get("id") if isinstance(obj, dict) and isinstance(obj.get("id"), int) else None
            log.info("%s: connection %d: bad request: %.200s", self.host.name, session.number, e)
            self.stats.count((OP_LABEL_UNKNOWN, e.reason_name))
            return error_reply(known_id, e)

    async def stop(self, grace_s: float) -> None:
        """At shutdown (the listener closed): let the requests running finish, up to ``grace_s``, then end every
        connection (each connection's thread ends at its next read: its socket is shut down)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.stats.inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.stats.inflight:
            log.warning("%s: %d requests still running after %.1fs; closing their connections", self.host.name,
                        self.stats.inflight, grace_s)
        if self._batch is not None:  # its connections end (each one with its thread ends at its next read)
            await asyncio.get_running_loop().run_in_executor(None, self._batch.stop)
        for sock in list(self._direct.values()):  # wakes each connection thread blocked reading its next request
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=max(1.0, deadline - loop.time()))


__all__ = ["Host", "Transport"]
