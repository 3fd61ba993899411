"""The pending commit: a get outside syncpoint whose structure fails, and is restored,
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

from cfemu.errors import MQError, NoMessageError, OutcomePendingError
from sqm.core.manager import QueueManager
from sqm.core.uow import UnitOfWork
from tests.support.restore_at_load import restore_at_load

WAIT_S = 120


def test_a_message_is_never_delivered_to_two_gets_outside_syncpoint_that_each_answered_done(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    restore_out: dict[str, Any] = {}
    read, go = threading.Event(), threading.Event()

    def hold() -> None:
        read.set()  # the restore has read the logs (its plan is made)
        go.wait(WAIT_S)

    with restore_at_load(redis_url, tmp_path) as at:

        def restore() -> None:
            try:
                at.restore(hold)
                restore_out["result"] = "restored"
            except BaseException as e:  # reported by the test below
                restore_out["error"] = e

        thread = threading.Thread(target=restore, daemon=True)
        try:
            at.conn.put("Q1", b"once only", syncpoint=False)
            at.backup()
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
                first = at.qm.connect().get("Q1", syncpoint=False).body
            except MQError as e:  # any refusal or an unknown outcome is an honest answer
                first = e
            go.set()
            thread.join(WAIT_S)
            assert "result" in restore_out, restore_out
            at.settle()
            if isinstance(first, OutcomePendingError):
                # Told its get is pending, the application has the message all the same: never consumed for nobody.
                assert first.message is not None and first.message.body == b"once only", first.message
                return
            if first != b"once only":
                return
            # The first get answered done with the message: no later get may be given it again.
            try:
                again = at.qm.connect().get("Q1", syncpoint=False).body
            except NoMessageError:
                again = None
            assert again is None, f"delivered by two gets outside syncpoint that each answered done: {again!r}"
        finally:
            go.set()
            if thread.is_alive():
                thread.join(WAIT_S)
