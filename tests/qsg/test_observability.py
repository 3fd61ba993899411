"""Observability of a live group as `cfemu cluster up` starts it (detached: its members, its backup scheduler, its
supervisor serving the CF's INFO): every /metrics endpoint by Prometheus's conventions (the client library's parser
always, promtool where installed); the alert rules and the Grafana dashboard shipped in deploy/ checked by promtool
and, always, against the metric names the live group exposes; every alert named in the runbook; the supervisor's
metrics counting a member it restarted after a SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from qsg.local_group import LocalGroup
from sqm.service.client import Client
from tests.support import prom

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "qsg-dashboard.json"
RUNBOOK = ROOT / "docs" / "runbook.md"
needs_promtool = pytest.mark.skipif(prom.promtool() is None,
                                    reason="promtool is not installed (Debian: apt-get install prometheus)")
# Grafana's own variables, as a query runs them (the dashboard's template variables select every value).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "1m", "$qmgr": ".*",
                     "$structure": ".*"}


def rule_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def dashboard_exprs() -> dict[str, str]:
    """Every query of the dashboard (its panels' and its template variables'), Grafana's variables filled in."""
    doc = json.loads(DASHBOARD.read_text())
    found: dict[str, str] = {}
    for panel in doc["panels"]:
        for t in panel.get("targets", []):
            found[f"panel {panel['title']!r} {t['refId']}"] = t["expr"]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", var["query"]["query"])
            assert m, var["query"]
            found[f"variable {var['name']}"] = m.group(1)
    for key, expr in found.items():
        for name, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, (key, expr)
        found[key] = expr
    return found


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGroup]:
    c = LocalGroup.up(tmp_path_factory.mktemp("obs") / "c", managers=2, backup_interval=1.0, backup_keep=2,
                      backup_keep_age="1h", lease_ms=2000, detach=True, restart_cf=True, restart_members=True)
    try:
        with Client([(h, p) for _, h, p in c.endpoints], token=c.token, client_name="obs") as cl:
            for i in range(10):
                cl.put("Q1", f"m{i}".encode())
            cl.commit()
            cl.get("Q1")
            cl.commit()
        yield c
    finally:
        c.down()


def endpoints(c: LocalGroup) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Each process's metrics port and the namespaces of its own families."""
    found = {m: (int(c.manager(m)["metrics_port"]), ("sqm_",)) for m in c.names}
    found["scheduler"] = (int(c.state["scheduler"]["metrics_port"]), ("cfbackup_scheduler_",))
    found["supervisor"] = (int(c.state["cf_supervisor"]["metrics_port"]), ("cfemu_supervisor_", "cfemu_cf_"))
    return found


def scrape_all(c: LocalGroup) -> dict[str, str]:
    texts: dict[str, str] = {}
    deadline = time.monotonic() + 60
    for name, (port, _) in endpoints(c).items():
        while True:
            try:
                texts[name] = prom.scrape(port)
                break
            except OSError:  # a process still starting
                assert time.monotonic() < deadline, f"{name}'s /metrics on {port} never answered"
                time.sleep(0.2)
    return texts


def value(text: str, name: str, **labels: str) -> float | None:
    found = [s.value for f in prom.families(text).values() for s in f.samples  # type: ignore[attr-defined]
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return float(found[0]) if found else None


def wait_for(c: LocalGroup, what: str, check: Any, timeout: float = 90) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        texts = scrape_all(c)
        if check(texts):
            return texts
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.3)


@pytest.mark.slow
def test_every_endpoint_of_a_live_group_follows_the_conventions(group: LocalGroup) -> None:
    # The member's page is collected at most once a second (--metrics-cache): it may show the backup a scrape later
    texts = wait_for(group, "a good scheduled backup, seen by the member", lambda t: (value(
        t["scheduler"], "cfbackup_scheduler_backups_total", result="ok") or 0) >= 1 and value(
        t["QM1"], "sqm_last_backup_timestamp_seconds", structure="APP1") is not None)
    for name, (_, prefixes) in endpoints(group).items():
        assert prom.convention_problems(texts[name], prefixes) == [], name
        if prom.promtool() is not None:  # Prometheus's linter too where installed (below: alone, skipped without)
            assert prom.promtool_problems(texts[name]) == "", name
    sup = texts["supervisor"]
    assert value(sup, "cfemu_cf_up") == 1 and value(sup, "cfemu_cf_keys", db="0")
    assert value(sup, "cfemu_supervisor_member_up", member="QM1") == 1
    assert value(sup, "cfemu_supervisor_cf_ping_duration_seconds_count") > 0  # type: ignore[operator]
    assert value(texts["QM1"], "sqm_last_backup_timestamp_seconds", structure="APP1") == pytest.approx(
        value(texts["scheduler"], "cfbackup_scheduler_last_success_timestamp_seconds", structure="APP1"), abs=30)
    rows = {r["process"]: r for r in group.status()["processes"]}
    assert rows["backup-scheduler"]["metrics"] == f"127.0.0.1:{group.state['scheduler']['metrics_port']}"
    assert rows["cf-supervisor"]["metrics"] == f"127.0.0.1:{group.state['cf_supervisor']['metrics_port']}"


