"""A restore killed (SIGKILL) in the middle of its load, then run again, gives the same structure as a clean run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from backup.catalog import INCOMPLETE, list_backups
from backup.points import UNFINISHED_MARK
from backup.run import run_backup
from cfemu import keys
from cfemu.admin import Admin
from restore.run import RESTORE_MEMBER, run_restore
from sqm.core.failpoints import ENV_VAR as FAILPOINTS
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


# Put in the environment of the restore a test kills: its workers inherit it.
RUN_MARK = "RESTORE_CRASH_TEST_RUN"


def _load_workers(run: str) -> set[int]:
    """The restore worker processes of the restore started with RUN_MARK=run (a restore killed must leave none);
    not those of other restores that run on the machine meanwhile (other tests, other workers of the suite)."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and b"restore.workers" in (proc / "cmdline").read_bytes()
                    and f"{RUN_MARK}={run}".encode() in (proc / "environ").read_bytes().split(b"\0")):
                found.add(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("engine", [(), ("--engine", "local", "--memory-limit", "64KiB", "--workers", "2")],
                         ids=["in-memory", "partitioned-with-workers"])
def test_restore_killed_mid_load_resumes_to_the_clean_result(redis_url: str, tmp_path: Path,
                                                             engine: tuple[str, ...]) -> None:
    """Partitioned with workers, the load's batches are prepared in a worker process: it ends with the restore."""
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

    run = str(tmp_path)
    crashed = cfrestore(redis_url, logs, backups, *engine, env={FAILPOINTS: "restore-load-batch=1", RUN_MARK: run})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    deadline = time.monotonic() + 10
    while _load_workers(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _load_workers(run) == set()
    assert Admin(client).state(S) == "RECOVERING"
    # One batch made it; the next, in flight when the restore was killed (bulk.LOAD_DEPTH), is in whole or not at all.
    assert client.hlen(keys.entries(S)) in (1000, 2000)
    decided = [r for _, r in LogReader(logs / RESTORE_MEMBER).records()]
    assert [(r["k"], r["o"], r["by"]) for r in decided] == [("RECOVERY", "B", "restore")]

    # The crashed run's restore point, begun with its load, is unfinished: the catalog shows it incomplete, and
    # the next run removes it (it held every message loaded so far).
    unfinished = [b for b in list_backups(backups, S) if b.state == INCOMPLETE]
    assert len(unfinished) == 1 and (unfinished[0].path / UNFINISHED_MARK).exists()
    resumed = cfrestore(redis_url, logs, backups, "--json", *engine)
    assert resumed.returncode == 0, resumed.stderr
    assert '"decisions_logged": 0' in resumed.stdout  # the crashed run's decision stands
    assert json.loads(resumed.stdout)["workers"] == (2 if engine else 1)
    assert json.loads(resumed.stdout)["unfinished_points_removed"] == [unfinished[0].id]
    assert not unfinished[0].path.exists()
    assert [b.state for b in list_backups(backups, S)] == ["ok", "ok"]  # the resumed run's point, the base
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
