"""The service's HTTP port (/metrics, /healthz, /readyz) has no authentication: it listened on the service's own
--host, so a server listening on every address showed its queue names, depths and counters to anyone who could
reach the machine. It now listens on loopback unless the operator names another address (--metrics-host), which
the server logs as unauthenticated. Probed with raw sockets at the machine's own non-loopback address."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.support.service_proc import TOKEN, start_server


def outward_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None when it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def raw_get(host: str, port: int, path: str = "/metrics") -> bytes:
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture
def address() -> str:
    found = outward_address()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 address to probe from")
    return found


def test_metrics_listen_on_loopback_even_when_the_service_listens_everywhere(
        redis_url: str, tmp_path: Path, address: str) -> None:
    srv = start_server(redis_url, tmp_path, "QM1", "--host", "0.0.0.0")
    try:
        with pytest.raises(ConnectionRefusedError):
            raw_get(address, srv.metrics_port)
        local = raw_get("127.0.0.1", srv.metrics_port)
        assert local.startswith(b"HTTP/1.") and b" 200 " in local.split(b"\r\n")[0] and b"sqm_" in local
        with socket.create_connection((address, srv.port), timeout=10):
            pass  # the service itself still listens where it was told
    finally:
        srv.stop()
    # listening off loopback without TLS: logon tokens and bodies would cross in clear, which the log says
    assert "the service on 0.0.0.0:" in srv.log_text() and "has no TLS" in srv.log_text(), srv.log_text()


def test_another_metrics_address_is_the_operators_choice_and_logged(
        redis_url: str, tmp_path: Path, address: str) -> None:
    srv = start_server(redis_url, tmp_path, "QM1", "--metrics-host", "0.0.0.0")
    try:
        assert b" 200 " in raw_get(address, srv.metrics_port, "/healthz").split(b"\r\n")[0]
    finally:
        srv.stop()
    assert "have no authentication" in srv.log_text() and "--metrics-host" in srv.log_text()
    assert "has no TLS" not in srv.log_text()  # the service itself on loopback


def test_a_rest_token_in_clear_off_loopback_is_said_valid_or_not(redis_url: str, tmp_path: Path,
                                                                 address: str) -> None:
    """Both are refused; the log says whether the token was one of the group's (then it is exposed: rotate it),
    where it said "rotate it if it was valid" and left the operator to guess."""
    srv = start_server(redis_url, tmp_path, "QM1", "--rest-port", "0", "--rest-host", "0.0.0.0")
    rest_port = int(json.loads((tmp_path / "QM1.ready").read_text())["rest_port"])
    try:
        for token in (TOKEN, "not-a-token-of-this-group"):
            request = (f"POST /ibmmq/rest/v3/messaging/qmgr/QM1/queue/Q1/message HTTP/1.1\r\nHost: x\r\n"
                       f"Authorization: Bearer {token}\r\nibm-mq-rest-csrf-token: 1\r\nContent-Type: text/plain\r\n"
                       "Content-Length: 1\r\nConnection: close\r\n\r\nx").encode()
            with socket.create_connection((address, rest_port), timeout=10) as s:
                s.sendall(request)
                reply = s.recv(65536)
            assert b" 401 " in reply.split(b"\r\n")[0], reply[:200]
    finally:
        srv.stop()
    lines = [ln for ln in srv.log_text().splitlines() if "sent a token in clear off loopback" in ln]
    assert len(lines) == 2, lines
    assert "IT WAS VALID, treat it as exposed and rotate it" in lines[0]
    assert "it was not a token of this group" in lines[1]
    assert TOKEN not in srv.log_text()
