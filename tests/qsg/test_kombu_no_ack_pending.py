"""The pending commit and the kombu transport's no-ack delivery.

A no-ack delivery (``basic_get(no_ack=True)``, a ``basic_consume`` with ``no_ack``) takes its message under syncpoint
and commits at once (qsg/kombu_transport.py, Channel._take). A commit that answers pending completes the get later:
the message is delivered all the same (as a get outside syncpoint delivers it), never consumed for nobody."""

from __future__ import annotations

import time
from typing import Any

import pytest

kombu = pytest.importorskip("kombu")

import qsg.kombu_transport as kt  # noqa: E402
from cfemu.admin import Admin  # noqa: E402
from cfemu.connection import connect  # noqa: E402
from cfemu.errors import MQError, OutcomeUnknownError  # noqa: E402
from sqm.service.client import Client  # noqa: E402
from tests.restore.test_xa_resolve_during_restore_network import member_process, pending  # noqa: E402,F401 - the fixture
from tests.support.service_proc import TOKEN, ServerProc  # noqa: E402

S = "APP1"


def test_a_no_ack_delivery_whose_commit_is_pending_is_never_consumed_for_nobody(
        member: ServerProc, fresh_redis: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(member.endpoint, token=TOKEN) as producer:
        producer.put("Q1", b"no-ack delivery", syncpoint=False)
    admin = Admin(connect(fresh_redis.url))
    real_get = Client.get

    def get_then_structure_fails(self: Client, *args: Any, **kwargs: Any) -> Any:
        m = real_get(self, *args, **kwargs)
        admin.set_state(S, "FAILED")  # the structure fails between the delivery's get and its commit
        return m

    monkeypatch.setattr(Client, "get", get_then_structure_fails)
    delivered: list[bytes] = []
    told: list[int] = []
    conn = kombu.Connection(kt.members_url([("127.0.0.1", member.port)], TOKEN),
                            transport_options={"polling_interval": 0.05})
    try:
        try:
            m = conn.default_channel.basic_get("Q1", no_ack=True)
            if m is not None:
                delivered.append(m.body)
        except MQError as e:
            told.append(e.reason)  # 2124: the commit answered pending
    finally:
        monkeypatch.setattr(Client, "get", real_get)
        conn.release()
    admin.set_state(S, "ACTIVE")  # the structure is back: the member completes its pending commits
    deadline = time.monotonic() + 60
    while pending(member) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pending(member) == 0
    with Client(member.endpoint, token=TOKEN) as c:
        left = [m.body for m in c.browse("Q1")]
    assert delivered or told == [2124], (delivered, told)
    # At least once: delivered to the consumer, or still on the queue.
    assert delivered == [b"no-ack delivery"] or left == [b"no-ack delivery"], (delivered, left)


def test_a_no_ack_delivery_whose_commit_outcome_is_unknown_is_delivered(
        member: ServerProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit is made, and its reply lost (the connection, or the member's log, failed during it): the
    consumer gets the message all the same, and the connection is not reused."""
    with Client(member.endpoint, token=TOKEN) as producer:
        producer.put("Q1", b"reply lost", syncpoint=False)
    real_commit = Client.commit
    closed: list[Client] = []

    def commit_then_reply_lost(self: Client, *args: Any, **kwargs: Any) -> Any:
        real_commit(self, *args, **kwargs)
        raise OutcomeUnknownError("connection lost during commit (injected): it may or may not have committed")

    real_close = Client.close

    def noted_close(self: Client) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(Client, "commit", commit_then_reply_lost)
    monkeypatch.setattr(Client, "close", noted_close)
    conn = kombu.Connection(kt.members_url([("127.0.0.1", member.port)], TOKEN),
                            transport_options={"polling_interval": 0.05})
    try:
        m = conn.default_channel.basic_get("Q1", no_ack=True)
        assert closed, "the connection whose commit's outcome is not known was reused"
    finally:
        monkeypatch.setattr(Client, "commit", real_commit)
        monkeypatch.setattr(Client, "close", real_close)
        conn.release()
    assert m is not None and m.body == b"reply lost"  # delivered: the commit took it, never consumed for nobody
    with Client(member.endpoint, token=TOKEN) as c:
        assert [x.body for x in c.browse("Q1")] == []
