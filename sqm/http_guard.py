"""What bounds an aiohttp door (the REST API of a member, the group's web console) against peers that have not
authenticated: a cap on open connections, a short wait for a request's head, a keep-alive timeout, and a log that a
flood cannot flood.

- A connection past the per-peer cap (cfemu.connection_cap) is closed at once, unanswered; past the total cap a
  connection without a request under way (no whole request head yet before idle between requests; of the address
  holding the most; the oldest: cfemu.connection_cap) is closed to make room for the newcomer, which is refused only
  when every connection has a request under way.
- A peer that half-closes (ends its sending side) after whole requests still gets their replies (pipelined ones
  too), and the connection is closed once they are sent: the end of the peer's stream means no more requests, not "do not answer" (aiohttp alone
  closed the connection at once, so a put was committed and its 201 never sent). A connection with no request under
  way is closed at once. The request's handler can tell (``peer_has_finished``): a destructive get must not hand a
  message to a peer whose end of stream may be a hang-up.
- A connection must deliver its first request's head within ``head_timeout_s`` of opening (a TLS one: its handshake
  too), else it is closed; between requests, aiohttp closes a connection idle for ``keepalive_timeout_s`` (its
  keep-alive timer, which also bounds a later request's head: the connection is idle until the head is whole).
- A request's body must be whole within ``head_timeout_s`` plus its length at BODY_MIN_RATE bytes a second
  (``read_body``), else it is answered 408 and its connection closed: the head timeout ends once the head is whole,
  and aiohttp waits for a body as long as it trickles, so one peer sending a byte now and then held a connection (and
  the REST door's admitted slot) for ever.
- aiohttp's own error lines (a traceback at ERROR for one malformed request) and the event loop's accept errors
  (one per refused accept when the process is out of file descriptors) go out as one WARNING line a second per
  kind at most, without traceback (sqm.throttled_log); the rest are counted and said with the next line.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import sys
import weakref
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_runner import BaseSite

from cfemu.connection_cap import ConnectionCap, Waiting, peer_of
from cfemu.sockets import is_loopback_ip
from sqm.operations import one_line
from sqm.throttled_log import ThrottledLog


@dataclass(frozen=True)
class HttpLimits:
    """The bounds of one door (docs/security.md, "HTTP doors")."""

    head_timeout_s: float = 10.0  # a new connection's first request head must be whole by then
    keepalive_timeout_s: float = 30.0  # a connection idle between requests this long is closed
    max_connections: int = 256  # connections open at once
    max_connections_per_peer: int = 64  # connections open at once from one address
    cap_options: str = ""  # the options that set the caps, named when a connection is refused

    def check(self, what: str) -> None:
        if self.head_timeout_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError(f"{what}: the head and keep-alive timeouts must be > 0 s")
        if min(self.max_connections, self.max_connections_per_peer) < 1:
            raise ValueError(f"{what}: connection caps must be at least 1")


BODY_MIN_RATE = 64 * 1024  # bytes a second: the least rate a request's body may arrive at (read_body)


async def read_body(request: web.Request, head_timeout_s: float) -> bytes:
    """The request's body (aiohttp keeps it: a later ``request.read()`` or ``post()`` gets the same), whole within
    ``head_timeout_s`` plus its length (the door's body limit when the head says none) at BODY_MIN_RATE; else
    HTTPRequestTimeout (408), its connection closed once answered."""
    said = request.content_length
    length = min(request.client_max_size if said is None else said, request.client_max_size)
    try:
        async with asyncio.timeout(head_timeout_s + length / BODY_MIN_RATE):
            return await request.read()
    except TimeoutError:
        late = web.HTTPRequestTimeout(text=f"the request's body of {length} bytes did not arrive within "
                                           f"{head_timeout_s + length / BODY_MIN_RATE:g} s\n")
        late.force_close()
        raise late from None


CLOSE_CHECK_S = 0.02  # how often a half-closed connection looks whether its requests are all answered


class _AiohttpLog(logging.Logger):
    """The logger aiohttp's request handlers write to: their errors (a malformed request, a handler's exception,
    a peer gone) as throttled one-line warnings; debug lines as they are."""

    def __init__(self, name: str, throttled: ThrottledLog) -> None:
        super().__init__(name)
        self.throttled = throttled
        self.parent = logging.getLogger(name)  # debug lines reach the real logger's handlers

    def _one_line(self, level: str, msg: object, *args: Any, **kw: Any) -> None:
        text = str(msg) % args if args else str(msg)
        exc = kw.get("exc_info")
        if exc is True:
            exc = sys.exc_info()[1]
        elif isinstance(exc, tuple):
            exc = exc[1]
        if isinstance(exc, HttpProcessingError):
            # aiohttp's parse errors quote what the peer sent (an over-long Authorization line: its credential):
            # the kind and status only, never the peer's bytes.
            detail = f": {type(exc).__name__} (HTTP {exc.code}; what the peer sent is not logged)"
        elif isinstance(exc, BaseException):
            detail = f": {type(exc).__name__}: {one_line(str(exc), 200)}"
        else:
            detail = ""
        line = f"{one_line(text, 200)}{detail}"  # one line: a peer's bytes may hold line breaks or escapes
        self.throttled(f"aiohttp-{level}", "%s: %s", self.name, line)

    def exception(self, msg: object, *args: Any, **kw: Any) -> None:
        self._one_line("error", msg, *args, **kw)

    def error(self, msg: object, *args: Any, **kw: Any) -> None:
        self._one_line("error", msg, *args, **kw)

    def warning(self, msg: object, *args: Any, **kw: Any) -> None:
        self._one_line("warning", msg, *args, **kw)


class _Guarded(asyncio.Protocol):
    """A connection of a guarded door: counted under the cap, closed if its first request head is late; everything
    else goes to aiohttp's handler as it is."""

    def __init__(self, site: GuardedSite, inner: asyncio.Protocol) -> None:
        self.site = site
        self.inner: asyncio.Protocol | None = inner
        self.peer = "?"
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""
        self.peer_finished = False  # the peer ended its sending side (a half-close, or a hang-up)
        self.finished_at = 0.0  # the loop's time when it did

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.peer = peer_of(transport.get_extra_info("peername"))
        refusal = self.site.cap.admit(self.peer, self)
        if refusal is not None:
            self.inner = None
            transport.abort()
            self.site.warn("cap", "%s: a connection from %s closed at once: the cap of %s is reached (closed so far: "
                           "%d)%s", self.site.what, self.peer, refusal, self.site.cap.refused, self.site.cap_hint(self.peer))
            return
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(self.site.limits.head_timeout_s, self._head_late)
        assert self.inner is not None
        self.inner.connection_made(transport)

    def waiting(self) -> Waiting:
        """For the cap: "head" before the first request head is whole, "idle" when aiohttp waits for the next
        request (or its head is partial), None while a request is under way (or the peer has ended its stream)."""
        if self.inner is None or self.transport is None or self.transport.is_closing():
            return None
        if self.timer is not None:
            return "head"
        if isinstance(self.inner, RequestHandler) and not self.peer_finished and _idle(self.inner):
            return "idle"
        return None

    def evict(self) -> None:
        """Closed by the cap to make room for a newer connection (it had no request under way)."""
        if self.transport is None or self.transport.is_closing():
            return
        what = "no whole request head yet" if self.timer is not None else "idle between requests"
        self.site.warn("evict", "%s: a connection from %s closed to make room for a new one: the cap of %d "
                       "connections at once is reached and it had no request under way (%s; closed so far: %d)",
                       self.site.what, self.peer, self.site.cap.total, what, self.site.cap.evicted)
        self.transport.abort()

    def _head_late(self) -> None:
        self.timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.site.head_timeouts += 1
            self.site.warn("head", "%s: a connection from %s closed: no whole request head within %.1fs (closed so "
                           "far: %d)", self.site.what, self.peer, self.site.limits.head_timeout_s,
                           self.site.head_timeouts)
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.timer is not None:
            seen = self.tail + data
            if b"\r\n\r\n" in seen or b"\n\n" in seen:
                self.timer.cancel()
                self.timer = None
                self.tail = b""
            else:
                self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        self.peer_finished = True
        self.finished_at = asyncio.get_running_loop().time()
        inner = self.inner
        if not isinstance(inner, RequestHandler) or self.timer is not None or _idle(inner):
            return inner.eof_received() if inner is not None else None  # nothing to answer: closed now
        self._close_once_answered()
        return True  # keep the transport open to write the replies

    def _close_once_answered(self) -> None:
        """Close the transport once aiohttp has answered every request the peer sent before its end of stream
        (pipelined ones too: aiohttp's own close() dropped those after the first), looking every CLOSE_CHECK_S; abort
        it when they are not answered within the head timeout of the end: a request whose body the peer never
        finished sending would otherwise hold its place under the caps for ever (a request the peer finished is
        answered at once: a waiting get ends when its caller has finished, peer_has_finished)."""
        inner, transport = self.inner, self.transport
        if transport is None or transport.is_closing() or not isinstance(inner, RequestHandler):
            return
        if _idle(inner):
            transport.close()
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self.finished_at >= self.site.limits.head_timeout_s:
            self.site.warn("unfinished", "%s: a connection from %s closed: its peer ended its stream %.1fs ago with "
                           "a request unanswered (its body not all sent?)", self.site.what, self.peer,
                           self.site.limits.head_timeout_s)
            transport.abort()
            return
        loop.call_later(CLOSE_CHECK_S, self._close_once_answered)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is None:
            return
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.site.cap.release(self.peer, self)
        inner, self.inner = self.inner, None
        inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


