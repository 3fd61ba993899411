"""What every Prometheus exporter of the project shares: a histogram family from cfemu.latency's snapshots, the
software's version for the ``_info`` metrics, and the client library's HTTP server for a process's /metrics.

The exporters: a member's (sqm.service.metrics, on its own health port), the backup scheduler's
(backup.schedule_metrics), the group supervisor's with the CF's INFO (qsg.supervisor_metrics,
cfemu.cf_exporter). Their names and the alerts on them: docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from http.server import ThreadingHTTPServer
from importlib import metadata
from typing import Any

from prometheus_client import PROCESS_COLLECTOR, generate_latest
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from cfemu.connection_cap import ConnectionCap, Waiting, peer_of
from cfemu.latency import Latency
from cfemu.sockets import is_loopback_host


def package_version() -> str:
    """The installed version of the project (its distribution's), 'unknown' when it runs from an uninstalled
    tree."""
    try:
        return metadata.version("cfemu")
    except metadata.PackageNotFoundError:
        return "unknown"


def histogram(name: str, help_text: str, labels: list[str],
              series: Iterable[tuple[list[str], Latency]]) -> HistogramMetricFamily:
    """A histogram family of the snapshots of ``series`` (label values, its Latency); the family is there
    (HELP and TYPE) even before anything was observed, so dashboards and alerts find its name."""
    family = HistogramMetricFamily(name, help_text, labels=labels)
    for values, latency in series:
        snap = latency.snapshot()
        family.add_metric(values, [("+Inf" if b == float("inf") else repr(b), n) for b, n in snap.buckets],
                          snap.sum)
    return family


# The bounds of an exporter's HTTP server: whoever reaches the port may connect, and each connection holds a thread.
EXPORTER_READ_TIMEOUT_S = 5.0  # a connection must send its whole request head within this long of its accept
EXPORTER_MAX_CONNECTIONS = 16  # connections served at once; past it one without a whole head is closed
EXPORTER_MAX_CONNECTIONS_PER_PEER = 4  # of them from one address; past it a new one is closed at once


class _Connection:
    """One connection of an exporter's server: the time its request head must be whole by (its accept's, plus the
    read timeout), and whether it is (the cap may evict it until then)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.head_read = False

    def waiting(self) -> Waiting:
        return None if self.head_read else "head"

    def evict(self) -> None:
        """Ends the handler's read (its thread closes the socket): called on the accept thread."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class _ReadByDeadline(io.RawIOBase):
    """A connection's socket read with what is left of its deadline as each read's timeout: a peer that sends a
    byte now and then is closed at the deadline all the same (a socket timeout alone is per read)."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.conn.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no whole request head within the read timeout of the accept")
        self.conn.sock.settimeout(left)
        return self.conn.sock.recv_into(buffer)


class _DeadlineHandler(MetricsHandler):
    """The client library's handler, reading its request head by the connection's deadline."""

    server: _CappedServer

    def setup(self) -> None:
        super().setup()
        conn = self.server.connections.get(self.request)
        if conn is not None:
            self.rfile.close()  # the socket's own file: left open, it would keep the socket from closing
            self.rfile = io.BufferedReader(_ReadByDeadline(conn))

    def parse_request(self) -> bool:
        ok = super().parse_request()  # it reads the headers, by the deadline too
        conn = self.server.connections.get(self.request)
        if conn is not None:
            conn.head_read = True  # a request under way: not evicted any more
        if self.timeout is not None:
            self.connection.settimeout(self.timeout)  # the reply's writes: the read timeout, not what was left
        return bool(ok)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the library's name
        """Not printed: a flood of refused requests would flood stderr."""


