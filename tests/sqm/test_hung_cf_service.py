"""A CF that stops answering (its redis-server stopped with SIGSTOP) while a `sqm run` member has a batch in flight:
the member's event loop is not held by it. Requests that need no CF on the loop's other connections (a ping, an
operator's status) and a new connection's handshake are answered at once; the batch's CF calls end, within the CF's
socket timeout, in an error that says the CF is unavailable; once the CF answers again (SIGCONT) the member serves
as before and nothing is left locked. Real redis-server, real `sqm run` process, real sockets and signals."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cfemu.embedded import EmbeddedRedis
from sqm.service.client import Client
from sqm.service.protocol import encode_frame
from tests.support.group import define_group
from tests.support.service_proc import OP_TOKEN, TOKEN, Raw, ServerProc, start_server

CF_TIMEOUT_S = 2.0  # the member's CF socket timeout (its --redis-url's socket_timeout)
QUICK_S = 1.0  # what a request that needs no CF may take while the CF is stopped (the machine is loaded)


@pytest.fixture
def member(redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> Iterator[tuple[ServerProc, int]]:
    cf = redis_factory()
    assert cf.pid is not None
    define_group(cf.url, queues=("Q1",))
    srv = start_server(f"{cf.url}?socket_timeout={CF_TIMEOUT_S}", tmp_path, "QM1", "--lease-ms", "60000")
    try:
        yield srv, cf.pid
    finally:
        os.kill(cf.pid, signal.SIGCONT)
        assert srv.stop(timeout=60) == 0, srv.log_text()


def _send_put(r: Raw, body: bytes) -> None:
    r.ids += 1
    r.send_bytes(encode_frame({"id": r.ids, "op": "put", "args": {"queue": "Q1", "body": body, "persistent": True,
                                                                  "syncpoint": False}}))


def _took(fn: Callable[[], object]) -> tuple[object, float]:
    started = time.monotonic()
    out = fn()
    return out, time.monotonic() - started


@pytest.mark.slow
def test_a_hung_cf_holds_up_no_request_that_needs_no_cf_and_its_calls_time_out(
        member: tuple[ServerProc, int]) -> None:
    srv, cf_pid = member
    apps = [Raw(srv.port) for _ in range(3)]
    idle = Raw(srv.port)  # an application's connection on the event loop, with no request in the batch
    for r in (*apps, idle):
        assert r.login()["ok"]
    operator = Client(srv.endpoint, token=OP_TOKEN, role="operator")
    with Client(srv.endpoint, token=TOKEN) as c:
        c.put("Q1", b"before", syncpoint=False)
    assert operator.status()["name"] == "QM1"
    os.kill(cf_pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        for k, r in enumerate(apps):
            _send_put(r, b"during%d" % k)
        time.sleep(0.2)  # the batch waits in its CF call
        pong, ping_took = _took(lambda: idle.request("ping"))
        status, status_took = _took(operator.status)
        newcomer = Raw(srv.port)
        handshake, handshake_took = _took(newcomer.login)
        replies = [r.reply() for r in apps]
        replies_took = time.monotonic() - started
    finally:
        os.kill(cf_pid, signal.SIGCONT)
    assert isinstance(pong, dict) and pong["ok"] and ping_took < QUICK_S, (pong, ping_took)
    assert isinstance(status, dict) and status["name"] == "QM1" and status_took < QUICK_S, status_took
    assert isinstance(handshake, dict) and handshake["ok"] and handshake_took < QUICK_S, handshake_took
    # Each put hears that the CF is unavailable within two of its timeouts: the batch in its CF call when it stopped,
    # and the one begun behind it (the puts that came meanwhile, together).
    assert replies_took < 2 * CF_TIMEOUT_S + 2 * QUICK_S, replies_took
    for reply in replies:
        assert not reply["ok"] and reply["error"]["type"] == "StructureFailedError", reply
        assert "the CF is unavailable" in reply["error"]["message"], reply
    # The CF back: the member serves as before, and the puts that failed left nothing behind (backed out).
    with Client(srv.endpoint, token=TOKEN) as c:
        c.put("Q1", b"after", syncpoint=False)
        deadline = time.monotonic() + 30
        while (held := [m.body for m in c.browse("Q1")]) != [b"before", b"after"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert held == [b"before", b"after"]
    operator.close()
