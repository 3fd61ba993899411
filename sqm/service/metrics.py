"""Prometheus metrics of one SQM server, collected on each scrape (prometheus-client custom collector).

The queue manager already counts what matters (QueueManager.counters, its log's stats) and the CF knows the
depths, so the collector reads them when scraped instead of mirroring every event into client-side metrics.
A CF that does not answer only leaves its metrics out of that scrape. The durations (operations, CF calls,
fsyncs, automatic recoveries and their phases) are histograms (cfemu.latency) the code that runs them fills.

Names follow Prometheus's conventions (tests/sqm/test_metrics_conventions.py holds them to it): the ``sqm_``
prefix, base units in the name (``_seconds``, ``_bytes``), ``_total`` on counters, a point in time as a
``_timestamp_seconds`` since the epoch (never an age: an age goes stale with the scrape that read it), constant
facts as the labels of an ``_info`` gauge of 1. The reference, with the alerts built on them: docs/metrics.md.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

from prometheus_client import PLATFORM_COLLECTOR, PROCESS_COLLECTOR
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cfemu import duplex, keys
from cfemu.admin import Admin
from cfemu.exposition import histogram, package_version
from cfemu.latency import Latencies, Latency
from sqm.core import recauto
from sqm.core.manager import CF_DOWN, QueueManager
from sqm.core.records import INBACKOUT, INCOMMIT, INDOUBT, INFLIGHT
from sqm.operations import Handler, Operation

log = logging.getLogger("sqm.service.metrics")

UOW_STATES = (INFLIGHT, INDOUBT, INCOMMIT, INBACKOUT)
# An LRSN is microseconds since the epoch (sqm.core.clock): below 2**53, where a float64 (a Prometheus sample)
# holds every integer exactly, until the year 2255. Above, the gauge would round: it is left out instead.
LRSN_EXACT_BELOW = 2**53

# One row per plain value: (family, name without the prefix, help, the key of QueueManager.status()).
QM_VALUES: tuple[tuple[type[CounterMetricFamily] | type[GaugeMetricFamily], str, str, str], ...] = (
    (CounterMetricFamily, "commits", "Units of work committed", "commits"),
    (CounterMetricFamily, "backouts", "Units of work backed out", "backouts"),
    (CounterMetricFamily, "puts", "Messages put", "puts"),
    (CounterMetricFamily, "gets", "Messages got", "gets"),
    (CounterMetricFamily, "peer_recoveries", "Peer recoveries this SQM carried out", "peer_recoveries"),
    (CounterMetricFamily, "fsyncs", "Log fsyncs", "fsyncs"),
    (CounterMetricFamily, "log_bytes", "Bytes written to the log", "log_bytes"),
    (CounterMetricFamily, "log_records", "Records written to the log", "log_records"),
    (CounterMetricFamily, "backout_records_with_data", "Backout records carrying message data",
     "backout_records_with_data"),
    (CounterMetricFamily, "cf_calls", "CF script calls", "cf_calls"),
    (CounterMetricFamily, "cf_round_trips", "CF round trips (concurrent requests' calls share one: sqm.core.cfgroup)",
     "cf_round_trips"),
    (GaugeMetricFamily, "fenced", "1 when peer recovery fenced this SQM", "fenced"),
    (GaugeMetricFamily, "pending", "Decided work waiting for the CF", "pending"),
)
# The same for the server's own counts (SQMServer.server_stats).
SERVER_VALUES: tuple[tuple[type[CounterMetricFamily] | type[GaugeMetricFamily], str, str, str], ...] = (
    (GaugeMetricFamily, "connections", "Open client connections", "connections"),
    (GaugeMetricFamily, "connections_unauthenticated", "Open connections that have not authenticated",
     "unauthenticated"),
    # Request slots (sqm.request_slots): a queue of waiters that never empties says the slots, not the CF or the
    # log, bound the service; --request-slots.
    (GaugeMetricFamily, "request_slots", "Requests that may do their work at once (--request-slots)",
     "request_slots"),
    (GaugeMetricFamily, "waiting_for_slot", "Requests waiting for a request slot now", "waiting_for_slot"),
    (CounterMetricFamily, "slot_waits", "Requests that waited for a request slot", "slot_waits"),
    (CounterMetricFamily, "slot_leases_expired", "Request slots taken back from requests that held theirs past "
     "--slot-lease-ms (waiting on the CF or a lock)", "slot_leases_expired"),
    # Scan slots (sqm.core.scans): waiters most of the time while the CF is idle say --scan-slots is too low.
    (GaugeMetricFamily, "scan_slots", "Calls of multi-call scans (browse pages, peek scans) that may be in the CF "
     "at once (--scan-slots)", "scan_slots"),
    (GaugeMetricFamily, "waiting_for_scan_slot", "Calls of scans waiting for a scan slot now", "waiting_for_scan_slot"),
    (CounterMetricFamily, "scan_slot_waits", "Calls of scans that waited for a scan slot", "scan_slot_waits"),
    (CounterMetricFamily, "scan_slot_leases_expired", "Scan slots a waiting call took from a call that held its "
     "slot past the lease (waiting on a CF that does not answer)", "scan_slot_leases_expired"),
    # The budget of request bytes in flight (sqm.service.transport): in use near the limit, and refusals, say
    # large requests (puts of large messages) come faster than the member takes them in.
    (GaugeMetricFamily, "request_bytes_in_flight", "Bytes of requests (and large replies) in flight now, counted "
     "against --max-request-bytes-per-member", "request_bytes_in_flight"),
    (GaugeMetricFamily, "request_bytes_limit", "Bytes of requests in flight this member takes in at once "
     "(--max-request-bytes-per-member)", "request_bytes_limit"),
    (CounterMetricFamily, "request_budget_waits", "Large requests that waited for the budget of request bytes in "
     "flight", "request_budget_waits"),
    (CounterMetricFamily, "request_budget_refusals", "Large requests refused (MQRC_DATA_LENGTH_ERROR) after "
     "waiting for the budget of request bytes in flight in vain", "request_budget_refusals"),
)
# Counters by one label (the security metrics): every label value comes from a fixed set (sqm.service.session),
# never from what a peer sent. (name, help, label, the key of server_stats).
SERVER_BY_LABEL = (
    ("auth_failures", "Connections refused before or at authentication, by reason", "reason", "auth_failures"),
    ("connections_refused", "Connections refused at accept by a connection limit", "limit", "refused"),
    ("connections_closed", "Connections the server closed for a timeout", "reason", "closed"),
)


def backup_finished_at(entry: dict[str, Any]) -> float | None:
    """When a catalogued backup ended, in seconds since the epoch (its manifest's ISO 8601 ``ended_at``)."""
    ended = entry.get("ended_at")
    if not isinstance(ended, str):
        return None
    try:
        return datetime.fromisoformat(ended.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def last_backup_time(admin: Admin, structure: str) -> float | None:
    """When the structure's last good backup ended, in seconds since the epoch (the catalog entry of the backup
    the structure's ``last_backup`` names), or None when it has none or no time is known."""
    last_id = admin.redis.hget(keys.meta(structure), "last_backup")
    entries = admin.backups(structure)
    if last_id is not None:
        entries = [b for b in entries if b.get("id") == keys.text(last_id)] or entries
    times = [t for t in (backup_finished_at(b) for b in entries) if t is not None]
    return max(times) if times else None


def last_backup_age(admin: Admin, structure: str, now: float | None = None) -> float | None:
    """Seconds since the structure's last good backup ended (``last_backup_time``), or None."""
    ended = last_backup_time(admin, structure)
    return None if ended is None else max(0.0, (now or time.time()) - ended)


def timed_handlers(operations: Iterable[Operation], seconds: Latencies) -> dict[str, Handler]:
    """The handler of each operation, each wrapped to observe how long it ran into ``seconds[name]`` (whether
    it returned or raised): the one place the service's operations are timed."""
    def timed(name: str, handler: Handler) -> Handler:
        found: list[Latency] = []  # its histogram, made at the first run: the exposition holds only the ops run

        def run(service: Any, session: Any, args: dict[str, Any]) -> Any:
            # The clock read here rather than by a timing context (Latency.time): every request runs this.
            t0 = time.perf_counter()
            try:
                return handler(service, session, args)
            finally:
                if not found:
                    found.append(seconds[name])
                found[0].observe(time.perf_counter() - t0)
        return run
    return {op.name: timed(op.name, op.handler) for op in operations if op.handler is not None}


class SQMCollector(Collector):
    """Depth by state per queue, UOWs by state, commits, fsyncs, log bytes, backup times, peer recoveries, the
    durations, and the server's own connection and request counts (``server_stats``)."""

    def __init__(self, qm: QueueManager, server_stats: Callable[[], dict[str, Any]] | None = None,
                 op_seconds: Latencies | None = None) -> None:
        self.qm = qm
        self.server_stats = server_stats
        self.op_seconds = op_seconds

    def collect(self) -> Iterator[Metric]:
        qm = self.qm
        status = qm.status()
        info = GaugeMetricFamily("sqm_info", "The member: its software version and Python (always 1)",
                                 labels=["qmgr", "version", "python"])
        info.add_metric([qm.name, package_version(), platform.python_version()], 1.0)
        yield info
        uows = GaugeMetricFamily("sqm_uows", "Units of work by state", labels=["qmgr", "state"])
        for state in UOW_STATES:
            uows.add_metric([qm.name, state], status["uows"].get(state, 0))
        yield uows
        yield from self._values(QM_VALUES, status)
        c = CounterMetricFamily("sqm_structure_recoveries", "Automatic structure recoveries (RECAUTO) this SQM "
                                "started, completed and failed (CSQE132I, CSQE131I, CSQE135E)", labels=["qmgr", "event"])
        for event in recauto.EVENTS:
            c.add_metric([qm.name, event], status.get(recauto.counter(event), 0))
        yield c
        lrsn = int(status.get("lrsn", 0))
        g = GaugeMetricFamily("sqm_lrsn", "The member's current LRSN (microseconds since the epoch, a hybrid "
                              "clock; exact: below 2**53)", labels=["qmgr"])
        if lrsn < LRSN_EXACT_BELOW:
            g.add_metric([qm.name], float(lrsn))
        yield g
        yield from self._durations()
        if self.server_stats is not None:
            yield from self._server(self.server_stats())
        try:
            yield from self._cf_metrics()
        except CF_DOWN as e:
            log.debug("metrics: the CF is unavailable: %s", e)

    def _values(self, rows: Iterable[tuple[type[CounterMetricFamily] | type[GaugeMetricFamily], str, str, str]],
                values: dict[str, Any]) -> Iterator[Metric]:
        for family, name, help_text, key in rows:
            m = family(f"sqm_{name}", help_text, labels=["qmgr"])
            m.add_metric([self.qm.name], float(values.get(key, 0)))
            yield m

    def _durations(self) -> Iterator[Metric]:
        qm, name = self.qm, [self.qm.name]
        yield histogram("sqm_operation_duration_seconds", "How long each service operation ran, from its start "
                        "in a request slot to its reply (a get's wait included)", ["qmgr", "op"],
                        [([qm.name, op], lat) for op, lat in (self.op_seconds.items() if self.op_seconds else [])])
        yield histogram("sqm_cf_call_duration_seconds", "How long each call of the queue manager on the CF took "
                        "(a re-join and its retry included)", ["qmgr"], [(name, qm.cf_call_seconds)])
        yield histogram("sqm_log_fsync_duration_seconds", "How long each fsync of the record log took (one per "
                        "group commit)", ["qmgr"], [(name, qm.log.stats.fsync_seconds)] if qm.log else [])
        rec = qm.recauto
        yield histogram("sqm_restore_duration_seconds", "How long the automatic structure recoveries (RECAUTO) "
                        "this member completed took", ["qmgr"], [(name, rec.seconds)] if rec else [])
        yield histogram("sqm_restore_phase_duration_seconds", "How long each phase of this member's automatic "
                        "structure recoveries took (read backup, read logs, settle, load)", ["qmgr", "phase"],
                        [([qm.name, phase], lat) for phase, lat in rec.phase_seconds.items()] if rec else [])

    def _server(self, stats: dict[str, Any]) -> Iterator[Metric]:
        qmgr = self.qm.name
        yield from self._values(SERVER_VALUES, stats)
        c = CounterMetricFamily("sqm_requests", "Requests served, by operation and result ('?': an operation "
                                "the server does not know)", labels=["qmgr", "op", "result"])
        for (op, result), n in sorted(stats.get("requests", {}).items()):
            c.add_metric([qmgr, op, result], n)
        yield c
        for name, help_text, label, key in SERVER_BY_LABEL:
            c = CounterMetricFamily(f"sqm_{name}", help_text, labels=["qmgr", label])
            for value, n in sorted(stats.get(key, {}).items()):
                c.add_metric([qmgr, value], n)
            yield c
        c = CounterMetricFamily("sqm_authentications", "Connections authenticated, by role and method",
                                labels=["qmgr", "role", "method"])
        for (role, method), n in sorted(stats.get("authenticated", {}).items()):
            c.add_metric([qmgr, role, method], n)
        yield c

    def _cf_metrics(self) -> Iterator[Metric]:
        qm = self.qm
        depth = GaugeMetricFamily("sqm_queue_depth", "Messages per queue and state (UP, CP, UG, EX)",
                                  labels=["structure", "queue", "state"])
        ended = GaugeMetricFamily("sqm_last_backup_timestamp_seconds", "When the structure's last good backup "
                                  "ended, in seconds since the epoch (time() - it: the backup's age)",
                                  labels=["structure"])
        up = GaugeMetricFamily("sqm_structure_active", "1 when the structure is ACTIVE", labels=["structure"])
        for sdef in qm.admin.structures():
            up.add_metric([sdef.name], 1.0 if qm.admin.state(sdef.name) == "ACTIVE" else 0.0)
            for queue, by_state in qm.structure(sdef.name).depths().items():
                for state, n in by_state.items():
                    depth.add_metric([sdef.name, queue, state], n)
            t = last_backup_time(qm.admin, sdef.name)
            if t is not None:
                ended.add_metric([sdef.name], t)
        yield from (depth, ended, up)
        duplexed = GaugeMetricFamily("sqm_cf_duplexed", "1 when the duplexed CF's copy is in sync (DUPLEX), 0 "
                                     "when it runs simplex (the secondary lost or resynchronising: CSQE250W); "
                                     "no sample: the CF is not duplexed", labels=[])
        generation = GaugeMetricFamily("sqm_cf_generation", "The duplexed CF's generation (one more at every "
                                       "promotion)", labels=[])
        if duplex.pair_of(qm.redis) is not None:  # a duplexed CF (cfemu.duplex): the pair's mode as the CF records it
            mode, gen = qm.redis.hmget(keys.duplex(), [duplex.MODE_FIELD, duplex.GEN_FIELD])
            duplexed.add_metric([], 1.0 if mode == duplex.DUPLEX.encode() else 0.0)
            generation.add_metric([], float(int(gen or 0)))
        yield from (duplexed, generation)


def make_registry(qm: QueueManager, server_stats: Callable[[], dict[str, Any]] | None = None,
                  op_seconds: Latencies | None = None) -> CollectorRegistry:
    """The member's registry: its collector, and the process's (CPU, memory, open files, start time) and
    Python's (``process_*``, ``python_info``) from the client library."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SQMCollector(qm, server_stats, op_seconds))
    registry.register(PROCESS_COLLECTOR)
    registry.register(PLATFORM_COLLECTOR)
    return registry


__all__ = ["LRSN_EXACT_BELOW", "SQMCollector", "backup_finished_at", "last_backup_age", "last_backup_time",
           "make_registry", "timed_handlers"]
