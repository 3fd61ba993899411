"""Health, readiness and Prometheus metrics of an SQM server over HTTP: /healthz, /readyz, /metrics.

They have no authentication (what they show: queue names, depths, counters), so the port listens on loopback
(``--metrics-host``, default 127.0.0.1) whatever address the service itself listens on; another address is the
operator's explicit choice, and logged as unauthenticated.

Whoever reaches the port may ask, so what a request costs is bounded: a collection of /metrics reads the CF (several
commands per queue), so one page serves every scrape for ``cache_s`` after it was collected, and one collection runs
at a time (scrapes that come meanwhile wait for it and share its page); the connections open at once are capped
(cfemu.connection_cap: past the per-address cap a new one is closed at once; past the total cap one that
has not sent its whole request head yet is closed to make room), and each must send its request head within
``head_timeout_s`` of its accept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from cfemu.connection_cap import ConnectionCap, Waiting, peer_of
from sqm.core.manager import CF_DOWN, QueueManager


class MetricsPage:
    """The /metrics page of a registry, collected at most once per ``cache_s`` and by one collection at a time."""

    def __init__(self, registry: CollectorRegistry, cache_s: float) -> None:
        self.registry = registry
        self.cache_s = cache_s
        self.collections = 0  # collections made since the start
        self._page = b""
        self._at = float("-inf")  # when the page's collection started
        self._ended = float("-inf")  # and when it ended
        self._lock: asyncio.Lock | None = None  # made on the loop that serves

    async def get(self) -> bytes:
        """The page: the last one if its collection ended after this scrape came (the scrape waited for it) or
        started at most ``cache_s`` before it came, else a new one."""
        came = time.monotonic()
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.collections == 0 or (self._ended < came and self._at < came - self.cache_s):
                started = time.monotonic()
                self._page = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self.registry)
                self._at, self._ended = started, time.monotonic()
                self.collections += 1
            return self._page


class _Connection:
    """One metrics-port connection, as the cap sees it: waiting for its head until it has read it."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.head_read = False

    def waiting(self) -> Waiting:
        return None if self.head_read else "head"

    def evict(self) -> None:
        self.writer.transport.abort()


class HealthEndpoint:
    """The HTTP endpoint of one server: ``serve`` is the listener's callback."""

    def __init__(self, qm: QueueManager, registry: CollectorRegistry, stopping: Callable[[], bool], *,
                 cache_s: float = 1.0, head_timeout_s: float = 5.0, max_connections: int = 32,
                 max_connections_per_peer: int = 8, warn: Callable[..., None] | None = None) -> None:
        self.qm = qm
        self.registry = registry
        self.stopping = stopping
        self.page = MetricsPage(registry, cache_s)
        self.head_timeout_s = head_timeout_s
        self.cap = ConnectionCap(max_connections, max_connections_per_peer)
        self.warn = warn or (lambda *a: None)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = peer_of(writer.get_extra_info("peername"))
        held = _Connection(writer)
        evicted = self.cap.evicted
        refusal = self.cap.admit(peer, held)
        if self.cap.evicted != evicted:
            self.warn("metrics-evict", "%s: a metrics-port connection closed to make room for one from %s: the cap "
                      "of %d connections at once is reached and it had sent no whole request head (closed so far: %d)",
                      self.qm.name, peer, self.cap.total, self.cap.evicted)
        if refusal is not None:
            self.warn("metrics-cap", "%s: a metrics-port connection from %s closed at once: the cap of %s is reached "
                      "(--metrics-max-connections; closed so far: %d)", self.qm.name, peer, refusal, self.cap.refused)
            writer.transport.abort()
            return
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.head_timeout_s)
            held.head_read = True
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].decode(errors="replace").split("?", 1)[0] if len(parts) >= 2 else ""
            status, ctype, body = await self.route(path)
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await asyncio.wait_for(writer.drain(), self.head_timeout_s)  # a peer that does not read is not waited for
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            self.cap.release(peer, held)
            writer.close()

    async def route(self, path: str) -> tuple[str, str, bytes]:
        loop = asyncio.get_running_loop()
        text = "text/plain; charset=utf-8"
        if path == "/healthz":
            if self.qm.fenced:
                return "503 Service Unavailable", text, b"fenced: restart required\n"
            return "200 OK", text, b"ok\n"
        if path == "/readyz":
            problem = await loop.run_in_executor(None, self.not_ready_because)
            if problem:
                return "503 Service Unavailable", text, f"not ready: {problem}\n".encode()
            return "200 OK", text, b"ready\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, await self.page.get()
        return "404 Not Found", text, b"try /healthz, /readyz or /metrics\n"

    def not_ready_because(self) -> str:
        if self.qm.fenced:
            return "fenced"
        stopping = self.stopping()
        if stopping or not self.qm.running:
            return "stopping" if stopping else "starting"
        try:
            self.qm.redis.ping()
        except CF_DOWN as e:
            return f"the CF does not answer: {e}"
        return ""


__all__ = ["HealthEndpoint", "MetricsPage"]
