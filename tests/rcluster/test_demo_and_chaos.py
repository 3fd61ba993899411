"""The demo and the chaos suite against a 3-master Redis Cluster as the CF (``--redis-cluster 3``): real nodes,
real ``sqm run`` members, real faults. The long runs are marked ``rcluster`` (make rcluster-test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qsg.chaos.faults import CF_LINK_KINDS, CLUSTER_SHORT_KINDS, KINDS, schedule


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qsg.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_fault_that_needs_a_cf_proxy_is_refused_for_a_redis_cluster_cf(tmp_path: Path) -> None:
    out = cli("chaos", "run", "--faults", "cf-link-cut,sqm-kill", "--redis-cluster", "3", "--dir", str(tmp_path))
    assert out.returncode != 0 and "cf-link-cut" in out.stderr and "proxy" in out.stderr
    assert not (tmp_path / "history.jsonl").exists()


def test_the_cluster_kinds() -> None:
    assert "cluster-node-kill" in KINDS and not set(CLUSTER_SHORT_KINDS) & set(CF_LINK_KINDS)
    specs = [f for seed in range(1, 30) for f in schedule(seed, ("cluster-node-kill",), 25, ["QM1"], lease_ms=3000)]
    assert {f.params["structure"] for f in specs} == {"APP1", "APP2"}  # the seed picks whose master dies


def summary(out: subprocess.CompletedProcess[str], tmp_path: Path) -> dict[str, object]:
    assert out.stdout, out.stderr[-3000:]
    s: dict[str, object] = json.loads(out.stdout)
    report = tmp_path / "report.md"
    assert out.returncode == 0, (s.get("findings"), s.get("fault_errors"),
                                 report.read_text()[-3000:] if report.exists() else "")
    return s


@pytest.mark.rcluster
def test_the_demo_loses_nothing_on_a_redis_cluster_cf(tmp_path: Path) -> None:
    out = cli("demo", "--quick", "--redis-cluster", "3", "--json", "--dir", str(tmp_path))
    r = json.loads(out.stdout)
    assert out.returncode == 0, r
    assert r["commits_after_restore"] > 0 and r["restore_s"] is not None and not r["fault_errors"]


@pytest.mark.rcluster
@pytest.mark.parametrize("seed", [1, 2])
def test_chaos_short_run_finds_nothing_on_a_redis_cluster_cf(tmp_path: Path, seed: int) -> None:
    s = summary(cli("chaos", "run", "--seed", str(seed), "--duration", "22", "--faults", "short",
                    "--redis-cluster", "3", "--json", "--dir", str(tmp_path)), tmp_path)
    assert s["kinds"] == list(CLUSTER_SHORT_KINDS)
    assert all(v == 0 for v in s["findings"].values())  # type: ignore[attr-defined]


@pytest.mark.rcluster
def test_chaos_node_kill_and_whole_cluster_kill_find_nothing(tmp_path: Path) -> None:
    """Seed 3 schedules a cluster-node-kill (APP2's master, which holds the admin structure too) and a cf-kill of
    every node: RECAUTO restores the first, the operator's restore the second; nothing lost or out of order."""
    s = summary(cli("chaos", "run", "--seed", "3", "--duration", "22", "--faults", "cf-kill,cluster-node-kill",
                    "--redis-cluster", "3", "--json", "--dir", str(tmp_path)), tmp_path)
    faults = {f["kind"]: f for f in s["faults"]}  # type: ignore[attr-defined]
    node_kill = faults["cluster-node-kill"]
    assert node_kill["service_s"] is not None and node_kill["timings"]["recauto_s"] > 0
    assert node_kill["timings"]["cf_restarts"] == 1 and node_kill["timings"]["structures"]
    assert faults["cf-kill"]["service_s"] is not None
    assert all(v == 0 for v in s["findings"].values())  # type: ignore[attr-defined]
