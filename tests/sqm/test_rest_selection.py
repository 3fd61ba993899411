"""A REST browse by messageId or correlationId (GET .../message and .../messagelist with the query parameter) finds
its messages through the CF's index of the id, a bounded batch per CF call (peek_scan.lua), never by reading the
queue: each call's cost is bounded however long the queue, a message anywhere on the queue is found, and what comes
back is what a browse shows (available messages only, in get order). A real member serving REST in this process,
a real redis-server, a plain HTTP client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from cfemu.cf import Structure
from cfemu.errors import NoMessageError
from cfemu.limits import CF_STEP, MAX_ID_LENGTH
from tests.sqm.test_rest import CSRF, basic, http
from tests.support.inprocess_server import RunningServer
from tests.support.rest_member import TOKEN, rest_member_of_its_own, rest_url

BULK = 2 * CF_STEP + 40  # messages sharing one correlation id: more than two batches of the index


@pytest.fixture(scope="module")
def member(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with rest_member_of_its_own(redis_server, tmp_path_factory.mktemp("selection")) as running:
        yield running


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[int]]]:
    """The CF's browse pages and index batches the member asks for (the count each asked for), and the bytes of
    data the CF's replies to its index batches and its reads of entries' data carried."""
    seen: dict[str, list[int]] = {"browse_page": [], "peek_scan": [], "peek_scan_data": [], "entry_data": []}
    real_page, real_scan, real_data = Structure.browse_page, Structure.peek_scan, Structure.entry_data

    def browse_page(self: Structure, queue: str, limit: int, *args: Any, **kw: Any) -> Any:
        seen["browse_page"].append(limit)
        return real_page(self, queue, limit, *args, **kw)

    def peek_scan(self: Structure, queue: str, match: str, value: str, cursor: str = "0", count: int = 500,
                  **kw: Any) -> Any:
        seen["peek_scan"].append(count)
        out = real_scan(self, queue, match, value, cursor, count, **kw)
        seen["peek_scan_data"].append(sum(len(d) for _, d in out[1]))
        return out

    def entry_data(self: Structure, queue: str, ids: Any) -> Any:
        out = real_data(self, queue, ids)
        seen["entry_data"].append(sum(len(got[1]) for got in out if got))
        return out

    monkeypatch.setattr(Structure, "browse_page", browse_page)
    monkeypatch.setattr(Structure, "peek_scan", peek_scan)
    monkeypatch.setattr(Structure, "entry_data", entry_data)
    yield seen


def get(member: RunningServer, query: str, resource: str = "message") -> Any:
    return http("GET", rest_url(member, resource=resource) + query, headers=basic(TOKEN), auth=False)


def test_a_lookup_by_id_reads_the_ids_index_in_bounded_batches_not_the_queue(
        member: RunningServer, calls: dict[str, list[int]]) -> None:
    qm = member.server.qm
    conn = qm.connect()
    try:
        bulk = [conn.put("Q1", b"b%d" % i, correlid=b"bulk", priority=i % 3, persistent=False, syncpoint=False)
                for i in range(BULK)]  # priorities 0-2 interleaved: get order is by priority, then FIFO
        conn.put("Q1", b"gone", correlid=b"needle", expiry_ms=1, persistent=False, syncpoint=False)
        held = conn.put("Q1", b"held", correlid=b"needle", priority=9, persistent=False, syncpoint=False)
        needle = conn.put("Q1", b"the needle", correlid=b"needle", persistent=False, syncpoint=False)
        padded = conn.put("Q1", b"padded", correlid=b"pad".ljust(MAX_ID_LENGTH, b"\0"), persistent=False,
                          syncpoint=False)
        time.sleep(0.01)  # "gone" has expired
        taker = qm.connect()
        assert taker.get("Q1", msgid=held.msgid).body == b"held"  # held by an open unit of work: not available
        calls["browse_page"].clear()

        r = get(member, "?correlationId=needle")
        assert (r.status, r.body) == (200, b"the needle"), (r.status, r.body[:300])
        r = get(member, f"?messageId={needle.msgid.hex()}")
        assert (r.status, r.body) == (200, b"the needle")
        r = get(member, "?correlationId=pad")  # put padded to MQ's 24 bytes by a native client, asked for bare
        assert (r.status, r.body, r.headers["ibm-mq-md-messageid"]) == (200, b"padded", "ID:" + padded.msgid.hex())
        assert get(member, "?correlationId=nothing").status == 204

        listed = get(member, f"?correlationId=bulk&limit={BULK}", "messagelist").json()["messages"]
        order = sorted(range(BULK), key=lambda i: (-(i % 3), i))
        assert [m["messageId"] for m in listed] == ["ID:" + bulk[i].msgid.hex() for i in order]
        first = get(member, "?correlationId=bulk&limit=5", "messagelist").json()["messages"]
        assert first == listed[:5]

        assert calls["browse_page"] == []  # the queue itself was never read
        assert calls["peek_scan"] and max(calls["peek_scan"]) <= CF_STEP
        assert get(member, "?correlationId=").body == get(member, "").body  # none to match, as a DELETE reads it
        taker.close()
    finally:
        conn.close()


def test_a_lookup_carries_from_the_cf_the_data_of_the_messages_it_shows_and_no_others(
        member: RunningServer, calls: dict[str, list[int]]) -> None:
    """The index's batches carried every match's data: 256 messages of the largest size a queue takes, one call's
    reply of gigabytes for a lookup that shows one. They carry descriptors now; the data is read for those shown."""
    conn = member.server.qm.connect()
    big = 256 * 1024
    try:
        for i in range(12):
            conn.put("Q1", bytes([65 + i]) * big, correlid=b"large", persistent=False, syncpoint=False)
        r = get(member, "?correlationId=large")
        assert (r.status, r.body) == (200, b"A" * big)
        assert sum(calls["peek_scan_data"]) == 0 and calls["entry_data"] == [big]
        listed = get(member, "?correlationId=large&limit=3", "messagelist").json()["messages"]
        assert len(listed) == 3 and calls["entry_data"] == [big]  # a list shows descriptors: no data read
        assert sum(calls["peek_scan_data"]) == 0
        while True:  # leave the queue as the module found it
            try:
                conn.get("Q1", correlid=b"large", syncpoint=False)
            except NoMessageError:
                break
    finally:
        conn.close()


def test_a_delete_by_correlation_id_takes_the_message_a_browse_by_it_shows(member: RunningServer) -> None:
    """A browse by correlationId matches the id as given and as MQ's 24-byte field holds it (padded with NULs); a
    DELETE matched the bytes as given only, so it took another message than the browse showed, or none."""
    conn = member.server.qm.connect()
    try:
        padded = conn.put("Q1", b"put padded", correlid=b"both".ljust(MAX_ID_LENGTH, b"\0"), persistent=False,
                          syncpoint=False)
        conn.put("Q1", b"put bare", correlid=b"both", persistent=False, syncpoint=False)
        shown = get(member, "?correlationId=both")
        assert (shown.status, shown.body) == (200, b"put padded")
        taken = http("DELETE", rest_url(member) + "?correlationId=both", headers={**basic(TOKEN), **CSRF}, auth=False)
        assert (taken.status, taken.body, taken.headers["ibm-mq-md-messageid"]) == (
            200, b"put padded", "ID:" + padded.msgid.hex())
        again = http("DELETE", rest_url(member) + "?correlationId=both", headers={**basic(TOKEN), **CSRF}, auth=False)
        assert (again.status, again.body) == (200, b"put bare")
        assert http("DELETE", rest_url(member) + "?correlationId=both", headers={**basic(TOKEN), **CSRF},
                    auth=False).status == 204
    finally:
        conn.close()
