"""MAXUMSGS through the REST door and the kombu transport, beside the native protocol, on a member whose limit is
2 messages a unit of work. A native client under syncpoint is refused its third get (MQRC_SYNCPOINT_LIMIT_REACHED,
2024). The doors give each request (REST) and each delivery (kombu) a unit of work of its own, holding one message:
they never reach the limit, however many messages a client takes in a row or holds unacknowledged at once, and
kombu's purge takes its batches within the limit. Were a door's unit of work refused, REST answers IBM's error
body, 503 with reasonCode 2024 (its unit of work backed out: try again). A real member in this process, a real
redis-server, the native client, urllib and kombu."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.errors import SyncpointLimitError
from sqm.service.client import Client
from sqm.service.config import ServerConfig
from sqm.service.rest import mq_failure
from tests.sqm.test_rest import CSRF, basic, http
from tests.support.group import define_group
from tests.support.inprocess_server import RunningServer
from tests.support.rest_member import TOKEN, rest_url

kombu = pytest.importorskip("kombu")

import qsg.kombu_transport as kt  # noqa: E402

MAXUMSGS = 2


@pytest.fixture
def member(redis_server: Any, tmp_path: Path) -> Iterator[RunningServer]:
    client = redis_server.client()
    client.flushall()
    client.close()
    define_group(redis_server.url, queues=("Q1",))
    running = RunningServer(ServerConfig(name="QM1", log_root=tmp_path / "logs", redis_url=redis_server.url,
                                         token=TOKEN, port=0, rest_port=0, lease_ms=1000,
                                         ready_file=tmp_path / "QM1.ready", max_umsgs=MAXUMSGS))
    try:
        yield running
    finally:
        running.stop()


def put(member: RunningServer, count: int) -> None:
    with Client(member.endpoint, token=TOKEN) as c:
        for n in range(count):
            c.put("Q1", f"m{n}".encode(), syncpoint=False)


def test_the_native_protocol_refuses_a_get_past_maxumsgs(member: RunningServer) -> None:
    put(member, MAXUMSGS + 1)
    with Client(member.endpoint, token=TOKEN) as c:
        for _ in range(MAXUMSGS):
            c.get("Q1")
        with pytest.raises(SyncpointLimitError):
            c.get("Q1")
        c.backout()


def test_rest_gets_each_hold_one_message_in_a_unit_of_work_of_their_own(member: RunningServer) -> None:
    count = 3 * MAXUMSGS
    put(member, count)
    bodies = []
    for _ in range(count):
        r = http("DELETE", rest_url(member), headers={**basic(TOKEN), **CSRF}, auth=False)
        assert r.status == 200, (r.status, r.body[:300])
        bodies.append(r.body)
    assert bodies == [f"m{n}".encode() for n in range(count)]
    refused = mq_failure(SyncpointLimitError("get on Q1 refused: MAXUMSGS 2"), "get on 1").response()
    assert refused.status == 503 and refused.text is not None
    assert '"reasonCode": 2024' in refused.text and '"msgId": "MQWB0303E"' in refused.text


def test_kombu_holds_more_deliveries_than_maxumsgs_and_purges_within_it(member: RunningServer) -> None:
    count = 3 * MAXUMSGS
    put(member, count)
    url = kt.members_url([member.endpoint], TOKEN)
    got: list[Any] = []
    with kombu.Connection(url, transport_options={"max_unacked": count, "polling_interval": 0.05}) as conn:
        queue = kombu.Queue("Q1", routing_key="Q1")
        with conn.Consumer(queue, callbacks=[lambda body, message: got.append(message)], prefetch_count=count):
            for _ in range(10):
                try:
                    conn.drain_events(timeout=0.2)
                except TimeoutError:
                    pass
            assert len(got) == count  # every one unacknowledged at once: a unit of work each
            for m in got:
                m.ack()
        put(member, count)
        with conn.channel() as channel:
            assert channel.queue_purge("Q1") == count  # batches of at most MAXUMSGS
    with Client(member.endpoint, token=TOKEN) as c:
        assert list(c.browse("Q1")) == []
