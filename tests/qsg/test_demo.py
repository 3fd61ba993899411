"""The README's main job, `cfemu demo`, in its short mode: real processes, real CF loss, nothing lost."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qsg.chaos.checker import FINDING_KINDS
from qsg.demo import demo_faults


def test_the_demo_is_a_scripted_chaos_run_backup_then_cf_loss() -> None:
    faults = demo_faults(3.0)
    assert [f.kind for f in faults] == ["backup", "cf-kill"]
    assert faults[0].at < faults[1].at


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_quick_loses_nothing(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "qsg.demo", "--quick", "--json", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    r = json.loads(out.stdout)
    assert out.returncode == 0, (r["fault_errors"], r["findings"], out.stderr[-3000:])
    assert r["committed_uows"] > 50 and r["operations"] > 100
    assert r["backup_entries"] > 0 and r["restore_s"] is not None
    assert r["commits_after_restore"] > 0, "the group must keep working on the restored structure"
    assert not r["fault_errors"]
    for finding in FINDING_KINDS:
        assert r[finding] == 0, (finding, r["findings"])
    assert (tmp_path / "history.jsonl").exists() and (tmp_path / "summary.json").exists()


# The demo's process with every restore plan failing as DuckDB fails out of memory.
FAILING_PLAN = """
import sys, duckdb
from restore.engine_columnar import ColumnarEngine
def plan(*args, **kwargs):
    raise duckdb.OutOfMemoryException("could not allocate block of size 256.0 KiB (injected)")
ColumnarEngine.plan = plan
from qsg.demo import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_demo_whose_restore_fails_ends_and_says_so(tmp_path: Path) -> None:
    """The restore after the CF loss fails: the structure stays FAILED, no member can serve its queues, and the demo
    ends at once with the failure (it used to wait for good on a service that could never come)."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", FAILING_PLAN, "--quick", "--json", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t0
    r = json.loads(out.stdout)
    assert out.returncode == 1, out.stderr[-3000:]
    assert len(r["fault_errors"]) == 1
    error = r["fault_errors"][0]
    assert "cf-kill: restore of APP1 failed: OutOfMemoryException" in error and "injected" in error
    # (the restores stop at the first that fails: APP2, restored after APP1, stays FAILED too)
    assert "structures left FAILED: APP1, APP2" in error
    assert r["stopped"] == "structures left FAILED (their restore failed): APP1, APP2"
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert any(e.get("phase") == "restore ended: failed" for e in history)
    assert any(e.get("what") == "run stopped" for e in history)
    assert took < 200