@pytest.mark.slow
def test_the_rules_and_the_dashboard_refer_only_to_metrics_the_group_exposes(group: LocalGroup) -> None:
    exposed: set[str] = set()
    for text in scrape_all(group).values():
        exposed |= prom.exposed_names(text)
    queries = {**{f"alert {k}": v for k, v in rule_exprs().items()}, **dashboard_exprs()}
    assert len(queries) > 50
    unknown = {key: sorted(prom.promql_metric_names(q) - exposed) for key, q in queries.items()}
    assert {k: v for k, v in unknown.items() if v} == {}
    assert all(prom.promql_metric_names(q) for q in queries.values())  # the parser found each query's names


@pytest.mark.slow
def test_the_supervisor_counts_the_restart_of_a_killed_member(group: LocalGroup) -> None:
    pid = int(group.manager("QM2")["pid"])
    os.kill(pid, signal.SIGKILL)
    texts = wait_for(group, "QM2 restarted and up", lambda t: value(
        t["supervisor"], "cfemu_supervisor_restarts_total", process="QM2", cause="killed") == 1 and value(
        t["supervisor"], "cfemu_supervisor_member_up", member="QM2") == 1, timeout=120)
    t = value(texts["supervisor"], "cfemu_supervisor_last_restart_timestamp_seconds", process="QM2")
    assert t is not None and time.time() - 120 < t <= time.time()
    with group.state_lock():  # cluster.json as the supervisor process rewrote it
        group.refresh()
    assert int(group.manager("QM2")["pid"]) != pid and group.manager("QM2")["restarts"] == 1


def test_the_scheduler_runs_with_the_groups_retention(group: LocalGroup) -> None:
    """cfemu cluster up --backup-keep N --backup-keep-age AGE reach the scheduler the group starts."""
    pid = group.state["scheduler"]["pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--keep") + 1] == b"2" and argv[argv.index(b"--keep-age") + 1] == b"1h", argv


def test_cluster_up_refuses_a_bad_backup_keep_age_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "qsg.cli", "cluster", "up", "--dir", str(tmp_path / "c"),
                           "--backup-keep-age", "soon"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--backup-keep-age" in done.stderr, done.stderr
    assert not (tmp_path / "c").exists()  # nothing started


def test_the_promql_reader_finds_metric_names_and_nothing_else() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, qmgr) (rate(sqm_cf_call_duration_seconds_bucket{qmgr=~"QM.*",'
            'le!="1e3"}[5m]))) > 0.05 and on (qmgr) time() - sqm_last_backup_timestamp_seconds offset 1h > 3600 '
            'or max_over_time(cfemu_cf_busy[2m:15s]) == 1')
    assert prom.promql_metric_names(expr) == {"sqm_cf_call_duration_seconds_bucket",
                                              "sqm_last_backup_timestamp_seconds", "cfemu_cf_busy"}


def test_the_dashboard_is_a_grafana_model_with_a_query_in_every_panel() -> None:
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in doc["panels"] if p["type"] != "row"]
    assert graphs and all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in graphs)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in graphs)  # the datasource the user picks


def test_every_alert_is_named_in_the_runbook() -> None:
    runbook = RUNBOOK.read_text()
    missing = [name for name in rule_exprs() if f"`{name}`" not in runbook]
    assert missing == []


@needs_promtool
def test_promtool_checks_the_rules_their_unit_tests_and_the_config() -> None:
    for cmd in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)], ["check", "config", str(CONFIG)]):
        r = subprocess.run([str(prom.promtool()), *cmd], capture_output=True, text=True, timeout=120,
                           cwd=RULES.parent)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query as the expression of a recording rule: promtool's PromQL parser checks it."""
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": expr}
                                                        for i, expr in enumerate(dashboard_exprs().values())]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    r = subprocess.run([str(prom.promtool()), "check", "rules", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
