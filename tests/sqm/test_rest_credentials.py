"""Credentials the REST door cannot read as text (an Authorization header whose bytes are not UTF-8, a basic
password that is not, a basic value that is not base64 of ASCII) are a 401 with a one-line message, as any other
credentials it does not accept, never a 500 or a traceback in the member's log. A real member serving REST in this
process, a real redis-server, raw sockets (an HTTP library would not send such bytes)."""

from __future__ import annotations

import base64
import json
import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.inprocess_server import RunningServer
from tests.support.rest_member import TOKEN, rest_member_of_its_own

PATH = "/ibmmq/rest/v3/messaging/qmgr/QM1/queue/Q1/message"


@pytest.fixture(scope="module")
def member(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with rest_member_of_its_own(redis_server, tmp_path_factory.mktemp("credentials")) as running:
        yield running


def ask(member: RunningServer, authorization: bytes) -> tuple[int, bytes]:
    """A GET with this Authorization header's bytes, on a socket of its own: (status, body)."""
    assert member.rest_port is not None
    with socket.create_connection(("127.0.0.1", member.rest_port), timeout=30) as s:
        s.sendall(b"GET " + PATH.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: "
                  + authorization + b"\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("authorization", [
    b"Bearer \xff\xfe" + TOKEN.encode(),  # a bearer token that is not UTF-8
    b"Bearer " + TOKEN.encode() + b"\xc3",  # a valid token with a truncated UTF-8 sequence after it
    b"Basic \xe9t\xe9",  # a basic value that is not ASCII, so not base64
    b"Basic " + base64.b64encode(b"app1:\xff" + TOKEN.encode()),  # base64 of a password that is not UTF-8
    b"\xff\xfe " + TOKEN.encode(),  # a scheme that is not UTF-8
], ids=["bearer", "bearer-truncated", "basic-not-ascii", "basic-password", "scheme"])
def test_credentials_that_are_not_utf8_are_a_401_in_one_line(member: RunningServer, authorization: bytes,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    status, body = ask(member, authorization)
    assert status == 401, (status, body[:300])
    [error] = json.loads(body)["error"]
    assert error["msgId"] == "MQWB0104E" and error["reasonCode"] == 2035
    assert "\n" not in error["message"] and error["message"].isprintable()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text
    ok = ask(member, b"Basic " + base64.b64encode(b"app1:" + TOKEN.encode()))  # the door still serves
    assert ok[0] == 204, ok
