"""A wall clock stepped back (NTP, or a backup or purge run on a host whose clock is behind): backups and restore
points are ordered by the start_lrsn the CF ticked (backup.catalog.order_lrsn), as log retention orders them, not by
the time in their ids. Else log prune keeps the logs from one backup while restore starts from another, and a point
made behind the clock is crossed."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import redis

import backup.points
import backup.run
from backup.catalog import list_backups
from backup.files import MANIFEST_NAME, parse_backup_id
from restore.run import RestoreError, run_purge, run_restore
from sqm.cli import main as sqm_main
from sqm.core.manager import QueueManager
from tests.support.group import define_group, rejoin, start_qm
from tests.support.harness import lose_cf
from tests.support.wall_clock import clock_behind

S = "APP1"
BACK = timedelta(minutes=2)


def _messages(qm: QueueManager) -> list[bytes]:
    return sorted(m.body for m in qm.connect().browse("Q1", limit=10_000))


def _work(qm: QueueManager, prefix: str, n: int = 5) -> None:
    c = qm.connect()
    for i in range(n):
        c.put("Q1", f"{prefix}{i}".encode() + b"." * 300)
        c.commit()


def test_a_backup_taken_with_the_clock_back_is_the_base_after_the_logs_were_pruned_to_it(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1", "Q2"))
    qm = start_qm(redis_url, logs, "QM1", background=False, segment_bytes=4096)
    _work(qm, "M")
    first = backup.run.run_backup(client, S, backups, log_root=logs)
    _work(qm, "N")  # committed after the first backup: in the second and in the logs only
    c = qm.connect()
    c.get("Q1")  # consumed after the first backup
    c.commit()
    for _ in range(20):  # log load, so that segments roll and prune has something to remove
        c.put("Q2", b"churn" + b"." * 300, syncpoint=False)
        c.get("Q2", syncpoint=False)
    with clock_behind(backup.run, BACK):
        second = backup.run.run_backup(client, S, backups, log_root=logs)
    assert parse_backup_id(second["id"])[1] < parse_backup_id(first["id"])[1]  # its id says it is older
    assert second["start_lrsn"] > first["start_lrsn"]
    assert [b.id for b in list_backups(backups, S)] == [second["id"], first["id"]]
    qm.checkpoint("after the second backup")
    truth = _messages(qm)
    qm.stop(checkpoint=False)
    capsys.readouterr()
    assert sqm_main(["log", "prune", "--all", "--json", "--log-root", str(logs), "--redis-url", redis_url]) == 0
    assert json.loads(capsys.readouterr().out)["pruned"]  # down to the second backup's replay start
    lose_cf(client)

    result = run_restore(client, S, backup_root=backups, log_root=logs)

    assert result.backup_id == second["id"]
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        assert _messages(qm) == truth  # nothing committed lost, nothing consumed back
    finally:
        qm.stop()


def _purged_behind_the_clock(redis_url: str, logs: Path,
                             backups: Path) -> tuple[redis.Redis, QueueManager, str, str]:
    """A fuzzy backup, then the CF lost and the structure purged on a clock behind the backup's: (the CF, the
    member, the backup's id, the purge point's id)."""
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    _work(qm, "M")
    fuzzy = backup.run.run_backup(client, S, backups, log_root=logs)["id"]
    lose_cf(client)
    with clock_behind(backup.points, BACK):
        point = run_purge(client, S, backup_root=backups, log_root=logs).restore_point
    assert parse_backup_id(point)[1] < parse_backup_id(fuzzy)[1]
    return client, qm, fuzzy, point


def test_a_purge_point_made_with_the_clock_behind_the_last_backup_is_not_crossed(
        redis_url: str, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client, qm, fuzzy, point = _purged_behind_the_clock(redis_url, logs, backups)
    assert [b.id for b in list_backups(backups, S)] == [point, fuzzy]
    rejoin(qm)
    c = qm.connect()
    c.put("Q1", b"after the purge")
    c.commit()
    lose_cf(client)
    qm.stop(checkpoint=False)

    result = run_restore(client, S, backup_root=backups, log_root=logs)

    assert result.backup_id == point
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        assert _messages(qm) == [b"after the purge"]  # the purged messages stay purged
    finally:
        qm.stop()


def test_a_damaged_purge_point_behind_the_clock_is_refused_not_crossed(
        redis_url: str, tmp_path: Path) -> None:
    """Its manifest unreadable, nothing says where the point stands but its id, whose time is behind: it counts as
    newer than the good backup whatever its time."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client, qm, _, point = _purged_behind_the_clock(redis_url, logs, backups)
    qm.stop(checkpoint=False)
    (backups / S / point / MANIFEST_NAME).write_bytes(b"{not json")
    lose_cf(client)

    with pytest.raises(RestoreError, match=f"backup {point} of {S} is corrupt .* would cross the restore or purge"):
        run_restore(client, S, backup_root=backups, log_root=logs)
