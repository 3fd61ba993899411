"""The service's transport: accepting connections under the limits, the frames, the session loop and the direct
loop, and the bounds of a reply.

The QueueManager API is synchronous (blocking Redis calls, fsync), so each client connection gets one worker
thread: its requests run there one after another, on one sqm.core.connection.Connection. The event loop accepts the
connection and runs the handshake (sqm.service.auth); once a plain (non-TLS) connection has authenticated, its
thread reads, runs and answers its requests itself on blocking socket calls (the direct loop: no hand-off from the
loop to the thread and back per request, which cost more CPU than the request's own work; bench/profile_service.py),
and the loop only ends it at shutdown. A TLS connection stays on the event loop, which hands each request to its
thread.

Until it has authenticated a peer may send only small frames, must do so within ``auth_timeout_s``, and counts
against ``max_unauthenticated``; every connection counts against ``max_connections`` and
``max_connections_per_peer`` (a refused one gets an error naming the limit, then is closed); an authenticated one
idle for ``idle_timeout_s`` is closed. A request runs only once the dispatcher (``Host.refusal``) lets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from cfemu.errors import BadRequestError, FencedError, MQError
from cfemu.sockets import set_kernel_timeout
from sqm.operations import OPERATOR, short
from sqm.service.auth import Authenticator
from sqm.service.config import EXIT_FENCED, ServerConfig
from sqm.service.protocol import (
    HEADER,
    PRE_HELLO_MAX_FRAME,
    ConnectionLimitError,
    FrameTooLargeError,
    NotAuthorizedError,
    ProtocolError,
    decode_body,
    encode_frame,
    error_reply,
    parse_request,
    read_frame,
    recv_body,
)
from sqm.service.session import OP_LABEL_UNKNOWN, Session, Stats, Warnings, op_label

log = logging.getLogger("sqm.service.server")  # the service's log lines keep one logger name


class Host(Protocol):
    """What the transport needs of the server: its name, the dispatcher, the end of a session, the stop."""

    @property
    def name(self) -> str: ...

    def refusal(self, session: Session, rid: int, op: str) -> dict[str, Any] | None: ...

    def dispatch(self, session: Session, rid: int, op: str, args: dict[str, Any]) -> dict[str, Any]: ...

    async def end_session(self, session: Session) -> None: ...

    def request_stop(self, exit_code: int = ...) -> None: ...


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
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sessions = 0

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
        self._sessions += 1
        session = Session(self._sessions, f"{ip}:{peer[1]}" if peer else "?",
                          ThreadPoolExecutor(1, thread_name_prefix=f"{self.host.name}-c{self._sessions}"),
                          authenticated=False, request_limit=min(PRE_HELLO_MAX_FRAME, self.config.max_frame),
                          reply_limit=self.config.max_frame, peer_ip=ip,
                          tls=writer.get_extra_info("ssl_object") is not None,
                          opened=asyncio.get_running_loop().time())
        self.stats.connections += 1
        self.stats.unauthenticated += 1
        self.stats.peers[ip] += 1
        self.stats.accepted += 1
        log.debug("%s: connection %d from %s", self.host.name, session.number, session.peer)
        if not self.config.auth:  # --no-auth (loopback only): every connection is an operator
            self.auth.authenticated(session, OPERATOR, "none")
        try:
            await self._session_loop(session, reader, writer)
        except asyncio.CancelledError:
            pass  # shutdown
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError) as e:
            log.debug("%s: connection %d ended: %s", self.host.name, session.number, e)
        finally:
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
                  "sent instead", self.host.name, session.number, op, length, session.reply_limit)
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
                    self.warn("auth-timeout", "%s: connection %d (%s) did not authenticate within %gs; closing it",
                              self.host.name, session.number, session.peer, self.config.auth_timeout_s)
                    exc = NotAuthorizedError(f"not authenticated within {self.config.auth_timeout_s:g}s: closing the "
                                             "connection")
                    writer.write(encode_frame(error_reply(None, exc)))
                else:
                    self.stats.closed["idle_timeout"] += 1
                    log.info("%s: connection %d (%s, %s) idle for %gs; closing it (its open UOW is backed out)",
                             self.host.name, session.number, session.peer, session.client_name or "no name",
                             self.config.idle_timeout_s)
                return
            try:
                body = next_frame.result()
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
            if body is None:
                return
            parsed = self._parse(session, body)
            if isinstance(parsed, dict):
                await self._send(writer, parsed)
                if not session.authenticated:
                    self.auth.refused(session, "malformed")
                    return
                continue
            rid, op, args = parsed
            if op in ("hello", "auth"):
                if session.authenticated and (self.config.auth or op == "auth"):
                    again = BadRequestError(f"{op}: this connection has already authenticated (as {session.role})")
                    self.stats.count((op, again.reason_name))
                    await self._send(writer, error_reply(rid, again, uow=session.uow_open()))
                    continue
                handshake = self.auth.hello if op == "hello" else self.auth.auth
                reply = await handshake(session, rid, args)
                await self._send(writer, reply)
                if not reply["ok"]:
                    return
                if session.authenticated and not session.tls:
                    await self._serve_direct(session, reader, writer)
                    return
                continue
            if not session.authenticated:
                exc = NotAuthorizedError(f"authenticate first: send hello and auth before {short(op)}")
                self.stats.count((op_label(op), exc.reason_name))
                self.auth.refused(session, "not_authenticated")
                await self._send(writer, error_reply(rid, exc))
                return
            refused = self.host.refusal(session, rid, op)
            if refused is not None:
                await self._send(writer, refused)
                continue
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
                return
            reply, frame = self._bounded(session, rid, op, reply)
            self.stats.count((op, "ok" if reply["ok"] else reply["error"]["reason_name"]))
            writer.write(frame)
            await writer.drain()
            if not reply["ok"] and reply["error"]["type"] == FencedError.__name__:
                self.host.request_stop(EXIT_FENCED)

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
                    with self.stats.lock:
                        self.stats.closed["idle_timeout"] += 1
                    log.info("%s: connection %d (%s, %s) idle for %gs; closing it (its open UOW is backed out)",
                             self.host.name, session.number, session.peer, session.client_name or "no name",
                             self.config.idle_timeout_s)
                    return
                except FrameTooLargeError as e:
                    self.warn("frame", "%s: connection %d (%s): %s; closing it", self.host.name, session.number,
                              session.peer, e)
                    self.stats.count((OP_LABEL_UNKNOWN, e.reason_name))
                    sock.sendall(encode_frame(error_reply(None, e)))
                    return
                if body is None:
                    return
                reply = self._direct_request(session, body)
                if reply is None:
                    log.info("%s: connection %d (%s) left during a request; its reply is dropped", self.host.name,
                             session.number, session.peer)
                    return
                sock.sendall(reply[0])
                if reply[1]:
                    loop.call_soon_threadsafe(self.host.request_stop, EXIT_FENCED)
        except OSError as e:  # the client went away (reset, broken pipe) or the shutdown closed its socket
            log.debug("%s: connection %d ended: %s", self.host.name, session.number, e)
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
            self.stats.count((op, again.reason_name))
            return encode_frame(error_reply(rid, again, uow=session.uow_open())), False
        refused = self.host.refusal(session, rid, op)
        if refused is not None:
            return encode_frame(refused), False
        with self.stats.lock:
            self.stats.inflight += 1
        try:
            reply = self.host.dispatch(session, rid, op, args)
        finally:
            with self.stats.lock:
                self.stats.inflight -= 1
        if threading.Event.is_set(session.gone):  # only what the request saw (no look at the socket per request)
            return None
        reply, frame = self._bounded(session, rid, op, reply)
        self.stats.count((op, "ok" if reply["ok"] else reply["error"]["reason_name"]))
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
        for sock in list(self._direct.values()):  # wakes each connection thread blocked reading its next request
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=max(1.0, deadline - loop.time()))


__all__ = ["Host", "Transport"]
