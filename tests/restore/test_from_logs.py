"""CF recovery from the logs alone (docs/log-management.md): a structure whose last backup is older than
the relog window is restored from the newest complete relog pass's window, without the backup, to what the clients
know; the local and the Spark engine plan it alike. The member runs in its own process, checkpointing by LOGLOAD
and relogging as it works, and is killed with SIGKILL before the CF is lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import redis

from backup.run import run_backup
from cfemu.repository import GroupRepository
from restore.engine import LocalEngine
from restore.run import LOGS, choose_start, member_log_dirs, open_backup, run_restore
from sqm.log import LogReader
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"
ROOT = Path(__file__).resolve().parents[2]

# A member that keeps 12 messages for the whole run (some got and backed out, so their backout counts rise) and
# churns many short-lived ones, with a checkpoint every 40 records: many relog passes of two pairs each. It says
# what it believes the queue holds (body -> backout count) and waits to be killed.
CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from sqm.core.manager import QueueManager, QueueManagerConfig
    url, logs = sys.argv[1], Path(sys.argv[2])
    qm = QueueManager(QueueManagerConfig(name="QM1", log_root=logs, redis_url=url, logload=40, cpl_entries=2,
                                         segment_bytes=16 * 1024))
    qm.start()
    c = qm.connect()
    held = {}
    for i in range(12):
        c.put("Q1", f"stay-{i:02}".encode() * 20, priority=i % 4)
        held[f"stay-{i:02}"] = 0
    c.commit()
    print("stayers", flush=True)
    sys.stdin.readline()  # the test takes its backup now
    for k in range(150):
        c.put("Q2", f"churn-{k}".encode())
        c.commit()
        if k % 10 == 5:  # get the first stayer in line and back it out: its backout count rises
            m = c.get("Q1")
            c.backout()
            held[m.body[:7].decode()] += 1
        if k % 50 == 49:  # consume one for good
            m = c.get("Q1")
            c.commit()
            del held[m.body[:7].decode()]
        got = c.get("Q2")
        assert got.body == f"churn-{k}".encode()
        c.commit()
    print(json.dumps(held), flush=True)
    sys.stdin.readline()
""")


def available(qm_conn: Any) -> list[tuple[str, int]]:
    return [(m.body[:7].decode(), m.backout_count) for m in qm_conn.browse("Q1", limit=1000)]


@pytest.mark.slow
@pytest.mark.xdist_group("spark")  # on the worker that holds the Spark session (tests/restore/conftest.py)
def test_a_structure_whose_backup_is_older_than_the_relog_window_restores_from_the_logs_alone(
        redis_url: str, tmp_path: Path, spark: Any) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1", "Q2"))
    child = subprocess.Popen([sys.executable, "-c", CHILD, redis_url, str(logs)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "stayers", child.stderr.read() if child.stderr else ""
        backup = run_backup(client, S, backups, log_root=logs)
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line, child.stderr.read() if child.stderr else ""
        believed = json.loads(line)
        reader = start_qm(redis_url, logs, "QM9", background=False, cpl_entries=0)
        before = available(reader.connect())  # what the CF holds, in get order
        reader.stop()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert sorted(before) == sorted(believed.items())
    assert 5 <= len(before) < 12

    lose_cf(client)
    repo = GroupRepository(logs)
    log_dirs = member_log_dirs(logs, repo.members(), 0)
    base = choose_start(S, open_backup(backups, S, None, None, repo), log_dirs, repo, "QSG1")
    assert base is not None and base.manifest["kind"] == LOGS
    window = int(base.manifest["replay_from"])
    assert window > int(backup["replay_from"])  # the backup is older than the window: not needed
    first_puts = [r["l"] for _, r in LogReader(logs / "QM1").records() if r["k"] == "PUT" and b"stay" in r["d"]]
    assert max(first_puts) < window  # every stayer's put is outside the window: only the relog copies hold them

    local = LocalEngine().plan(S, base, log_dirs, window, 0)
    from restore.engine_spark import SparkEngine

    remote = SparkEngine(spark=spark).plan(S, base, log_dirs, window, 0)
    key = lambda s: s.id  # noqa: E731
    assert [(s.id, s.disposition, s.entry) for s in sorted(remote.settled, key=key)] == \
        [(s.id, s.disposition, s.entry) for s in sorted(local.settled, key=key)]

    result = run_restore(redis.Redis.from_url(redis_url), S, backup_root=backups, log_root=logs)
    assert result.base_kind == LOGS and result.replay_from == window and "logs alone" in result.start
    assert all(r["from"] == window for r in result.log_ranges.values())
    after = start_qm(redis_url, logs, "QM9", background=False, cpl_entries=0)
    try:
        assert available(after.connect()) == before  # the client-side truth, in get order, backout counts kept
    finally:
        after.stop()
