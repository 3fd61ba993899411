"""A purge of a structure the CF lost, run on a host whose clock is behind the group's LRSNs (the members' clocks run
ahead; the structure's backups began at LRSNs the CF ticked from them). The purge's new generation and its point's
LRSN came from its own clock alone (the CF, lost, had no clock or generation left to go above): its point sorted
before the last fuzzy backup, so that the next restore started from that backup, crossed the purge, and the purged
messages came back. A restore goes above every LRSN its base records; a purge must go above those of every backup."""

from __future__ import annotations

from pathlib import Path

from backup.catalog import list_backups
from backup.run import run_backup
from restore.run import run_purge, run_restore
from tests.support.group import define_group, rejoin, start_qm
from tests.support.harness import lose_cf

S = "APP1"
AHEAD_US = 600 * 1_000_000  # the members' clocks: ten minutes ahead of this host's


def test_a_purge_on_a_host_behind_the_groups_clock_is_not_crossed_by_the_next_restore(redis_url: str,
                                                                                    tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, clock_skew_us=AHEAD_US)
    conn = qm.connect()
    for i in range(3):
        conn.put("Q1", f"purged {i}".encode())
    conn.commit()
    fuzzy = run_backup(client, S, backups, log_root=logs)
    lose_cf(client)
    purged = run_purge(client, S, backup_root=backups, log_root=logs)
    assert [b.id for b in list_backups(backups, S)][0] == purged.restore_point  # the newest: no restore crosses it
    assert purged.gen > fuzzy["start_lrsn"] and purged.gen > fuzzy["gen"]

    rejoin(qm)
    conn = qm.connect()
    conn.put("Q1", b"after the purge")
    conn.commit()
    lose_cf(client)
    result = run_restore(client, S, backup_root=backups, log_root=logs)
    assert result.backup_id == purged.restore_point
    rejoin(qm)
    assert sorted(m.body for m in qm.connect().browse("Q1", limit=100)) == [b"after the purge"]
    qm.stop()


def test_a_restore_from_an_older_backup_on_a_host_behind_the_groups_clock_makes_the_newest_point(
        redis_url: str, tmp_path: Path) -> None:
    """The same for a restore from a base the operator names (--backup), older than the last backup: the CF's
    clock, which unlogged work moves too (a non-persistent put), may stand above every LRSN of the logs when that
    backup began, and this host's clock below it. The restore's point must still be the newest: the next restore
    starts there (docs/runbook.md, "A second CF loss before the next backup")."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, clock_skew_us=AHEAD_US)
    conn = qm.connect()
    for i in range(3):
        conn.put("Q1", f"m{i}".encode())
    conn.commit()
    older = run_backup(client, S, backups, log_root=logs)
    for i in range(3):
        conn.put("Q1", f"np{i}".encode(), persistent=False, syncpoint=False)  # the CF's clock moves, unlogged
    newer = run_backup(client, S, backups, log_root=logs)
    qm.stop(checkpoint=False)
    lose_cf(client)
    result = run_restore(client, S, backup_root=backups, log_root=logs, backup_id=older["id"])
    assert result.restore_lrsn > newer["start_lrsn"]
    assert [b.id for b in list_backups(backups, S)][0] == result.restore_point
