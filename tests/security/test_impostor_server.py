"""A server that says it needs no authentication is refused by a client that holds a token (docs/security.md).

Anything that can answer on a member's address (a local user who took its port while it was down, or whoever sits in
the path of a connection without TLS) could otherwise skip the mutual proof by saying "no authentication required"
and be sent the client's requests: its messages, and the logon tokens of its users in clear.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sqm.service.client import Client
from sqm.service.protocol import NotAuthorizedError
from tests.support.fake_member import FakeMember


def needs_no_authentication(req: dict[str, Any]) -> dict[str, Any]:
    """An impostor's answers: hello with `auth.required` false, every other request ok."""
    if req["op"] == "hello":
        return {"qmgr": "QM1", "version": 3, "max_frame": 1 << 20, "session": 1,
                "auth": {"required": False, "methods": [], "nonce": b""}}
    return {"pong": True}


@pytest.fixture
def impostor() -> Iterator[FakeMember]:
    server = FakeMember(needs_no_authentication)
    try:
        yield server
    finally:
        server.close()


def test_a_client_holding_a_token_refuses_a_server_that_needs_no_authentication(impostor: FakeMember) -> None:
    with pytest.raises(NotAuthorizedError, match="says it needs no authentication.*holds a application token"):
        Client(f"127.0.0.1:{impostor.port}", token="the-application-token", connect_timeout=3, request_timeout=3,
               reconnect_timeout=1)
    assert impostor.ops() == ["hello"]  # the hello tells nothing secret; nothing after it was sent
    assert "the-application-token" not in repr(impostor.received)


def test_an_operator_token_is_refused_to_it_too(impostor: FakeMember) -> None:
    with pytest.raises(NotAuthorizedError, match="holds a operator token"):
        Client(f"127.0.0.1:{impostor.port}", token="the-operator-token", role="operator", connect_timeout=3,
               request_timeout=3, reconnect_timeout=1)
    assert impostor.ops() == ["hello"]


def test_a_member_run_with_no_auth_is_reached_without_a_token_or_when_the_caller_allows_it(
        impostor: FakeMember) -> None:
    with Client(f"127.0.0.1:{impostor.port}", connect_timeout=3, request_timeout=3) as c:
        c.ping()
    with Client(f"127.0.0.1:{impostor.port}", token="a-token", allow_unauthenticated=True, connect_timeout=3,
                request_timeout=3) as c:
        c.ping()
    assert impostor.ops() == ["hello", "ping", "hello", "ping"]
