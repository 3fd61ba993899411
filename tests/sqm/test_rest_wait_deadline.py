"""A waiting REST get answers when its wait is over, not up to a poll interval (50 ms) later: its last look at the
queue is at the end of the wait, never after it. Before, the get slept its whole poll interval past the end of the
wait and looked once more: a message arriving in the last 50 ms of the wait was taken after the wait was over, and
answered to a client that may have stopped reading at its ``wait`` (its connection's end seen only after the take:
a message consumed for nobody), and an empty queue's 204 came up to 50 ms late. A real member serving REST in this
process, a real redis-server, raw sockets."""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sqm.test_rest_connection_ends import AUTH, PATH, connect, read_to_end
from tests.support.inprocess_server import RunningServer
from tests.support.rest_member import rest_member_of_its_own

ROUNDS = 24


@pytest.fixture
def member(redis_server: Any, tmp_path: Any) -> Iterator[RunningServer]:
    with rest_member_of_its_own(redis_server, tmp_path) as running:
        yield running


def put_native(member: RunningServer, body: bytes) -> None:
    conn = member.server.qm.connect()
    try:
        conn.put("Q1", body, syncpoint=False)
    finally:
        conn.close()


def timed_get(member: RunningServer, wait_ms: int) -> tuple[float, bytes]:
    """A DELETE waiting ``wait_ms``: how long after it was sent its reply was whole (s), and the reply."""
    request = (f"DELETE {PATH}?wait={wait_ms} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n"
               "ibm-mq-rest-csrf-token: 1\r\nConnection: close\r\n\r\n").encode()
    with connect(member) as s:
        t0 = time.monotonic()
        s.sendall(request)
        reply = read_to_end(s)
        return time.monotonic() - t0, reply


@pytest.mark.timed
def test_a_waiting_get_answers_when_its_wait_is_over(member: RunningServer) -> None:
    """Each round waits a different time (the poll interval's phase at the end of the wait differs), on an empty
    queue or with a message put in the last 50 ms of the wait: the reply is never much later than the wait."""
    rng = random.Random(11)
    late: list[float] = []
    for i in range(ROUNDS):
        wait_ms = rng.randrange(250, 350)
        timer = None
        if i % 2:
            timer = threading.Timer((wait_ms - rng.uniform(5, 50)) / 1000, put_native, (member, f"m{i}".encode()))
            timer.start()
        took, reply = timed_get(member, wait_ms)
        if timer is not None:
            timer.join()
        assert reply.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 204 ")), reply[:200]
        late.append(took - wait_ms / 1000)
    mean_ms, worst_ms = statistics.mean(late) * 1000, max(late) * 1000
    assert mean_ms < 12, f"replies came {mean_ms:.1f} ms after the wait on average (worst {worst_ms:.1f} ms)"


def test_a_caller_that_leaves_while_its_commit_waits_for_a_thread_gets_nothing_taken(member: RunningServer) -> None:
    """The get took the message and its caller was still there; its commit waits for one of the busy request
    threads, and the caller hangs up meanwhile: the commit looks once more, in its thread, and the get is backed
    out. Before, it was committed for a caller seen there a while before: the message consumed for nobody."""
    rest = member.server.rest
    assert rest is not None
    release = threading.Event()
    busy = [rest.executor.submit(release.wait, 30) for _ in range(member.server.config.rest_workers)]
    try:
        put_native(member, b"kept")
        s = connect(member)
        s.sendall((f"DELETE {PATH}?wait=5000 HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n"
                   "ibm-mq-rest-csrf-token: 1\r\n\r\n").encode())  # its get runs in a waiting get's thread
        time.sleep(0.5)  # the message taken, the commit queued behind the busy threads
        s.close()
        time.sleep(0.3)  # the member sees the caller's end of stream
    finally:
        release.set()
        for f in busy:
            f.result(10)
    _, reply = timed_get(member, 2000)
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"\r\n\r\nkept"), reply[:300]
