"""A persistent put outside syncpoint (put on the CF first, then its PUT and forced COMMIT logged, then committed)
through backup and a restore in place (mark_failed), and a put made while a restore loads: each message ends as the
live CF held it, never lost once acknowledged, never delivered once refused. Real redis-server, real logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu.errors import StructureFailedError
from restore.run import run_restore
from sqm.core.manager import QueueManager
from tests.restore.test_restore import S, rejoin
from tests.support.group import define_group, start_qm


def view(qm: QueueManager, queue: str = "Q1") -> list[tuple[bytes, int]]:
    """The queue's available messages: (body, backout count), in get order."""
    return [(m.body, m.backout_count) for m in qm.connect().browse(queue, limit=100)]


@pytest.mark.parametrize("backup_at", ["before-consume", "after-consume"])
@pytest.mark.parametrize("restart", ["before-restore", "after-restore"])
def test_a_put_whose_owner_died_before_its_end_is_restored_and_redone_once(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backup_at: str, restart: str) -> None:
    """The put was committed on the CF, its owner died before its END; a consumer takes the message; a
    backup runs before or after that; the live structure is restored; the owner restarts (its redo) before or
    after the restore. The message must be consumed in the end, and the restore must agree with the CF."""
    from tests.sqm.test_put_committed_recovery import died_before_its_end
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    qm2 = start_qm(redis_url, logs, "QM2", background=False, lease_ms=60_000)
    try:
        died_before_its_end(qm1, monkeypatch)
        monkeypatch.undo()
        if backup_at == "before-consume":
            run_backup(client, S, backups, log_root=logs)
        c = qm2.connect()
        assert c.get("Q1").body == b"once"
        c.commit()
        if backup_at == "after-consume":
            run_backup(client, S, backups, log_root=logs)
        if restart == "before-restore":
            qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
            assert view(qm2) == []
            assert qm1.log is not None
            qm1.log.force()
        assert qm2.log is not None
        qm2.log.force()
        run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True)
        rejoin(qm2)
        assert view(qm2) == [], "the restore brought the consumed message back"
        if restart == "after-restore":
            qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
        else:
            rejoin(qm1)
        assert view(qm2) == [], "the owner's redo after the restore brought the consumed message back"
    finally:
        qm1.stop(checkpoint=False)
        qm2.stop(checkpoint=False)


def test_a_restore_of_a_put_whose_owner_died_before_its_end_leaves_no_tombstones_behind(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner of a put outside syncpoint died before its END; a backup, a restore, the owner's restart (its redo),
    more puts: at most one tombstone is left on the structure, not one per restore or per put."""
    from tests.sqm.test_put_committed_recovery import died_before_its_end, tombstones
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    try:
        died_before_its_end(qm1, monkeypatch)
        monkeypatch.undo()
        run_backup(client, S, backups, log_root=logs)
        run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True)
        qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
        assert qm1.connect().get("Q1", syncpoint=False).body == b"once"
        conn = qm1.connect()
        conn.put("Q1", b"learns the generation", syncpoint=False)
        conn.get("Q1", syncpoint=False)
        for i in range(3):
            qm1.connect().put("Q1", b"n%d" % i, syncpoint=False)
        left = tombstones(qm1)
        assert len(left) <= 1, f"tombstones left: {sorted(left.items())}"
    finally:
        qm1.stop(checkpoint=False)


def test_a_put_while_a_restore_loads_is_refused_before_anything_is_logged(redis_url: str, tmp_path: Path) -> None:
    """A put outside syncpoint to a structure a restore is loading goes to the CF first, which refuses it (2373):
    the application is told before anything is logged, so the put is neither acknowledged and lost (its retry after
    the restore naming the old generation) nor delivered later; made again after the restore, it is there once."""
    from restore.engine import LOAD
    from tests.sqm.test_put_committed_recovery import warm
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    refused: list[str] = []
    try:
        warm(qm1)
        conn = qm1.connect()
        run_backup(client, S, backups, log_root=logs)

        def during_load(phase: str, done: int, total: int | None) -> None:
            if phase == LOAD and not refused:
                with pytest.raises(StructureFailedError) as e:
                    conn.put("Q1", b"during the restore", syncpoint=False)
                refused.append(str(e.value))
        run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True, progress=during_load)
        assert refused and "2373" in refused[0]
        rejoin(qm1)
        qm1.retry_pending()
        assert qm1.pending == {} and qm1.uows == {}
        assert qm1.log is not None
        assert b"during the restore" not in [r.get("d") for _, r in qm1.log.records() if r["k"] == "PUT"]
        assert view(qm1) == []
        conn.put("Q1", b"during the restore", syncpoint=False)
        assert view(qm1) == [(b"during the restore", 0)]
    finally:
        qm1.stop(checkpoint=False)
