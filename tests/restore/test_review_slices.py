"""Review of the sliced log scan (restore.log_slices, restore.partitioned._scan_slice): what an operator would hit.

- A corrupt log read by a worker process is the LogCorruptError it always was (one line naming the file), not a
  worker that "stopped" with a TypeError: LogCorruptError does not survive pickle on its own.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from restore.engine import LocalEngine
from sqm.log import LogCorruptError
from sqm.log.format import list_segments
from tests.restore.test_engine_spark import NOW_MS, S, simulate, write_history

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
