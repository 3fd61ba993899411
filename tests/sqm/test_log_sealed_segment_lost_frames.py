"""A sealed segment cut at a frame boundary (whole frames lost at its end) reads cleanly frame by frame: each reader
of sqm.log compares it with its manifest entry (check_sealed) and raises LogCorruptError naming the file, rather
than read on without the lost records. A sealed segment read whole that matches its entry reads as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from sqm.log import LogCorruptError, LogReader, RecordLog
from sqm.log.format import SegmentScan, read_manifest, segment_name, trusted_segments
from tests.sqm.test_log import write_log
from tests.support.log_damage import cut_at_a_frame_boundary


def _cut_log(tmp_path: Path) -> tuple[Path, Path, int]:
    d = tmp_path / "QM1"
    write_log(d, 120, segment_bytes=1024, size=40)
    segno = 3
    victim = d / segment_name(segno)
    assert trusted_segments(d, read_manifest(d))[segno].sealed
    cut_at_a_frame_boundary(victim)
    return d, victim, segno


def test_the_log_reader_refuses_a_sealed_segment_that_lost_frames(tmp_path: Path) -> None:
    d, victim, segno = _cut_log(tmp_path)
    info = trusted_segments(d, read_manifest(d))[segno]
    for read in (lambda: list(LogReader(d).records()), lambda: list(LogReader(d).records(min_lrsn=0))):
        with pytest.raises(LogCorruptError) as caught:
            read()
        e = caught.value
        assert e.path == str(victim)
        assert (f"sealed segment {segno} ends at byte {e.offset} with " in e.what
                and f"but its manifest entry says it ends at byte {info.end.offset} with {info.records} records, "
                    f"LRSN {info.min_lrsn}..{info.max_lrsn}" in e.what)


def test_a_scan_from_inside_the_segment_compares_where_it_ends(tmp_path: Path) -> None:
    d, victim, segno = _cut_log(tmp_path)
    info = trusted_segments(d, read_manifest(d))[segno]
    assert info.first is not None and info.last is not None
    with pytest.raises(LogCorruptError, match="records at its end are lost"):
        list(SegmentScan(victim, segno, "QM1", is_last=False, start_offset=info.last.offset, expected=info))


def test_the_writer_does_not_open_a_log_whose_sealed_segment_lost_frames(tmp_path: Path) -> None:
    d, victim, _ = _cut_log(tmp_path)
    with pytest.raises(LogCorruptError) as caught:
        RecordLog(d, "QM1", segment_bytes=1024)
    assert caught.value.path == str(victim)


def test_an_intact_log_reads_as_it_was_written(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    written = write_log(d, 120, segment_bytes=1024, size=40)
    assert [r for _, r in LogReader(d).records(min_lrsn=0)] == [r for _, r in written]
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        assert [r for _, r in log.records()] == [r for _, r in written]
