"""No file of the group is readable by other users (docs/security.md, "Files"). Log segments (message bodies),
backup entry files, restore reports and manifests are 0600 in 0700 directories, set by the code whatever the umask;
a log or backup directory that other users can write is refused at start with a one-line error. Probed as another OS
user."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu.connection import connect
from cfemu.private_files import UnsafeDirectoryError
from restore.run import run_restore
from sqm.log import RecordLog
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_logs_backups_and_reports_are_their_owners_only(redis_url: str, tmp_path: Path) -> None:
    old = os.umask(0o022)  # a permissive umask, as a user's shell has: the code must not depend on it
    try:
        logs, backups = tmp_path / "logs", tmp_path / "backups"
        client = define_group(redis_url)
        qm = start_qm(redis_url, logs, "QM1", background=False)
        conn = qm.connect()
        conn.put("Q1", b"secret body")
        conn.commit()
        run_backup(client, "APP1", backups, log_root=logs)
        qm.stop()
        lose_cf(client)
        result = run_restore(connect(redis_url), "APP1", backup_root=backups, log_root=logs)
    finally:
        os.umask(old)
    found = {**{f"logs/{k}": v for k, v in modes(logs / "QM1").items()},
             **{f"backups/{k}": v for k, v in modes(backups / "APP1").items()},
             **{f"restore/{k}": v for k, v in modes(logs / "_restore").items()}}
    assert result.report_path is not None
    found["report"] = stat.S_IMODE(Path(result.report_path).stat().st_mode)
    loose = {name: oct(m) for name, m in found.items() if m & 0o077}
    assert not loose, f"readable or writable by others: {loose}"


def test_a_log_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(UnsafeDirectoryError, match="writable by other users"):
        RecordLog(d, "QM1")
    assert not any(d.iterdir()), "nothing is written into a refused directory"


def test_another_os_user_cannot_read_a_segment(redis_url: str, tmp_path: Path) -> None:
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root and a system python3 to probe as another OS user")
    tmp_path.chmod(0o755)
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o755)
    define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    conn = qm.connect()
    conn.put("Q1", b"secret body")
    conn.commit()
    qm.stop()
    segment = next((logs / "QM1").glob("seg-*"))
    probe = subprocess.run(["/usr/bin/python3", "-c", f"open({str(segment)!r}, 'rb').read()"], user=65534,
                           group=65534, capture_output=True, text=True, timeout=30)
    assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr
