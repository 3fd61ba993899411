"""restore.log_slices: the logs' segments shared out among the processes of a restore's log scan. Every record a
plan would read is in exactly one slice; a slice is one log's run of segments; a log directory that is none, or
one member's log in two directories, is refused as before."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from restore.engine import LocalEngine
from restore.log_slices import LogSlice, log_slices
from restore.reference import read_logs, stream_logs
from restore.run import log_ranges
from sqm.log import LogFormatError, LogReader, RecordLog, merged_records
from sqm.log.format import list_segments
from tests.restore.test_engine_spark import NOW_MS, S, simulate, write_history


def _history(tmp_path: Path, steps: int = 400) -> tuple[object, list[Path], int]:
    h = simulate(random.Random(7), steps)
    backup, log_dirs = write_history(h, tmp_path)
    return backup, log_dirs, h.replay_from


def test_every_record_is_in_exactly_one_slice_and_a_slice_is_one_logs_segments(tmp_path: Path) -> None:
    _, log_dirs, replay_from = _history(tmp_path)
    assert all(len(list_segments(d)) > 3 for d in log_dirs)  # small segments: a log is several slices
    size = {(str(d), n): p.stat().st_size for d in log_dirs for n, p in list_segments(d)}
    for count in (1, 2, 5, 40):
        slices = log_slices(log_dirs, replay_from, count)
        # a slice ends once it holds its share (count slices of like size), and at the end of its log
        assert min(count, len(log_dirs)) <= len(slices) <= count + len(log_dirs)
        assert count == 1 or len(slices) >= count // 2
        covered = [(sl.directory, seg) for sl in slices for seg in sl.segments or ()]
        assert len(covered) == len(set(covered))
        assert {sl.directory for sl in slices} == {str(d) for d in log_dirs}
        read = sorted(kr for sl in slices for kr in sl.records())
        assert read == sorted(stream_logs(log_dirs, replay_from))
        sizes = [sum(size[(sl.directory, n)] for n in sl.segments or ()) for sl in slices]
        assert sizes == sorted(sizes, reverse=True)  # largest first: the readers end at about the same time


def _small_log(directory: Path) -> None:
    """40 records (LRSN 100-139) in segments of 300 bytes."""
    with RecordLog(directory, "QM1", segment_bytes=300) as log:
        for i in range(40):
            log.append({"k": "X", "l": 100 + i, "pad": "x" * 40})
        log.force()


def test_a_reader_of_some_segments_reads_only_those(tmp_path: Path) -> None:
    _small_log(tmp_path / "QM1")
    segs = [n for n, _ in list_segments(tmp_path / "QM1")]
    assert len(segs) > 3
    some = set(segs[1:3])
    got = list(LogReader(tmp_path / "QM1").records(segments=some))
    assert got and {pos.segment for pos, _ in got} == some
    assert [r["l"] for _, r in LogReader(tmp_path / "QM1").records()] == list(range(100, 140))


def test_segments_below_the_replay_are_left_out_but_never_the_last(tmp_path: Path) -> None:
    _small_log(tmp_path / "QM1")
    segs = [n for n, _ in list_segments(tmp_path / "QM1")]
    late = log_slices([tmp_path / "QM1"], 10_000, 3)  # no record reaches it: only the last segment is read
    assert [s for sl in late for s in sl.segments or ()] in ([segs[-1]], [])
    assert list(late[0].records()) == [] if late else True
    every = log_slices([tmp_path / "QM1"], 0, 3)
    assert sorted(s for sl in every for s in sl.segments or ()) == segs


def test_a_directory_that_is_no_log_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(LogFormatError, match="not a record log directory"):
        log_slices([tmp_path / "empty"], 0, 2)


@pytest.mark.parametrize("workers", [1, 2])
def test_one_members_log_in_two_directories_is_refused(tmp_path: Path, workers: int) -> None:
    backup, log_dirs, replay_from = _history(tmp_path, 200)
    twin = tmp_path / "logs" / "twin"
    shutil.copytree(log_dirs[0], twin)
    with pytest.raises(LogFormatError, match=f"member '{LogSlice(str(twin), None, 0).member()}' appears twice"):
        LocalEngine(memory=64 << 10, work_dir=tmp_path / "work", workers=workers).plan(
            S, backup, [*log_dirs, twin], replay_from, NOW_MS)  # type: ignore[arg-type]
    assert list((tmp_path / "work").iterdir()) == []


def test_a_members_second_log_directory_is_refused_by_every_reader_even_without_records(tmp_path: Path) -> None:
    """The rule is one (sqm.log.one_log_per_member), checked before any record is read: a second directory of one
    member's log is refused even when it holds no record in the replay range (the partitioned plan refused it
    only when both had records there, the Spark engine always: two answers to one operator's mistake)."""
    backup, log_dirs, replay_from = _history(tmp_path, 200)
    member = LogReader(log_dirs[0]).member
    twin = tmp_path / "logs" / "twin"
    with RecordLog(twin, member) as log:  # the same member's log, no record yet
        log.force()
    dirs = [*log_dirs, twin]
    why = f"member '{member}' appears twice: {log_dirs[0]} and {twin}"
    for workers in (1, 2):
        with pytest.raises(LogFormatError, match=why):
            LocalEngine(memory=64 << 10, work_dir=tmp_path / "work", workers=workers).plan(
                S, backup, dirs, replay_from, NOW_MS)  # type: ignore[arg-type]
    with pytest.raises(LogFormatError, match=why):
        log_slices(dirs, replay_from, 4)
    with pytest.raises(LogFormatError, match=why):
        next(iter(stream_logs(dirs, replay_from)))
    with pytest.raises(LogFormatError, match=why):
        read_logs(dirs, replay_from)
    with pytest.raises(LogFormatError, match=why):
        merged_records(dirs)
    assert list((tmp_path / "work").iterdir()) == []


