"""A restore killed (SIGKILL) in the middle of its load, then run again, gives the same structure as a clean run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import redis

from backup.run import run_backup
from cfemu import keys
from cfemu.admin import Admin
from restore.run import RESTORE_MEMBER, run_restore
from sqm.failpoints import ENV_VAR as FAILPOINTS
from sqm.log import LogReader
from tests.restore.test_restore import VOLATILE, S, snapshot
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

MESSAGES = 2500  # three load batches of 1000


def cfrestore(url: str, logs: Path, backups: Path, *args: str, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "restore.cli", "run", S, "--redis-url", url, "--backup-dir", str(backups),
           "--log-root", str(logs), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_restore_killed_mid_load_resumes_to_the_clean_result(redis_url: str, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client: redis.Redis = define_group(redis_url)
    qm1, qm2 = (start_qm(redis_url, logs, name, background=False) for name in ("QM1", "QM2"))
    a, b = qm1.connect(), qm2.connect()
    for i in range(MESSAGES):
        a.put("Q1" if i % 2 else "Q2", b"x" * 100 + str(i).encode(), priority=i % 10)
    a.commit()
    backup_id = run_backup(client, S, backups)["id"]
    for _ in range(10):
        b.get("Q1")
    b.commit()
    inflight = qm2.connect()
    inflight.get("Q2")
    b.put("Q1", b"forces QM2's log")
    b.commit()
    lose_cf(client)  # the CF is lost

    crashed = cfrestore(redis_url, logs, backups, env={FAILPOINTS: "restore-load-batch=1"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert Admin(client).state(S) == "RECOVERING"
    assert client.hlen(keys.entries(S)) == 1000  # one batch made it
    decided = [r for _, r in LogReader(logs / RESTORE_MEMBER).records()]
    assert [(r["k"], r["o"], r["by"]) for r in decided] == [("RECOVERY", "B", "restore")]

    resumed = cfrestore(redis_url, logs, backups, "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert '"decisions_logged": 0' in resumed.stdout  # the crashed run's decision stands
    assert Admin(client).state(S) == "ACTIVE"
    after_resume = snapshot(client, volatile=VOLATILE)
    assert client.hlen(keys.entries(S)) == MESSAGES - 10 + 1

    Admin(client).set_state(S, "FAILED")
    # A clean run from the same backup, to the end (without --backup it would start at the resumed run's
    # restore point, which holds the same result).
    run_restore(client, S, backup_root=backups, log_root=logs, backup_id=backup_id)
    assert snapshot(client, volatile=VOLATILE) == after_resume
    for qm in (qm1, qm2):
        qm.stop()
