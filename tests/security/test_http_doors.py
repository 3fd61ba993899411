"""The HTTP doors of a member (its REST port, its metrics port) against a peer that has not authenticated: a
message whose properties HTTP cannot carry is left on its queue, never consumed for nobody; idle and half-sent
connections are closed and capped; malformed requests do not flood the member's log; a /metrics flood costs the CF
one collection per cache period. Real members, raw sockets; caps and timeouts set small."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import resource
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sqm.service.client import Client
from tests.support.raw_sockets import closed_by_server, exchange
from tests.support.service_proc import TOKEN, ServerProc, fresh_group, start_server
from tests.support.slowloris import Slowloris

REST = "/ibmmq/rest/v3/messaging/qmgr/QM1/queue/Q1/message"


def rest_request(port: int, method: str) -> bytes:
    auth = "Basic " + base64.b64encode(f"x:{TOKEN}".encode()).decode()
    return exchange(port, (f"{method} {REST} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n"
                      "ibm-mq-rest-csrf-token: 1\r\nConnection: close\r\n\r\n").encode())


def rest_member(redis_server: Any, tmp_path: Path, *args: str) -> tuple[ServerProc, int]:
    fresh_group(redis_server)
    srv = start_server(redis_server.url, tmp_path, "QM1", "--rest-port", "0", *args)
    return srv, int(json.loads((tmp_path / "QM1.ready").read_text())["rest_port"])


@pytest.mark.parametrize("props, named", [({"note": "a\r\nSet-Cookie: owned=1"}, "note"),
                                          ({"a b": "v"}, "a b"),
                                          ({"x\r\nSet-Cookie": "owned=1"}, "x\\r\\nSet-Cookie")])
def test_a_message_whose_property_http_cannot_carry_is_left_on_its_queue(
        redis_server: Any, tmp_path: Path, props: dict[str, str], named: str) -> None:
    """The native protocol may carry any property; the REST door answers 400 naming the property (as for a body
    that is not UTF-8) and backs the get out: the message stays for a native client. Before, the get was committed
    and then aiohttp refused to send the reply: the message was gone and the caller saw a dropped connection."""
    srv, port = rest_member(redis_server, tmp_path)
    try:
        with Client(srv.endpoint, token=TOKEN) as c:
            c.put("Q1", b"planted", syncpoint=False, properties=props)
            for method in ("GET", "DELETE"):
                reply = rest_request(port, method)
                head, _, body = reply.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 400 "), reply[:300]
                error = json.loads(body)["error"][0]
                assert error["msgId"] == "MQWB0303E" and error["reasonCode"] == 2110
                assert named in error["message"] and "native client" in error["action"]
                assert b"owned" not in head  # nothing of the property reached the reply's headers
            left = c.browse("Q1", 10)
            assert len(left) == 1 and left[0].body == b"planted" and left[0].properties == props
            got = c.get("Q1", syncpoint=False)  # the native client still gets it, its property whole
            assert got.properties == props
    finally:
        srv.stop()


def test_rest_connections_are_capped_and_idle_ones_closed(redis_server: Any, tmp_path: Path) -> None:
    """Past the cap (per peer here) a new connection is closed at once; a connection that sends no whole request
    head is closed after the head timeout, one idle after a reply after the keep-alive timeout; the member serves
    requests meanwhile and after. Before, aiohttp held an idle connection for an hour, with no cap."""
    srv, port = rest_member(redis_server, tmp_path, "--http-head-timeout", "1", "--rest-keepalive-timeout", "1",
                            "--rest-max-connections", "6", "--rest-max-connections-per-peer", "3")
    held: list[socket.socket] = []
    try:
        for partial in (b"", b"GET / HTTP/1.1\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n"):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(partial)
            held.append(s)
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert closed_by_server(extra, 0.5), "a fourth connection from one address was not closed at once"
        extra.close()
        t0 = time.monotonic()
        for s in held:
            assert closed_by_server(s, 3.0), "a connection without a whole request head was held open"
        assert time.monotonic() - t0 < 2.5
        # a connection that got a reply and then sits idle: closed after the keep-alive timeout
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /ibmmq/rest/v3/messaging/qmgr/QM1/queue/Q1/message HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(5)
            assert s.recv(65536).startswith(b"HTTP/1.1 401 ")
            assert closed_by_server(s, 3.0), "an idle keep-alive connection was held open"
        assert rest_request(port, "GET").startswith(b"HTTP/1.1 204 ")  # the door serves after all that
    finally:
        for s in held:
            s.close()
        srv.stop()
    assert "closed at once: the cap of 3 connections at once from 127.0.0.1 is reached" in srv.log_text()


def test_a_put_whose_body_trickles_in_is_refused_408_and_nothing_is_put(redis_server: Any, tmp_path: Path) -> None:
    """An authenticated put whose body comes a byte at a time held its connection and its admitted slot for as long
    as bytes kept coming. Its body must be whole within the head timeout (plus its length at the least rate): else
    408, the connection closed, and no message put."""
    srv, port = rest_member(redis_server, tmp_path, "--http-head-timeout", "1")
    auth = "Basic " + base64.b64encode(f"x:{TOKEN}".encode()).decode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall((f"POST {REST} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nibm-mq-rest-csrf-token: 1"
                       "\r\nContent-Type: text/plain;charset=utf-8\r\nContent-Length: 100\r\n\r\nbody").encode())
            s.settimeout(0.2)
            t0, answer = time.monotonic(), b""
            while time.monotonic() - t0 < 6 and not answer:
                s.sendall(b"x")
                try:
                    answer = s.recv(65536)
                except TimeoutError:
                    pass
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:80] or b"no answer in 6 s"
            assert time.monotonic() - t0 < 3.0
            assert closed_by_server(s, 3.0), "the connection of a late body was kept open"
        with Client(srv.endpoint, token=TOKEN) as c:
            assert len(c.browse("Q1", 10)) == 0
        assert rest_request(port, "GET").startswith(b"HTTP/1.1 204 ")  # the door serves after it
    finally:
        srv.stop()


def test_a_slowloris_from_several_addresses_does_not_keep_a_client_out_of_the_rest_door(
        redis_server: Any, tmp_path: Path) -> None:
    """Two local addresses, each under its per-address cap, hold the whole door with partial request heads and
    reopen every connection it closes. Before, the cap refused every newcomer (0 of 10 requests answered, as 0 of 40
    against the default caps with four addresses); now the oldest connection without a whole head is closed to make
    room, and the client is served every time."""
    srv, port = rest_member(redis_server, tmp_path, "--http-head-timeout", "30", "--rest-max-connections", "8",
                            "--rest-max-connections-per-peer", "4")
    try:
        with Slowloris(port, ["127.0.0.2", "127.0.0.3"], 4) as attack:
            time.sleep(0.3)
            replies = [rest_request(port, "GET")[:12] for _ in range(10)]
            assert attack.opened > 8  # it did reopen the connections the door closed
        assert replies == [b"HTTP/1.1 204"] * 10, replies
    finally:
        srv.stop()
    assert "closed to make room for a new one" in srv.log_text()


def test_a_slowloris_from_several_addresses_does_not_keep_a_scraper_out_of_the_metrics_port(
        redis_server: Any, tmp_path: Path) -> None:
    """The same against the member's metrics port (four addresses of eight filled it with the defaults)."""
    fresh_group(redis_server)
    srv = start_server(redis_server.url, tmp_path, "QM1", "--metrics-max-connections", "4",
                       "--metrics-max-connections-per-peer", "2", "--http-head-timeout", "30")
    try:
        with Slowloris(srv.metrics_port, ["127.0.0.2", "127.0.0.3"], 2, b"GET /metrics HTTP/1.1\r\n"):
            time.sleep(0.3)
            replies = [exchange(srv.metrics_port, b"GET /healthz HTTP/1.0\r\n\r\n")[:15] for _ in range(10)]
        assert replies == [b"HTTP/1.1 200 OK"] * 10, replies
    finally:
        srv.stop()


