"""The README's main job, `cfemu demo`, in its short mode: real processes, real CF loss, nothing lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_quick_loses_nothing(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "qsg.demo", "--quick", "--json", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["committed"] > 100 and r["consumed"] > 0
    assert r["restored"] > 0 and r["backup_entries"] > 0
    assert r["commits_after_restore"] > 0, "the group must keep working on the restored structure"
    for finding in ("lost", "duplicated", "phantom", "corrupted", "resurrected"):
        assert r[finding] == 0, (finding, r["findings"])
