"""A reader of a member's log (LogReader: restore, peer recovery) falls back on a sealed segment's verified archived
copy (sqm.log.mediacopy) where the active file is missing or damaged, and never on a copy whose bytes are not its
digest's. Real files, fsynced by the writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from sqm.log import LogCorruptError, LogReader, RecordLog
from sqm.log.format import LogFormatError, segment_name
from tests.sqm.test_media_recovery_damage import sealed_and_copied


def test_a_reader_reads_a_deleted_sealed_segment_from_its_archived_copy(tmp_path: Path) -> None:
    d, seg = sealed_and_copied(tmp_path)
    seg.unlink()
    assert [r["l"] for _, r in LogReader(d).records()] == list(range(1, 61))


def test_a_reader_does_not_read_a_damaged_copy(tmp_path: Path) -> None:
    d, seg = sealed_and_copied(tmp_path)
    b = bytearray(seg.read_bytes())
    b[len(b) // 2] ^= 0xFF
    seg.write_bytes(bytes(b))
    copy = tmp_path / "archive" / seg.name
    c = bytearray(copy.read_bytes())
    c[len(c) // 2] ^= 0x0F
    copy.write_bytes(bytes(c))
    with pytest.raises(Exception, match="corrupt record log"):
        sum(1 for _ in LogReader(d).records())


def test_a_deleted_segment_without_a_copy_still_fails_the_read(tmp_path: Path) -> None:
    d, seg = sealed_and_copied(tmp_path)
    seg.unlink()
    (tmp_path / "archive" / seg.name).unlink()
    with pytest.raises(LogFormatError):
        sum(1 for _ in LogReader(d).records())


def test_a_reader_reads_a_damaged_checkpoint_record_from_the_archived_copy(tmp_path: Path) -> None:
    """The last checkpoint lies in a sealed segment damaged in place (a bad sector over its frame): peer recovery's
    LogReader.last_checkpoint reads it from the verified copy, as records() does, rather than fail."""
    d = tmp_path / "QM1"
    log = RecordLog(d, "QM1", segment_bytes=4096)
    for i in range(10):
        log.append_forced({"k": "NOTE", "l": i + 1, "x": b"p" * 100})
    ckpt = log.checkpoint({"k": "CHECKPOINT", "l": 50, "uows": {}, "n": 10, "why": "logload"})
    while log.end_position().segment == ckpt.segment:
        log.append_forced({"k": "NOTE", "l": 100, "x": b"q" * 100})
    assert ckpt.segment in log.copy_sealed(tmp_path / "archive")
    log.close()
    seg = d / segment_name(ckpt.segment)
    b = bytearray(seg.read_bytes())
    b[ckpt.offset + 12] ^= 0xFF  # inside the checkpoint's body
    seg.write_bytes(bytes(b))
    found = LogReader(d).last_checkpoint()
    assert found is not None and found[0] == ckpt and found[1]["l"] == 50
    (tmp_path / "archive" / seg.name).unlink()  # without a copy the damage is reported, as before
    with pytest.raises(LogCorruptError, match="CRC mismatch"):
        LogReader(d).last_checkpoint()


def test_a_reader_reads_a_deleted_sealed_segment_between_two_others_from_its_archived_copy(tmp_path: Path) -> None:
    """The deleted segment is neither the first nor the last: the files left have a gap in their numbering, which its
    copy fills. Before, the listing refused the gap before it looked at the copies, so peer recovery and restore
    failed on a log the member's own restart repairs."""
    d = tmp_path / "QM1"
    with RecordLog(d, "QM1", segment_bytes=4096) as log:
        for i in range(200):
            log.append_forced({"k": "NOTE", "l": i + 1, "x": b"p" * 100})
        copied = log.copy_sealed(tmp_path / "archive")
    assert len(copied) >= 3
    (d / segment_name(copied[1])).unlink()
    assert [r["l"] for _, r in LogReader(d).records()] == list(range(1, 201))
    assert [s.segment for s in LogReader(d).segments()] == list(range(1, copied[-1] + 2))
    (tmp_path / "archive" / segment_name(copied[1])).unlink()  # no copy: the gap is named, as before
    with pytest.raises(LogFormatError, match=f"segment {copied[1]}"):
        sum(1 for _ in LogReader(d).records())
