"""The commit outside syncpoint that skips standing.lua (sqm.core.manager.complete pstore_checked):
the skip holds only when the put's or get's own script checked the persistent store for all of the UOW's
persistent work just before the force. Real redis-server, real logs."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.errors import BackedOutError
from sqm.core.connection import Message
from tests.support.group import define_group, start_qm


def test_a_waiting_get_that_moved_a_poison_message_asks_the_store_before_its_commit(
        redis_url: str, tmp_path: Path) -> None:
    """A get outside syncpoint that meets a poison message moves it to the backout queue (a persistent get and
    put) and waits on for a message to deliver. The store is disconnected meanwhile; the message that comes is
    non-persistent, which get.lua takes while disconnected. The UOW's persistent work was checked only when it
    was done, seconds before: its COMMIT must not be forced on a disconnected store (docs/pstore.md)."""
    client = define_group(redis_url, queues=("BQ",))
    Admin(client).define_queue("IN", "APP1", backout_threshold=1, backout_queue="BQ")
    qm = start_qm(redis_url, tmp_path, "QM1", background=False)
    try:
        c, other = qm.connect(), qm.connect()
        c.put("IN", b"poison", syncpoint=False)
        c.get("IN")
        c.backout()  # backout count 1: poison from now on
        got: list[Message | BaseException] = []

        def waiting_get() -> None:
            try:
                got.append(c.get("IN", syncpoint=False, wait_ms=5000))
            except BaseException as e:  # noqa: BLE001 - examined below
                got.append(e)
        t = threading.Thread(target=waiting_get)
        t.start()
        time.sleep(0.5)  # the get moved the poison message and waits for the next one
        CF(client).structure("APP1").pstore("disconnect")
        other.put("IN", b"plain", persistent=False, syncpoint=False)
        t.join(10)
        assert len(got) == 1
        assert isinstance(got[0], BackedOutError), got[0]
        CF(client).structure("APP1").pstore("connect")
        assert [m.body for m in other.browse("BQ")] == []
        assert sorted(m.body for m in other.browse("IN")) == [b"plain", b"poison"]
    finally:
        qm.stop()
