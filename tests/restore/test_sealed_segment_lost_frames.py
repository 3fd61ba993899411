"""A sealed log segment that lost whole frames at its end (cut at a frame boundary: a bad copy, writes lost in a
host crash) reads cleanly frame by frame; only its manifest entry (end offset, record count, LRSN range) tells
that committed records are gone. Every reader refuses it, naming the file, rather than restoring or recovering
around the lost records: both local restore engines end to end, the Spark engine's segment task, the log archive,
and the member's own restart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from backup.run import run_backup
from restore.run import run_restore
from sqm.log import LogCorruptError
from sqm.log.format import read_manifest, trusted_segments
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf
from tests.support.log_damage import cut_at_a_frame_boundary

S = "APP1"


def _member_with_a_cut_segment(redis_url: str, tmp_path: Path) -> tuple[redis.Redis, Path, Path, Path]:
    """QM1 logs 40 commits in small segments after a backup, and is killed (no checkpoint: its sealed segments
    have no archived copy); a sealed segment in the middle of the replay range loses its last frames."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, segment_bytes=4096)
    c = qm.connect()
    run_backup(client, S, backups, log_root=logs)
    for i in range(40):
        c.put("Q1", f"M{i:02d}".encode() + b"." * 300)
        c.commit()
    qm.stop(checkpoint=False)
    segs = sorted((logs / "QM1").glob("seg-*"))
    victim = segs[len(segs) // 2]
    assert victim.name in {e["file"] for e in (read_manifest(logs / "QM1") or {})["segments"] if e["sealed"]}
    cut_at_a_frame_boundary(victim)
    return client, logs, backups, victim


@pytest.mark.parametrize("engine", ["columnar", "local"])
def test_restore_refuses_a_sealed_segment_that_lost_frames_at_its_end(redis_url: str, tmp_path: Path,
                                                                     engine: str) -> None:
    client, logs, backups, victim = _member_with_a_cut_segment(redis_url, tmp_path)
    lose_cf(client)
    with pytest.raises(LogCorruptError) as caught:
        run_restore(client, S, backup_root=backups, log_root=logs, engine=engine)
    e = caught.value
    assert e.path == str(victim) and "\n" not in str(e)
    info = trusted_segments(logs / "QM1", read_manifest(logs / "QM1"))[int(victim.name[4:12])]
    assert f"ends at byte {info.end.offset} with {info.records} records" in e.what
    assert f"LRSN {info.min_lrsn}..{info.max_lrsn}" in e.what


def test_the_member_does_not_restart_on_a_log_that_lost_frames(redis_url: str, tmp_path: Path) -> None:
    _, logs, _, victim = _member_with_a_cut_segment(redis_url, tmp_path)
    with pytest.raises(LogCorruptError) as caught:
        start_qm(redis_url, logs, "QM1", background=False, segment_bytes=4096)
    assert caught.value.path == str(victim) and "records at its end are lost" in caught.value.what


def test_the_spark_engines_segment_task_refuses_it(redis_url: str, tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    from restore.engine_spark import SparkEngine, scan_segment

    _, logs, _, victim = _member_with_a_cut_segment(redis_url, tmp_path)
    tasks, _ = SparkEngine()._log_sources([logs / "QM1"], 0)
    task = next(t for t in tasks if t[2] == str(victim.absolute()))
    with pytest.raises(LogCorruptError) as caught:
        list(scan_segment(task, 0))
    assert caught.value.path == str(victim.absolute())


def test_the_log_archive_refuses_it(redis_url: str, tmp_path: Path) -> None:
    from restore.archive import segment_table

    _, logs, _, victim = _member_with_a_cut_segment(redis_url, tmp_path)
    segno = int(victim.name[4:12])
    info = trusted_segments(logs / "QM1", read_manifest(logs / "QM1"))[segno]
    with pytest.raises(LogCorruptError):
        segment_table(victim, segno, "QM1", info)
