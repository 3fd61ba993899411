"""The sliced log scan (restore.log_slices, restore.partitioned._scan_slice) over a corrupt log and a log still
being written: what an operator would hit.

- A corrupt log read by a worker process is the LogCorruptError it always was (one line naming the file), not a
  worker that "stopped" with a TypeError: LogCorruptError does not survive pickle on its own.
- A member still logging while the restore plans (the re-plan after the claim of an ACTIVE structure, with
  mark_failed): the slices are made before the backup is read, the logs read after; a segment the member starts
  meanwhile must be read, as stream_logs reads each log to its end when it gets to it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from restore.engine import READ_BACKUP, LocalEngine
from restore.log_slices import log_slices
from restore.reference import stream_logs
from sqm.log import LogCorruptError, RecordLog
from sqm.log.format import list_segments
from tests.restore.test_engine_spark import NOW_MS, S, simulate, write_history
from tests.restore.test_partitioned import described, reference

TINY = 64 << 10


def _corrupt_a_middle_segment(log_dir: Path) -> Path:
    segs = list_segments(log_dir)
    assert len(segs) > 3
    _, path = segs[len(segs) // 2]  # sealed: damage there is corruption, never a torn tail
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the last frame's body: its CRC no longer matches
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_a_corrupt_log_read_by_a_worker_is_reported_as_corrupt_naming_the_file(tmp_path: Path,
                                                                                 workers: int) -> None:
    h = simulate(random.Random(7), 400)
    backup, log_dirs = write_history(h, tmp_path)
    bad = _corrupt_a_middle_segment(log_dirs[0])
    engine = LocalEngine(memory=TINY, work_dir=tmp_path / "work", workers=workers, partitions=8)
    with pytest.raises(LogCorruptError) as caught:
        engine.plan(S, backup, log_dirs, h.replay_from, NOW_MS)
    e = caught.value
    assert e.path == str(bad) and "CRC mismatch" in e.what
    assert str(e).startswith(f"corrupt record log {bad} at byte offset ") and "\n" not in str(e)
    assert list((tmp_path / "work").iterdir()) == []


def _split_history(tmp_path: Path, tail: int) -> tuple[Any, Any, list[Path], str, list[dict[str, Any]]]:
    """A history written but for the last `tail` records of its busiest member (logged later, as a live member
    would)."""
    h = simulate(random.Random(11), 600)
    member = max(h.logs, key=lambda m: len(h.logs[m]))
    later = h.logs[member][-tail:]
    h.logs[member] = h.logs[member][:-tail]
    backup, log_dirs = write_history(h, tmp_path)
    h.logs[member] = [*h.logs[member], *later]
    return h, backup, log_dirs, member, later


def _log_more(log_dir: Path, member: str, recs: list[dict[str, Any]]) -> None:
    before = len(list_segments(log_dir))
    with RecordLog(log_dir, member, segment_bytes=600) as log:
        for r in recs:
            log.append(dict(r))
        log.force()
    assert len(list_segments(log_dir)) > before + 1  # the member went on into segments of its own


def test_segments_a_member_starts_after_the_slicing_are_read(tmp_path: Path) -> None:
    h, _, log_dirs, member, later = _split_history(tmp_path, 40)
    slices = log_slices(log_dirs, h.replay_from, 4)
    _log_more(tmp_path / "logs" / member, member, later)
    read = sorted(kr for sl in slices for kr in sl.records())
    assert read == sorted(stream_logs(log_dirs, h.replay_from))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_plan_reads_what_a_live_member_logs_while_the_backup_is_read(tmp_path: Path, workers: int) -> None:
    h, backup, log_dirs, member, later = _split_history(tmp_path, 40)
    logged = False

    def progress(phase: str, done: int, total: int | None) -> None:
        nonlocal logged
        if phase == READ_BACKUP and not logged:  # the slices are made; the logs are read after the backup
            logged = True
            _log_more(tmp_path / "logs" / member, member, later)

    plan = LocalEngine(memory=TINY, work_dir=tmp_path / "work", workers=workers).plan(
        S, backup, log_dirs, h.replay_from, NOW_MS, progress)
    try:
        assert logged
        assert described(plan) == described(reference(backup, log_dirs, h.replay_from))
    finally:
        plan.close()


def test_the_spark_engines_scan_reads_segments_a_member_starts_after_the_listing(tmp_path: Path) -> None:
    """The Spark engine lists the segments before it reads the backup, and reads them after (a task each): the
    task of a member's last segment reads every segment the log has gained since, as the slices do."""
    pytest.importorskip("pyspark")
    from restore.engine_spark import SparkEngine, scan_segment

    h, _, log_dirs, member, later = _split_history(tmp_path, 40)
    tasks, archived = SparkEngine()._log_sources(log_dirs, h.replay_from)
    assert archived == []
    _log_more(tmp_path / "logs" / member, member, later)
    read = sorted(kr for t in tasks for kr in scan_segment(t, h.replay_from))
    assert read == sorted(stream_logs(log_dirs, h.replay_from))
