"""A member's /metrics as Prometheus reads it: names by the conventions (the client library's parser always,
promtool's linter where it is installed), latency histograms that count what ran, a backup's end as a timestamp,
an LRSN exact to the microsecond, the _info metric."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest

from cfemu import keys
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis
from cfemu.exposition import package_version
from cfemu.latency import FAST_BUCKETS, Latencies, Latency, PhaseTimes
from sqm.core.manager import QueueManager
from sqm.service import metrics
from sqm.service.client import Client
from tests.support import prom
from tests.support.group import define_group
from tests.support.service_proc import TOKEN, ServerProc, start_server


@pytest.fixture(scope="module")
def member(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server on a CF of its own for the module (its tests count deltas, never absolute figures)."""
    cf = EmbeddedRedis(data_dir=tmp_path_factory.mktemp("cf")).start()
    try:
        define_group(cf.url, queues=("Q1",))
        srv = start_server(cf.url, tmp_path_factory.mktemp("member"), "QM1", "--token", TOKEN)
        yield srv
        assert srv.stop() == 0, srv.log_text()
    finally:
        cf.stop()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` with (at least) ``labels``."""
    found = [s.value for f in prom.families(text).values() for s in f.samples  # type: ignore[attr-defined]
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return float(found[0])


def test_member_metrics_follow_the_conventions(member: ServerProc) -> None:
    with Client(member.endpoint, token=TOKEN) as c:
        c.put("Q1", b"x")
        c.commit()
        c.get("Q1")
        c.commit()
    text = prom.scrape(member.metrics_port)
    assert prom.convention_problems(text, ("sqm_",)) == []
    names = prom.exposed_names(text)
    for name in ("sqm_info", "sqm_operation_duration_seconds_bucket", "sqm_cf_call_duration_seconds_count",
                 "sqm_log_fsync_duration_seconds_sum", "sqm_restore_phase_duration_seconds_bucket",
                 "sqm_last_backup_timestamp_seconds", "process_start_time_seconds"):
        assert name in names, name
    assert not [n for n in names if "age_seconds" in n]


@pytest.mark.skipif(prom.promtool() is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_member_metrics(member: ServerProc) -> None:
    with Client(member.endpoint, token=TOKEN) as c:
        c.put("Q1", b"x")
        c.commit()
    assert prom.promtool_problems(prom.scrape(member.metrics_port)) == ""


def test_each_operation_is_timed_and_fsyncs_and_cf_calls_too(member: ServerProc) -> None:
    before = prom.scrape(member.metrics_port)
    puts_before = sample(before, "sqm_operation_duration_seconds_count", op="put") \
        if 'op="put"' in before else 0.0
    with Client(member.endpoint, token=TOKEN) as c:
        for i in range(7):
            c.put("Q1", f"m{i}".encode())
        c.commit()
        with pytest.raises(Exception):  # noqa: B017 - any refusal: a failed operation is timed too
            c.put("NO.SUCH.QUEUE", b"x")
    text = prom.scrape(member.metrics_port)
    assert sample(text, "sqm_operation_duration_seconds_count", op="put") == puts_before + 8
    assert sample(text, "sqm_operation_duration_seconds_count", op="commit") >= 1
    assert sample(text, "sqm_operation_duration_seconds_bucket", op="put", le="+Inf") == puts_before + 8
    assert sample(text, "sqm_operation_duration_seconds_sum", op="put") > 0
    # One observation per fsync: the histogram counts what the counter counts.
    assert sample(text, "sqm_log_fsync_duration_seconds_count") == sample(text, "sqm_fsyncs_total") > 0
    assert sample(text, "sqm_cf_call_duration_seconds_count") >= 8
    timed_ops = {s.labels["op"] for f in prom.families(text).values() for s in f.samples  # type: ignore[attr-defined]
                 if s.name == "sqm_operation_duration_seconds_count"}
    assert {"put", "commit"} <= timed_ops and "subscribe" not in timed_ops  # only the operations that ran


def test_the_last_backup_is_a_timestamp_from_the_catalog(qm: QueueManager) -> None:
    registry = metrics.make_registry(qm)
    assert "sqm_last_backup_timestamp_seconds{" not in generate_latest(registry).decode()
    admin = Admin(qm.redis)
    admin.record_backup("APP1", {"id": "B1", "start_lrsn": 1, "ended_at": "2020-01-01T00:00:00+00:00"})
    admin.record_backup("APP1", {"id": "B2", "start_lrsn": 2, "ended_at": "2020-01-01T00:01:40+00:00"})
    qm.redis.hset(keys.meta("APP1"), "last_backup", "B1")  # the one the structure names, not the newest
    text = generate_latest(registry).decode()
    assert sample(text, "sqm_last_backup_timestamp_seconds", structure="APP1") == 1577836800.0
    assert metrics.last_backup_age(admin, "APP1", now=1577836800.0 + 50) == pytest.approx(50)


def test_the_lrsn_is_exact_and_left_out_where_a_float_would_round_it(qm: QueueManager) -> None:
    registry = metrics.make_registry(qm)
    conn = qm.connect()
    conn.put("Q1", b"x")
    conn.commit()
    text = generate_latest(registry).decode()
    exposed = sample(text, "sqm_lrsn", qmgr="QM1")
    assert exposed == int(exposed) == qm.clock.last  # every microsecond of it
    qm.clock.observe(metrics.LRSN_EXACT_BELOW + 1)  # a float64 would round it: no sample, rather than a wrong one
    text = generate_latest(registry).decode()
    assert "# TYPE sqm_lrsn gauge" in text and "sqm_lrsn{" not in text


def test_the_info_metric_names_the_version(qm: QueueManager) -> None:
    text = generate_latest(metrics.make_registry(qm)).decode()
    assert sample(text, "sqm_info", qmgr="QM1", version=package_version()) == 1.0
    assert package_version() != "unknown"


def test_a_latency_counts_each_observation_into_its_bucket() -> None:
    lat = Latency((0.1, 1.0))
    for s in (0.05, 0.1, 0.5, 2.0):
        lat.observe(s)
    snap = lat.snapshot()
    assert snap.buckets == ((0.1, 2), (1.0, 3), (float("inf"), 4))  # le: 0.1 counts in the 0.1 bucket
    assert snap.count == 4 and snap.sum == pytest.approx(2.65)
    with pytest.raises(ValueError, match="ascending"):
        Latency((1.0, 0.1))


def test_phase_times_time_each_phase_until_the_next() -> None:
    seen: list[str] = []
    phases = Latencies(FAST_BUCKETS)
    timer = PhaseTimes(phases, lambda p, d, t: seen.append(p))
    timer("read backup", 0, None)
    time.sleep(0.02)
    timer("read backup", 5, 5)
    timer("settle", 0, 1)
    timer.finish()
    timer.finish()  # once only
    got = {k: v.snapshot() for k, v in phases.items()}
    assert set(got) == {"read backup", "settle"} and [s.count for s in got.values()] == [1, 1]
    assert got["read backup"].sum >= 0.02
    assert seen == ["read backup", "read backup", "settle"]
