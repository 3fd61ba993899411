"""bench/bench_restore.py with the spark engine: the whole restore (plan, load, raw writes) runs on a Spark plan,
and its peak memory is that of the whole process tree (the driver, Spark's JVM and its Python workers), which the
driver's own peak leaves out. Run from a copy of bench/ so that its result lines stay out of the tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("spark")]


@pytest.mark.deep
@pytest.mark.timeout(600)
def test_the_spark_engine_restores_and_its_jvm_counts_in_the_peak(tmp_path: Path) -> None:
    copy = tmp_path / "bench"
    shutil.copytree(REPO / "bench", copy, ignore=shutil.ignore_patterns("results", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    run = subprocess.run([sys.executable, str(copy / "bench_restore.py"), "--sizes", "2000:4000",
                          "--skip-calibration", "--engines", "spark", "columnar", "--spark-master", "local[1]",
                          "--dir", str(tmp_path / "work")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = (copy / "results" / "restore.jsonl").read_text().splitlines()
    runs = {r["engine"]: r for r in (json.loads(line)["runs"][0] for line in lines)}
    spark, columnar = runs["spark"], runs["columnar"]
    for r in (spark, columnar):
        assert r["problems"] == [] and r["loaded"] == r["messages"] > 0
        assert r["raw_written"] == r["messages"]  # the raw baseline wrote the same data (a spill of its own)
    # Spark's JVM alone takes more than the driver's Python: the tree's peak must see it.
    assert spark["tree_peak_rss_mib"] > spark["peak_rss_mib"] + 100
    assert spark["plan_tree_cpu_s"] > spark["plan_cpu_s"]
    assert columnar["tree_peak_rss_mib"] >= 0.5 * columnar["peak_rss_mib"]
