"""The group supervisor's Prometheus metrics (``python -m qsg.local_group supervise --metrics-port``, which
``cfemu cluster up`` starts with a port of its own, shown by ``cfemu cluster status``): what it restarted and why,
what failed to restart, each tended member's liveness, how fast the CF answers its hang probe; served beside the
CF's own INFO (cfemu.cf_exporter). Names: the ``cfemu_supervisor_`` namespace (docs/metrics.md).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cfemu.exposition import histogram, package_version
from qsg.group_supervisor import Supervisor

PREFIX = "cfemu_supervisor_"
PAIR_EVENTS = (("degrade", "degrades"), ("resync", "resyncs"), ("promotion", "promotions"),
               ("empty_restart", "empty_restarts"))  # (label, the pair state's count)


class SupervisorCollector(Collector):
    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor

    def collect(self) -> Iterator[Metric]:
        counts = self.sup.counts
        g = GaugeMetricFamily(f"{PREFIX}info", "The group supervisor: its version and what it tends (always 1)",
                              labels=["version", "tends_cf", "tends_members"])
        g.add_metric([package_version(), str(self.sup.tends_cf).lower(),
                      str(bool(self.sup.c.state.get("member_restart"))).lower()], 1.0)
        yield g
        c = CounterMetricFamily(f"{PREFIX}restarts", "Processes the supervisor restarted, by process (CF or a "
                                "member) and cause (CF: died, hung; member: killed, fenced, log_failed, exited)",
                                labels=["process", "cause"])
        for (process, cause), n in sorted(counts.restarts.items()):
            c.add_metric([process, cause], n)
        yield c
        c = CounterMetricFamily(f"{PREFIX}restart_failures", "Restarts that failed (tried again later)",
                                labels=["process"])
        for process, n in sorted(counts.restart_failures.items()):
            c.add_metric([process], n)
        yield c
        g = GaugeMetricFamily(f"{PREFIX}last_restart_timestamp_seconds", "When the supervisor last restarted the "
                              "process, in seconds since the epoch", labels=["process"])
        for process, t in sorted(counts.last_restart.items()):
            g.add_metric([process], t)
        yield g
        g = GaugeMetricFamily(f"{PREFIX}member_up", "1 when the member's process runs (members it tends)",
                              labels=["member"])
        for member, up in sorted(counts.member_up.items()):
            g.add_metric([member], 1.0 if up else 0.0)
        yield g
        g = GaugeMetricFamily(f"{PREFIX}cf_ping_misses", "The CF's unanswered hang probes in a row (hung, and "
                              "restarted, after 3 over 6 s)", labels=[])
        g.add_metric([], self.sup.cf_misses)
        yield g
        c = CounterMetricFamily(f"{PREFIX}cf_script_kills", "Scripts the supervisor ended with SCRIPT KILL after "
                                "they kept the CF BUSY 10 s", labels=[])
        c.add_metric([], counts.script_kills)
        yield c
        yield histogram(f"{PREFIX}cf_ping_duration_seconds", "How long the CF took to answer the hang probe (PING; "
                        "BUSY is an answer)", [], [([], counts.ping_seconds)])
        yield histogram(f"{PREFIX}tick_duration_seconds", "How long each of the supervisor's intervals took", [],
                        [([], counts.tick_seconds)])
        pair = self.sup.c.state.get("duplex") or {}  # a duplexed CF: its controller's record (qsg.cfpair)
        c = CounterMetricFamily(f"{PREFIX}cf_pair_events", "The duplexed CF pair's events: the secondary lost "
                                "(degrade), copied again (resync), promoted, or both lost (empty_restart)",
                                labels=["event"])
        g = GaugeMetricFamily(f"{PREFIX}cf_pair_generation", "The duplexed CF pair's generation", labels=[])
        if pair:
            for event, key in PAIR_EVENTS:
                c.add_metric([event], int(pair.get(key) or 0))
            g.add_metric([], int(pair.get("gen") or 0))
        yield from (c, g)
        c = CounterMetricFamily(f"{PREFIX}tick_failures", "Intervals that failed (tried again at the next)",
                                labels=[])
        c.add_metric([], counts.tick_failures)
        yield c


__all__ = ["PAIR_EVENTS", "PREFIX", "SupervisorCollector"]
