"""What every Prometheus exporter of the project shares: a histogram family from cfemu.latency's snapshots, the
software's version for the ``_info`` metrics, and the client library's HTTP server for a process's /metrics.

The exporters: a member's (sqm.service.metrics, on its own health port), the backup scheduler's
(backup.schedule_metrics), the group supervisor's with the CF's INFO (qsg.supervisor_metrics,
cfemu.cf_exporter). Their names and the alerts on them: docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata

from prometheus_client import PROCESS_COLLECTOR, start_http_server
from prometheus_client.core import CollectorRegistry, HistogramMetricFamily
from prometheus_client.registry import Collector

from cfemu.latency import Latency


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


def serve(collectors: Iterable[Collector], host: str, port: int) -> int:
    """Serve /metrics of ``collectors`` and the process's own (CPU, memory, open files, start time) on host:port,
    in a thread of the client library's HTTP server; the port it listens on (0: one the system chose)."""
    registry = CollectorRegistry(auto_describe=False)
    for c in (*collectors, PROCESS_COLLECTOR):
        registry.register(c)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


__all__ = ["histogram", "package_version", "serve"]
