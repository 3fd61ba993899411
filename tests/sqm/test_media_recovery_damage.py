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


def interrupted_archive(root: Path) -> tuple[Path, Path, Path]:
    """A log whose segments 1 and 2 were archived, then segment 2's active file put back: an archive killed after
    the manifest listed its copy and before it removed the active file. Returns (log dir, segment 2's active file,
    its archived copy)."""
    d = root / "QM1"
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        for i in range(60):
            log.append({"k": "END", "l": 1000 + i, "u": f"u{i}", "pad": "." * 100})
        log.force()
        moved = log.archive(3, root / "archive")
    assert [m.segment for m in moved] == [1, 2]
    active, copy = d / segment_name(2), moved[1].path
    active.write_bytes(copy.read_bytes())
    return d, active, copy


@pytest.mark.parametrize("copy_state", ["missing", "damaged"])
def test_an_interrupted_archive_keeps_the_active_file_when_its_copy_is_not_good(tmp_path: Path,
                                                                              copy_state: str) -> None:
    """The open finishes an interrupted archive by removing the active file, which is then the only other copy:
    only once the archived copy reads as the active file's bytes. A copy gone (the archive's volume not mounted
    at the restart) or damaged leaves the active file in place, read by every reader, until a later open finds the
    copy good again; nothing of the log is lost."""
    d, active, copy = interrupted_archive(tmp_path)
    kept = copy.read_bytes()
    if copy_state == "missing":
        copy.unlink()
    else:
        copy.write_bytes(kept[:-10] + b"\0" * 10)
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        assert active.is_file()
        assert [r["l"] for _, r in log.records()] == list(range(1000, 1060))
    assert [r["l"] for _, r in LogReader(d).records()] == list(range(1000, 1060))
    copy.write_bytes(kept)  # the archive back as it was: the next open finishes the archive
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        assert not active.exists()
        assert [r["l"] for _, r in log.records()] == list(range(1000, 1060))


def test_an_interrupted_archive_with_a_good_copy_is_finished_at_the_open(tmp_path: Path) -> None:
    d, active, _ = interrupted_archive(tmp_path)
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        assert not active.exists()
        assert [r["l"] for _, r in log.records()] == list(range(1000, 1060))