def test_a_plan_of_no_logs_still_reports_reading_them(tmp_path: Path) -> None:
    """The phases a restore reports are the same whatever it reads: "read logs" with no log at all too (the
    report's timings, an operator's progress display)."""
    backup, _, _ = _history(tmp_path, 50)
    phases: list[str] = []
    LocalEngine(memory=64 << 10, work_dir=tmp_path / "work", workers=2).plan(
        S, backup, [], 0, NOW_MS, lambda phase, done, total: phases.append(phase))  # type: ignore[arg-type]
    assert [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p] == ["read backup", "read logs",
                                                                                 "settle"]


def test_the_plans_input_counts_archived_segments(tmp_path: Path) -> None:
    """Archived segments are read where the archive keeps them: the partitions are sized by them too (they were
    left out of the input's size, so a restore of archived logs planned too few partitions for its memory)."""
    from restore.engine import input_bytes

    class _NoBackup:
        manifest: dict[str, int] = {"bytes": 0, "entries": 0}

    _small_log(tmp_path / "QM1")
    before = input_bytes(_NoBackup(), [tmp_path / "QM1"], 0)  # type: ignore[arg-type]
    with RecordLog(tmp_path / "QM1", "QM1", segment_bytes=300) as log:
        assert log.archive(4, tmp_path / "archive")
    assert input_bytes(_NoBackup(), [tmp_path / "QM1"], 0) == before  # type: ignore[arg-type]


def test_a_logs_range_ends_where_the_plan_stopped_reading(tmp_path: Path) -> None:
    """The report's range of a member's log ends at the highest LRSN the plan read: records a live member
    appended after the plan (the log is read again for the report) were not replayed and are not in it."""
    _small_log(tmp_path / "QM1")  # LRSN 100-139
    assert log_ranges([tmp_path / "QM1"], 110, 139)["QM1"]["to"] == 139
    assert log_ranges([tmp_path / "QM1"], 110, 125)["QM1"] == {"dir": str(tmp_path / "QM1"), "from": 110, "to": 125}
    assert log_ranges([tmp_path / "QM1"], 110, 105)["QM1"]["to"] is None  # nothing of the range was read
    assert log_ranges([tmp_path / "QM1"], 140, 200)["QM1"]["to"] is None  # the log ends before the range
