"""A member killed while it made its log's first segment: no manifest yet, the segment file empty, its header cut
short, or zeros (the filesystem's unwritten pages). The member logged nothing, so its log is empty: the readers
that read it while the member is down (peer recovery, restore, the printer) read no records from it, named by its
directory, instead of failing on it; the member's restart writes the header and goes on."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sqm.log import LogReader, RecordLog
from sqm.log.format import encode_header, segment_name
from tests.restore.test_engine_columnar import columnar
from tests.restore.test_engine_spark import simulate, write_history
from tests.restore.test_partitioned import described, reference

TORN = {"empty": b"", "header cut short": encode_header(1, 1 << 20, "QM9")[:7], "zeros": b"\0" * 64}


def torn_first_segment(d: Path, how: str) -> Path:
    d.mkdir(parents=True)
    (d / segment_name(1)).write_bytes(TORN[how])
    return d


@pytest.mark.parametrize("how", list(TORN))
def test_a_log_torn_in_its_first_segment_reads_as_empty_until_its_member_restarts(tmp_path: Path, how: str) -> None:
    d = torn_first_segment(tmp_path / "QM9", how)
    reader = LogReader(d)
    assert reader.member == "QM9"
    assert list(reader.records()) == []
    with RecordLog(d, "QM9") as log:  # the restart
        log.append_forced({"k": "NOTE", "l": 1})
    assert [r["l"] for _, r in LogReader(d).records()] == [1]


@pytest.mark.parametrize("how", list(TORN))
def test_restore_reads_past_a_member_killed_in_its_first_segment(tmp_path: Path, how: str) -> None:
    """The structure is restored from the other members' logs as if the torn log were not there (it holds
    nothing), by the reference and by the columnar engine."""
    h = simulate(random.Random(3), 300)
    backup, log_dirs = write_history(h, tmp_path)
    expected = described(reference(backup, log_dirs, h.replay_from))
    with_torn = [*log_dirs, torn_first_segment(tmp_path / "logs-torn" / "QM9", how)]
    assert described(reference(backup, with_torn, h.replay_from)) == expected
    assert columnar(backup, with_torn, h.replay_from, tmp_path / "work", workers=1) == expected
