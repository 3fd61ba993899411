"""The backup scheduler's /metrics (cfbackup schedule --metrics-port), scraped from the real process while it
backs up a real structure: what it ran by result (a backup refused because another runs is ``busy``), each good
backup's and each copy step's duration, the last good backup as a timestamp, what retention removed; by the
Prometheus conventions (the parser, and promtool where installed)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from backup.protocol import STEPS
from cfemu.procs import free_port
from sqm.core.manager import QueueManager
from tests.backup.test_retention import _hold_mark
from tests.support import prom
from tests.support.cfbackup import cfbackup_env as _env

S = "APP1"


def _value(text: str, name: str, **labels: str) -> float:
    found = [s.value for f in prom.families(text).values() for s in f.samples  # type: ignore[attr-defined]
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return float(found[0]) if found else 0.0


@pytest.mark.slow
def test_the_scheduler_exports_what_it_ran_and_how_long_each_step_took(
        qsg: tuple[redis.Redis, QueueManager], redis_url: str, tmp_path: Path) -> None:
    client, qm = qsg
    conn = qm.connect()
    for i in range(20):
        conn.put("Q1", f"m{i}".encode())
    conn.commit()
    qm.stop()
    holder = _hold_mark(client, 6.0)  # an operator's backup runs: the scheduler's first ones are refused (busy)
    port = free_port()
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "backup.cli", "schedule", "--interval", "0.2", "--keep", "2",
                             "--structure", S, "--metrics-port", str(port)], env=_env(redis_url, tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = ""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                text = prom.scrape(port)
            except OSError:  # not listening yet
                text = ""
            if _value(text, "cfbackup_scheduler_backups_total", structure=S, result="ok") >= 4 and \
                    _value(text, "cfbackup_scheduler_retention_removed_backups_total", structure=S) >= 1:
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        holder.join(timeout=10)
    ok = _value(text, "cfbackup_scheduler_backups_total", structure=S, result="ok")
    assert ok >= 4, out
    assert _value(text, "cfbackup_scheduler_backups_total", structure=S, result="busy") >= 1, out
    assert _value(text, "cfbackup_scheduler_backups_total", structure=S, result="failed") == 0, out
    # One observation per good backup, and per good backup one per copy step (the manifest's seconds).
    assert _value(text, "cfbackup_scheduler_backup_duration_seconds_count", structure=S) == ok
    for number, (_state, label) in enumerate(STEPS, start=1):
        assert _value(text, "cfbackup_scheduler_backup_step_duration_seconds_count", step=f"{number} {label}") == ok
    assert _value(text, "cfbackup_scheduler_backup_duration_seconds_sum", structure=S) > \
        _value(text, "cfbackup_scheduler_backup_step_duration_seconds_sum", step=f"3 {STEPS[2][1]}") > 0
    assert started <= _value(text, "cfbackup_scheduler_last_success_timestamp_seconds", structure=S) <= time.time()
    assert _value(text, "cfbackup_scheduler_last_backup_bytes", structure=S) >= 20 * 2
    assert _value(text, "cfbackup_scheduler_info", keep="2") == 1
    assert prom.convention_problems(text, ("cfbackup_scheduler_",)) == []
    if prom.promtool() is not None:  # the linter too, where installed (tests/sqm/test_metrics.py: always run)
        assert prom.promtool_problems(text) == ""