class _CappedServer(ThreadingHTTPServer):
    """The client library's threaded server with a cap on the connections it serves at once (each is a thread)
    and a deadline on each one's request head (cfemu.connection_cap: past the per-address cap a new connection is
    closed unanswered; past the total cap one that has not sent its whole request head is closed to make
    room)."""

    daemon_threads = True
    request_queue_size = 64  # the listen backlog (socketserver's 5 made a flood's connections wait for SYN retries)
    cap: ConnectionCap
    read_timeout_s: float
    connections: dict[Any, _Connection]

    def process_request(self, request: Any, client_address: Any) -> None:
        conn = _Connection(request, time.monotonic() + self.read_timeout_s)
        if self.cap.admit(peer_of(client_address), conn) is not None:
            self.shutdown_request(request)
            return
        self.connections[request] = conn
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.cap.release(peer_of(client_address), self.connections.pop(request))

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer's broken or timed-out request is not the process's error: not printed (a flood of them would
        flood stderr)."""


def serve(collectors: Iterable[Collector], host: str, port: int, *, read_timeout_s: float = EXPORTER_READ_TIMEOUT_S,
          max_connections: int = EXPORTER_MAX_CONNECTIONS,
          max_connections_per_peer: int = EXPORTER_MAX_CONNECTIONS_PER_PEER) -> int:
    """Serve /metrics of ``collectors`` and the process's own (CPU, memory, open files, start time) on host:port,
    in a thread of an HTTP server (the client library's handler, at most ``max_connections`` connections at once,
    ``max_connections_per_peer`` from one address, each closed unless its whole request head came within
    ``read_timeout_s`` of its accept, however it trickles in); the
    port it listens on (0: one the system chose). /metrics has no authentication: on an address beyond loopback, a
    one-line warning on stderr says so (exposure_warning)."""
    registry = CollectorRegistry(auto_describe=False)
    for c in (*collectors, PROCESS_COLLECTOR):
        registry.register(c)
    handler = type("BoundedMetricsHandler", (_DeadlineHandler,), {"registry": registry, "timeout": read_timeout_s})
    server_class = type("ExporterServer", (_CappedServer,), {
        "address_family": socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                             flags=socket.AI_PASSIVE)[0][0],
        "cap": ConnectionCap(max_connections, max_connections_per_peer), "read_timeout_s": read_timeout_s,
        "connections": {}})
    server = server_class((host, port), handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    bound = int(server.server_port)
    warning = exposure_warning(host, bound)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return bound


def exposure_warning(host: str, port: int) -> str | None:
    """The line to print when /metrics listens beyond loopback (None when it does not)."""
    if is_loopback_host(host):
        return None
    return (f"warning: the metrics on {host}:{port} have no authentication: whoever reaches that address reads "
            "them (structure and queue names, depths, counters); bind 127.0.0.1 unless a firewall guards the port")


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def write_last_run(path: str | os.PathLike[str], prefix: str, structure: str, *, ok: bool, seconds: float,
                   phases: Mapping[str, float], values: Mapping[str, tuple[str, float]] | None = None) -> None:
    """A one-shot command's run (a backup, a restore by hand) as gauges in ``path``, for node_exporter's textfile
    collector: when it ended, whether it succeeded, how long it and each phase took, and ``values`` (name ->
    (help, value)). Written atomically (a temporary file renamed), so a scrape never reads half of it. The temporary
    file has a name nobody can guess and is created, never opened where something already is: a link planted in the
    directory beside it is never written through (prometheus_client's own textfile writer uses <path>.<pid>.<tid>).
    Mode 0644: the collector runs as another user."""
    def gauge(name: str, help_text: str, value: float, **labels: str) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"{prefix}{name}", help_text, labels=["structure", *labels])
        g.add_metric([structure, *labels.values()], value)
        return g

    families: list[Metric] = [
        gauge("last_run_timestamp_seconds", "When the last run ended, in seconds since the epoch", time.time()),
        gauge("last_run_success", "1 when the last run succeeded", 1.0 if ok else 0.0),
        gauge("last_run_duration_seconds", "How long the last run took", seconds)]
    phase = GaugeMetricFamily(f"{prefix}last_run_phase_duration_seconds", "How long each phase of the last run "
                              "took", labels=["structure", "phase"])
    for name, secs in phases.items():
        phase.add_metric([structure, name], secs)
    families.append(phase)
    families += [gauge(name, help_text, value) for name, (help_text, value) in (values or {}).items()]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    target = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(target)), prefix=f".{os.path.basename(target)}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(generate_latest(registry))
            os.fchmod(f.fileno(), 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


__all__ = ["exposure_warning", "histogram", "package_version", "serve", "write_last_run"]
