"""`cfbackup run --metrics-file` and `cfrestore run --metrics-file`: a run by hand, good or failed, as gauges for
node_exporter's textfile collector (each step's and phase's seconds), by the Prometheus conventions."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from backup.protocol import STEPS
from sqm.core.manager import QueueManager
from tests.support import prom
from tests.support.cfbackup import cfbackup_env as _env

S = "APP1"


def run(tmp_path: Path, redis_url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], env=_env(redis_url, tmp_path), capture_output=True,
                          text=True, timeout=300)


def value(text: str, name: str, **labels: str) -> float | None:
    found = [s.value for f in prom.families(text).values() for s in f.samples  # type: ignore[attr-defined]
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return float(found[0]) if found else None


@pytest.mark.slow
def test_a_backup_and_a_restore_by_hand_leave_their_metrics_in_a_file(
        qsg: tuple[redis.Redis, QueueManager], redis_url: str, tmp_path: Path) -> None:
    _client, qm = qsg
    conn = qm.connect()
    for i in range(30):
        conn.put("Q1", f"m{i}".encode())
    conn.commit()
    qm.stop()
    began = time.time()
    backup_prom, restore_prom = tmp_path / "backup.prom", tmp_path / "restore.prom"
    r = run(tmp_path, redis_url, "backup.cli", "run", S, "--metrics-file", str(backup_prom))
    assert r.returncode == 0, r.stderr
    text = backup_prom.read_text()
    assert value(text, "cfbackup_last_run_success", structure=S) == 1
    assert began <= value(text, "cfbackup_last_run_timestamp_seconds", structure=S) <= time.time()  # type: ignore[operator]
    assert value(text, "cfbackup_last_run_entries", structure=S) == 30
    steps = [value(text, "cfbackup_last_run_phase_duration_seconds", structure=S, phase=f"{n} {label}")
             for n, (_state, label) in enumerate(STEPS, start=1)]
    assert all(s is not None and s >= 0 for s in steps)
    assert sum(steps) <= value(text, "cfbackup_last_run_duration_seconds", structure=S)  # type: ignore[arg-type,operator]
    assert prom.convention_problems(text, ("cfbackup_",)) == []

    r = run(tmp_path, redis_url, "restore.cli", "run", S, "--mark-failed", "--metrics-file", str(restore_prom))
    assert r.returncode == 0, r.stderr
    text = restore_prom.read_text()
    assert value(text, "cfrestore_last_run_success", structure=S) == 1
    assert value(text, "cfrestore_last_run_loaded_entries", structure=S) == 30
    for phase in ("read backup", "read logs", "settle", "load"):
        assert value(text, "cfrestore_last_run_phase_duration_seconds", structure=S, phase=phase) is not None, phase
    assert prom.convention_problems(text, ("cfrestore_",)) == []
    if prom.promtool() is not None:
        assert prom.promtool_problems(text) == "" and prom.promtool_problems(backup_prom.read_text()) == ""

    # A failed run says so, in place of the good one's figures.
    r = run(tmp_path, redis_url, "backup.cli", "run", "NOPE", "--metrics-file", str(backup_prom))
    assert r.returncode != 0
    text = backup_prom.read_text()
    assert value(text, "cfbackup_last_run_success", structure="NOPE") == 0
    assert value(text, "cfbackup_last_run_entries", structure="NOPE") is None
    assert value(text, "cfbackup_last_run_success", structure=S) is None


def test_the_metrics_file_is_never_written_through_a_link_planted_beside_it(tmp_path: Path) -> None:
    """The temporary file a run's metrics are written to first cannot be guessed and is created anew: a link at the
    name prometheus_client's own writer would use (<path>.<pid>.<thread id>) is left alone, and so is its target;
    the file is 0644 for the collector, which runs as another user."""
    import os
    import threading

    from cfemu.exposition import write_last_run

    path = tmp_path / "cfbackup.prom"
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    planted = Path(f"{path}.{os.getpid()}.{threading.current_thread().ident}")
    planted.symlink_to(victim)
    write_last_run(path, "cfbackup_", S, ok=True, seconds=1.5, phases={"copy": 1.0})
    assert victim.read_text() == "keep me\n" and planted.is_symlink()
    assert value(path.read_text(), "cfbackup_last_run_success", structure=S) == 1.0
    assert path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, victim.name, planted.name])
