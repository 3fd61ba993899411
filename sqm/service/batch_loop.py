"""The service's event loop for authenticated plain connections: one thread reads every connection that has a
request, runs the requests that arrived together as one batch, and writes their replies.

Each turn: ``select`` on every connection the loop holds; read what each ready one has (non-blocking); take from
each at most one whole request (a connection's next request is never begun before its previous reply is out:
order per connection); run those the host can run together in one call (``Host.run_together``: puts and gets
outside syncpoint, one CF round trip for their scripts, one append and one fsync for their records, one round trip
for their commits; sqm.core.lifecycles), then send their replies, each only after its commit is on disk.

A request of any other kind, a frame that is large or not whole yet, and a request the batch leaves to its own
path go as before: the connection is handed to its own thread for that one request (sqm.service.transport,
``direct_step``, on the blocking socket), and comes back to the loop once its reply is sent. A reply the client
does not take at once waits in the connection's own buffer (the socket is written when it can take more): a client
that stops reading holds back only itself. A connection idle for the idle timeout is closed, as the direct path
closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cfemu.errors import FencedError
from sqm.service.config import EXIT_FENCED
from sqm.service.protocol import HEADER, encode_frame
from sqm.service.session import Session

log = logging.getLogger("sqm.service.server")

READ_CHUNK = 65536  # what one read of a ready connection asks for
TURN_READ = 4 * READ_CHUNK  # the most one turn reads of one connection (the rest waits for the next turn)


class LoopHost(Protocol):
    """What the loop needs of the transport and the server."""

    @property
    def name(self) -> str: ...

    def loop_request(self, session: Session, body: bytes) -> tuple[int, str, dict[str, Any]] | dict[str, Any]:
        """The request in a frame (parsed, then let run by the dispatcher), or the reply to send instead."""
        ...

    def run_together(self, requests: list[tuple[Session, int, str, dict[str, Any]]]) -> list[dict[str, Any] | None]:
        ...

    def finish(self, session: Session, rid: int, op: str, reply: dict[str, Any]) -> bytes:
        """A reply's frame, bounded and counted."""
        ...

    def hold(self, session: Session, n: int) -> None:
        """Count a reply of n bytes against the member's budget until ``release``."""
        ...

    def release(self, session: Session) -> None: ...

    def direct_step(self, session: Session, sock: socket.socket, buf: bytearray, loop: asyncio.AbstractEventLoop,
                    parsed: tuple[int, str, dict[str, Any]] | None = None) -> bool: ...

    def closed_idle(self, session: Session) -> None: ...


@dataclass(eq=False)
class _Conn:
    session: Session
    sock: socket.socket
    ended: Callable[[], None]  # tells the connection's task that the loop is done with it
    buf: bytearray = field(default_factory=bytearray)
    out: bytearray = field(default_factory=bytearray)  # a reply not yet taken by the client
    away: bool = False  # with its thread for one request
    held: bool = False  # its reply in ``out`` holds bytes of the member's budget
    last: float = field(default_factory=time.monotonic)


