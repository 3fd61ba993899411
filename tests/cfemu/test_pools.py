"""cfemu.pools: the CF client's bounded pool of connections, whose free connections are taken and given back without
a condition while there are some (FreeConnections), and whose callers wait for one when there are none. A real
redis-server."""

from __future__ import annotations

import queue
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from cfemu.connection import connect
from cfemu.pools import FreeConnections, PoolExhaustedError, WaitingPool
from cfemu.redis_internals import idle_and_clean


@pytest.fixture
def one(redis_url: str) -> Iterator[redis.Redis]:
    """A CF client as the members make it, with a pool of one connection and a short wait for it."""
    c = connect(redis_url, max_connections=1, pool_timeout=5.0)
    try:
        yield c
    finally:
        c.close()


def wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_the_pool_keeps_its_free_connections_in_free_connections(one: redis.Redis) -> None:
    pool = one.connection_pool
    assert isinstance(pool, WaitingPool)
    assert isinstance(pool.pool, FreeConnections)


def test_a_connection_given_back_goes_to_the_caller_waiting_for_one(one: redis.Redis) -> None:
    pool = one.connection_pool
    held = pool.get_connection()
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(pool.get_connection()))
    waiter.start()
    wait_for(lambda: pool.pool._sleepers == 1, "the second caller to wait")  # type: ignore[attr-defined]
    pool.release(held)
    waiter.join(30)
    assert not waiter.is_alive() and got == [held]
    pool.release(got[0])
    assert pool.pool._sleepers == 0  # type: ignore[attr-defined]


def test_many_threads_share_a_small_pool_and_none_is_left_waiting(redis_url: str) -> None:
    c = connect(redis_url, max_connections=2, pool_timeout=30.0)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for i in range(200):
                assert c.echo(str(i)) == str(i).encode()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads) and errors == []
        assert len(c.connection_pool.pool.queue) == 2  # type: ignore[attr-defined]  # every connection came back
    finally:
        c.close()


def test_an_exhausted_pool_says_so_after_its_timeout(redis_url: str) -> None:
    c = connect(redis_url, max_connections=1, pool_timeout=0.2)
    try:
        held = c.connection_pool.get_connection()
        t0 = time.monotonic()
        with pytest.raises(PoolExhaustedError, match="all 1 connections to the CF stayed busy for 0.2s"):
            c.connection_pool.get_connection()
        assert time.monotonic() - t0 >= 0.2
        c.connection_pool.release(held)
    finally:
        c.close()


def test_free_connections_refuses_more_than_its_size_and_says_when_empty() -> None:
    q = FreeConnections(2)
    q.put_nowait(None)
    q.put_nowait("c")
    with pytest.raises(queue.Full):
        q.put_nowait("d")
    assert q.full() and q.qsize() == 2
    assert q.get() == "c" and q.get_nowait() is None  # last in, first out
    assert q.empty()
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)


def test_a_connection_left_with_an_unread_reply_is_not_handed_out_as_it_is(one: redis.Redis) -> None:
    """A connection given back with a reply still unread (a caller that sent and never read) would answer the next
    caller's command with it: the pool reconnects it instead."""
    pool = one.connection_pool
    conn = pool.get_connection()
    conn.send_command("ECHO", "stale")
    wait_for(lambda: bool(conn.can_read()), "the stale reply to arrive")
    pool.release(conn)
    again = pool.get_connection()
    try:
        again.send_command("ECHO", "fresh")
        assert again.read_response() == b"fresh"
    finally:
        pool.release(again)


def test_a_connected_idle_connection_is_taken_without_redis_pys_checks(one: redis.Redis,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = one.connection_pool
    assert one.ping()  # connected, and back in the pool

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("redis-py's connect/can_read was called for a connected, idle connection")

    monkeypatch.setattr(redis.connection.AbstractConnection, "connect", refuse)
    monkeypatch.setattr(redis.connection.AbstractConnection, "can_read", refuse)
    conn = pool.get_connection()
    pool.release(conn)


def test_a_connection_the_server_closed_is_reconnected_after_earlier_checks(one: redis.Redis) -> None:
    """The readiness check keeps a poll object with a connection for its socket (made once, not at every take):
    after several takes, a connection the server then closes is still seen closed and is reconnected before use
    (no command sent on it, so no lost reply), and the check then watches the new socket."""
    pool = one.connection_pool
    for _ in range(3):
        assert one.ping()
    conn = pool.get_connection()
    old = conn._sock
    old.shutdown(socket.SHUT_WR)  # the server reads the end of the stream and closes its side
    pool.release(conn)
    wait_for(lambda: bool(select.select([old], [], [], 0)[0]), "the server's close to reach the socket")
    assert one.ping()
    conn = pool.get_connection()
    try:
        assert conn._sock is not None and conn._sock is not old
    finally:
        pool.release(conn)
    assert one.ping()


def test_a_reconnected_connection_is_not_checked_through_a_file_number_another_connection_took(
        redis_url: str) -> None:
    """A connection dropped (its socket closed) and made again later is checked on its new socket: another
    connection that took its old file number meanwhile, and has a reply waiting, does not make it look busy, and
    its own server-closed socket is never taken for clean through the old registration."""
    a = redis.Redis.from_url(redis_url)
    b = redis.Redis.from_url(redis_url)
    try:
        assert a.ping()
        conn_a = a.connection_pool.get_connection()
        old_fd = conn_a._sock.fileno()
        assert idle_and_clean(conn_a)  # the poll object is made and kept for this socket
        conn_a.disconnect()  # its file number is free again
        conn_b = b.connection_pool.get_connection()
        conn_b.connect()
        if conn_b._sock.fileno() != old_fd:
            pytest.skip("the other connection did not get the freed file number")
        conn_b.send_command("PING")  # a reply waits on the old number: readable
        wait_for(lambda: bool(select.select([conn_b._sock], [], [], 0)[0]), "the PONG to reach the socket")
        conn_a.connect()
        assert conn_a._sock.fileno() != old_fd
        assert idle_and_clean(conn_a), "checked through the old file number, now the other connection's"
        assert conn_b.read_response() in (b"PONG", "PONG", True)
        conn_a._sock.shutdown(socket.SHUT_WR)
        wait_for(lambda: bool(select.select([conn_a._sock], [], [], 0)[0]), "the server's close to reach the socket")
        assert not idle_and_clean(conn_a)
        b.connection_pool.release(conn_b)
        a.connection_pool.release(conn_a)
    finally:
        a.close()
        b.close()
