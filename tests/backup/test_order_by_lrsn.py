"""The catalog orders backups by the start_lrsn the CF ticked (backup.catalog.order_lrsn), not by the wall-clock time
in their ids: after a clock step back the scheduler's retention and cfbackup prune keep the newest backups, not
remove each new one."""

from __future__ import annotations

import contextlib
from datetime import datetime, timedelta
from pathlib import Path

import backup.run
from backup.catalog import INCOMPLETE, list_backups, order_lrsn, prune, retain
from backup.files import new_backup_id
from tests.support.group import define_group, start_qm
from tests.support.wall_clock import clock_behind

S = "APP1"
STEP = timedelta(minutes=10)  # the clock steps back this much before the third backup


def _backups_across_a_clock_step(redis_url: str, tmp_path: Path, keep: int | None) -> tuple[list[str], list[list[str]]]:
    """Four backups, the clock stepped back 10 minutes before the third; with `keep`, the retention after each.
    Returns the ids in the order taken, and what retention removed after each."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    c = qm.connect()
    taken, removed = [], []
    try:
        for k in range(4):
            c.put("Q1", f"M{k}".encode())
            c.commit()
            with clock_behind(backup.run, STEP) if k >= 2 else contextlib.nullcontext():
                taken.append(backup.run.run_backup(client, S, backups, log_root=logs)["id"])
            if keep is not None:
                removed.append([b.id for b in retain(backups, S, keep, client=client, log_root=logs).removed])
    finally:
        qm.stop()
    return taken, removed


def test_retention_after_a_clock_step_back_keeps_the_newest_backups(
        redis_url: str, tmp_path: Path) -> None:
    taken, removed = _backups_across_a_clock_step(redis_url, tmp_path, keep=2)
    assert removed == [[], [], [taken[0]], [taken[1]]]  # each time the oldest, never the one just taken
    assert [b.id for b in list_backups(tmp_path / "backups", S)] == [taken[3], taken[2]]


def test_the_catalog_and_prune_order_by_the_cf_clock_after_a_clock_step_back(
        redis_url: str, tmp_path: Path) -> None:
    taken, _ = _backups_across_a_clock_step(redis_url, tmp_path, keep=None)
    root = tmp_path / "backups"
    assert [b.id for b in list_backups(root, S)] == taken[::-1]
    assert [b.id for b in prune(root, S, keep=2).removed] == [taken[1], taken[0]]
    assert [b.id for b in list_backups(root, S)] == [taken[3], taken[2]]


def test_an_entry_without_a_readable_manifest_stands_at_the_end_of_its_ids_second(tmp_path: Path) -> None:
    """Nothing better than its id's time: an LRSN is microseconds since the epoch, and one begun in the same second
    as a good backup counts as the newer."""
    when = datetime(2026, 12, 1, 5, 0, 0)
    unfinished = tmp_path / S / new_backup_id(S, when)
    unfinished.mkdir(parents=True)
    [info] = list_backups(tmp_path, S)
    assert info.state == INCOMPLETE
    assert order_lrsn(info) == int(info.started.timestamp()) * 1_000_000 + 999_999