def test_malformed_requests_do_not_flood_the_members_log(redis_server: Any, tmp_path: Path) -> None:
    """aiohttp logged a traceback at ERROR for each malformed request: a peer that has not authenticated could
    write the member's log as fast as it could send. Now at most one line a second per kind, no traceback."""
    srv, port = rest_member(redis_server, tmp_path)
    try:
        for _ in range(20):
            reply = exchange(port, b"GET /" + b"Q" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", wait=3)
            assert reply.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")) or reply == b""
        assert rest_request(port, "GET").startswith(b"HTTP/1.1 204 ")
    finally:
        srv.stop()
    text = srv.log_text()
    assert "Traceback" not in text
    lines = [ln for ln in text.splitlines() if "aiohttp" in ln or "Error handling request" in ln or "ERROR" in ln]
    assert len(lines) <= 3, lines


def test_a_malformed_request_is_logged_without_what_the_peer_sent(redis_server: Any, tmp_path: Path) -> None:
    """aiohttp's parse error quotes the first bytes of the line it refused: an over-long Authorization line put
    the caller's credential into the member's log."""
    srv, port = rest_member(redis_server, tmp_path)
    secret = "SECRETSTANDIN0123456789abcdef"
    try:
        reply = exchange(port, (f"GET {REST} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {secret}"
                                + "x" * 9000 + "\r\n\r\n").encode(), wait=3)
        assert reply.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")) or reply == b""
        deadline = time.monotonic() + 10
        while "LineTooLong" not in srv.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        srv.stop()
    text = srv.log_text()
    assert "LineTooLong (HTTP 400; what the peer sent is not logged)" in text, text[-2000:]
    assert secret not in text and "Bearer" not in text


def test_metrics_port_connections_are_capped(redis_server: Any, tmp_path: Path) -> None:
    """The metrics port has no authentication: past its cap a new connection is closed at once, and one that
    sends no whole request head is closed after the head timeout."""
    fresh_group(redis_server)
    srv = start_server(redis_server.url, tmp_path, "QM1", "--metrics-max-connections-per-peer", "2",
                       "--http-head-timeout", "1")
    held: list[socket.socket] = []
    try:
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            held.append(s)
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=5)
        assert closed_by_server(extra, 0.5), "a third connection from one address was not closed at once"
        extra.close()
        for s in held:
            assert closed_by_server(s, 3.0)
        assert b" 200 " in exchange(srv.metrics_port, b"GET /healthz HTTP/1.0\r\n\r\n").split(b"\r\n")[0]
    finally:
        for s in held:
            s.close()
        srv.stop()


