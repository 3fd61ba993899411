"""A circular log's writer killed (SIGKILL, a real process) while it reuses its oldest segment: the manifest already
says the segment is gone ("pruned"), and the file is left emptied, or holding the next segment's header under its
old name. Every reader (peer recovery of the dead member, restore, the printer) reads the log as its writer reopens
it, without the left-over file; the writer removes the file when it opens."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sqm.log import LogFormatError, LogReader, RecordLog
from sqm.log.format import read_manifest, segment_name

# A child that appends forced records to a ring of 3 segments, releasing each sealed segment, and kills itself at
# the chosen step of the first reuse of a segment file (sqm.log.writer.RecordLog._reuse_segment).
CHILD = r"""
import os, signal, sys
import sqm.log.writer as w
from sqm.log import RecordLog
directory, step = sys.argv[1], sys.argv[2]
real = os
class Os:
    def __getattr__(self, name):
        return getattr(real, name)
    def ftruncate(self, fd, n):
        real.ftruncate(fd, n)
        if step == "emptied" and n == 0:
            real.kill(real.getpid(), signal.SIGKILL)
    def replace(self, src, dst):
        if step == "header-written" and str(src).endswith(".log"):
            real.kill(real.getpid(), signal.SIGKILL)
        real.replace(src, dst)
        if step == "renamed" and str(src).endswith(".log"):
            real.kill(real.getpid(), signal.SIGKILL)
log = RecordLog(directory, "QM1", segment_bytes=1024, ring=3)
w.os = Os()  # opened: the lock file's own truncation is behind
i = 0
while True:
    log.release_below(log.end_position().segment)
    log.append_forced({"k": "PUT", "l": i, "d": b"x" * 100})
    i += 1
"""


def _killed_in_reuse(d: Path, step: str) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(d), step], timeout=60, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()


@pytest.mark.parametrize("step", ["emptied", "header-written", "renamed"])
def test_a_reader_reads_a_ring_log_killed_while_reusing_a_segment(tmp_path: Path, step: str) -> None:
    d = tmp_path / "QM1"
    _killed_in_reuse(d, step)
    pruned = int((read_manifest(d) or {})["pruned"])
    left_over = d / segment_name(pruned - 1)
    assert left_over.exists() == (step != "renamed")
    reader = LogReader(d)
    read = [r for _, r in reader.records()]
    assert [s.segment for s in reader.segments()][0] == pruned
    assert reader.last_checkpoint() is None
    reopened = tmp_path / "reopened"
    shutil.copytree(d, reopened)
    with RecordLog(reopened, "QM1", segment_bytes=1024, ring=3) as log:  # what the member's restart reads
        assert [r for _, r in log.records()] == read
    assert not (reopened / segment_name(pruned - 1)).exists()
    lrsns = [r["l"] for r in read]
    assert lrsns == list(range(lrsns[0], lrsns[0] + len(lrsns)))  # every record the ring still holds, in order


def test_a_reader_whose_segment_the_running_ring_reuses_says_so_in_one_line(tmp_path: Path) -> None:
    """A reader (the printer on a live member, say) that listed a circular log's segments, then found one released
    and reused by the running writer before it got there: its records are no longer in the log. The reader says
    so, naming the segment, not a missing file's traceback; read again, the log reads from its oldest segment."""
    d = tmp_path / "QM1"
    with RecordLog(d, "QM1", segment_bytes=1024, ring=4) as log:
        for i in range(12):
            log.append_forced({"k": "NOTE", "l": i + 1, "pad": "." * 100})
        reading = LogReader(d).records()
        next(reading)
        for i in range(12, 60):
            log.append_forced({"k": "NOTE", "l": i + 1, "pad": "." * 100})
            log.release_below(log.end_position().segment)
        with pytest.raises(LogFormatError, match="segment 2 of QM1 was released by its running writer while this "
                                                 "read its log"):
            list(reading)
        again = [r["l"] for _, r in LogReader(d).records()]
        assert again == list(range(again[0], 61))


def test_a_ring_lowered_at_a_restart_shrinks_to_it_as_its_segments_are_released(tmp_path: Path) -> None:
    """`--log-ring` lowered: the files of the larger ring beyond the new one are removed at the rolls, once released
    (never one recovery needs), so that the ring's disk use comes down to what the operator set; the log reads on."""
    d = tmp_path / "QM1"
    with RecordLog(d, "QM1", segment_bytes=1024, ring=6) as log:
        for i in range(40):
            log.append_forced({"k": "NOTE", "l": i + 1, "pad": "." * 100})
            if len(log.segments()) == 6:
                break
    assert len(list(d.glob("seg-*.log"))) == 6
    with RecordLog(d, "QM1", segment_bytes=1024, ring=3) as log:
        for i in range(60, 120):
            log.release_below(log.end_position().segment)
            log.append_forced({"k": "NOTE", "l": i + 1, "pad": "." * 100})
        assert len(list(d.glob("seg-*.log"))) == 3
        assert len(log.segments()) == 3
        tail = [r["l"] for _, r in log.records()]
    assert [r["l"] for _, r in LogReader(d).records()] == tail == list(range(tail[0], 121))
    with RecordLog(d, "QM1", segment_bytes=1024, ring=3) as log:  # and it opens as that ring
        assert len(log.segments()) == 3
