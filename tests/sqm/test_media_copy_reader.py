"""A reader of a member's log (LogReader: restore, peer recovery) falls back on a sealed segment's verified archived
copy (sqm.log.mediacopy) where the active file is missing or damaged, and never on a copy whose bytes are not its
digest's. Real files, fsynced by the writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from sqm.log import LogReader
from sqm.log.format import LogFormatError
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
