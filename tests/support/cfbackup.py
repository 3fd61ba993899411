"""`cfbackup` as a user runs it, for the backup tests: its environment, a group with messages to back up, and a run
of the command as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.group import define_group, start_qm

CFBACKUP = str(Path(sys.executable).parent / "cfbackup")


def cfbackup_env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    """The process environment with the CF at redis_url, backups under tmp_path/bk and logs under tmp_path/logs
    (whatever backup directory and log root the caller's environment names)."""
    e = {k: v for k, v in os.environ.items() if k not in ("CFEMU_BACKUP_DIR", "CFEMU_LOG_ROOT")}
    e.update(REDIS_URL=redis_url, CFEMU_BACKUP_DIR=str(tmp_path / "bk"), CFEMU_LOG_ROOT=str(tmp_path / "logs"))
    return e


def group_to_back_up(redis_url: str, tmp_path: Path, messages: int,
                     queues: tuple[str, ...] = ("Q1", "Q2")) -> dict[str, str]:
    """A group on structure APP1 with ``messages`` committed on Q1 (put through QM1, stopped again), and
    cfbackup_env for it."""
    client = define_group(redis_url, queues=queues)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    conn = qm.connect()
    for i in range(messages):
        conn.put("Q1", b"m%d" % i)
    conn.commit()
    qm.stop()
    client.close()
    return cfbackup_env(redis_url, tmp_path)


def cfbackup(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CFBACKUP, *args], env=env, capture_output=True, text=True, timeout=120)
