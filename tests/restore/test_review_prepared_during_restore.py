"""Adversarial review of the pending commit: a prepared (in-doubt) unit of work and a restore.

A coordinator's resolve-commit that meets a failed or RECOVERING structure is acknowledged, on the ground that a
restore keeps in-doubt UOWs in doubt. That holds only for a restore that read the PREPARE: a unit of work prepared
while its structure's restore loads (after it read the logs) is in flight in the logs that restore read, and is
backed out by it. So Connection.prepare asks each structure of the UOW after its PREPARE is forced
(QueueManager.confirm_prepared): one that is not ACTIVE refuses the vote (BackedOutError), and a yes vote is always
one the coordinator's commit can honour."""

from __future__ import annotations

from pathlib import Path

from backup.run import run_backup
from cfemu.errors import MQError
from restore.engine import LOAD
from restore.run import run_restore
from tests.restore.test_restore import S
from tests.restore.test_restore_commit_during_load import settle, view
from tests.sqm.test_put_committed_recovery import warm
from tests.support.group import define_group, start_qm


def test_a_resolve_commit_during_a_restore_of_a_uow_prepared_after_the_restore_read_the_logs(
        redis_url: str, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    try:
        warm(qm1)
        conn = qm1.connect()
        conn.put("Q1", b"prepared during the restore")
        run_backup(client, S, backups, log_root=logs)
        told: list[str] = []

        def during_load(phase: str, done: int, total: int | None) -> None:
            if phase == LOAD and not told:
                try:
                    uow = conn.prepare("xid-review-1")  # the coordinator's phase one: voted yes
                    told.append("prepared")
                    qm1.resolve(uow, True)  # the coordinator's phase two
                    told.append("committed")
                except MQError as e:
                    told.append(f"{type(e).__name__}: {e}")

        run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True, progress=during_load)
        assert told, "the restore never reached its load"
        settle(qm1)
        after = view(qm1)
        if told[-1] == "committed":
            # The coordinator was told the unit of work committed: its put must be there.
            assert after == [(b"prepared during the restore", 0)], f"resolve answered committed, then: {after}"
    finally:
        qm1.stop(checkpoint=False)


def test_a_uow_prepared_while_a_restore_loads_can_still_be_committed_by_its_coordinator(
        redis_url: str, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    try:
        warm(qm1)
        conn = qm1.connect()
        conn.put("Q1", b"prepared during the restore")
        run_backup(client, S, backups, log_root=logs)
        prepared: list[str] = []
        refused: list[str] = []

        def during_load(phase: str, done: int, total: int | None) -> None:
            if phase == LOAD and not prepared and not refused:
                try:
                    prepared.append(conn.prepare("xid-review-2"))
                except MQError as e:  # refusing the vote is a correct answer: the coordinator backs out
                    refused.append(str(e))

        run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True, progress=during_load)
        assert prepared or refused, "the restore never reached its load"
        if refused:
            return
        settle(qm1)
        # A participant that voted yes must be able to commit when its coordinator says so (two-phase commit).
        try:
            qm1.resolve(prepared[0], True)
        except MQError as e:
            raise AssertionError(f"the coordinator's commit of a unit of work that voted yes was refused: {e}") from e
        assert view(qm1) == [(b"prepared during the restore", 0)]
    finally:
        qm1.stop(checkpoint=False)


def test_a_uow_prepared_before_the_restore_read_the_logs_is_kept_in_doubt_and_its_resolve_commit_holds(
        redis_url: str, tmp_path: Path) -> None:
    """The exemption's own ground, checked with a real restore: a PREPARE on the logs the restore reads keeps the
    unit of work in doubt in the restored structure, so a resolve-commit during the load, answered committed, ends
    with the put there."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    try:
        warm(qm1)
        conn = qm1.connect()
        conn.put("Q1", b"prepared before the restore")
        uow = conn.prepare("xid-review-3")
        run_backup(client, S, backups, log_root=logs)
        told: list[str] = []

        def during_load(phase: str, done: int, total: int | None) -> None:
            if phase == LOAD and not told:
                qm1.resolve(uow, True)
                told.append("committed")

        run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True, progress=during_load)
        assert told == ["committed"]
        settle(qm1)
        assert view(qm1) == [(b"prepared before the restore", 0)]
    finally:
        qm1.stop(checkpoint=False)