def _idle(handler: RequestHandler) -> bool:
    """Whether aiohttp's handler holds no request to answer: it waits for the next one (its waiter pending) and has
    none parsed. Its waiter is None while it answers one."""
    waiter = getattr(handler, "_waiter", None)
    return waiter is not None and not waiter.done() and not getattr(handler, "_messages", None)


def peer_has_finished(transport: asyncio.BaseTransport | None) -> bool:
    """Whether the peer of a guarded door's connection has ended its stream or gone: the transport is gone or
    closing, or the peer half-closed it (TCP cannot tell a half-close from a hang-up until a write fails)."""
    if transport is None or transport.is_closing():
        return True
    guard = transport.get_protocol()
    return isinstance(guard, _Guarded) and guard.peer_finished


class GuardedSite(BaseSite):
    """aiohttp's TCP site under HttpLimits; ``port`` is the one it listens on once started."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: HttpLimits, what: str,
                 log: logging.Logger, *, ssl_context: ssl.SSLContext | None = None, backlog: int = 128) -> None:
        limits.check(what)
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host, self._port = host, port
        self.limits = limits
        self.what = what
        self.cap = ConnectionCap(limits.max_connections, limits.max_connections_per_peer)
        self.warn = ThrottledLog(log)
        self.head_timeouts = 0
        self.port = port

    def cap_hint(self, peer: str) -> str:
        """What the refusal line adds: the options that set the caps; from a loopback peer, that every local client
        (a local reverse proxy in front of the door, a local tool) is that one address, so the per-address cap is
        theirs together, and setting it to the total cap lets one of them use the whole door."""
        if not self.limits.cap_options:
            return ""
        hint = f"; the caps are {self.limits.cap_options}"
        if is_loopback_ip(peer):
            hint += (": every local client is one loopback address, sharing the per-address cap (give it the total "
                     "cap's value to let one local client, a reverse proxy say, use the whole door)")
        return hint

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        throttle_accept_errors(loop, self.warn)
        server = self._runner.server
        assert server is not None
        self._server = await loop.create_server(
            lambda: _Guarded(self, server()), self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            ssl_handshake_timeout=self.limits.head_timeout_s if self._ssl_context else None)
        self.port = int(self._server.sockets[0].getsockname()[1])


def runner_kwargs(limits: HttpLimits, log: logging.Logger) -> dict[str, Any]:
    """What an AppRunner of a guarded door takes: the keep-alive timeout, the throttled error log, and how long a
    body left unread after its reply (a refusal before the body, a late body's 408) is read and dropped before the
    connection closes: the head timeout (aiohttp's lingering; its own 10 s otherwise)."""
    return {"keepalive_timeout": limits.keepalive_timeout_s, "lingering_time": limits.head_timeout_s,
            "logger": _AiohttpLog(log.name + ".http", ThrottledLog(log))}


def throttle_accept_errors(loop: asyncio.AbstractEventLoop, warn: ThrottledLog) -> None:
    """The loop's accept errors (out of file descriptors: one per refused accept) throttled; every other error goes
    to the handler the loop had."""
    if loop in _THROTTLED_LOOPS:
        return
    previous = loop.get_exception_handler()

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if message.startswith("socket.accept()"):
            exc = context.get("exception")
            warn("accept", "accepting a connection failed: %s: %s", message, exc)
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)
    _THROTTLED_LOOPS.add(loop)


_THROTTLED_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()  # handler installed once a loop


__all__ = ["BODY_MIN_RATE", "GuardedSite", "HttpLimits", "peer_has_finished", "read_body", "runner_kwargs",
           "throttle_accept_errors"]
