"""A restore that planned while another restore brought the structure back, after which the CF was lost again by a
flush (FLUSHALL: the same server, the same run id). The CF no longer holds anything of the other restore (its token,
its generation, its state), so the claim alone cannot tell: the structure looks as it did when this restore started.
The other restore's point in the backup directory says it: a restore or purge point written since this restore
chose its base. Loading its plan would bring back the structure as it was before the other restore, without the
work committed on it since (acknowledged to the applications), in a generation below the other's."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from backup.catalog import list_backups
from backup.points import PURGE, RESTORE, kind_of
from backup.run import run_backup
from cfemu.admin import Admin
from restore import run as restore_run
from restore.engine import SETTLE
from restore.run import RestoreError, run_purge, run_restore
from tests.restore.test_ownership import in_thread
from tests.restore.test_restore import S, all_keys, drain
from tests.support.group import define_group, rejoin, start_qm
from tests.support.harness import lose_cf


class HeldAtSettle:
    """A progress callback that holds a restore once it has read the logs, before it claims the structure."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.release = threading.Event()

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if phase == SETTLE and not self.held.is_set():
            self.held.set()
            assert self.release.wait(60)


def test_a_restore_that_planned_before_another_restore_and_a_flush_of_the_cf_refuses(redis_url: str,
                                                                                   tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    conn = qm.connect()
    for i in range(5):
        conn.put("Q1", f"m{i}".encode())
    conn.commit()
    run_backup(client, S, backups, log_root=logs)
    lose_cf(client)

    held = HeldAtSettle()
    stale, outcome = in_thread(lambda: run_restore(client, S, backup_root=backups, log_root=logs, progress=held))
    assert held.held.wait(60)
    other = run_restore(client, S, backup_root=backups, log_root=logs)  # restores it, ACTIVE again
    assert other.loaded_entries == 5 and Admin(client).state(S) == "ACTIVE"
    rejoin(qm)
    conn = qm.connect()
    conn.put("Q1", b"committed after the other restore")
    conn.commit()  # acknowledged
    lose_cf(client)  # lost again: flushed
    before = all_keys(client)

    held.release.set()
    stale.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], RestoreError), outcome
    message = str(outcome[0])
    assert message.startswith("restore of APP1 refused: another restore or a purge wrote its restore point "), message
    assert other.restore_point in message and "nothing was written" in message and "\n" not in message
    assert all_keys(client) == before
    assert [kind_of(b.manifest) for b in list_backups(backups, S) if b.manifest].count(RESTORE) == 1

    # Run again, it starts at the other restore's point: the work committed since is there.
    again = run_restore(client, S, backup_root=backups, log_root=logs)
    assert again.backup_id == other.restore_point
    rejoin(qm)
    assert [body for body, _ in drain(qm.connect(), "Q1")] == [
        *(f"m{i}".encode() for i in range(5)), b"committed after the other restore"]
    qm.stop()


def test_a_purge_that_began_before_a_restore_and_a_flush_of_the_cf_refuses(redis_url: str, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a purge: one chosen on the lost CF, a restore bringing the structure back and work committed
    on it before the purge claims, then the CF flushed again. The purge refuses in one line, writing nothing; it
    empties a structure only as it saw it."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    conn = qm.connect()
    conn.put("Q1", b"m0")
    conn.commit()
    run_backup(client, S, backups, log_root=logs)
    lose_cf(client)

    others: list[str] = []
    checked = restore_run.refuse_missing_member_logs

    def another_restore_first(*args: object, **kwargs: object) -> None:
        # Between the purge's start and its claim: another restore, work on the structure, the CF flushed.
        if not others:
            others.append(run_restore(client, S, backup_root=backups, log_root=logs).restore_point)
            rejoin(qm)
            again = qm.connect()
            again.put("Q1", b"committed after the other restore")
            again.commit()
            lose_cf(client)
        checked(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(restore_run, "refuse_missing_member_logs", another_restore_first)
    with pytest.raises(RestoreError) as refused:
        run_purge(client, S, backup_root=backups, log_root=logs)
    message = str(refused.value)
    assert message.startswith("purge of APP1 refused: another restore or a purge wrote its restore point "), message
    assert others[0] in message and "nothing was written" in message and "\n" not in message
    assert all_keys(client) == {}
    assert [kind_of(b.manifest) for b in list_backups(backups, S) if b.manifest].count(PURGE) == 0
    qm.stop()
