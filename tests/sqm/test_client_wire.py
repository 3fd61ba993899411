"""The client's end of a connection (sqm.service.client_wire): replies read whole however they arrive, a get's wait
on top of the request timeout, a stream out of step refused, a close between requests seen, and a TLS socket left
as it was by the check between requests. Real sockets, a scripted server in a thread."""

from __future__ import annotations

import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from sqm.service.client_wire import RECEIVE_BUFFER, Wire
from sqm.service.protocol import HEADER, ProtocolError, encode_frame

Step = Callable[[socket.socket, dict[str, Any]], None]


def read_request(conn: socket.socket) -> dict[str, Any]:
    head = b""
    while len(head) < HEADER.size:
        head += conn.recv(HEADER.size - len(head))
    (length,) = HEADER.unpack(head)
    body = b""
    while len(body) < length:
        body += conn.recv(length - len(body))
    request: dict[str, Any] = msgpack.unpackb(body, raw=False)
    return request


class Scripted:
    """A server that accepts one connection and answers each request it reads with its next step."""

    def __init__(self, steps: list[Step], wrap: Callable[[socket.socket], socket.socket] | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.steps, self.wrap = steps, wrap
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.listener.accept()
            if self.wrap is not None:
                conn = self.wrap(conn)
            with conn:
                for step in self.steps:
                    step(conn, read_request(conn))
                conn.recv(1)  # until the client closes
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors.append(e)

    def stop(self) -> None:
        self.listener.close()
        self.thread.join(10)


def reply(result: Any, *, delay: float = 0.0, pieces: int = 1, extra: bytes = b"", rid: int | None = None) -> Step:
    def step(conn: socket.socket, request: dict[str, Any]) -> None:
        time.sleep(delay)
        frame = encode_frame({"id": request["id"] if rid is None else rid, "ok": True, "result": result}) + extra
        cut = max(1, len(frame) // pieces)
        for at in range(0, len(frame), cut):
            conn.sendall(frame[at:at + cut])
            if pieces > 1:
                time.sleep(0.02)
    return step


def close_after_reply(conn: socket.socket, request: dict[str, Any]) -> None:
    reply("bye")(conn, request)
    conn.shutdown(socket.SHUT_RDWR)


def connect(server: Scripted, request_timeout: float = 5.0) -> Wire:
    return Wire(socket.create_connection(("127.0.0.1", server.port)), request_timeout=request_timeout,
                max_frame=64 * 2**20)


def call(wire: Wire, rid: int, wait_s: float = 0.0, request_timeout: float | None = None) -> Any:
    timeout = wire.request_timeout if request_timeout is None else request_timeout
    return wire.exchange(wire.frame({"id": rid, "op": "ping", "args": {}}), rid, timeout, wait_s)


def test_replies_are_read_whole_in_pieces_longer_than_the_buffer_and_two_in_one_read() -> None:
    big = b"x" * (3 * RECEIVE_BUFFER)
    first_of_two = encode_frame({"id": 5, "ok": True, "result": "second"})
    server = Scripted([reply("one"), reply("split", pieces=7), reply(big, pieces=3), reply(big[:RECEIVE_BUFFER - 100]),
                       reply("first", extra=first_of_two)])
    try:
        wire = connect(server)
        assert call(wire, 1)["result"] == "one"
        assert call(wire, 2)["result"] == "split"
        assert call(wire, 3)["result"] == big
        assert call(wire, 4)["result"] == big[:RECEIVE_BUFFER - 100]
        assert call(wire, 5)["result"] == "first"
        # What came past a reply is not thrown away, and is no reply to wait for: the server spoke unasked.
        assert wire.closed_while_idle()
        wire.close()
    finally:
        server.stop()
    assert not server.errors


def test_a_get_may_take_its_wait_on_top_of_the_request_timeout_and_no_more() -> None:
    server = Scripted([reply("late but waited for", delay=0.6), reply("too late", delay=0.8)])
    try:
        # The client's timeout when it connected, then shortened by the application (Client.request_timeout, which
        # the client passes with each request): the next requests keep to it.
        wire = connect(server, request_timeout=30.0)
        assert call(wire, 1, wait_s=0.5, request_timeout=0.3)["result"] == "late but waited for"  # within 0.3 + 0.5
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no reply within"):
            call(wire, 2, request_timeout=0.3)  # no wait: the request timeout alone
        assert 0.25 < time.monotonic() - t0 < 0.55  # once the request timeout, not twice
        wire.close()
    finally:
        server.stop()


def test_a_reply_to_another_request_means_the_stream_is_out_of_step() -> None:
    def nil(conn: socket.socket, request: dict[str, Any]) -> None:
        conn.sendall(HEADER.pack(1) + b"\xc0")
    server = Scripted([nil, reply("stale", rid=41)])
    try:
        wire = connect(server)
        assert call(wire, 41) is None  # a reply of nil is a reply (the client refuses it as malformed)
        with pytest.raises(ProtocolError, match="out of step"):
            call(wire, 42)
        wire.close()
    finally:
        server.stop()


def test_a_close_by_the_server_between_requests_is_seen_before_the_next_is_sent() -> None:
    server = Scripted([reply("still here"), close_after_reply])
    try:
        wire = connect(server)
        assert call(wire, 1)["result"] == "still here"
        assert not wire.closed_while_idle()
        assert call(wire, 2)["result"] == "bye"
        deadline = time.monotonic() + 5
        while not wire.closed_while_idle():
            assert time.monotonic() < deadline, "the server's close was never seen"
            time.sleep(0.01)
        wire.close()
    finally:
        server.stop()


def test_the_tls_check_between_requests_leaves_the_socket_blocking(tmp_path: Path) -> None:
    """A TLS record without data (a session ticket) makes the socket readable between replies: the check reads
    without waiting, and must put the socket's timeout back, or the next reply, not there yet, would fail."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=wire",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    server = Scripted([reply("first"), reply("after the check", delay=0.2)],
                      wrap=lambda s: server_ctx.wrap_socket(s, server_side=True))
    try:
        client_ctx = ssl.create_default_context(cafile=str(cert))
        sock = client_ctx.wrap_socket(socket.create_connection(("127.0.0.1", server.port)),
                                      server_hostname="127.0.0.1")
        wire = Wire(sock, request_timeout=5.0, max_frame=2**20)
        assert call(wire, 1)["result"] == "first"

        class Readable:  # as poll answers when such a record came
            def poll(self, timeout: int) -> list[tuple[int, int]]:
                return [(sock.fileno(), select.POLLIN)]
        wire._poll = Readable()  # type: ignore[assignment]
        assert not wire.closed_while_idle()
        assert call(wire, 2)["result"] == "after the check"
        wire.close()
    finally:
        server.stop()


def test_the_idle_check_reads_tcp_info_on_linux_alone() -> None:
    """tcpi_state is numbered as Linux numbers it: on a BSD that names TCP_INFO too (ESTABLISHED is 4 there) the
    check would find every idle connection closed, so there the socket is polled instead."""
    probe = ("import sys; sys.platform = {!r}; import sqm.service.client_wire as w; "
             "print(w.TCP_INFO is None)")
    for platform, polled in (("freebsd14", "True"), ("linux", "False")):
        out = subprocess.run([sys.executable, "-c", probe.format(platform)], capture_output=True, text=True,
                             timeout=60, check=True).stdout.strip()
        assert out == polled, (platform, out)
