"""What the REST door repeats of what a client sent (a queue name in the URL, a queue manager's name, a path, a
header, a library's error): at most a few tens of characters, its control characters escaped, so that the error
still names the problem in one line and a client cannot send its kilobytes, line breaks or terminal escapes into
the reply, a header or the member's log. Before, a 3,000-character queue name came back whole in the 404's body
and CR LF in a name came back as CR LF. A real member serving REST (in this process), a real redis-server, a plain
HTTP client."""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from cfemu.errors import ResourceProblemError
from sqm.http_guard import HttpLimits, runner_kwargs
from sqm.service.rest import mq_failure
from tests.sqm.test_rest import CSRF, TEXT, Reply, basic, http
from tests.support.inprocess_server import RunningServer
from tests.support.rest_member import TOKEN, rest_member_of_its_own, rest_url

HOSTILE = "AB\r\nSet-Cookie: owned=1\x1b[2J"  # a line break into a header or a log, a terminal's clear screen


@pytest.fixture(scope="module")
def member(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with rest_member_of_its_own(redis_server, tmp_path_factory.mktemp("echo")) as running:
        yield running


def ask(method: str, url: str) -> Reply:
    return http(method, url, b"x", {**basic(TOKEN), **CSRF, **TEXT}, auth=False)


def one_safe_line(text: str, most: int) -> None:
    assert len(text) <= most, f"{len(text)} characters echoed: {text[:120]}..."
    assert text.isprintable(), f"a control character echoed: {text!r}"


@pytest.mark.parametrize("method, resource", [("POST", "message"), ("DELETE", "message"), ("GET", "message"),
                                              ("GET", "messagelist")])
def test_a_long_queue_name_is_named_in_a_few_characters(member: RunningServer, method: str, resource: str) -> None:
    r = ask(method, rest_url(member, "Q" * 3000, resource=resource))
    assert r.status == 404, (r.status, r.body[:300])
    error = r.error()
    assert error["reasonCode"] == 2085
    one_safe_line(error["message"], 200)
    assert "(3000 chars)" in error["message"] and "QQQQ" in error["message"]
    assert len(r.body) < 1000


def test_control_characters_in_a_queue_name_are_escaped_not_echoed(member: RunningServer) -> None:
    for method in ("POST", "DELETE", "GET"):
        r = ask(method, rest_url(member, urllib.parse.quote(HOSTILE)))
        assert r.status == 404, (r.status, r.body[:300])
        message = r.error()["message"]
        one_safe_line(message, 200)
        assert "\\r\\nSet-Cookie" in message  # named, escaped
        assert "set-cookie" not in r.headers


def test_a_queue_managers_name_and_a_path_are_echoed_bounded_and_escaped(member: RunningServer) -> None:
    r = ask("GET", rest_url(member, qmgr=urllib.parse.quote(HOSTILE + "M" * 3000)))
    assert r.status == 404 and r.error()["reasonCode"] == 2058
    one_safe_line(r.error()["message"], 200)
    r = ask("GET", f"http://127.0.0.1:{member.rest_port}/" + urllib.parse.quote(HOSTILE + "P" * 3000))
    assert r.status == 404
    one_safe_line(r.error()["message"], 200)


def test_a_header_value_is_echoed_bounded(member: RunningServer) -> None:
    """(aiohttp itself refuses a header value with a control character, before the door sees it.)"""
    r = http("POST", rest_url(member), b"x", {**basic(TOKEN), **CSRF, **TEXT,
                                              "ibm-mq-md-persistence": "p" * 3000}, auth=False)
    assert r.status == 400
    one_safe_line(r.error()["message"], 250)


def test_an_mq_error_naming_what_a_client_sent_is_cut_and_escaped() -> None:
    """The queue manager's refusals name what they refuse (a queue, a property): the error repeats a few hundred
    characters of it at most, on one line."""
    e = ResourceProblemError("property " + HOSTILE + "x" * 5000 + " refused")
    said = mq_failure(e, "put on 1").message
    one_safe_line(said, 500)
    assert said.startswith("put on 1: ") and "chars)" in said


def test_the_http_libraries_error_lines_are_escaped(caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp's error lines (a malformed request: its text holds what the peer sent) reach the log escaped."""
    logger = runner_kwargs(HttpLimits(), logging.getLogger("sqm.test.echo"))["logger"]
    with caplog.at_level(logging.WARNING, "sqm.test.echo"):
        logger.error("Error handling request from %s", HOSTILE, exc_info=ValueError("bad \x1b[2J line\r\nx"))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.isprintable() and "\\x1b[2J" in line and "\\r\\n" in line, line
