"""The service's event loop for authenticated plain connections: one thread reads every connection that has a
request, runs the requests that arrived together as one batch, and writes their replies.

Each turn: ``select`` on every connection the loop holds; read what each ready one has (non-blocking); take from
each at most one whole request (a connection's next request is never begun before its previous reply is out:
order per connection); hand those the host can run together to the beginner thread, which begins them as one
batch (``LoopHost.begin_together``: puts and gets outside syncpoint, puts, gets and commits under syncpoint, one CF
round trip for their scripts and the commits' standing checks, their records and COMMITs appended;
sqm.core.lifecycles, sqm.core.syncpoint_calls). The finisher thread then forces every batch begun meanwhile with one
fsync, applies their commits in one CF round trip (``LoopHost.finish_together``) and writes each reply, only after
its COMMIT is on disk; while it does, the beginner begins the next batch. The loop's own thread makes no CF call
while other connections are there to serve: a CF that hangs until its calls time out holds up the batches that need
it, never the other connections' requests that need no CF (a status, a ping). With no other connection to read
meanwhile, the loop begins and finishes its batch itself (one client pays no hand-off; a connection that joins
meanwhile waits for that batch, up to the CF's timeout when the CF hangs).

A request of any other kind, a frame that is large or not whole yet, and a request the batch leaves to its own
path go as before: the connection is handed to its own thread for that one request (sqm.service.transport,
``direct_step``, on the blocking socket), and comes back to the loop once its reply is sent. A reply the client
does not take at once waits in the connection's own buffer (the socket is written when it can take more, and not
read meanwhile): a client that stops reading holds back only itself. The loop reads a connection no further ahead
of the requests it runs than ``AHEAD`` bytes: a client that sends faster than its requests run is held back by its
own socket, not buffered by the member. A connection idle for the idle timeout is closed, as the direct path
closes it (one whose reply is being taken is not idle).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from cfemu.errors import FencedError, OutcomeUnknownError
from sqm.service.config import EXIT_FENCED
from sqm.service.protocol import HEADER, encode_frame, error_reply
from sqm.service.session import Session, Together

log = logging.getLogger("sqm.service.server")

READ_CHUNK = 65536  # what one read of a ready connection asks for
TURN_READ = 4 * READ_CHUNK  # the most one turn reads of one connection (the rest waits for the next turn)
# The most of a connection's bytes the loop holds read and not yet run (at least one whole frame it runs): past it
# the loop reads no more of that connection, and the client's own socket holds it back (TCP), as a connection's
# thread does, which reads a request only once its previous reply is sent.
AHEAD = TURN_READ
# Turns failed in a row after which the loop gives up: its connections are closed and the transport serves new ones
# by a thread each (a failure that repeats every turn would otherwise spin, and answer nobody).
MAX_FAILED_TURNS = 20


class LoopHost(Protocol):
    """What the loop needs of the transport and the server."""

    @property
    def name(self) -> str: ...

    def loop_request(self, session: Session, body: bytes) -> tuple[int, str, dict[str, Any]] | dict[str, Any]:
        """The request in a frame (parsed, then let run by the dispatcher), or the reply to send instead."""
        ...

    def begin_together(self, requests: list[tuple[Session, int, str, dict[str, Any]]]) -> Together: ...

    def finish_together(self, batches: list[Together]) -> None: ...

    def finish(self, session: Session, rid: int, op: str, reply: dict[str, Any]) -> bytes:
        """A reply's frame, bounded and counted."""
        ...

    def hold(self, session: Session, n: int) -> None:
        """Count a reply of n bytes against the member's budget until ``release``."""
        ...

    def release(self, session: Session) -> None: ...

    def may_run_together(self, op: str, args: dict[str, Any]) -> bool: ...

    def direct_step(self, session: Session, sock: socket.socket, buf: bytearray, loop: asyncio.AbstractEventLoop,
                    parsed: tuple[int, str, dict[str, Any]] | None = None,
                    hand_back: Callable[[str, dict[str, Any]], bool] | None = None
                    ) -> bool | tuple[int, str, dict[str, Any]]: ...

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
    events: int = 0  # what the selector watches it for (0: not registered)
    blocking: bool = True  # its socket's mode (its thread's path reads it blocking)


