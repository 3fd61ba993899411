"""`cfrestore run --mark-failed` (and `cfrestore purge --mark-failed`) of a structure its members are busy on: the
members write the structure's header on every operation (its clock, its counts) until the structure is no longer
ACTIVE, so a claim that watches the header while it is still ACTIVE finds it changed every time, and the operator's
restore of a live structure was refused ("the structure's header changed under 20 transactions in a row")."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu import keys
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import MQError
from restore.run import run_purge, run_restore
from sqm.core.manager import QueueManager
from tests.restore.test_restore import S
from tests.support.group import define_group, start_qm

WORKERS = 4
BUMP = ("if redis.call('HGET', KEYS[1], 'state') == 'ACTIVE' then redis.call('HINCRBY', KEYS[1], 'clock', 1) "
        "return 1 end return 0")


@pytest.fixture
def busy(redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, Path, Path, list[int]]]:
    """A member putting and committing on APP1 as fast as it can, until its structure is no longer ACTIVE."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    conn = qm.connect()
    for i in range(20):
        conn.put("Q1", f"m{i}".encode())
    conn.commit()
    run_backup(client, S, backups, log_root=logs)
    done, stop = [0], threading.Event()

    def work() -> None:
        c = qm.connect()
        while not stop.is_set():
            try:
                c.put("Q1", b"busy")
                c.commit()
                done[0] += 1
            except MQError:
                return  # the structure failed under it: the restore's mark

    def write_header() -> None:
        # What every member script does to the header while the structure is ACTIVE (its clock, its counts), as
        # fast as a connection can, so that a claim watching the header of an ACTIVE structure never gets in.
        header = connect(redis_url)
        while not stop.is_set() and header.eval(BUMP, 1, keys.meta(S)):
            pass

    threads = [threading.Thread(target=work, daemon=True) for _ in range(WORKERS)]
    threads += [threading.Thread(target=write_header, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    while done[0] < 50:
        stop.wait(0.01)
    try:
        yield qm, logs, backups, done
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        qm.stop()


def test_a_restore_of_a_busy_structure_marked_failed_claims_it(busy: tuple[QueueManager, Path, Path, list[int]],
                                                                redis_url: str) -> None:
    qm, logs, backups, done = busy
    cf = connect(redis_url)
    result = run_restore(cf, S, backup_root=backups, log_root=logs, mark_failed=True)
    assert Admin(cf).state(S) == "ACTIVE" and result.loaded_entries >= 20


def test_a_purge_of_a_busy_structure_marked_failed_claims_it(busy: tuple[QueueManager, Path, Path, list[int]],
                                                              redis_url: str) -> None:
    qm, logs, backups, done = busy
    cf = connect(redis_url)
    run_purge(cf, S, backup_root=backups, log_root=logs, mark_failed=True)
    assert Admin(cf).state(S) == "ACTIVE"
