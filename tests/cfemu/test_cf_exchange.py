"""A CF script call's send and reply (cfemu.cf._lean_exchange): the socket and hiredis reader driven
directly, with redis-py's failure rules kept. Real redis-server processes, stopped and killed with real signals."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from cfemu.errors import UnknownObjectError
from sqm.core.manager import reply_lost
from tests.support.one_connection_cf import browse_q1, one_connection_cf
from tests.support.waits import sigstop


def test_calls_take_the_lean_path_not_redis_pys(redis_factory: Callable[..., EmbeddedRedis],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cf, _ = one_connection_cf(redis_factory())
    browse_q1(cf)  # connected

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("redis-py's per-command path was taken")
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", refuse)
    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", refuse)
    assert [browse_q1(cf) for _ in range(3)] == [0, 0, 0]


def test_a_refusal_is_the_mapped_error_and_the_connection_stays_in_step(
        redis_factory: Callable[..., EmbeddedRedis]) -> None:
    cf, _ = one_connection_cf(redis_factory())
    with pytest.raises(UnknownObjectError):
        cf.structure("APP1").browse("NOSUCH", 10, 0)
    assert browse_q1(cf) == 0  # the next call reads its own reply, not a leftover


def test_scripts_flushed_are_loaded_again(redis_factory: Callable[..., EmbeddedRedis]) -> None:
    cf, client = one_connection_cf(redis_factory())
    browse_q1(cf)
    client.script_flush()
    assert browse_q1(cf) == 0


def test_a_reply_that_times_out_is_never_read_by_the_next_call(redis_factory: Callable[..., EmbeddedRedis]) -> None:
    """The CF stopped (SIGSTOP) past the socket timeout: TimeoutError, and the connection is dropped, so that the
    late reply, sent once the CF runs again, cannot be taken for the next call's."""
    srv = redis_factory()
    cf, client = one_connection_cf(srv, socket_timeout=0.5)
    browse_q1(cf)
    pool = client.connection_pool
    assert srv.pid is not None
    sigstop(srv.pid)
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            cf.structure("APP1").browse("NOSUCH", 10, 0)  # would answer NOQUEUE once the CF runs again
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    assert all(c is None or c._sock is None for c in list(pool.pool.queue))  # type: ignore[attr-defined]
    assert browse_q1(cf) == 0


def test_a_reply_lost_after_the_request_went_out_reads_as_maybe_applied(
        redis_factory: Callable[..., EmbeddedRedis]) -> None:
    """The member reads a failure while reading (the script may have run: sqm.core.manager.reply_lost) apart from
    one before anything was sent; the lean path's errors must keep that distinction (a commit reported backed out
    that the CF applied is a lost or duplicated message). Timeout: the CF stopped; reset: the CF killed while the
    request waits in its socket."""
    srv = redis_factory()
    cf, _ = one_connection_cf(srv, socket_timeout=0.5)
    browse_q1(cf)
    assert srv.pid is not None
    sigstop(srv.pid)
    try:
        with pytest.raises(redis.exceptions.TimeoutError) as timed_out:
            browse_q1(cf)
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    assert reply_lost(timed_out.value)
    browse_q1(cf)
    cf2 = CF(connect(srv.url, max_connections=1, socket_timeout=10))
    browse_q1(cf2)
    sigstop(srv.pid)
    result: list[BaseException] = []

    def call() -> None:
        try:
            browse_q1(cf2)
        except BaseException as e:  # noqa: BLE001 - examined below
            result.append(e)
    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.3)  # the request is in the stopped CF's socket
    srv.kill()
    t.join(15)
    assert result and isinstance(result[0], redis.exceptions.ConnectionError), result
    assert reply_lost(result[0]), result[0]


def test_a_cf_killed_gives_a_connection_error_then_a_restarted_one_answers(
        redis_factory: Callable[..., EmbeddedRedis]) -> None:
    srv = redis_factory()
    cf, _ = one_connection_cf(srv)
    browse_q1(cf)
    srv.kill()
    with pytest.raises(redis.exceptions.ConnectionError):
        browse_q1(cf)
    srv.start()
    admin_client = connect(srv.url)
    Admin(admin_client).define_structure("APP1")
    Admin(admin_client).define_queue("Q1", "APP1")
    assert browse_q1(cf) == 0


def test_an_argument_no_command_carries_fails_its_call_and_gives_the_connection_back(
        redis_factory: Callable[..., EmbeddedRedis]) -> None:
    """A call with an argument redis-py cannot send (None) is refused before anything is sent, and the pool's one
    connection goes back: the next call gets it (it waited the pool's timeout for one that never came back)."""
    cf, _ = one_connection_cf(redis_factory(), pool_timeout=2)
    for _ in range(2):
        with pytest.raises(redis.exceptions.DataError):
            cf.run("browse", "APP1", ["Q1", None, 0, 0, 0])
        assert browse_q1(cf) == 0


def test_in_a_pipeline_a_call_that_cannot_be_sent_fails_alone(redis_factory: Callable[..., EmbeddedRedis]) -> None:
    """CF.run_many: a call whose argument no command carries is refused in its place; the calls before and after
    it still run, each with its own reply (it failed the whole pipeline, none of them sent)."""
    cf, _ = one_connection_cf(redis_factory(), pool_timeout=2)
    now = int(time.time() * 1000)
    browse = ("browse", "APP1", ["Q1", 10, now, 0, 0])
    out = cf.run_many([browse, ("browse", "APP1", ["Q1", None, now, 0, 0]), browse])
    assert out[0] == out[2] == [0, b""]  # each: nothing more, the queue's end, no message
    assert isinstance(out[1], redis.exceptions.DataError)
    [alone] = cf.run_many([("browse", "APP1", ["Q1", None, now, 0, 0])])  # nothing to send at all
    assert isinstance(alone, redis.exceptions.DataError)
    assert browse_q1(cf) == 0  # the connection went back, in step
