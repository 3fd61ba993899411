"""Prometheus metrics of one SQM server, collected on each scrape (prometheus-client custom collector).

The queue manager already counts what matters (QueueManager.counters, its log's stats) and the CF knows the
depths, so the collector reads them when scraped instead of mirroring every event into client-side metrics.
A CF that does not answer only leaves its metrics out of that scrape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cfemu import duplex, keys
from cfemu.admin import Admin
from sqm.core import recauto
from sqm.core.manager import CF_DOWN, QueueManager
from sqm.core.records import INBACKOUT, INCOMMIT, INDOUBT, INFLIGHT

log = logging.getLogger("sqm.service.metrics")

UOW_STATES = (INFLIGHT, INDOUBT, INCOMMIT, INBACKOUT)


def backup_finished_at(entry: dict[str, Any]) -> float | None:
    """When a catalogued backup ended, in seconds since the epoch (its manifest's ISO 8601 ``ended_at``)."""
    ended = entry.get("ended_at")
    if not isinstance(ended, str):
        return None
    try:
        return datetime.fromisoformat(ended.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def last_backup_age(admin: Admin, structure: str, now: float | None = None) -> float | None:
    """Seconds since the structure's last good backup ended (the catalog entry of the backup the structure's
    ``last_backup`` names), or None when it has none or no time is known."""
    last_id = admin.redis.hget(keys.meta(structure), "last_backup")
    entries = admin.backups(structure)
    if last_id is not None:
        entries = [b for b in entries if b.get("id") == keys.text(last_id)] or entries
    times = [t for t in (backup_finished_at(b) for b in entries) if t is not None]
    if not times:
        return None
    return max(0.0, (now or time.time()) - max(times))


class SQMCollector(Collector):
    """Depth by state per queue, UOWs by state, commits, fsyncs, log bytes, backup age, peer recoveries, and
    the server's own connection and request counts (``server_stats``)."""

    def __init__(self, qm: QueueManager, server_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.qm = qm
        self.server_stats = server_stats

    def collect(self) -> Iterator[Metric]:
        qm = self.qm
        labels = {"qmgr": qm.name}
        status = qm.status()
        uows = GaugeMetricFamily("sqm_uows", "Units of work by state", labels=["qmgr", "state"])
        for state in UOW_STATES:
            uows.add_metric([qm.name, state], status["uows"].get(state, 0))
        yield uows
        for key, help_text in (("commits", "Units of work committed"), ("backouts", "Units of work backed out"),
                               ("puts", "Messages put"), ("gets", "Messages got"),
                               ("peer_recoveries", "Peer recoveries this SQM carried out"),
                               ("fsyncs", "Log fsyncs"), ("log_bytes", "Bytes written to the log"),
                               ("log_records", "Records written to the log"),
                               ("backout_records_with_data", "Backout records carrying message data"),
                               ("cf_calls", "CF script calls"),
                               ("cf_round_trips", "CF round trips (concurrent requests' calls share one: "
                                "sqm.core.cfgroup)")):
            c = CounterMetricFamily(f"sqm_{key}", help_text, labels=list(labels))
            c.add_metric([qm.name], status.get(key, 0))
            yield c
        c = CounterMetricFamily("sqm_structure_recoveries", "Automatic structure recoveries (RECAUTO) this SQM "
                                "started, completed and failed (CSQE132I, CSQE131I, CSQE135E)", labels=["qmgr", "event"])
        for event in recauto.EVENTS:
            c.add_metric([qm.name, event], status.get(recauto.counter(event), 0))
        yield c
        for key, help_text in (("fenced", "1 when peer recovery fenced this SQM"),
                               ("pending", "Decided work waiting for the CF"), ("lrsn", "Current LRSN")):
            g = GaugeMetricFamily(f"sqm_{key}", help_text, labels=list(labels))
            g.add_metric([qm.name], float(status.get(key, 0)))
            yield g
        if self.server_stats is not None:
            stats = self.server_stats()
            g = GaugeMetricFamily("sqm_connections", "Open client connections", labels=list(labels))
            g.add_metric([qm.name], stats.get("connections", 0))
            yield g
            c = CounterMetricFamily("sqm_requests", "Requests served, by operation and result ('?': an operation "
                                    "the server does not know)", labels=["qmgr", "op", "result"])
            for (op, result), n in sorted(stats.get("requests", {}).items()):
                c.add_metric([qm.name, op, result], n)
            yield c
            # Request slots (sqm.request_slots): a queue of waiters that never empties says the slots, not the CF
            # or the log, bound the service; --request-slots.
            for key, help_text in (("request_slots", "Requests that may do their work at once (--request-slots)"),
                                   ("waiting_for_slot", "Requests waiting for a request slot now")):
                g = GaugeMetricFamily(f"sqm_{key}", help_text, labels=list(labels))
                g.add_metric([qm.name], stats.get(key, 0))
                yield g
            for key, help_text in (("slot_waits", "Requests that waited for a request slot"),
                                   ("slot_leases_expired", "Request slots taken back from requests that held theirs "
                                    "past --slot-lease-ms (waiting on the CF or a lock)")):
                c = CounterMetricFamily(f"sqm_{key}", help_text, labels=list(labels))
                c.add_metric([qm.name], stats.get(key, 0))
                yield c
            # The budget of request bytes in flight (sqm.service.transport): in use near the limit, and refusals,
            # say large requests (puts of large messages) come faster than the member takes them in.
            for key, help_text in (("request_bytes_in_flight", "Bytes of requests (and large replies) in flight "
                                    "now, counted against --max-request-bytes-per-member"),
                                   ("request_bytes_limit", "Bytes of requests in flight this member takes in at "
                                    "once (--max-request-bytes-per-member)")):
                g = GaugeMetricFamily(f"sqm_{key}", help_text, labels=list(labels))
                g.add_metric([qm.name], stats.get(key, 0))
                yield g
            for key, help_text in (("request_budget_waits", "Large requests that waited for the budget of request "
                                    "bytes in flight"),
                                   ("request_budget_refusals", "Large requests refused (MQRC_DATA_LENGTH_ERROR) "
                                    "after waiting for the budget of request bytes in flight in vain")):
                c = CounterMetricFamily(f"sqm_{key}", help_text, labels=list(labels))
                c.add_metric([qm.name], stats.get(key, 0))
                yield c
            # The security metrics: every label value comes from a fixed set (sqm.service.server), never from
            # what a peer sent.
            g = GaugeMetricFamily("sqm_connections_unauthenticated", "Open connections that have not authenticated",
                                  labels=list(labels))
            g.add_metric([qm.name], stats.get("unauthenticated", 0))
            yield g
            for name, help_text, label, key in (
                    ("sqm_auth_failures", "Connections refused before or at authentication, by reason", "reason",
                     "auth_failures"),
                    ("sqm_connections_refused", "Connections refused at accept by a connection limit", "limit",
                     "refused"),
                    ("sqm_connections_closed", "Connections the server closed for a timeout", "reason", "closed")):
                c = CounterMetricFamily(name, help_text, labels=["qmgr", label])
                for value, n in sorted(stats.get(key, {}).items()):
                    c.add_metric([qm.name, value], n)
                yield c
            c = CounterMetricFamily("sqm_authentications", "Connections authenticated, by role and method",
                                    labels=["qmgr", "role", "method"])
            for (role, method), n in sorted(stats.get("authenticated", {}).items()):
                c.add_metric([qm.name, role, method], n)
            yield c
        try:
            yield from self._cf_metrics()
        except CF_DOWN as e:
            log.debug("metrics: the CF is unavailable: %s", e)

    def _cf_metrics(self) -> Iterator[Metric]:
        qm = self.qm
        depth = GaugeMetricFamily("sqm_queue_depth", "Messages per queue and state (UP, CP, UG, EX)",
                                  labels=["structure", "queue", "state"])
        age = GaugeMetricFamily("sqm_last_backup_age_seconds", "Seconds since the last good backup ended",
                                labels=["structure"])
        up = GaugeMetricFamily("sqm_structure_active", "1 when the structure is ACTIVE", labels=["structure"])
        for sdef in qm.admin.structures():
            up.add_metric([sdef.name], 1.0 if qm.admin.state(sdef.name) == "ACTIVE" else 0.0)
            for queue, by_state in qm.structure(sdef.name).depths().items():
                for state, n in by_state.items():
                    depth.add_metric([sdef.name, queue, state], n)
            a = last_backup_age(qm.admin, sdef.name)
            if a is not None:
                age.add_metric([sdef.name], a)
        yield from (depth, age, up)
        if duplex.pair_of(qm.redis) is not None:  # a duplexed CF (cfemu.duplex): the pair's mode as the CF records it
            mode, gen = qm.redis.hmget(keys.duplex(), [duplex.MODE_FIELD, duplex.GEN_FIELD])
            g = GaugeMetricFamily("sqm_cf_duplexed", "1 when the duplexed CF's copy is in sync (DUPLEX), 0 when "
                                  "it runs simplex (the secondary lost or resynchronising: CSQE250W)", labels=[])
            g.add_metric([], 1.0 if mode == duplex.DUPLEX.encode() else 0.0)
            yield g
            g = GaugeMetricFamily("sqm_cf_generation", "The duplexed CF's generation (one more at every promotion)",
                                  labels=[])
            g.add_metric([], float(int(gen or 0)))
            yield g


def make_registry(qm: QueueManager, server_stats: Callable[[], dict[str, Any]] | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SQMCollector(qm, server_stats))
    return registry


__all__ = ["SQMCollector", "backup_finished_at", "last_backup_age", "make_registry"]
