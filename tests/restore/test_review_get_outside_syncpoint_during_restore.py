"""Adversarial review of the pending commit: a get outside syncpoint whose structure fails, and is restored,
between its get and its COMMIT.

A restore that read the logs before that get's COMMIT backs the get out, and the message is delivered again. The get
must therefore never answer plainly "done": it raises OutcomePendingError carrying the message (delivered, never
consumed for nobody), so that two gets are never both told done for one message (invariant 1, docs/invariants.md,
and the chaos checker's `duplicated`)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from backup.run import run_backup
from cfemu.errors import MQError, NoMessageError, OutcomePendingError
from restore.engine import LOAD
from restore.run import run_restore
from sqm.core.manager import QueueManager
from sqm.core.uow import UnitOfWork
from tests.restore.test_restore import S
from tests.restore.test_restore_commit_during_load import settle
from tests.sqm.test_put_committed_recovery import warm
from tests.support.group import define_group, start_qm

WAIT_S = 120


def test_a_message_is_never_delivered_to_two_gets_outside_syncpoint_that_each_answered_done(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, lease_ms=60_000)
    restore_out: dict[str, Any] = {}
    read, go = threading.Event(), threading.Event()

    def during_load(phase: str, done: int, total: int | None) -> None:
        if phase == LOAD and not read.is_set():
            read.set()  # the restore has read the logs (its plan is made)
            go.wait(WAIT_S)

    def restore() -> None:
        try:
            restore_out["result"] = run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True,
                                                progress=during_load)
        except BaseException as e:  # reported by the test below
            restore_out["error"] = e

    thread = threading.Thread(target=restore, daemon=True)
    try:
        warm(qm1)
        qm1.connect().put("Q1", b"once only", syncpoint=False)
        run_backup(client, S, backups, log_root=logs)
        real = QueueManager.log_decision

        def restore_before_the_force(self: QueueManager, uow: UnitOfWork, commit: bool, **kw: Any) -> int:
            # The get has taken the message on the CF (and logged its GET); the structure fails now and its
            # restore reads the logs before this COMMIT is forced.
            monkeypatch.setattr(QueueManager, "log_decision", real)
            thread.start()
            assert read.wait(WAIT_S), f"the restore never reached its load: {restore_out}"
            return real(self, uow, commit, **kw)

        monkeypatch.setattr(QueueManager, "log_decision", restore_before_the_force)
        first: object
        try:
            first = qm1.connect().get("Q1", syncpoint=False).body
        except MQError as e:  # any refusal or an unknown outcome is an honest answer
            first = e
        go.set()
        thread.join(WAIT_S)
        assert "result" in restore_out, restore_out
        settle(qm1)
        if isinstance(first, OutcomePendingError):
            # Told its get is pending, the application has the message all the same: never consumed for nobody.
            assert first.message is not None and first.message.body == b"once only", first.message
            return
        if first != b"once only":
            return
        # The first get answered done with the message: no later get may be given it again.
        try:
            again = qm1.connect().get("Q1", syncpoint=False).body
        except NoMessageError:
            again = None
        assert again is None, f"delivered by two gets outside syncpoint that each answered done: {again!r}"
    finally:
        go.set()
        if thread.is_alive():
            thread.join(WAIT_S)
        qm1.stop(checkpoint=False)
