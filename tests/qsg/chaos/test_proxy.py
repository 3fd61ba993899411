"""The chaos suite's fault-injecting TCP proxy does what it says, on a loopback echo server."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from qsg.chaos.proxy import FaultProxy, ProxyError


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[0], server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(echo: tuple[str, int]) -> Iterator[FaultProxy]:
    p = FaultProxy(echo, name="test").start()
    yield p
    p.stop()


def _connect(p: FaultProxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", p.port), timeout=2)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _roundtrip(s: socket.socket, data: bytes = b"ping") -> float:
    t0 = time.monotonic()
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = s.recv(4096)
        assert chunk, "connection closed"
        got += chunk
    assert got == data
    return time.monotonic() - t0


def test_forwards_both_ways(proxy: FaultProxy) -> None:
    with _connect(proxy) as s:
        assert _roundtrip(s, b"x" * 100_000) < 1.0


def test_cut_closes_connections_and_refuses_new_ones_until_healed(proxy: FaultProxy) -> None:
    s = _connect(proxy)
    _roundtrip(s)
    proxy.cut()
    with pytest.raises(OSError):  # reset, or EOF surfacing as the echo check failing
        s.sendall(b"after the cut")
        if not s.recv(10):
            raise ConnectionResetError("closed")
    s.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    proxy.heal()
    with _connect(proxy) as s2:  # same port again
        _roundtrip(s2)


def test_delay_adds_latency_in_each_direction(proxy: FaultProxy) -> None:
    with _connect(proxy) as s:
        base = _roundtrip(s)
        proxy.delay(0.15)
        slow = _roundtrip(s)
        proxy.heal()
        fast = _roundtrip(s)
    assert slow >= 0.3 > base  # 0.15 s on the way there and again on the way back
    assert fast < 0.15


def test_half_open_forwards_nothing_and_closes_nothing_then_delivers_on_heal(proxy: FaultProxy) -> None:
    with _connect(proxy) as s:
        _roundtrip(s)
        proxy.half_open()
        s.sendall(b"held")
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):  # neither data nor EOF: the connection just hangs
            s.recv(10)
        late = _connect(proxy)  # new connections are accepted, and hang too
        late.sendall(b"late")
        late.settimeout(0.3)
        with pytest.raises(TimeoutError):
            late.recv(10)
        proxy.heal()
        s.settimeout(2)
        assert s.recv(10) == b"held"
        late.settimeout(2)
        assert late.recv(10) == b"late"
        late.close()


def test_lost_replies_reach_the_target_and_never_the_caller_then_the_cut_tells_it() -> None:
    received: list[bytes] = []

    class Recording(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            while data := self.request.recv(4096):
                received.append(data)
                self.request.sendall(data)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Recording)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    p = FaultProxy(server.server_address, name="test").start()
    try:
        with _connect(p) as s:
            _roundtrip(s)
            p.lose_replies()
            s.sendall(b"acted-on")
            s.settimeout(0.5)
            with pytest.raises(TimeoutError):  # the reply never comes
                s.recv(10)
            assert received[-1] == b"acted-on", "the request reached the target"
            p.cut()
            s.settimeout(2)
            with pytest.raises(ConnectionResetError):
                s.recv(10)
            p.heal()
        with _connect(p) as s:
            _roundtrip(s)  # forwarding both ways again
    finally:
        p.stop()
        server.shutdown()
        server.server_close()


def test_refuses_non_loopback_targets() -> None:
    with pytest.raises(ProxyError, match="127.0.0.1"):
        FaultProxy(("10.0.0.1", 80))
