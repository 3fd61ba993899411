"""Health, readiness and Prometheus metrics of an SQM server over HTTP: /healthz, /readyz, /metrics.

They have no authentication (what they show: queue names, depths, counters), so the port listens on loopback
(``--metrics-host``, default 127.0.0.1) whatever address the service itself listens on; another address is the
operator's explicit choice, and logged as unauthenticated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from sqm.core.manager import CF_DOWN, QueueManager


class HealthEndpoint:
    """The HTTP endpoint of one server: ``serve`` is the listener's callback."""

    def __init__(self, qm: QueueManager, registry: CollectorRegistry, stopping: Callable[[], bool]) -> None:
        self.qm = qm
        self.registry = registry
        self.stopping = stopping

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].decode(errors="replace").split("?", 1)[0] if len(parts) >= 2 else ""
            status, ctype, body = await self.route(path)
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
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
            body = await loop.run_in_executor(None, generate_latest, self.registry)
            return "200 OK", CONTENT_TYPE_LATEST, body
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


__all__ = ["HealthEndpoint"]
