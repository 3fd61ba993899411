"""A CF that stops answering (its redis-server stopped with SIGSTOP) while a `sqm run` member has batches in flight:
the member's event loop is not held by it. Requests that need no CF (an operator's status, a new connection's
handshake) are answered at once, and the CF calls of the batches end, within the CF's socket timeout, in an error
that says the CF is unavailable; once the CF answers again (SIGCONT) the member serves as before and nothing is
lost or left locked. Real redis-server, real `sqm run` process, real sockets and signals."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cfemu.embedded import EmbeddedRedis
from sqm.service.client import Client
from tests.support.group import define_group
from tests.support.service_proc import OP_TOKEN, TOKEN, Raw, ServerProc, start_server

CF_TIMEOUT_S = 2.0  # the member's CF socket timeout (its --redis-url's socket_timeout)
QUICK_S = 1.0  # what a request that needs no CF may take while the CF is stopped (the machine is loaded)


@pytest.fixture
def member(redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> Iterator[tuple[ServerProc, int]]:
    cf = redis_factory()
    assert cf.pid is not None
    define_group(cf.url, queues=("Q1", "Q2"))
    srv = start_server(f"{cf.url}?socket_timeout={CF_TIMEOUT_S}", tmp_path, "QM1", "--lease-ms", "60000")
    try:
        yield srv, cf.pid
    finally:
        os.kill(cf.pid, signal.SIGCONT)
        srv.stop(timeout=60)


def _send_put(r: Raw, queue: str, body: bytes) -> None:
    r.ids += 1
    from sqm.service.protocol import encode_frame
    r.send_bytes(encode_frame({"id": r.ids, "op": "put", "args": {"queue": queue, "body": body, "persistent": True,
                                                                  "syncpoint": False}}))


@pytest.mark.slow
def test_a_hung_cf_holds_up_no_request_that_needs_no_cf_and_its_calls_time_out(
        member: tuple[ServerProc, int]) -> None:
    srv, cf_pid = member
    apps = [Raw(srv.port) for _ in range(3)]
    idle = Raw(srv.port)  # an application's connection on the event loop, with no request in the batch
    assert idle.login()["ok"]
    for r in apps:
        assert r.login()["ok"]
    operator = Client(srv.endpoint, token=OP_TOKEN, role="operator")
    with Client(srv.endpoint, token=TOKEN) as c:
        c.put("Q1", b"before", syncpoint=False)
    assert operator.status()["name"] == "QM1"
    os.kill(cf_pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        for k, r in enumerate(apps):
            _send_put(r, "Q1", b"during%d" % k)
        time.sleep(0.2)  # the batch is in its CF call
        t = time.monotonic()
        pong = idle.request("ping")
        ping_took = time.monotonic() - t
        t = time.monotonic()
        status = operator.status()
        status_took = time.monotonic() - t
        t = time.monotonic()
        newcomer = Raw(srv.port)
        handshake = newcomer.login()
        handshake_took = time.monotonic() - t
        replies = [r.reply() for r in apps]
        replies_took = time.monotonic() - started
    finally:
        os.kill(cf_pid, signal.SIGCONT)
    print(f"ping {ping_took:.2f}s status {status_took:.2f}s handshake {handshake_took:.2f}s replies {replies_took:.2f}s", replies)
    assert status["name"] == "QM1"
    assert status_took < QUICK_S, status_took
    assert handshake["ok"] and handshake_took < QUICK_S, (handshake, handshake_took)
    assert replies_took < 3 * CF_TIMEOUT_S + QUICK_S, replies_took
    for reply in replies:
        assert not reply["ok"] and "CF" in reply["error"]["message"], reply
