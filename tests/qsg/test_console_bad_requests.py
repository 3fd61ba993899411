"""Requests the console's code did not expect: bytes that are not UTF-8 in a login form or an Origin header were
answered 500 without the security headers (a UnicodeDecodeError reading the form; the refusal's text could not be
encoded). Now a 400 and a 403, and any error the code did not expect is a 500 that carries the headers too. A real
console on 127.0.0.1, raw sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from qsg.console.app import SECURITY_HEADERS, Console
from qsg.console.source import GroupSource


@pytest.fixture
def where(redis_url: str, tmp_path: Path) -> dict[str, str]:
    return {"redis_url": redis_url, "log_root": str(tmp_path / "logs"), "token": "the-operator-token-of-bad-bytes"}


async def _exchange(port: int, raw: bytes) -> tuple[int, dict[str, str]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1")
    finally:
        writer.close()
    lines = head.split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers


def _post_login(body: bytes, *extra: bytes) -> bytes:
    return (b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
            + b"".join(extra) + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)


def _replies(console: Console, *requests: bytes) -> list[tuple[int, dict[str, str]]]:
    async def scenario() -> list[tuple[int, dict[str, str]]]:
        runner = await console.serve("127.0.0.1", 0, None)
        try:
            return [await _exchange(runner.addresses[0][1], raw) for raw in requests]
        finally:
            await runner.cleanup()

    return asyncio.run(scenario())


def _has_security_headers(headers: dict[str, str]) -> bool:
    return all(headers.get(name) == value for name, value in SECURITY_HEADERS.items())


def test_bytes_that_are_not_utf8_in_a_login_form_or_an_origin_are_refused_with_the_headers(
        where: dict[str, str]) -> None:
    console = Console(GroupSource(where), interval_s=3600)
    replies = _replies(console, _post_login(b"token=\xff"), _post_login(b"token=x", b"Origin: \xff\r\n"))
    assert [status for status, _ in replies] == [400, 403]
    for _, headers in replies:
        assert _has_security_headers(headers), headers
    assert len(console.sessions) == 0


def test_an_error_the_code_did_not_expect_is_a_500_with_the_security_headers(
        where: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self: Console, request: web.Request) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Console, "login_page", broken)
    console = Console(GroupSource(where), interval_s=3600)
    [(status, headers)] = _replies(console, b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert status == 500 and _has_security_headers(headers), headers