def test_a_metrics_flood_costs_the_cf_one_collection_per_cache_period(redis_server: Any, tmp_path: Path) -> None:
    """Each /metrics request made a full collection from the CF (several commands per queue); now a page serves
    every scrape for --metrics-cache seconds, and concurrent scrapes share one collection."""
    admin = fresh_group(redis_server)
    for i in range(10):
        admin.define_queue(f"QX{i}", "APP1")
    srv = start_server(redis_server.url, tmp_path, "QM1", "--metrics-cache", "30",
                       "--metrics-max-connections-per-peer", "16")
    cf = redis_server.client()
    url = f"http://127.0.0.1:{srv.metrics_port}/metrics"

    def scrape(_: int = 0) -> bytes:
        with urllib.request.urlopen(url, timeout=10) as r:
            return bytes(r.read())

    def commands() -> int:
        return int(cf.info("stats")["total_commands_processed"])
    try:
        c0 = commands()
        first = scrape()
        one = commands() - c0
        assert b"sqm_" in first
        c1 = commands()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            pages = list(pool.map(scrape, range(40)))
        forty = commands() - c1
        assert all(p == first for p in pages)  # the cached page, collected once
        assert forty < one, f"40 scrapes cost {forty} CF commands, one cost {one}"
    finally:
        cf.close()
        srv.stop()


def test_accept_errors_when_out_of_file_descriptors_do_not_flood_the_log(redis_server: Any, tmp_path: Path) -> None:
    """A member out of file descriptors failed hundreds of accepts a second, each logged at ERROR with its
    traceback; now one line a second, saying how many were not logged. The member's limit is lowered (prlimit) so
    that tens of connections reach it, with the REST caps above that."""
    srv, port = rest_member(redis_server, tmp_path, "--rest-max-connections", "500",
                            "--rest-max-connections-per-peer", "500")
    in_use = len(list(Path(f"/proc/{srv.proc.pid}/fd").iterdir()))
    _, hard = resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE, (in_use + 30, hard))
    held: list[socket.socket] = []
    try:
        end = time.monotonic() + 3
        while time.monotonic() < end and len(held) < 200:
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                time.sleep(0.01)
    finally:
        for s in held:
            s.close()
        srv.stop()
    accept_lines = [ln for ln in srv.log_text().splitlines() if "socket.accept() out of system resource" in ln]
    assert 1 <= len(accept_lines) <= 5, accept_lines[:10]
    assert any("more like it not logged" in ln for ln in accept_lines)
