"""A server that says it needs no authentication is refused by a client that holds a token (docs/security.md).

Anything that can answer on a member's address (a local user who took its port while it was down, or whoever sits in
the path of a connection without TLS) could otherwise skip the mutual proof by saying "no authentication required"
and be sent the client's requests: its messages, and the logon tokens of its users in clear.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from sqm.service.client import Client
from sqm.service.protocol import HEADER, NotAuthorizedError, decode_body, encode_frame, ok_reply


class Impostor:
    """A socket server on 127.0.0.1 that answers hello with `auth.required` false and every request with ok, and
    keeps every request it was sent."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._answer, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    head = conn.recv(HEADER.size, socket.MSG_WAITALL)
                    if len(head) < HEADER.size:
                        return
                    (n,) = HEADER.unpack(head)
                    req = decode_body(conn.recv(n, socket.MSG_WAITALL))
                    self.received.append(req)
                    result = ({"qmgr": "QM1", "version": 3, "max_frame": 1 << 20, "session": 1,
                               "auth": {"required": False, "methods": [], "nonce": b""}}
                              if req["op"] == "hello" else {"pong": True})
                    conn.sendall(encode_frame(ok_reply(req["id"], result, uow=False)))
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for t in self.threads:
            t.join(timeout=5)

    def ops(self) -> list[str]:
        return [r["op"] for r in self.received]


@pytest.fixture
def impostor() -> Iterator[Impostor]:
    server = Impostor()
    try:
        yield server
    finally:
        server.close()


def test_a_client_holding_a_token_refuses_a_server_that_needs_no_authentication(impostor: Impostor) -> None:
    with pytest.raises(NotAuthorizedError, match="says it needs no authentication.*holds a application token"):
        Client(f"127.0.0.1:{impostor.port}", token="the-application-token", connect_timeout=3, request_timeout=3,
               reconnect_timeout=1)
    assert impostor.ops() == ["hello"]  # the hello tells nothing secret; nothing after it was sent
    assert "the-application-token" not in repr(impostor.received)


def test_an_operator_token_is_refused_to_it_too(impostor: Impostor) -> None:
    with pytest.raises(NotAuthorizedError, match="holds a operator token"):
        Client(f"127.0.0.1:{impostor.port}", token="the-operator-token", role="operator", connect_timeout=3,
               request_timeout=3, reconnect_timeout=1)
    assert impostor.ops() == ["hello"]


def test_a_member_run_with_no_auth_is_reached_without_a_token_or_when_the_caller_allows_it(
        impostor: Impostor) -> None:
    with Client(f"127.0.0.1:{impostor.port}", connect_timeout=3, request_timeout=3) as c:
        c.ping()
    with Client(f"127.0.0.1:{impostor.port}", token="a-token", allow_unauthenticated=True, connect_timeout=3,
                request_timeout=3) as c:
        c.ping()
    assert impostor.ops() == ["hello", "ping", "hello", "ping"]
