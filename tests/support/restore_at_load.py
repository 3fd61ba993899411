"""A restore held at its load, for the tests of work a member does while its structure is restored: one member
(QM1, no housekeeping thread, a lease long enough for the test) on structure APP1 of a real redis-server, its first
CF calls made; a backup of the structure; then a RECOVER CFSTRUCT (the structure marked failed, restored from the
backup and the logs) that runs the test's action once, when the restore begins its load: after it read the logs,
before the structure is ACTIVE again."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from backup.run import run_backup
from cfemu.errors import OutcomePendingError
from restore.engine import LOAD
from restore.run import run_restore
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager
from tests.support.group import define_group, rejoin, start_qm, warm

STRUCTURE = "APP1"


@dataclass
class RestoreAtLoad:
    client: redis.Redis
    qm: QueueManager
    conn: Connection  # the application's connection to QM1
    logs: Path
    backups: Path

    def backup(self) -> None:
        run_backup(self.client, STRUCTURE, self.backups, log_root=self.logs)

    def restore(self, at_load: Callable[[], None] | None = None, *, mark_failed: bool = True) -> None:
        """Restore the structure from the latest backup and the logs; ``at_load`` runs once, when the restore begins
        its load (it must get there). mark_failed False: the structure has failed already."""
        ran: list[bool] = []

        def progress(phase: str, done: int, total: int | None) -> None:
            if at_load is not None and phase == LOAD and not ran:
                ran.append(True)
                at_load()

        run_restore(self.client, STRUCTURE, backup_root=self.backups, log_root=self.logs, mark_failed=mark_failed,
                    progress=progress)
        assert ran or at_load is None, "the restore never reached its load"

    def restore_committing(self) -> list[str]:
        """Restore the structure with the application's commit of its unit of work made at the load. What the
        application was told: ["committed"], or ["pending", the error's text] (OutcomePendingError)."""
        told: list[str] = []

        def commit() -> None:
            try:
                self.conn.commit()
                told.append("committed")
            except OutcomePendingError as e:
                told.extend(["pending", str(e)])

        self.restore(commit)
        return told

    def commit_during_restore(self) -> tuple[list[str], list[tuple[bytes, int]]]:
        """A backup, then a restore during whose load the application commits its unit of work, the member
        settled on the restored structure: what the application was told (restore_committing) and the queue Q1
        then (view)."""
        self.backup()
        told = self.restore_committing()
        self.settle()
        return told, self.view()

    def settle(self) -> None:
        settle(self.qm)

    def view(self, queue: str = "Q1") -> list[tuple[bytes, int]]:
        """The queue's available messages: (body, backout count), in get order."""
        return [(m.body, m.backout_count) for m in self.qm.connect().browse(queue, limit=100)]


def settle(qm: QueueManager) -> None:
    """The member back on the restored structure, its pending outcomes retried until none is left."""
    rejoin(qm)
    qm.retry_pending()
    assert not qm.pending, f"still pending after the restore: {list(qm.pending)}"


@contextmanager
def restore_at_load(redis_url: str, tmp_path: Path) -> Iterator[RestoreAtLoad]:
    """QM1 started on APP1 (queues Q1, Q2) with its logs and the backups under tmp_path, and stopped again."""
    logs = tmp_path / "logs"
    client = define_group(redis_url, structure=STRUCTURE)
    qm = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    at = RestoreAtLoad(client, qm, qm.connect(), logs, tmp_path / "backups")
    try:
        warm(qm)
        yield at
    finally:
        at.qm.stop(checkpoint=False)  # the member the test left there (it may have restarted QM1)