class BatchLoop:
    """The loop's thread and the connections it holds (``add``); ``stop`` ends both."""

    def __init__(self, host: LoopHost, aio: asyncio.AbstractEventLoop, idle_timeout_s: float,
                 request_stop: Callable[[int], None], free: int) -> None:
        self.host = host
        self.free = free  # a frame longer than this is read by the connection's thread, under the budget
        self.ahead = max(AHEAD, HEADER.size + free)  # a whole frame the loop runs always fits
        self.aio = aio
        self.idle_timeout_s = idle_timeout_s
        self.request_stop = request_stop
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._inbox: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._back: list[_Conn] = []  # connections come (back) with bytes read: the next turn looks at them
        # requests a connection's thread read and handed to the loop to run together (the next turn's batch)
        self._handed: list[tuple[_Conn, int, str, dict[str, Any]]] = []
        self._stopping = False
        self._idle_due = 0.0  # no connection can reach its idle timeout before this (monotonic) time
        self._closed = False  # the loop's thread has ended (or is ending): it takes no connection more
        self.failed = ""  # why the loop's thread ended, when it failed
        self.batches = 0  # batches run, and the requests they carried (their mean: how much arrived together)
        self.batched = 0
        # Batches for the beginner (their CF scripts, their records), which hands those with commits on to the
        # finisher (their force, their commits); each hands back what it has done.
        self._to_begin: queue.SimpleQueue[tuple[list[tuple[Session, int, str, dict[str, Any]]], list[_Conn]] | None] \
            = queue.SimpleQueue()
        self._begun: queue.SimpleQueue[tuple[Together, list[_Conn]] | None] = queue.SimpleQueue()
        self._pending = 0  # connections whose batch is with the beginner or the finisher (the loop's count)
        self._finisher_closed = False  # set by stop: the loop begins and finishes what it takes itself
        self._thread = threading.Thread(target=self._run, name=f"{host.name}-loop", daemon=True)
        self._beginner = threading.Thread(target=self._begin, name=f"{host.name}-begin", daemon=True)
        self._finisher = threading.Thread(target=self._finish, name=f"{host.name}-commit", daemon=True)
        self._thread.start()
        self._beginner.start()
        self._finisher.start()

    # --- from other threads -------------------------------------------------------------------------------------
    def add(self, session: Session, sock: socket.socket, buf: bytearray, ended: Callable[[], None]) -> bool:
        """Take an authenticated connection (its socket the loop's own from now on; buf: what was read past the
        handshake); ``ended`` is called, from the loop's thread, once the loop is done with it. False: the loop
        has ended (``failed`` says why, when it failed), and the connection is still the caller's."""
        with self._lock:
            if self._closed:
                return False
            self._inbox.append(("add", _Conn(session, sock, ended, buf)))
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")
        return True

    def _post(self, what: str, item: Any) -> None:
        with self._lock:
            if not self._closed:
                self._inbox.append((what, item))
                item = None
        if item is not None:  # the loop has ended: nobody is left to take the connections back, they end here
            self._end_without_loop(what, item)
            return
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def stop(self) -> None:
        """End the loop: the batches begun are finished and answered, then every connection it holds is shut down
        and ended (those with their thread end there)."""
        with self._lock:
            self._finisher_closed = True
            self._to_begin.put(None)  # the beginner hands the end on to the finisher once it has begun the rest
        self._beginner.join(timeout=30)
        self._finisher.join(timeout=30)
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join(timeout=5)

    # --- the beginner's thread -----------------------------------------------------------------------------------
    def _begin(self) -> None:
        """Begin the batches the loop hands over (their CF scripts, their records appended), all those waiting
        together as one: one with commits goes on to the finisher, one without is finished and answered here (its
        replies need no force: they do not wait behind the finisher's). The CF calls run here, not in the loop's
        thread: a CF that answers slowly, or not at all until the calls time out, holds up only the batches that
        need it (those handed over meanwhile wait one more round trip, together, not one each), and the loop goes
        on reading, handing out and answering every other connection's requests."""
        ending = False
        while not ending:
            item = self._to_begin.get()
            if item is None:
                break
            requests, conns = list(item[0]), list(item[1])
            while True:
                try:
                    more = self._to_begin.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    ending = True
                    break
                requests += more[0]
                conns += more[1]
            try:
                t = self.host.begin_together(requests)
            except Exception as e:  # that batch's failure alone: each of its requests hears it
                log.exception("%s: beginning a batch failed", self.host.name)
                t = Together(requests, [None] * len(requests))
                _unknown(t, e)  # its records may be appended: a later force can make them durable
                self._reply([(t, conns)])
                self._post("done", [(t, conns)])
                continue
            if t.forces:
                self._begun.put((t, conns))
            else:
                self._complete([(t, conns)])
                self._post("done", [(t, conns)])
        self._begun.put(None)

    # --- the finisher's thread -----------------------------------------------------------------------------------
    def _finish(self) -> None:
        """Force and commit the batches the loop began, as many together as have been begun meanwhile (one fsync
        and one CF round trip for all of them: while one batch's force runs, the loop begins the next), write
        their replies, and hand their connections back to the loop."""
        while True:
            first = self._begun.get()
            batches = [first]
            while first is not None:
                try:
                    more = self._begun.get_nowait()
                except queue.Empty:
                    break
                batches.append(more)
                if more is None:
                    break
            begun = [b for b in batches if b is not None]
            if begun:
                self._complete(begun)
                self._post("done", begun)
            if batches[-1] is None:
                return

    def _complete(self, begun: list[tuple[Together, list[_Conn]]]) -> None:
        """Force and commit begun batches, then write their replies (in the finisher, or in the loop when it
        began the only batch its connections can have). A failure to finish answers each request not answered
        yet with its outcome unknown (a COMMIT may be on disk): every request hears something."""
        try:
            self.host.finish_together([t for t, _ in begun])
        except Exception as e:  # never made again by another path: its outcome is not known
            log.exception("%s: finishing a batch failed", self.host.name)
            for t, _ in begun:
                _unknown(t, e)
        self._reply(begun)

    # --- the loop's thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0  # turns failed in a row
        ready: list[_Conn] = []
        try:
            while not self._stopping:
                try:
                    ready = self._once(ready)
                    failures = 0
                except Exception:  # the loop goes on: what that turn held is looked at again by the next
                    failures += 1
                    log.exception("%s: a turn of the service's event loop failed (%d in a row)", self.host.name,
                                  failures)
                    if failures >= MAX_FAILED_TURNS:
                        raise
                    self._back.extend(c for c in ready if c not in self._back)
                    ready = []
                    time.sleep(0.01 * failures)  # a failure that repeats does not spin
        except Exception:  # the loop must not die silently: its connections would hang
            self.failed = "its turns failed again and again (see the log)"
            log.error("%s: the service's event loop ended: %s; its connections are closed and new ones are "
                      "served by a thread each", self.host.name, self.failed)
        finally:
            with self._lock:
                self._closed = True  # add refuses from now on: the transport serves the connection itself
            self._drain_wake()  # the last batches' replies
            for conn in list(self._conns):
                if not conn.away:
                    self._end(conn)
                else:
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _once(self, ready: list[_Conn]) -> list[_Conn]:
        """One turn: read what the ready connections have, run what came, close the idle ones."""
        timeout = 0.0 if ready or self._back or self._handed else self._next_idle()
        for key, events in self._sel.select(timeout):
            if key.data is None:
                self._drain_wake()
                continue
            conn: _Conn = key.data
            if conn.away:  # its next request, sent on its reply: waits in its buffer until its batch is done
                self._read_ahead(conn)
                continue
            if events & selectors.EVENT_WRITE and not self._flush(conn):
                continue
            if events & selectors.EVENT_READ and not self._read(conn):
                continue
            if conn not in ready:
                ready.append(conn)
        back, self._back = self._back, []
        ready = self._turn(ready + [c for c in back if c not in ready])
        self._close_idle()
        return ready

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for what, item in inbox:
            if what == "done":
                self._pending -= sum(len(conns) for _, conns in item)
                self._answer(item)
                continue
            if what == "handed":  # back with a request to run together: it waits in the loop for its batch
                handed, (rid, op, args) = item
                self._nonblocking(handed)
                self._handed.append((handed, rid, op, args))
                continue
            conn: _Conn = item
            if what == "end":
                self._end(conn)
                continue
            if what == "add":
                self._conns.add(conn)
            self._back_to_loop(conn)

    def _back_to_loop(self, conn: _Conn) -> None:
        """A connection comes (back) to the loop: from its handshake, its thread or its batch."""
        conn.away = False
        conn.last = time.monotonic()
        self._nonblocking(conn)
        self._watch(conn, selectors.EVENT_READ)
        if conn.buf:  # a request may be there already: this turn looks at it
            self._back.append(conn)

    @staticmethod
    def _nonblocking(conn: _Conn) -> None:
        """The loop reads and writes a connection's socket without blocking (set only when its thread had it)."""
        if conn.blocking:
            conn.sock.setblocking(False)
            conn.blocking = False

    # The selector watches a connection while the loop has it and while it is away with a batch (two epoll_ctl
    # calls and the selector's bookkeeping per request saved; what it sends meanwhile: ``_read_ahead``); one that
    # goes to its own thread is taken out, and its return puts it back.
    def _watch(self, conn: _Conn, events: int) -> None:
        if conn.events == events:
            return
        if conn.events:
            self._sel.modify(conn.sock, events, conn)
        else:
            self._sel.register(conn.sock, events, conn)
        conn.events = events

    def _unwatch(self, conn: _Conn) -> None:
        if conn.events:
            conn.events = 0
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)

    def _read(self, conn: _Conn) -> bool:
        """What the connection has, into its buffer; False when it ended (closed by its client or broken)."""
        got = 0
        try:
            while got < TURN_READ and len(conn.buf) < self.ahead:
                chunk = conn.sock.recv(READ_CHUNK)
                if not chunk:
                    self._gone(conn)
                    return False
                conn.buf += chunk
                got += len(chunk)
                if len(chunk) < READ_CHUNK:  # the socket is drained: no read more to learn it
                    break
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            log.debug("%s: connection %d ended: %s", self.host.name, conn.session.number, e)
            self._gone(conn)
            return False
        conn.last = time.monotonic()
        return True

    def _read_ahead(self, conn: _Conn) -> None:
        """A connection away with its batch that the selector finds ready: its client took its reply (the finisher
        writes it) and sent its next request before the batch came back to the loop. What it sent is read now, as
        any connection's is, and is run once the batch is done (``_answer``): it costs no turn more, and the
        connection stays registered. Only one that the selector would report again and again (its buffer full, its
        client gone) is taken out of the selector until it is back."""
        if len(conn.buf) >= self.ahead or not self._read(conn) or len(conn.buf) >= self.ahead:
            self._unwatch(conn)

    def _gone(self, conn: _Conn) -> None:
        """The client closed or broke the connection: it ends now, or once its batch is done (``_answer``, which
        ends a connection whose client has gone)."""
        conn.session.gone.set()
        if conn.away:
            self._unwatch(conn)
        else:
            self._end(conn)

    def _turn(self, ready: list[_Conn]) -> list[_Conn]:
        """Take one request from each ready connection, run them, send the replies; the connections with more
        bytes waiting (the next turn looks at them again)."""
        together: list[tuple[_Conn, int, str, dict[str, Any]]] = self._handed
        self._handed = []
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
            try:
                request = self.host.loop_request(conn.session, body)
            except Exception:  # that connection's failure alone: it ends (its client sees the close)
                log.exception("%s: connection %d ended: its request could not be read", self.host.name,
                              conn.session.number)
                self._end(conn)
                continue
            if isinstance(request, dict):
                self._send(conn, encode_frame(request))
                continue
            rid, op, args = request
            if self.host.may_run_together(op, args):
                together.append((conn, rid, op, args))
            else:
                self._away(conn, request)
        if together:
            self.batches += 1
            self.batched += len(together)
            conns = [c for c, _, _, _ in together]
            requests = [(c.session, rid, op, args) for c, rid, op, args in together]
            # With no other connection to read meanwhile, the loop begins and finishes the batch itself (one client
            # pays no hand-off); else the beginner does, and the loop goes on with the other connections.
            with self._lock:
                alone = self._finisher_closed or not (self._pending or len(self._conns) > len(conns))
                if not alone:
                    for conn in conns:  # each waits for its reply, running nothing more meanwhile (order per connection)
                        conn.away = True
                    self._pending += len(conns)
                    self._to_begin.put((requests, conns))
            if alone:
                try:
                    t = self.host.begin_together(requests)
                except Exception as e:  # that batch's failure alone: each of its requests hears it, the loop goes on
                    log.exception("%s: beginning a batch failed", self.host.name)
                    t = Together(requests, [None] * len(requests))
                    _unknown(t, e)  # its records may be appended: a later force can make them durable
                    self._reply([(t, conns)])
                    self._answer([(t, conns)])
                    return self._still_ready(ready)
                self._complete([(t, conns)])
                self._answer([(t, conns)])
        return self._still_ready(ready)

    def _still_ready(self, ready: list[_Conn]) -> list[_Conn]:
        return [c for c in ready if c in self._conns and not c.away and not c.out and self._whole(c)]

    def _reply(self, done: list[tuple[Together, list[_Conn]]]) -> None:
        """In the finisher, once every commit of the batches is on disk: each reply written as far as its client
        takes it at once (the connection is out of the loop until ``_answer``: nobody else writes to it), so
        that the reply does not wait for the loop's next turn."""
        for t, conns in done:
            for conn, (_, rid, op, _), reply in zip(conns, t.requests, t.replies, strict=True):
                if reply is not None:
                    self._reply_one(conn, rid, op, reply)

    def _reply_one(self, conn: _Conn, rid: int, op: str, reply: dict[str, Any]) -> None:
        """Queue and write one reply; a reply that cannot be made is sent as an error saying its outcome is
        unknown (its work may be done), and a connection that cannot take even that is ended by ``_answer``."""
        try:
            frame = self.host.finish(conn.session, rid, op, reply)
        except Exception as e:
            log.exception("%s: the reply to %s on connection %d could not be made", self.host.name, op,
                          conn.session.number)
            frame = encode_frame(error_reply(rid, OutcomeUnknownError(f"{op}: its reply could not be made: {e}")))
        try:
            self._queue_reply(conn, frame)
        except Exception:  # nothing to say it with: the connection ends, and its client learns that
            log.exception("%s: connection %d ended: its reply could not be queued", self.host.name,
                          conn.session.number)
            conn.session.gone.set()
            return
        self._write(conn)

    def _answer(self, done: list[tuple[Together, list[_Conn]]]) -> None:
        """Batches the finisher handed back: each connection back in the loop with the rest of its reply to write,
        each request the batch left to its own path handed to its connection's thread."""
        for t, conns in done:
            for conn, (_, rid, op, args), reply in zip(conns, t.requests, t.replies, strict=True):
                if conn not in self._conns:  # ended meanwhile: nobody to answer
                    continue
                if reply is None:
                    self._away(conn, (rid, op, args))
                    continue
                if not reply["ok"] and reply["error"]["type"] == FencedError.__name__:
                    self.aio.call_soon_threadsafe(self.request_stop, EXIT_FENCED)
                if conn.session.gone.seen_to_leave():  # its connection broke while the finisher wrote
                    self._end(conn)
                    continue
                if conn.away:
                    self._back_to_loop(conn)
                elif conn.buf:  # finished by the loop itself, still in the selector: its next request
                    self._back.append(conn)
                self._flush(conn)

    def _whole(self, conn: _Conn) -> bool:
        """A request is there to take (or a frame the connection's thread reads: one too large for the loop)."""
        if len(conn.buf) < HEADER.size:
            return False
        (length,) = HEADER.unpack_from(conn.buf)
        return bool(length > conn.session.request_limit or length > self.free
                    or len(conn.buf) >= HEADER.size + length)

    def _send(self, conn: _Conn, frame: bytes) -> None:
        self._queue_reply(conn, frame)
        self._flush(conn)

    def _queue_reply(self, conn: _Conn, frame: bytes) -> None:
        if len(frame) > self.free:
            self.host.hold(conn.session, len(frame))
            conn.held = True
        conn.out += frame
        conn.last = time.monotonic()

    def _write(self, conn: _Conn) -> bool:
        """Write what the connection's client can take now (by the thread that has the connection: the loop, or
        the finisher while the connection waits for its batch); False when the connection broke."""
        try:
            while conn.out:
                n = conn.sock.send(conn.out)
                del conn.out[:n]
                conn.last = time.monotonic()  # a client taking its reply is not idle
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            log.debug("%s: connection %d ended: %s", self.host.name, conn.session.number, e)
            conn.session.gone.set()
            return False
        if conn.held and not conn.out:
            conn.held = False
            self.host.release(conn.session)
        return True

    def _flush(self, conn: _Conn) -> bool:
        """In the loop: write what the client can take now, and wait to write the rest (reading nothing of the
        connection meanwhile: its next request waits for this reply); False when the connection ended."""
        if not self._write(conn):
            self._end(conn)
            return False
        if conn.events:
            self._watch(conn, selectors.EVENT_WRITE if conn.out else selectors.EVENT_READ)
        return True

    def _away(self, conn: _Conn, parsed: tuple[int, str, dict[str, Any]] | None) -> None:
        """Hand the connection to its thread for one request (``parsed``, or the next frame it reads)."""
        self._unwatch(conn)
        conn.away = True
        conn.sock.setblocking(True)
        conn.blocking = True
        conn.session.executor.submit(self._step, conn, parsed)

    def _step(self, conn: _Conn, parsed: tuple[int, str, dict[str, Any]] | None) -> None:
        """In the connection's thread: its requests, one after another on the blocking socket (as the thread per
        connection serves them: a connection whose requests do not run together costs no hand-off per request),
        until one that runs together comes: then back to the loop with it (or the connection's end)."""
        going: bool | tuple[int, str, dict[str, Any]] = False
        try:
            while True:
                going = self.host.direct_step(conn.session, conn.sock, conn.buf, self.aio, parsed,
                                              self.host.may_run_together)
                parsed = None
                if going is not True or self._stopping:
                    break
        finally:
            if self._stopping:  # the loop is going: the connection ends here
                conn.sock.close()
                conn.ended()
            elif isinstance(going, tuple):
                self._post("handed", (conn, going))
            else:
                self._post("back" if going else "end", conn)

    @staticmethod
    def _end_without_loop(what: str, item: Any) -> None:
        if what == "done":
            conns = [c for _, cs in item for c in cs]
        elif what == "handed":
            conns = [item[0]]
        else:
            conns = [item]
        for conn in conns:
            conn.sock.close()
            conn.ended()

    def _end(self, conn: _Conn) -> None:
        self._unwatch(conn)
        if conn in self._conns:
            self._conns.discard(conn)
            conn.sock.close()
            conn.ended()

    def _next_idle(self) -> float:
        """Seconds until the next connection may reach its idle timeout (at most one)."""
        if not self.idle_timeout_s or not self._conns:
            return 1.0
        return max(0.0, min(1.0, self._idle_due - time.monotonic()))

    def _close_idle(self) -> None:
        """Close the connections idle for the idle timeout. They are looked at only once the first of them may
        be (``_idle_due``), not at every turn: a connection's ``last`` only moves forward, and one that comes back
        to the loop later comes with a later one, so none can reach its timeout before that time."""
        if not self.idle_timeout_s:
            return
        now = time.monotonic()
        if now < self._idle_due:
            return
        due = now + self.idle_timeout_s  # the soonest a connection that comes back from now on may be idle
        for conn in list(self._conns):
            if conn.away:
                continue
            if now - conn.last >= self.idle_timeout_s:
                self.host.closed_idle(conn.session)
                self._end(conn)
            else:
                due = min(due, conn.last + self.idle_timeout_s)
        self._idle_due = due


def _unknown(t: Together, e: BaseException) -> None:
    """Every request of a batch not answered yet hears that its outcome is not known (``e`` says why)."""
    t.replies = [r or error_reply(req[1], OutcomeUnknownError(f"{req[2]}: {e}"))
                 for r, req in zip(t.replies, t.requests, strict=True)]


__all__ = ["BatchLoop", "LoopHost"]
