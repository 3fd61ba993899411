"""The CF's INFO exporter against a real redis-server: keys, memory, scripts' time, BUSY while a script runs past
its threshold, persistence, and a CF that does not answer (up 0, the scrape still served)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import redis
from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry

from cfemu.cf_exporter import CFInfoCollector
from cfemu.embedded import EmbeddedRedis
from cfemu.exposition import exposure_warning
from tests.support import prom


def scrape(collector: CFInfoCollector) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


def value(text: str, name: str, **labels: str) -> float | None:
    found = [s.value for f in prom.families(text).values() for s in f.samples  # type: ignore[attr-defined]
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return float(found[0]) if found else None


def test_the_cf_exporter_reads_keys_memory_scripts_and_persistence(fresh_redis: EmbeddedRedis) -> None:
    client = fresh_redis.client()
    client.mset({f"k{i}": "v" for i in range(25)})
    client.set("expiring", "v", ex=3600)
    client.eval("return redis.call('get', KEYS[1])", 1, "k1")
    collector = CFInfoCollector(lambda: fresh_redis.client(socket_timeout=2))
    text = scrape(collector)
    assert value(text, "cfemu_cf_up") == 1 and value(text, "cfemu_cf_busy") == 0
    assert value(text, "cfemu_cf_keys", db="0") == 26 and value(text, "cfemu_cf_keys_expiring", db="0") == 1
    assert value(text, "cfemu_cf_memory_used_bytes") > 100_000  # type: ignore[operator]
    assert value(text, "cfemu_cf_command_calls_total", command="eval") == 1
    assert value(text, "cfemu_cf_command_seconds_total", command="eval") > 0  # type: ignore[operator]
    assert value(text, "cfemu_cf_connected_clients") >= 2  # type: ignore[operator]
    version = client.info("server")["redis_version"]
    assert value(text, "cfemu_cf_info", version=version, role="master") == 1
    started = value(text, "cfemu_cf_start_time_seconds")
    assert started is not None and time.time() - 600 < started <= time.time() + 1
    assert value(text, "cfemu_cf_rdb_last_save_timestamp_seconds") is not None
    assert value(text, "cfemu_cf_rdb_changes_since_last_save") >= 26  # type: ignore[operator]
    assert prom.convention_problems(text, ("cfemu_cf_",)) == []
    if prom.promtool() is not None:
        assert prom.promtool_problems(text) == ""
    client.close()


def test_a_script_past_its_threshold_shows_busy_then_counts_the_busy_replies(fresh_redis: EmbeddedRedis) -> None:
    admin = fresh_redis.client()
    threshold = "busy-reply-threshold" if int(admin.info("server")["redis_version"].split(".")[0]) >= 7 \
        else "lua-time-limit"
    admin.config_set(threshold, 100)  # milliseconds
    spin = "local t0 = redis.call('time') repeat local t = redis.call('time') until (t[1] - t0[1]) * 1e6 + " \
           "(t[2] - t0[2]) > 1500000 return 1"
    runner = threading.Thread(target=lambda: fresh_redis.client(socket_timeout=30).eval(spin, 0), daemon=True)
    collector = CFInfoCollector(lambda: fresh_redis.client(socket_timeout=2))
    runner.start()
    busy = None
    deadline = time.monotonic() + 20
    while runner.is_alive() and time.monotonic() < deadline:
        text = scrape(collector)
        if value(text, "cfemu_cf_busy") == 1:
            busy = text
            break
        time.sleep(0.05)
    runner.join(timeout=30)
    assert busy is not None, "the exporter never saw the CF BUSY"
    assert value(busy, "cfemu_cf_up") == 1  # BUSY is an answer: the CF is not down
    after = scrape(collector)
    assert value(after, "cfemu_cf_busy") == 0
    assert value(after, "cfemu_cf_errors_total", error="BUSY") >= 1  # type: ignore[operator]


def test_a_cf_that_does_not_answer_is_down_and_the_scrape_still_served(
        redis_factory: object) -> None:
    srv: EmbeddedRedis = redis_factory()  # type: ignore[operator]
    collector = CFInfoCollector(lambda: srv.client(socket_timeout=1, socket_connect_timeout=1))
    assert value(scrape(collector), "cfemu_cf_up") == 1
    srv.kill()
    t0 = time.monotonic()
    text = scrape(collector)
    assert time.monotonic() - t0 < 10
    assert value(text, "cfemu_cf_up") == 0 and value(text, "cfemu_cf_keys", db="0") is None
    assert "# TYPE cfemu_cf_memory_used_bytes gauge" in text  # the names stay, without samples


def test_a_refused_info_is_an_answer_without_figures() -> None:
    class Refusing:
        def info(self, section: str) -> dict[str, str]:
            raise redis.exceptions.ResponseError("NOPERM this user has no permissions to run the 'info' command")

        def close(self) -> None:
            pass

    text = scrape(CFInfoCollector(lambda: Refusing()))  # type: ignore[arg-type,return-value]
    assert value(text, "cfemu_cf_up") == 1 and value(text, "cfemu_cf_busy") == 0
    assert value(text, "cfemu_cf_keys", db="0") is None


def test_cfemu_exporter_serves_the_cf_metrics_until_sigterm(fresh_redis: EmbeddedRedis) -> None:
    fresh_redis.client().set("k", "v")
    proc = subprocess.Popen([sys.executable, "-m", "qsg.cli", "exporter", "--port", "0", "--json",
                             "--redis-url", fresh_redis.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        printed = proc.stdout.readline()
        while not printed.rstrip().endswith(b"}"):  # one JSON document, maybe over several lines
            printed += proc.stdout.readline()
        where = json.loads(printed)
        with urllib.request.urlopen(where["metrics"], timeout=15) as r:
            text = r.read().decode()
        assert value(text, "cfemu_cf_up") == 1 and value(text, "cfemu_cf_keys", db="0") == 1
        assert value(text, "process_start_time_seconds") is not None
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    assert b"no authentication" not in err  # loopback: nothing to warn of


def test_cfemu_exporter_on_a_network_address_warns_that_its_metrics_have_no_authentication(
        fresh_redis: EmbeddedRedis) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "qsg.cli", "exporter", "--host", "0.0.0.0", "--port", "0",
                             "--redis-url", fresh_redis.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None
        warning = proc.stderr.readline().decode()  # printed once bound, before it serves
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert warning.startswith("warning: the metrics on 0.0.0.0:") and "have no authentication" in warning, (
        warning + err.decode())
    assert exposure_warning("127.0.0.1", 9121) is None and exposure_warning("localhost", 9121) is None
