"""A fault-injecting TCP proxy (asyncio, 127.0.0.1 only): the network between an SQM and the CF, or between
clients and an SQM, with faults a real network has.

    proxy = FaultProxy(("127.0.0.1", 6379), name="QM1->CF").start()
    url = f"redis://127.0.0.1:{proxy.port}"     # give this to the SQM instead of the CF's own address
    proxy.cut()          # every connection closed at once (RST), new ones refused: the listener is closed
    proxy.heal()         # the listener comes back on the same port; forwarding resumes
    proxy.delay(0.2)     # every chunk waits 200 ms before it is forwarded (both directions)
    proxy.half_open()    # nothing is forwarded and nothing is closed: peers wait until their own timeouts
    proxy.lose_replies() # requests reach the target, its replies are dropped (then cut(): the callers learn it)
    proxy.stop()

Half-open keeps what it read: on heal() it is delivered, as TCP would retransmit it once the path is back.
The proxy runs its own event loop in a daemon thread; every control method is thread-safe and returns once the
change is in effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any

LOOPBACK = "127.0.0.1"
CHUNK = 64 * 1024
PASS, CUT, HALF_OPEN, REPLIES_LOST = "pass", "cut", "half-open", "replies-lost"


class ProxyError(RuntimeError):
    """The proxy cannot do what was asked (not started, port taken, a non-loopback address)."""


class FaultProxy:
    """One listening port forwarding to one target, with cut / delay / half-open faults."""

    def __init__(self, target: tuple[str, int], *, name: str = "", port: int = 0) -> None:
        if target[0] not in (LOOPBACK, "localhost"):
            raise ProxyError(f"the proxy only forwards to {LOOPBACK}, not {target[0]}")
        self.target = (LOOPBACK, int(target[1]))
        self.name = name or f"proxy->{target[1]}"
        self.port = port
        self.mode = PASS
        self.delay_s = 0.0
        self.connections_accepted = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._flowing: asyncio.Event | None = None  # set unless half-open

    # --- life cycle ------------------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=f"proxy-{self.name}", daemon=True)
        self._thread.start()
        self._run(self._init())
        return self

    async def _init(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        await self._listen()

    def stop(self) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(Exception):
            self._run(self._close_all(close_listener=True))
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._loop.close()
        self._loop = None

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        if self._loop is None:
            raise ProxyError(f"{self.name}: not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    # --- faults ----------------------------------------------------------------------------------------------
    def cut(self) -> None:
        """Close every connection (with a reset) and refuse new ones until heal()."""
        self._run(self._cut())

    def half_open(self) -> None:
        """Stop forwarding in both directions; keep every connection open; accept new ones but forward nothing."""
        self._run(self._set_flowing(False, HALF_OPEN))

    def lose_replies(self) -> None:
        """Forward every request, drop every reply: the target acts on requests whose callers never hear back (the
        window a cut link opens between a request's arrival and its reply, held open). End it with cut()."""
        self.mode = REPLIES_LOST

    def delay(self, seconds: float) -> None:
        """Add this much latency to every chunk forwarded, in both directions (0 removes it)."""
        if seconds < 0:
            raise ProxyError(f"delay must be >= 0 s, not {seconds}")
        self.delay_s = float(seconds)

    def heal(self) -> None:
        """Back to plain forwarding: listen again after a cut, deliver what half-open held, no added delay."""
        self.delay_s = 0.0
        self._run(self._heal())

    async def _cut(self) -> None:
        self.mode = CUT
        await self._close_all(close_listener=True)

    async def _heal(self) -> None:
        if self._server is None:
            await self._listen()
        await self._set_flowing(True, PASS)

    async def _set_flowing(self, flowing: bool, mode: str) -> None:
        assert self._flowing is not None
        self.mode = mode
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _listen(self) -> None:
        # The same port every time: the SQM (or client) keeps the address it was given.
        self._server = await asyncio.start_server(self._accept, LOOPBACK, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close_all(self, *, close_listener: bool) -> None:
        if close_listener and self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._open):
            _reset(w)
        self._open.clear()

    # --- forwarding --------------------------------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_accepted += 1
        if self.mode == CUT:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)  # the target is down: the client sees its connection reset, as without a proxy
            return
        self._open.update((writer, up_writer))
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer, replies=True),
                             return_exceptions=True)
        for w in (writer, up_writer):
            self._open.discard(w)
            with contextlib.suppress(Exception):
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                    replies: bool = False) -> None:
        assert self._flowing is not None
        try:
            while True:
                data = await reader.read(CHUNK)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                await self._flowing.wait()
                if not data:
                    break
                if replies and self.mode == REPLIES_LOST:
                    continue
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # One side ended: end the other too (a proxy does not keep half a conversation).
            if writer in self._open:
                with contextlib.suppress(Exception):
                    writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0), as a cut path does, rather than a polite FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport = writer.transport
    with contextlib.suppress(Exception):
        transport.abort()


__all__ = ["CUT", "FaultProxy", "HALF_OPEN", "PASS", "REPLIES_LOST", "ProxyError"]