class BatchLoop:
    """The loop's thread and the connections it holds (``add``); ``stop`` ends both."""

    def __init__(self, host: LoopHost, aio: asyncio.AbstractEventLoop, idle_timeout_s: float,
                 request_stop: Callable[[int], None], free: int) -> None:
        self.host = host
        self.free = free  # a frame longer than this is read by the connection's thread, under the budget
        self.aio = aio
        self.idle_timeout_s = idle_timeout_s
        self.request_stop = request_stop
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._inbox: list[tuple[str, _Conn]] = []
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._back: list[_Conn] = []  # connections come (back) with bytes read: the next turn looks at them
        self._stopping = False
        self.batches = 0  # batches run, and the requests they carried (their mean: how much arrived together)
        self.batched = 0
        self._thread = threading.Thread(target=self._run, name=f"{host.name}-loop", daemon=True)
        self._thread.start()

    # --- from other threads -------------------------------------------------------------------------------------
    def add(self, session: Session, sock: socket.socket, buf: bytearray, ended: Callable[[], None]) -> None:
        """Take an authenticated connection (its socket the loop's own from now on; buf: what was read past the
        handshake); ``ended`` is called, from the loop's thread, once the loop is done with it."""
        self._post("add", _Conn(session, sock, ended, buf))

    def _post(self, what: str, conn: _Conn) -> None:
        with self._lock:
            self._inbox.append((what, conn))
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def stop(self) -> None:
        """End the loop: every connection it holds is shut down and ended (those with their thread end there)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join(timeout=5)

    # --- the loop's thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            ready: list[_Conn] = []
            while not self._stopping:
                timeout = 0.0 if ready else self._next_idle()
                for key, events in self._sel.select(timeout):
                    if key.data is None:
                        self._drain_wake()
                        continue
                    conn: _Conn = key.data
                    if events & selectors.EVENT_WRITE and not self._flush(conn):
                        continue
                    if events & selectors.EVENT_READ and not self._read(conn):
                        continue
                    if conn not in ready:
                        ready.append(conn)
                ready = self._turn(ready + [c for c in self._back if c not in ready])
                self._back = []
                self._close_idle()
        except Exception:  # the loop must not die silently: its connections would hang
            log.exception("%s: the service's event loop failed; its connections are closed", self.host.name)
        finally:
            for conn in list(self._conns):
                if not conn.away:
                    self._end(conn)
                else:
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for what, conn in inbox:
            if what == "end":
                self._end(conn)
                continue
            if what == "add":
                self._conns.add(conn)
            conn.away = False
            conn.last = time.monotonic()
            conn.sock.setblocking(False)
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            if conn.buf:  # a request may be there already: this turn looks at it
                self._back.append(conn)

    def _read(self, conn: _Conn) -> bool:
        """What the connection has, into its buffer; False when it ended (closed by its client or broken)."""
        got = 0
        try:
            while got < TURN_READ:
                chunk = conn.sock.recv(READ_CHUNK)
                if not chunk:
                    conn.session.gone.set()
                    self._end(conn)
                    return False
                conn.buf += chunk
                got += len(chunk)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            log.debug("%s: connection %d ended: %s", self.host.name, conn.session.number, e)
            conn.session.gone.set()
            self._end(conn)
            return False
        conn.last = time.monotonic()
        return True

    def _turn(self, ready: list[_Conn]) -> list[_Conn]:
        """Take one request from each ready connection, run them, send the replies; the connections with more
        bytes waiting (the next turn looks at them again)."""
        together: list[tuple[_Conn, int, str, dict[str, Any]]] = []
        for conn in ready:
            if conn.away or conn.out or conn not in self._conns:
                continue
            if len(conn.buf) < HEADER.size:
                continue
            (length,) = HEADER.unpack_from(conn.buf)
            # A frame larger than free, or over the connection's limit, is read by the connection's thread, under
            # the member's budget of request bytes (sqm.service.transport).
            if length > conn.session.request_limit or length > self.free:
                self._away(conn, None)
                continue
            end = HEADER.size + length
            if len(conn.buf) < end:
                continue
            body = bytes(conn.buf[HEADER.size:end])
            del conn.buf[:end]
            request = self.host.loop_request(conn.session, body)
            if isinstance(request, dict):
                self._send(conn, encode_frame(request))
                continue
            rid, op, args = request
            if op in ("put", "get"):
                together.append((conn, rid, op, args))
            else:
                self._away(conn, request)
        if together:
            self.batches += 1
            self.batched += len(together)
            replies = self.host.run_together([(c.session, rid, op, args) for c, rid, op, args in together])
            for (conn, rid, op, args), reply in zip(together, replies, strict=True):
                if reply is None:
                    self._away(conn, (rid, op, args))
                    continue
                if conn not in self._conns:  # ended meanwhile (its client left): the reply has nobody to go to
                    continue
                if not reply["ok"] and reply["error"]["type"] == FencedError.__name__:
                    self.aio.call_soon_threadsafe(self.request_stop, EXIT_FENCED)
                self._send(conn, self.host.finish(conn.session, rid, op, reply))
        return [c for c in ready if c in self._conns and not c.away and not c.out and self._whole(c)]

    def _whole(self, conn: _Conn) -> bool:
        """A request is there to take (or a frame the connection's thread reads: one too large for the loop)."""
        if len(conn.buf) < HEADER.size:
            return False
        (length,) = HEADER.unpack_from(conn.buf)
        return bool(length > conn.session.request_limit or length > self.free
                    or len(conn.buf) >= HEADER.size + length)

    def _send(self, conn: _Conn, frame: bytes) -> None:
        if len(frame) > self.free:
            self.host.hold(conn.session, len(frame))
            conn.held = True
        conn.out += frame
        conn.last = time.monotonic()
        self._flush(conn)

    def _flush(self, conn: _Conn) -> bool:
        """Write what the connection's client can take now; False when the connection ended."""
        try:
            while conn.out:
                n = conn.sock.send(conn.out)
                del conn.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            log.debug("%s: connection %d ended: %s", self.host.name, conn.session.number, e)
            conn.session.gone.set()
            self._end(conn)
            return False
        if conn.held and not conn.out:
            conn.held = False
            self.host.release(conn.session)
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            if self._sel.get_key(conn.sock).events != events:
                self._sel.modify(conn.sock, events, conn)
        return True

    def _away(self, conn: _Conn, parsed: tuple[int, str, dict[str, Any]] | None) -> None:
        """Hand the connection to its thread for one request (``parsed``, or the next frame it reads)."""
        self._sel.unregister(conn.sock)
        conn.away = True
        conn.sock.setblocking(True)
        conn.session.executor.submit(self._step, conn, parsed)

    def _step(self, conn: _Conn, parsed: tuple[int, str, dict[str, Any]] | None) -> None:
        """In the connection's thread: its one request, then back to the loop (or its end)."""
        going = False
        try:
            going = self.host.direct_step(conn.session, conn.sock, conn.buf, self.aio, parsed)
        finally:
            if self._stopping:  # the loop is gone or going: the connection ends here
                conn.sock.close()
                conn.ended()
            else:
                self._post("back" if going else "end", conn)

    def _end(self, conn: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        if conn in self._conns:
            self._conns.discard(conn)
            conn.sock.close()
            conn.ended()

    def _next_idle(self) -> float:
        """Seconds until the next connection may reach its idle timeout (at most one)."""
        if not self.idle_timeout_s or not self._conns:
            return 1.0
        oldest = min((c.last for c in self._conns if not c.away), default=time.monotonic())
        return max(0.0, min(1.0, oldest + self.idle_timeout_s - time.monotonic()))

    def _close_idle(self) -> None:
        if not self.idle_timeout_s:
            return
        now = time.monotonic()
        for conn in [c for c in self._conns if not c.away and now - c.last >= self.idle_timeout_s]:
            self.host.closed_idle(conn.session)
            self._end(conn)


__all__ = ["BatchLoop", "LoopHost"]
