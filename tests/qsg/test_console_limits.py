"""The console's server against a peer that has not logged in: past its connection cap a new connection is closed
at once, one that sends no whole request head is closed after the head timeout, one idle after a reply after the
keep-alive timeout; it serves meanwhile. Before, aiohttp held an idle connection for an hour, with no cap. Real
sockets to the console's server; caps and timeouts set small."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from qsg.console.app import Console
from qsg.console.source import GroupSource
from sqm.http_guard import HttpLimits
from tests.support.slowloris import Slowloris


@pytest.fixture
def where(redis_url: str, tmp_path: Path) -> dict[str, str]:
    return {"redis_url": redis_url, "log_root": str(tmp_path / "logs")}


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(65536), within) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_the_console_caps_connections_and_closes_idle_ones(where: dict[str, str]) -> None:
    console = Console(GroupSource(where), interval_s=3600)
    limits = HttpLimits(head_timeout_s=0.5, keepalive_timeout_s=0.5, max_connections=4, max_connections_per_peer=2)

    async def scenario() -> None:
        runner = await console.serve("127.0.0.1", 0, None, limits)
        port = runner.addresses[0][1]
        held = []
        try:
            for partial in (b"", b"GET /login HTTP/1.1\r\n"):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(partial)
                held.append((reader, writer))
            await asyncio.sleep(0.1)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await closed_by_server(reader, 0.3), "a third connection from one address was not closed"
            writer.close()
            t0 = time.monotonic()
            for reader, _ in held:
                assert await closed_by_server(reader, 2.0), "a connection without a request head was held open"
            assert time.monotonic() - t0 < 1.5
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 ")
            length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(
                b"content-length")))
            await reader.readexactly(length)
            assert await closed_by_server(reader, 2.0), "an idle keep-alive connection was held open"
            writer.close()
        finally:
            for _, w in held:
                w.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_slowloris_from_several_addresses_does_not_keep_the_operator_out(where: dict[str, str]) -> None:
    """Two local addresses, each under its per-address cap, hold every connection of the console with partial
    request heads and reopen each it closes. Before, every newcomer was closed at once (curl: status 000); now the
    oldest connection without a whole head is closed to make room, and the operator's page is served each time."""
    console = Console(GroupSource(where), interval_s=3600)
    limits = HttpLimits(head_timeout_s=30, keepalive_timeout_s=30, max_connections=8, max_connections_per_peer=4)

    async def get_login(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return (await asyncio.wait_for(reader.read(), 5))[:15]
        except ConnectionResetError:
            return b""
        finally:
            writer.close()

    async def scenario() -> None:
        runner = await console.serve("127.0.0.1", 0, None, limits)
        port = runner.addresses[0][1]
        try:
            with Slowloris(port, ["127.0.0.2", "127.0.0.3"], 4, b"GET /login HTTP/1.1\r\n"):
                await asyncio.sleep(0.3)
                replies = [await get_login(port) for _ in range(10)]
        finally:
            await runner.cleanup()
        assert replies == [b"HTTP/1.1 200 OK"] * 10, replies

    asyncio.run(scenario())


def test_a_body_that_trickles_in_is_answered_408_and_its_connection_closed(where: dict[str, str]) -> None:
    """A login whose head is whole and whose body comes a byte at a time: the head timeout was over and aiohttp
    waited for the body as long as bytes kept coming, the connection held for ever. Its body must now be whole
    within the head timeout (plus its length at the least rate), else 408, the connection closed."""
    console = Console(GroupSource(where), interval_s=3600)
    limits = HttpLimits(head_timeout_s=0.5, keepalive_timeout_s=30, max_connections=8, max_connections_per_peer=4)

    async def scenario() -> None:
        runner = await console.serve("127.0.0.1", 0, None, limits)
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        try:
            writer.write(b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded"
                         b"\r\nContent-Length: 100\r\n\r\ntoken=")
            t0, answer = time.monotonic(), b""
            while time.monotonic() - t0 < 5 and not answer:
                writer.write(b"x")
                try:
                    answer = await asyncio.wait_for(reader.read(65536), 0.2)
                except TimeoutError:
                    pass
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:80] or "no answer in 5 s"
            assert time.monotonic() - t0 < 2.0
            assert await closed_by_server(reader, 2.0), "the connection of a late body was kept open"
        finally:
            writer.close()
            await runner.cleanup()

    asyncio.run(scenario())
