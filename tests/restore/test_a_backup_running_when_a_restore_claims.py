"""A fuzzy backup that runs when a restore claims its structure (`cfrestore run --mark-failed` while the scheduler's
backup runs) copies what the restore's wipe and load leave at each of its steps, not the structure it began on. It
must not end ok: as the newest good backup it would be the base of the next restore, and a restore that did not
finish (killed, its CF lost) is run again from there, without the messages its copy missed, which lie below its
replay start."""

from __future__ import annotations

import threading
from pathlib import Path

from backup.catalog import OK, list_backups
from backup.run import run_backup
from cfemu.admin import Admin
from restore.engine import LOAD
from restore.run import run_restore
from tests.restore.test_ownership import in_thread
from tests.restore.test_restore import S, drain
from tests.support.group import define_group, rejoin, start_qm


class Stopped(Exception):
    """The restore ends here, as a kill or a lost CF would end it."""


def test_a_backup_running_when_a_restore_claims_the_structure_does_not_end_ok(redis_url: str,
                                                                              tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    conn = qm.connect()
    for i in range(20):
        conn.put("Q1", f"m{i:02d}".encode())
    conn.commit()
    run_backup(client, S, backups, log_root=logs)
    good_before = [b.id for b in list_backups(backups, S) if b.state == OK]

    wiped, release = threading.Event(), threading.Event()

    def at_load(phase: str, done: int, total: int | None) -> None:
        if phase == LOAD and not wiped.is_set():
            wiped.set()  # the structure is wiped, none of it loaded yet
            assert release.wait(60)
            raise Stopped()

    restoring: tuple[threading.Thread, list[object]] | None = None

    def on_step(number: int, state: str) -> None:
        nonlocal restoring
        if number == 1:  # the backup has begun; the operator restores the structure
            restoring = in_thread(lambda: run_restore(client, S, backup_root=backups, log_root=logs,
                                                      mark_failed=True, progress=at_load))
            assert wiped.wait(60)

    try:
        run_backup(client, S, backups, log_root=logs, on_step=on_step)
    except Exception:  # noqa: BLE001 - refused: what must happen
        pass
    assert restoring is not None
    release.set()
    restoring[0].join(60)
    assert len(restoring[1]) == 1 and isinstance(restoring[1][0], Stopped), restoring[1]
    assert Admin(client).state(S) == "RECOVERING"
    assert [b.id for b in list_backups(backups, S) if b.state == OK] == good_before

    # Run again, the restore gives every message back.
    again = run_restore(client, S, backup_root=backups, log_root=logs)
    assert again.loaded_entries == 20
    rejoin(qm)
    assert [body for body, _ in drain(qm.connect(), "Q1")] == [f"m{i:02d}".encode() for i in range(20)]
    qm.stop()
