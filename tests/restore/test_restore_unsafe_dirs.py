"""cfrestore run refuses, before it reads or changes anything, a directory it reads or writes that other users can
write: the log root (and each member's log), the --archive-dir of the Spark engine, the --report's directory
(docs/security.md, "Files"). And it never chmods a directory the operator named: the report file itself is 0600."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cfemu.admin import Admin
from sqm.core.manager import QueueManager
from tests.restore import test_cli
from tests.restore.test_restore import S

group = test_cli.group  # the fixture: three members with a small workload, the CLI's environment
run = test_cli.run


def backups_of(tmp_path: Path) -> list[str]:
    """What the backup root holds for the structure: a restore that ran wrote a restore point and a report there."""
    return sorted(p.name for p in (tmp_path / "backups" / S).iterdir())


def refused_untouched(group: list[QueueManager], tmp_path: Path, before: list[str], rc: int, err: str,
                      unsafe: Path) -> None:
    assert rc == 2 and err.count("\n") == 1 and f"{unsafe} is writable by other users" in err, err
    assert Admin(group[0].redis).state(S) == "ACTIVE"  # --mark-failed was not acted on
    assert backups_of(tmp_path) == before  # no restore point, no report


def test_a_report_into_a_directory_others_can_write_is_refused_before_the_restore(
        group: list[QueueManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    before = backups_of(tmp_path)
    rc, _, err = run(capsys, "run", S, "--mark-failed", "--report", str(shared / "report.json"))
    refused_untouched(group, tmp_path, before, rc, err, shared)
    assert list(shared.iterdir()) == []
    rc, _, err = run(capsys, "plan", S, "--report", str(shared / "report.json"))  # a dry run's report too
    assert rc == 2 and "is writable by other users" in err and list(shared.iterdir()) == []


def test_a_report_leaves_the_operators_directory_as_it_was(group: list[QueueManager], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "reports"
    mine.mkdir()
    mine.chmod(0o755)
    rc, out, err = run(capsys, "run", S, "--mark-failed", "--report", str(mine / "report.json"), "--json")
    assert rc == 0, err
    assert mine.stat().st_mode & 0o7777 == 0o755  # never chmodded
    report = mine / "report.json"
    assert report.stat().st_mode & 0o777 == 0o600
    assert json.loads(report.read_text()) == json.loads(out)
    made = tmp_path / "new" / "deeper" / "report.json"  # a directory the report makes: the owner's only
    rc, _, err = run(capsys, "plan", S, "--report", str(made))
    assert rc == 0, err
    assert made.parent.stat().st_mode & 0o777 == 0o700 and made.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("which", ["root", "member"])
def test_a_log_root_others_can_write_is_refused(group: list[QueueManager], tmp_path: Path, which: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    unsafe = tmp_path / "logs" if which == "root" else tmp_path / "logs" / "QM2"
    mode = unsafe.stat().st_mode & 0o7777
    unsafe.chmod(0o777)
    try:
        before = backups_of(tmp_path)
        rc, _, err = run(capsys, "run", S, "--mark-failed")
        refused_untouched(group, tmp_path, before, rc, err, unsafe)
        rc, _, err = run(capsys, "plan", S)
        assert rc == 2 and f"{unsafe} is writable by other users" in err
    finally:
        unsafe.chmod(mode)  # the running members' own directories


def test_a_purge_with_a_log_root_others_can_write_is_refused_before_it_changes_anything(
        group: list[QueueManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A purge reads the definitions a lost CF no longer has from the group repository under the log root."""
    unsafe = tmp_path / "logs"
    mode = unsafe.stat().st_mode & 0o7777
    unsafe.chmod(0o777)
    try:
        before = backups_of(tmp_path)
        rc, _, err = run(capsys, "purge", S, "--mark-failed")
        refused_untouched(group, tmp_path, before, rc, err, unsafe)
    finally:
        unsafe.chmod(mode)


def test_a_spark_archive_directory_others_can_write_is_refused_before_spark_starts(
        group: list[QueueManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shared = tmp_path / "archive"
    shared.mkdir()
    shared.chmod(0o777)
    before = backups_of(tmp_path)
    rc, _, err = run(capsys, "run", S, "--mark-failed", "--engine", "spark", "--archive-dir", str(shared),
                     "--master", "local[1]")
    refused_untouched(group, tmp_path, before, rc, err, shared)
    assert not os.listdir(shared)
