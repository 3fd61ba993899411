"""How the REST door ends its connections: a client that half-closes (shuts down its sending side) right after a
whole request still gets its reply, as from any HTTP server; and every way a connection can end (closed by the
client before its request was whole, half-closed, reset with SO_LINGER 0, closed while its request ran) gives back
its place under the connection caps, so many short connections never leave the door refusing new ones. A real
member serving REST in this process, a real redis-server, raw sockets."""

from __future__ import annotations

import base64
import dataclasses
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sqm.http_guard import GuardedSite
from tests.support.inprocess_server import RunningServer
from tests.support.rest_member import TOKEN, serving_rest
from tests.support.waits import wait_until

AUTH = "Basic " + base64.b64encode(f"x:{TOKEN}".encode()).decode()
PATH = "/ibmmq/rest/v3/messaging/qmgr/QM1/queue/Q1/message"
BROWSE = f"GET {PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n\r\n".encode()


@pytest.fixture(scope="module")
def member(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    client = redis_server.client()
    client.flushall()
    client.close()
    with serving_rest(redis_server.url, tmp_path_factory.mktemp("ends")) as running:
        yield running


def site_of(member: RunningServer) -> GuardedSite:
    assert member.server.rest is not None and member.server.rest.site is not None
    return member.server.rest.site


def connect(member: RunningServer) -> socket.socket:
    assert member.rest_port is not None
    return socket.create_connection(("127.0.0.1", member.rest_port), timeout=5)


def read_to_end(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def test_a_half_closed_connection_gets_the_reply_to_its_whole_request(member: RunningServer) -> None:
    for request in (BROWSE, BROWSE.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")):
        with connect(member) as s:
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            reply = read_to_end(s)
        assert reply.startswith(b"HTTP/1.1 204 "), reply[:200]


def half_closed(member: RunningServer, request: bytes) -> bytes:
    """The reply to ``request`` sent on a new connection whose sending side is then shut down."""
    with connect(member) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        return read_to_end(s)


def test_a_half_closed_put_hears_its_201_and_a_half_closed_get_takes_nothing(member: RunningServer) -> None:
    """The 201 of a put whose client half-closed is sent (before, the put was committed and the client heard nothing:
    it might send it again). A destructive get from a half-closed connection hands no message over (the end of the
    stream may be a hang-up): it says so, and the message stays on its queue."""
    body = b"half"
    post = (f"POST {PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\nibm-mq-rest-csrf-token: 1\r\n"
            f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    reply = half_closed(member, post)
    assert reply.startswith(b"HTTP/1.1 201 "), reply[:200]
    for query in ("", "?wait=2000"):
        delete = (f"DELETE {PATH}{query} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n"
                  "ibm-mq-rest-csrf-token: 1\r\n\r\n").encode()
        reply = half_closed(member, delete)
        assert reply.startswith(b"HTTP/1.1 400 "), reply[:300]
        assert b"half-close" in reply
    reply = half_closed(member, BROWSE)
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"\r\n\r\nhalf"), reply[:300]
    with connect(member) as s:  # the module's other tests find Q1 empty, whatever their order
        s.sendall(f"DELETE {PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\nibm-mq-rest-csrf-token: 1\r\n"
                  "Connection: close\r\n\r\n".encode())
        assert read_to_end(s).startswith(b"HTTP/1.1 200 ")


def reset(s: socket.socket) -> None:
    """Close ``s`` with a reset (SO_LINGER 0) rather than an orderly end of stream."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


WAITING_GET = (f"DELETE {PATH}?wait=5000 HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\n"
               "ibm-mq-rest-csrf-token: 1\r\n\r\n").encode()


def given_back(member: RunningServer, site: GuardedSite, what: str) -> None:
    """Until every connection made so far has been accepted and given back its place. A connection the kernel has
    completed may still wait in the listen backlog, not counted yet: a request on a new connection, answered, shows
    that the door has accepted every one before it (the backlog is first in, first out)."""
    close = BROWSE.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    deadline = time.monotonic() + 20
    while True:
        wait_until(lambda: site.cap.open == 0, 10, what)
        with connect(member) as s:
            s.sendall(close)
            if read_to_end(s).startswith(b"HTTP/1.1 "):  # answered (refused at the cap: reset, nothing read)
                break
        assert time.monotonic() < deadline, f"{what}: a new connection was never answered"
    wait_until(lambda: site.cap.open == 0, 10, what)


def test_every_way_a_connection_ends_gives_back_its_place_under_the_caps(member: RunningServer) -> None:
    """Past the per-address cap (64) many times over: connections closed before their request was whole, after it,
    half-closed, reset with SO_LINGER 0 before and after their request, reset while their get waited. Each gives its
    place back: none is counted once closed, and a new client is served."""
    ends = {
        "closed mid-request": lambda s: (s.sendall(BROWSE[:30]), s.close()),
        "closed after a request": lambda s: (s.sendall(BROWSE), s.close()),
        "half-closed": lambda s: (s.sendall(BROWSE), s.shutdown(socket.SHUT_WR), read_to_end(s), s.close()),
        "reset mid-request": lambda s: (s.sendall(BROWSE[:30]), reset(s)),
        "reset after a request": lambda s: (s.sendall(BROWSE), reset(s)),
        "reset before a byte": reset,
    }
    site = site_of(member)
    for how, end in ends.items():
        for _ in range(80):
            end(connect(member))
        given_back(member, site, f"every connection {how} to be given back")
    for how, end in (("reset", reset), ("closed", socket.socket.close)):
        waiting = [connect(member) for _ in range(20)]
        for s in waiting:
            s.sendall(WAITING_GET)
        time.sleep(0.5)  # the gets wait
        t0 = time.monotonic()
        for s in waiting:
            end(s)
        wait_until(lambda: site.cap.open == 0, 10, f"the connections {how} while their get waited to be given back")
        assert time.monotonic() - t0 < 2.0, f"connections {how} while their get waited were counted for seconds"
    with connect(member) as s:
        s.sendall(BROWSE.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        assert read_to_end(s).startswith(b"HTTP/1.1 204 ")


def test_pipelined_requests_of_a_half_closed_connection_are_all_answered(member: RunningServer) -> None:
    reply = half_closed(member, BROWSE * 3)
    assert reply.count(b"HTTP/1.1 ") == 3, reply[:600]


def test_a_connection_closed_with_its_request_body_unfinished_gives_back_its_place(member: RunningServer) -> None:
    """A peer that ends its stream before its request body is whole (an aborted upload) never gets an answer: its
    connection is aborted once the head timeout has passed since the end, not held under the caps for ever."""
    site = site_of(member)
    kept = site.limits
    site.limits = dataclasses.replace(kept, head_timeout_s=1.0)
    post = (f"POST {PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH}\r\nibm-mq-rest-csrf-token: 1\r\n"
            f"Content-Type: text/plain\r\nContent-Length: 100\r\n\r\n").encode() + b"abcde"
    try:
        before = site.cap.open
        for _ in range(5):
            with connect(member) as s:
                s.sendall(post)
        wait_until(lambda: site.cap.open == before, timeout=8.0, what="the unfinished requests' connections closed")
    finally:
        site.limits = kept
