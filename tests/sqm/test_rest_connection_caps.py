"""The REST door's connection caps as an operator sees them: every local client (a local reverse proxy in front
of the door, a local tool) is one loopback address, so they share the per-address cap; the refusal line says so and
names the options, and the per-address cap set to the total cap lets one local client use the whole door. A real
member serving REST in this process, a real redis-server, raw sockets."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from sqm.service.config import ServerConfig
from tests.sqm.test_rest_connection_ends import BROWSE, read_to_end
from tests.support.group import define_group
from tests.support.inprocess_server import RunningServer
from tests.support.raw_sockets import closed_by_server
from tests.support.rest_member import TOKEN


@contextmanager
def capped_member(redis_server: Any, tmp_path: Path, total: int, per_peer: int) -> Iterator[RunningServer]:
    client = redis_server.client()
    client.flushall()
    client.close()
    define_group(redis_server.url, queues=("Q1",))
    running = RunningServer(ServerConfig(name="QM1", log_root=tmp_path / "logs", redis_url=redis_server.url,
                                         token=TOKEN, port=0, rest_port=0, lease_ms=1000,
                                         ready_file=tmp_path / "QM1.ready", rest_max_connections=total,
                                         rest_max_connections_per_peer=per_peer))
    try:
        yield running
    finally:
        running.stop()


def hold(member: RunningServer, count: int, stack: ExitStack) -> None:
    """``count`` open connections to the door, each with one request answered (so each was admitted)."""
    assert member.rest_port is not None
    for _ in range(count):
        s = stack.enter_context(socket.create_connection(("127.0.0.1", member.rest_port), timeout=5))
        s.sendall(BROWSE)
        assert s.recv(65536).startswith(b"HTTP/1.1 204 ")


def served(member: RunningServer) -> bool:
    assert member.rest_port is not None
    with socket.create_connection(("127.0.0.1", member.rest_port), timeout=5) as s:
        s.sendall(BROWSE.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        return read_to_end(s).startswith(b"HTTP/1.1 204 ")


def test_local_clients_share_the_per_address_cap_and_the_refusal_names_the_options(
        redis_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sqm.service.rest")
    with capped_member(redis_server, tmp_path, total=6, per_peer=3) as member, ExitStack() as stack:
        hold(member, 3, stack)  # one local client (a proxy, say) at the per-address cap
        assert member.rest_port is not None
        with socket.create_connection(("127.0.0.1", member.rest_port), timeout=5) as other:  # another local tool
            assert closed_by_server(other, 2.0)
    line = next(r.getMessage() for r in caplog.records if "closed at once" in r.getMessage())
    assert "--rest-max-connections-per-peer" in line and "every local client is one loopback address" in line


def test_the_per_address_cap_at_the_total_lets_one_local_client_use_the_whole_door(
        redis_server: Any, tmp_path: Path) -> None:
    with capped_member(redis_server, tmp_path, total=6, per_peer=6) as member, ExitStack() as stack:
        hold(member, 5, stack)
        assert served(member)  # the sixth, from the same address
