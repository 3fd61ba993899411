"""Three queue managers over one CF: MQ put/get semantics under syncpoint (against a real redis-server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu import keys
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import NoMessageError, OutcomeUnknownError, StructureFullError, UnknownObjectError
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.wings import WINGS
from tests.support.group import define_group, start_qm


@pytest.fixture
def group(redis_url: str, tmp_path: Path) -> Iterator[list[QueueManager]]:
    define_group(redis_url)
    qms = [start_qm(redis_url, tmp_path / "logs", f"QM{i}", background=False) for i in (1, 2, 3)]
    yield qms
    for qm in qms:
        qm.stop()


def test_put_on_one_get_on_another(group: list[QueueManager]) -> None:
    a, b, _ = (qm.connect() for qm in group)
    a.put("Q1", b"hello")
    a.commit()
    m = b.get("Q1")
    b.commit()
    assert m.body == b"hello"
    with pytest.raises(NoMessageError):
        b.get("Q1")


def test_uncommitted_put_is_invisible_until_commit(group: list[QueueManager]) -> None:
    a, b, _ = (qm.connect() for qm in group)
    a.put("Q1", b"x")
    with pytest.raises(NoMessageError):
        b.get("Q1")
    a.commit()
    assert b.get("Q1").body == b"x"


def test_backed_out_get_returns_message_with_backout_count(group: list[QueueManager]) -> None:
    a, b, c = (qm.connect() for qm in group)
    a.put("Q1", b"m", syncpoint=False)
    assert b.get("Q1").backout_count == 0
    b.backout()
    m = c.get("Q1")
    assert m.body == b"m" and m.backout_count == 1
    c.backout()
    assert a.get("Q1").backout_count == 2


def test_priority_then_fifo(group: list[QueueManager]) -> None:
    a, b, _ = (qm.connect() for qm in group)
    order = [(0, b"a"), (5, b"b"), (0, b"c"), (9, b"d"), (5, b"e")]
    for prio, body in order:
        a.put("Q1", body, priority=prio)
    a.commit()
    got = [b.get("Q1").body for _ in order]
    assert got == [b"d", b"b", b"e", b"a", b"c"]


def test_get_by_correlation_id_and_message_id(group: list[QueueManager]) -> None:
    a, b, _ = (qm.connect() for qm in group)
    a.put("Q1", b"one", correlid=b"c1")
    m2 = a.put("Q1", b"two", correlid=b"c2")
    a.put("Q1", b"three", correlid=b"c1")
    a.commit()
    assert b.get("Q1", correlid=b"c2").body == b"two"
    assert b.get("Q1", correlid=b"c1").body == b"one"
    with pytest.raises(NoMessageError):
        b.get("Q1", msgid=m2.msgid)
    b.backout()
    assert b.get("Q1", msgid=m2.msgid).body == b"two"


def test_full_structure_refuses_and_uow_stays_consistent(redis_url: str, tmp_path: Path) -> None:
    client = define_group(redis_url, structure="SMALL", queues=("S1",), max_entries=3)
    qm = start_qm(redis_url, tmp_path, "QM1", background=False)
    try:
        c = qm.connect()
        for i in range(3):
            c.put("S1", b"%d" % i)
        with pytest.raises(StructureFullError, match="3 of 3 entries"):
            c.put("S1", b"3")
        c.commit()
        got = [c.get("S1").body for _ in range(3)]
        c.commit()
        assert got == [b"0", b"1", b"2"]
        assert client.hget(keys.meta("SMALL"), "entries") == b"0"
    finally:
        qm.stop()


def test_unknown_queue_is_clear(group: list[QueueManager]) -> None:
    with pytest.raises(UnknownObjectError, match="NOPE"):
        group[0].connect().put("NOPE", b"x")


def test_one_uow_spans_queues_puts_and_gets(group: list[QueueManager]) -> None:
    a, b, _ = (qm.connect() for qm in group)
    a.put("Q1", b"in", syncpoint=False)
    with b.unit_of_work():
        m = b.get("Q1")
        b.put("Q2", m.body + b"-out")
    assert a.get("Q2").body == b"in-out"
    with pytest.raises(NoMessageError):
        a.get("Q1")


def test_expired_message_never_returned(group: list[QueueManager]) -> None:
    a, b, _ = (qm.connect() for qm in group)
    a.put("Q1", b"short", expiry_ms=1, syncpoint=False)
    a.put("Q1", b"long", syncpoint=False)
    import time

    time.sleep(0.01)
    assert b.get("Q1").body == b"long"
    with pytest.raises(NoMessageError):
        b.get("Q1")


def test_backout_threshold_moves_poison_message(redis_url: str, tmp_path: Path) -> None:
    client = define_group(redis_url, queues=("BQ",))
    Admin(client).define_queue("IN", "APP1", backout_threshold=2, backout_queue="BQ")
    qm = start_qm(redis_url, tmp_path, "QM1", background=False)
    try:
        c = qm.connect()
        c.put("IN", b"poison", syncpoint=False)
        for _ in range(2):
            c.get("IN")
            c.backout()
        with pytest.raises(NoMessageError):
            c.get("IN")
        c.commit()
        m = c.get("BQ")
        assert m.body == b"poison" and m.backout_count == 2
    finally:
        qm.stop()


def test_outside_syncpoint_a_poison_message_alone_on_its_queue_still_moves(redis_url: str, tmp_path: Path) -> None:
    """A get outside syncpoint that moves a poison message and then finds nothing behind it commits the move
    (its own unit of work): backed out, the message went back to the head of IN at every get and never reached
    the backout queue."""
    client = define_group(redis_url, queues=("BQ",))
    Admin(client).define_queue("IN", "APP1", backout_threshold=1, backout_queue="BQ")
    qm = start_qm(redis_url, tmp_path, "QM1", background=False)
    try:
        c = qm.connect()
        c.put("IN", b"poison", syncpoint=False)
        c.get("IN")
        c.backout()  # backout count 1: at the threshold
        with pytest.raises(NoMessageError):
            c.get("IN", syncpoint=False)
        with pytest.raises(NoMessageError):
            c.get("IN", syncpoint=False)
        m = c.get("BQ", syncpoint=False)
        assert m.body == b"poison" and m.backout_count == 1
    finally:
        qm.stop()


def test_a_put_whose_cf_reply_is_lost_is_outcome_unknown_not_failed(redis_server: Any, redis_url: str,
                                                                     tmp_path: Path) -> None:
    """A non-persistent put outside syncpoint whose request reached the CF but whose reply was lost is 'outcome
    unknown', never MQRC_CF_STRUC_FAILED: the message may be on the queue and delivered later (a 'phantom' if it
    were reported failed). Here the reply is lost for real: the CF is held busy (DEBUG SLEEP from the
    harness) past the member's read timeout, and runs the put after the member stopped waiting."""
    define_group(redis_url)
    qm = QueueManager(QueueManagerConfig(name="QM1", log_root=tmp_path / "logs", redis_url=redis_url,
                                         background=False), client=connect(redis_url, socket_timeout=0.3), wings=WINGS)
    qm.start()
    try:
        conn = qm.connect()
        conn.put("Q1", b"warm-up", persistent=False, syncpoint=False)  # scripts loaded, connection open
        conn.get("Q1", syncpoint=False)
        harness = redis_server.client()
        busy = threading.Thread(target=lambda: harness.execute_command("DEBUG", "SLEEP", "1.0"))
        busy.start()
        time.sleep(0.1)
        with pytest.raises(OutcomeUnknownError, match="may or may not be on the queue"):
            conn.put("Q1", b"maybe", persistent=False, syncpoint=False)
        busy.join()
        assert [m.body for m in conn.browse("Q1")] == [b"maybe"], "the CF ran the put after the reply was lost"
    finally:
        qm.stop()
