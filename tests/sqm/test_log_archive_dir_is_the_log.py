"""An archive directory that is the log directory itself (an archive root set to the log root: ROOT/<member> is the
member's own log) is refused before anything is copied or removed. Archiving there made each segment's "copy" its
active file and then removed it, leaving a manifest that lists archived segments no file holds: every reader of the
log (peer recovery, restore, the printer) refused it. A member so configured keeps its segments in the active log."""

from __future__ import annotations

from pathlib import Path

import pytest

from sqm.log import LogFormatError, LogReader, RecordLog
from sqm.log.format import list_segments, read_manifest
from tests.support.group import define_group, start_qm


def _log(d: Path) -> RecordLog:
    log = RecordLog(d, "QM1", segment_bytes=1024)
    for i in range(40):
        log.append_forced({"k": "PUT", "l": i, "d": b"x" * 100})
    return log


@pytest.mark.parametrize("how", ["itself", "through a symlink"])
def test_archiving_into_the_log_directory_is_refused_and_changes_nothing(tmp_path: Path, how: str) -> None:
    d = tmp_path / "logs" / "QM1"
    log = _log(d)
    target = d
    if how == "through a symlink":
        target = tmp_path / "alias"
        target.symlink_to(d)
    files = sorted(p.name for p in d.iterdir())
    with log:
        for act in (lambda: log.copy_sealed(target), lambda: log.archive(3, target)):
            with pytest.raises(LogFormatError, match="is the log directory itself"):
                act()
    manifest = read_manifest(d) or {}
    assert manifest["archived"] == [] and manifest["copies"] == []
    assert sorted(p.name for p in d.iterdir()) == files
    assert [r["l"] for _, r in LogReader(d).records()] == list(range(40))


def test_a_member_whose_archive_root_is_its_log_root_keeps_a_readable_log(redis_url: str, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=1, segment_bytes=4096, log_archive_dir=logs)
    c = qm.connect()
    for _interval in range(8):
        for _ in range(6):
            c.put("Q1", b"x" * 300, syncpoint=False)
            c.get("Q1", syncpoint=False)
        qm.checkpoint("logload")
    qm.stop(checkpoint=False)
    assert (read_manifest(logs / "QM1") or {})["archived"] == []
    assert list_segments(logs / "QM1")[0][0] == 1  # nothing left the active log
    assert sum(1 for _ in LogReader(logs / "QM1").records()) > 0
