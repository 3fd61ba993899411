"""The running store report's file is the member's own: its default place is the current directory, which may be
one others write, so a symbolic link, a FIFO or another user's file planted at its path is refused by name, and
nothing is written through it. Real files, a real member start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cfemu.embedded import EmbeddedRedis
from sqm.core.storereport import StoreReport, StoreReportError
from tests.support.group import define_group, start_qm


def test_a_symbolic_link_at_the_reports_path_is_refused_and_its_target_untouched(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("the operator's own file\n")
    report = tmp_path / "PSTORE.REPORT"
    report.symlink_to(victim)
    define_group(fresh_redis.url, queues=("Q1",))
    with pytest.raises(StoreReportError, match=f"{report} is a symbolic link: refusing to follow it"):
        start_qm(fresh_redis.url, tmp_path / "logs", "QM1", background=False, pstore_report=report)
    assert victim.read_text() == "the operator's own file\n"
    qm = start_qm(fresh_redis.url, tmp_path / "logs", "QM1", background=False,
                  pstore_report=tmp_path / "own.report")  # a path of its own: the member starts and reports
    c = qm.connect()
    c.put("Q1", b"m")
    c.commit()
    qm.stop()
    assert '"action": "created"' in (tmp_path / "own.report").read_text()


def test_a_fifo_at_the_reports_path_is_refused_at_once(tmp_path: Path) -> None:
    report = tmp_path / "PSTORE.REPORT"
    os.mkfifo(report)
    with pytest.raises(StoreReportError, match="is not a regular file"):
        StoreReport(report, "QM1")  # no reader: an open for writing that waited would never return


def test_another_users_file_at_the_reports_path_is_refused_and_not_written(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another user")
    report = tmp_path / "PSTORE.REPORT"
    report.write_text("")
    os.chown(report, 4321, 4321)
    with pytest.raises(StoreReportError, match="belongs to another user \\(uid 4321\\)"):
        StoreReport(report, "QM1")
    assert report.read_text() == ""


def test_the_members_own_report_is_appended_to_across_runs(tmp_path: Path) -> None:
    report = tmp_path / "PSTORE.REPORT"
    for _ in range(2):
        StoreReport(report, "QM1").close()
    assert report.read_text().count('"report": "pstore"') == 2 and oct(report.stat().st_mode & 0o777) == oct(0o600)
