"""A crash on a filesystem that leaves the unwritten pages of a write as zeros: the writer (a real process, SIGKILLed)
had written records it never forced, and the pages holding the end of one of them and all that followed read back
as zeros. That frame's CRC is bad and only zeros follow it: a torn tail, not corruption. The member's log opens,
every forced record is there, and the next record goes where the torn frame began. Non-zero bytes after such a
frame are still corruption."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sqm.log import LogCorruptError, LogPosition, LogReader, RecordLog
from sqm.log.format import encode_header, segment_name

FORCED = 5

CHILD = r"""
import os, signal, sys
from sqm.log import RecordLog
log = RecordLog(sys.argv[1], "QM1")
for i in range(int(sys.argv[2])):
    log.append_forced({"k": "PUT", "l": i, "d": b"x" * 300})
first = log.append({"k": "PUT", "l": 100, "d": b"y" * 3000})
for i in range(5):
    log.append({"k": "PUT", "l": 101 + i, "d": b"z" * 300})
list(log.records())  # written out to the file, never forced
print(first.offset, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_with_unforced_records(d: Path) -> int:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(d), str(FORCED)], timeout=60, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    return int(proc.stdout.split()[0])


def _zero_from(path: Path, offset: int) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * (size - offset))


def test_a_frame_cut_short_by_zeros_with_zeros_after_it_is_a_torn_tail(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    torn_at = _killed_with_unforced_records(d)
    path = d / segment_name(1)
    size = path.stat().st_size
    _zero_from(path, torn_at + 1000)  # inside the first unforced frame's body: its end and the rest never written
    assert [r["l"] for _, r in LogReader(d).records()] == list(range(FORCED))
    with RecordLog(d, "QM1") as log:
        assert log.stats.torn_bytes_truncated == size - torn_at
        assert log.append_forced({"k": "PUT", "l": 200}) == LogPosition(1, torn_at)
    assert [r["l"] for _, r in LogReader(d).records()] == [*range(FORCED), 200]


def test_non_zero_bytes_after_a_frame_with_a_bad_crc_are_still_corruption(tmp_path: Path) -> None:
    d = tmp_path / "QM1"
    torn_at = _killed_with_unforced_records(d)
    path = d / segment_name(1)
    size = path.stat().st_size
    _zero_from(path, torn_at + 1000)
    with open(path, "r+b") as f:
        f.seek(size - 10)
        f.write(b"\x01")
    for read in (lambda: list(LogReader(d).records()), lambda: RecordLog(d, "QM1")):
        with pytest.raises(LogCorruptError, match=f"at byte offset {torn_at}: CRC mismatch"):
            read()


def test_a_last_segment_whose_header_never_reached_the_disk_reads_as_empty(tmp_path: Path) -> None:
    """A crash while a roll created the next segment, its header written but not yet fsynced: a zero-filling
    filesystem leaves the file as zeros. Like an empty file, it is a segment whose creation the crash cut short."""
    d = tmp_path / "QM1"
    written = []
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        for i in range(30):
            written.append(log.append_forced({"k": "PUT", "l": i, "d": b"x" * 60}))
    nxt = d / segment_name(written[-1].segment + 1)
    header = len(encode_header(nxt_no := written[-1].segment + 1, 1024, "QM1"))
    nxt.write_bytes(bytes(header))  # the header's length, all zeros
    assert [r["l"] for _, r in LogReader(d).records()] == list(range(30))
    with RecordLog(d, "QM1", segment_bytes=1024) as log:
        assert log.stats.torn_bytes_truncated == header
        p = log.append_forced({"k": "PUT", "l": 99})
    assert p.segment == nxt_no
    assert [r["l"] for _, r in LogReader(d).records()] == [*range(30), 99]
