"""Peer recovery fencing a member in the middle of its PREPARE, for the tests of the prepare's vote on a restore held
at its load (tests/support/restore_at_load.py, member QM1): a peer, QM2, started beside QM1 on the same group and
logs; QM1's log appends wrapped so that at its PREPARE record QM1's lease lapses and QM2 recovers its work
(sqm.core.recovery.recover_peer), either just before the record is written or once it is forced."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from cfemu import keys
from sqm.core.manager import QueueManager
from sqm.core.recovery import PeerRecoveryReport, recover_peer
from tests.support.group import start_qm
from tests.support.restore_at_load import RestoreAtLoad


@contextmanager
def peer_beside(redis_url: str, at: RestoreAtLoad) -> Iterator[QueueManager]:
    """QM2 started (no housekeeping thread) beside the test's QM1, and stopped again."""
    peer = start_qm(redis_url, at.logs, "QM2", background=False)
    try:
        yield peer
    finally:
        peer.stop(checkpoint=False)


def fence_at_prepare(at: RestoreAtLoad, peer: QueueManager, monkeypatch: pytest.MonkeyPatch, *,
                     forced: bool) -> list[PeerRecoveryReport | None]:
    """From now on QM1's first PREPARE record meets peer recovery: QM1's lease lapses and ``peer`` recovers it,
    once the record is forced (forced True: on disk when the peer reads the log) or just before it is written.
    Returns the list the recovery's report goes to."""
    append = at.qm.append
    recovered: list[PeerRecoveryReport | None] = []

    def fenced(record: dict[str, Any], **kw: Any) -> None:
        if forced:
            append(record, **kw)
        if record["k"] == "PREPARE" and not recovered:
            peer.redis.delete(keys.lease("QM1"))  # its lease has lapsed
            recovered.append(recover_peer(peer, "QM1"))
        if not forced:
            append(record, **kw)

    monkeypatch.setattr(at.qm, "append", fenced)
    return recovered
