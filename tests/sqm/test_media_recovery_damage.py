"""Media recovery (sqm.log.mediacopy): a sealed segment with a verified archived copy, damaged in ways a
disk damages files. Real files, fsynced by the writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from sqm.log import LogReader, RecordLog
from sqm.log.format import segment_name


def sealed_and_copied(root: Path) -> tuple[Path, Path]:
    """A log whose first segment is sealed and copied to the archive (copy_sealed); returns (log dir, segment)."""
    d = root / "QM1"
    log = RecordLog(d, "QM1", segment_bytes=4096)
    for i in range(60):
        log.append({"k": "NOTE", "l": i + 1, "x": b"p" * 100})
        log.force()
    copied = log.copy_sealed(root / "archive")
    log.close()
    assert copied
    return d, d / segment_name(copied[0])


def test_a_deleted_sealed_segment_is_restored_from_its_archived_copy(tmp_path: Path) -> None:
    """The open refuses ("its records are lost") before media recovery looks: checked_segments raises on a listed
    segment that is missing, although its verified copy is in the archive."""
    d, seg = sealed_and_copied(tmp_path)
    seg.unlink()
    log = RecordLog(d, "QM1", segment_bytes=4096)
    try:
        assert [m.segment for m in log.media_recovered] == [1]
        assert sum(1 for _ in log.records()) == 60
    finally:
        log.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_reader_of_a_damaged_sealed_segment_uses_its_archived_copy(tmp_path: Path, damage: str) -> None:
    """Restore and peer recovery read a member's log with LogReader, which does not fall back on the verified
    copy: until the member itself restarts (and repairs the segment at its open), the restore fails on it."""
    d, seg = sealed_and_copied(tmp_path)
    b = bytearray(seg.read_bytes())
    if damage == "flip":
        b[len(b) // 2] ^= 0xFF
    else:
        del b[len(b) // 2:]
    seg.write_bytes(bytes(b))
    assert sum(1 for _ in LogReader(d).records()) == 60


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_archiving_a_segment_never_removes_its_only_good_copy(tmp_path: Path, damage: str) -> None:
    """The archived copy made while the segment was active is damaged (or gone) by the time the segment becomes
    inactive; archive() only moves the manifest entry (no check of the copy against its sha256) and removes the
    active file, the one good copy: the segment's records are lost."""
    d, seg = sealed_and_copied(tmp_path)
    copy = tmp_path / "archive" / seg.name
    if damage == "flip":
        b = bytearray(copy.read_bytes())
        b[len(b) // 2] ^= 0xFF
        copy.write_bytes(bytes(b))
    else:
        copy.unlink()
    log = RecordLog(d, "QM1", segment_bytes=4096)
    try:
        try:
            log.archive(2, tmp_path / "archive")
        except Exception:  # refusing to archive is fine: the active segment is kept
            pass
        assert sum(1 for _ in log.records()) == 60
    finally:
        log.close()
    assert sum(1 for _ in LogReader(d).records()) == 60
