"""The README's main job, `cfemu demo`, in its short mode: real processes, real CF loss, nothing lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qsg.chaos.checker import FINDING_KINDS
from qsg.demo import demo_faults


def test_the_demo_is_a_scripted_chaos_run_backup_then_cf_loss() -> None:
    faults = demo_faults(3.0)
    assert [f.kind for f in faults] == ["backup", "cf-kill"]
    assert faults[0].at < faults[1].at


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
