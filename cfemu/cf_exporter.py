"""The CF's own metrics: an exporter of its redis-server's INFO, read on each scrape (the group supervisor serves
it beside its own: qsg.supervisor_metrics; docs/metrics.md).

What an operator of the CF watches: whether it answers (``cfemu_cf_up``) or answers BUSY (a script has run past
its busy-reply-threshold: ``cfemu_cf_busy``, and the BUSY replies in ``cfemu_cf_errors_total{error="BUSY"}``),
its memory against its limit, its clients, its keys, how much time its commands and scripts took
(``cfemu_cf_command_seconds_total{command="evalsha"}`` is the CF operations' time: each is one script; where the
server module runs, its commands, ``cf.put``, ``cf.get`` and ``cf.commit``, are the others: cfemu.server_module), and its
persistence (the last save, the changes since, the last write's status). A scrape reads INFO once, with a short
timeout, so a hung CF costs the scrape at most that long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("cfemu.cf_exporter")

PREFIX = "cfemu_cf_"
INFO_TIMEOUT_S = 2.0

# (INFO field, family, name without the prefix, help): the plain values, each exported as it is found.
FIELDS: tuple[tuple[str, type[GaugeMetricFamily] | type[CounterMetricFamily], str, str], ...] = (
    ("connected_clients", GaugeMetricFamily, "connected_clients", "Client connections open"),
    ("blocked_clients", GaugeMetricFamily, "blocked_clients", "Clients blocked in a blocking command"),
    ("used_memory", GaugeMetricFamily, "memory_used_bytes", "Memory the CF's data and buffers use"),
    ("used_memory_peak", GaugeMetricFamily, "memory_peak_bytes", "The most memory the CF used"),
    ("used_memory_rss", GaugeMetricFamily, "memory_rss_bytes", "The CF process's resident memory"),
    ("maxmemory", GaugeMetricFamily, "memory_max_bytes", "The CF's memory limit (0: none)"),
    ("used_memory_lua", GaugeMetricFamily, "memory_scripts_engine_bytes", "Memory of the script engine"),
    ("used_memory_vm_eval", GaugeMetricFamily, "memory_scripts_engine_bytes", "Memory of the script engine"),
    ("used_memory_scripts", GaugeMetricFamily, "memory_scripts_bytes", "Memory of the cached scripts"),
    ("number_of_cached_scripts", GaugeMetricFamily, "cached_scripts", "Scripts loaded in the CF"),
    ("mem_fragmentation_ratio", GaugeMetricFamily, "memory_fragmentation_ratio", "Resident over used memory"),
    ("total_commands_processed", CounterMetricFamily, "commands_processed", "Commands the CF ran"),
    ("total_connections_received", CounterMetricFamily, "connections_received", "Connections accepted"),
    ("rejected_connections", CounterMetricFamily, "rejected_connections", "Connections refused (maxclients)"),
    ("expired_keys", CounterMetricFamily, "expired_keys", "Keys removed at their expiry"),
    ("evicted_keys", CounterMetricFamily, "evicted_keys", "Keys evicted for memory (never in a CF: noeviction)"),
    ("rdb_changes_since_last_save", GaugeMetricFamily, "rdb_changes_since_last_save",
     "Writes since the last snapshot to disk"),
    ("rdb_last_save_time", GaugeMetricFamily, "rdb_last_save_timestamp_seconds",
     "When the last snapshot to disk was taken, in seconds since the epoch"),
    ("aof_enabled", GaugeMetricFamily, "aof_enabled", "1 when the append-only file is on"),
    ("loading", GaugeMetricFamily, "loading", "1 while the CF loads its data from disk"),
    ("connected_slaves", GaugeMetricFamily, "connected_replicas", "Replicas connected to the CF"),
)
# Status fields ("ok" or "err"), each exported as 1 when ok.
STATUS_FIELDS = (
    ("rdb_last_bgsave_status", "rdb_last_bgsave_ok", "1 when the last snapshot to disk succeeded"),
    ("aof_last_write_status", "aof_last_write_ok", "1 when the last write of the append-only file succeeded"),
)


class CFInfoCollector(Collector):
    """Reads the CF's INFO on each scrape. ``connect``: a client to the CF (called again after a failure, e.g. a
    CF restarted, with its socket timeout to bound the scrape)."""

    def __init__(self, connect: Callable[[], redis.Redis]) -> None:
        self.connect = connect
        self._client: redis.Redis | None = None

    def read_info(self) -> tuple[dict[str, Any] | None, bool, bool]:
        """(INFO, answered, busy): INFO as redis-py parses it (None when the CF did not give it); answered when
        the CF replied at all; busy when it replied BUSY (a script past its busy-reply-threshold: INFO is refused
        until it ends). Another refusal (the CF user may not run INFO) is logged, and answered."""
        try:
            if self._client is None:
                self._client = self.connect()
            return dict(self._client.info("all")), True, False
        except redis.exceptions.BusyLoadingError:
            return None, True, False
        except redis.exceptions.ResponseError as e:
            if str(e).startswith("BUSY"):
                return None, True, True
            log.warning("the CF refused INFO: %s", e)
            return None, True, False
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
            log.debug("the CF did not answer INFO: %s", e)
            self.close()
            return None, False, False

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - a broken connection's close may fail too
                pass
        self._client = None

    def collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        info, answered, busy = self.read_info()
        up = GaugeMetricFamily(f"{PREFIX}up", "1 when the CF answered (INFO, or BUSY while a script runs)", labels=[])
        up.add_metric([], 1.0 if answered else 0.0)
        yield up
        g = GaugeMetricFamily(f"{PREFIX}busy", "1 when the CF answered BUSY: a script has run past its "
                              "busy-reply-threshold (every other call waits)", labels=[])
        g.add_metric([], 1.0 if busy else 0.0)
        yield g
        g = GaugeMetricFamily(f"{PREFIX}scrape_duration_seconds", "How long reading the CF's INFO took", labels=[])
        g.add_metric([], time.perf_counter() - t0)
        yield g
        yield from self._from_info(info or {})

    def _from_info(self, info: dict[str, Any]) -> Iterator[Metric]:
        g = GaugeMetricFamily(f"{PREFIX}info", "The CF's server: its version, role and executable (always 1)",
                              labels=["version", "role", "executable"])
        if info:
            g.add_metric([str(info.get("redis_version", "")), str(info.get("role", "")),
                          str(info.get("executable", ""))], 1.0)
        yield g
        g = GaugeMetricFamily(f"{PREFIX}start_time_seconds", "When the CF's server started, in seconds since the "
                              "epoch (a restart moves it)", labels=[])
        if "uptime_in_seconds" in info:
            g.add_metric([], round(time.time() - float(info["uptime_in_seconds"])))
        yield g
        families: dict[str, Metric] = {}
        for field, family, name, help_text in FIELDS:
            if name not in families:
                families[name] = family(f"{PREFIX}{name}", help_text, labels=[])
            if field in info and not families[name].samples:  # one field per family (an old name is an alias)
                families[name].add_metric([], float(info[field]))  # type: ignore[attr-defined]
        yield from families.values()
        for field, name, help_text in STATUS_FIELDS:
            g = GaugeMetricFamily(f"{PREFIX}{name}", help_text, labels=[])
            if field in info:
                g.add_metric([], 1.0 if info[field] == "ok" else 0.0)
            yield g
        keys_ = GaugeMetricFamily(f"{PREFIX}keys", "Keys per database", labels=["db"])
        expiring = GaugeMetricFamily(f"{PREFIX}keys_expiring", "Keys with an expiry per database", labels=["db"])
        calls = CounterMetricFamily(f"{PREFIX}command_calls", "Calls of each command (evalsha: the CF's "
                                    "operations, one script each)", labels=["command"])
        seconds = CounterMetricFamily(f"{PREFIX}command_seconds", "Time each command took in the CF (evalsha: "
                                      "its scripts' time)", labels=["command"])
        errors = CounterMetricFamily(f"{PREFIX}errors", "Error replies by their first word (BUSY: refused while "
                                     "a script ran past its threshold)", labels=["error"])
        for key, value in sorted(info.items()):
            if key.startswith("db") and isinstance(value, dict) and key[2:].isdigit():
                keys_.add_metric([key[2:]], float(value.get("keys", 0)))
                expiring.add_metric([key[2:]], float(value.get("expires", 0)))
            elif key.startswith("cmdstat_") and isinstance(value, dict):
                calls.add_metric([key[8:]], float(value.get("calls", 0)))
                seconds.add_metric([key[8:]], float(value.get("usec", 0)) / 1e6)
            elif key.startswith("errorstat_") and isinstance(value, dict):
                errors.add_metric([key[10:]], float(value.get("count", 0)))
        yield from (keys_, expiring, calls, seconds, errors)


__all__ = ["CFInfoCollector", "PREFIX"]
