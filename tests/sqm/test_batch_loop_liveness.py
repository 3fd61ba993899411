"""The service's event loop (sqm.service.batch_loop) answers every request, or ends its connection, whatever one
batch or one turn raises: in process, on real sockets, with a host whose batches fail on demand (a real member
cannot be made to raise in these places)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from cfemu.errors import OutcomeUnknownError
from sqm.service.batch_loop import MAX_FAILED_TURNS, BatchLoop
from sqm.service.protocol import HEADER, decode_body, encode_frame, ok_reply, parse_request
from sqm.service.session import Session, Together

DEADLINE_S = 20.0  # generous: the machine is loaded; a hang is what fails


class _Forcing(Together):
    """A batch whose finish forces the log (its commits): the loop hands it to its finisher."""

    @property
    def forces(self) -> bool:
        return True


class FailingHost:
    """A LoopHost whose batches succeed (each request's reply: its own args) unless told to raise."""

    name = "QMT"

    def __init__(self) -> None:
        self.fail_begin = 0  # how many begin_together calls raise
        self.fail_finish = 0  # how many finish_together calls raise
        self.fail_turns = 0  # how many select calls raise (the loop's turn itself)
        self.forcing = False  # each batch forces the log, as commits do (finished by the loop's finisher)
        self.finish_s = 0.0  # how long each finish takes (a slow fsync)

    def loop_request(self, session: Session, body: bytes) -> tuple[int, str, dict[str, Any]] | dict[str, Any]:
        return parse_request(decode_body(body))

    def begin_together(self, requests: list[tuple[Session, int, str, dict[str, Any]]]) -> Together:
        if self.fail_begin:
            self.fail_begin -= 1
            raise RuntimeError("begin exploded")
        return (_Forcing if self.forcing else Together)(requests, [None] * len(requests))

    def finish_together(self, batches: list[Together]) -> None:
        if self.fail_finish:
            self.fail_finish -= 1
            raise RuntimeError("finish exploded")
        time.sleep(self.finish_s)
        for t in batches:
            t.replies = [ok_reply(rid, args) for _, rid, _, args in t.requests]

    def finish(self, session: Session, rid: int, op: str, reply: dict[str, Any]) -> bytes:
        return encode_frame(reply)

    def hold(self, session: Session, n: int) -> None:
        pass

    def release(self, session: Session) -> None:
        pass

    def may_run_together(self, op: str, args: dict[str, Any]) -> bool:
        return True

    def direct_step(self, *a: Any, **kw: Any) -> bool:
        raise AssertionError("every request here runs together")

    def closed_idle(self, session: Session) -> None:
        pass


class Harness:
    def __init__(self, host: FailingHost) -> None:
        self.host = host
        self.aio = asyncio.new_event_loop()
        self.aio_thread = threading.Thread(target=self.aio.run_forever, daemon=True)
        self.aio_thread.start()
        self.loop = BatchLoop(host, self.aio, 0.0, lambda code: None, 65536)  # type: ignore[arg-type]
        self.executors: list[ThreadPoolExecutor] = []
        self.ended: list[threading.Event] = []

    def connect(self) -> tuple[socket.socket, threading.Event, bool]:
        ours, theirs = socket.socketpair()
        ex = ThreadPoolExecutor(1)
        self.executors.append(ex)
        session = Session(len(self.executors), "test", ex, True, 65536, 1 << 20)
        done = threading.Event()
        self.ended.append(done)
        theirs.settimeout(DEADLINE_S)
        return theirs, done, self.loop.add(session, ours, bytearray(), done.set)

    def close(self) -> None:
        self.loop.stop()
        self.aio.call_soon_threadsafe(self.aio.stop)
        self.aio_thread.join(5)
        for ex in self.executors:
            ex.shutdown(wait=False)


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(FailingHost())
    yield h
    h.close()


def ask(sock: socket.socket, rid: int, op: str = "put") -> dict[str, Any]:
    """Send one request and read its reply (a hang fails at the socket's timeout)."""
    sock.sendall(encode_frame({"id": rid, "op": op, "args": {"n": rid}}))
    head = _exactly(sock, HEADER.size)
    (length,) = HEADER.unpack(head)
    reply = decode_body(_exactly(sock, length))
    assert isinstance(reply, dict)
    return reply


def _exactly(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise ConnectionError("closed by the member")
        got += chunk
    return got


def test_a_batch_whose_finish_raises_answers_each_request_at_once(harness: Harness) -> None:
    harness.host.fail_finish = 1
    sock, _, _ = harness.connect()
    started = time.monotonic()
    reply = ask(sock, 1)
    assert not reply["ok"] and reply["error"]["type"] == OutcomeUnknownError.__name__
    assert "finish exploded" in reply["error"]["message"]
    assert time.monotonic() - started < DEADLINE_S / 2
    assert ask(sock, 2) == {"id": 2, "ok": True, "result": {"n": 2}}  # the connection goes on


def test_a_batch_whose_begin_raises_is_answered_and_the_loop_goes_on(harness: Harness) -> None:
    harness.host.fail_begin = 1
    first, _, _ = harness.connect()
    reply = ask(first, 1)
    assert not reply["ok"] and "begin exploded" in reply["error"]["message"]
    second, _, _ = harness.connect()  # the loop survived: a connection added later is served
    assert ask(second, 7)["ok"]
    assert ask(first, 2)["ok"]


def test_a_connection_that_sends_ahead_while_its_batch_finishes_costs_the_loop_no_turns(harness: Harness) -> None:
    """A client sends its next request while its batch is being forced by the loop's finisher: the loop neither
    runs it nor turns on it meanwhile (the connection, away with its batch, is taken out of the selector when found
    ready, not looked at again and again), and both requests are answered in their order."""
    sock, _, _ = harness.connect()
    other, _, _ = harness.connect()  # another connection to read meanwhile: the loop hands the batch to its finisher
    assert ask(sock, 0)["ok"] and ask(other, 0)["ok"]  # both in the loop
    harness.host.forcing = True
    harness.host.finish_s = 1.0
    turns = _count_selects(harness.loop)
    sock.sendall(encode_frame({"id": 1, "op": "put", "args": {"n": 1}}))
    time.sleep(0.3)  # its batch is in the finisher's slow force
    sock.sendall(encode_frame({"id": 2, "op": "put", "args": {"n": 2}}))  # before its reply
    before = turns[0]
    assert _reply(sock) == {"id": 1, "ok": True, "result": {"n": 1}}
    assert turns[0] - before < 20  # a few turns (the finisher's wake-ups), not a spin while the batch is away
    assert _reply(sock) == {"id": 2, "ok": True, "result": {"n": 2}}


def _count_selects(loop: BatchLoop) -> list[int]:
    """Count the loop's selects (its turns) from now on."""
    real = loop._sel.select
    count = [0]

    def select(timeout: float | None = None) -> Any:
        count[0] += 1
        return real(timeout)

    loop._sel.select = select  # type: ignore[method-assign]
    return count


def _reply(sock: socket.socket) -> dict[str, Any]:
    (length,) = HEADER.unpack(_exactly(sock, HEADER.size))
    reply = decode_body(_exactly(sock, length))
    assert isinstance(reply, dict)
    return reply


def _fail_select(loop: BatchLoop, times: int) -> list[int]:
    """The loop's next ``times`` selects raise; the list holds how many are left."""
    real = loop._sel.select
    left = [times]

    def select(timeout: float | None = None) -> Any:
        if left[0]:
            left[0] -= 1
            raise OSError("select exploded")
        return real(timeout)

    loop._sel.select = select  # type: ignore[method-assign]
    return left


def _wait(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_turn_that_fails_now_and_then_stops_no_connection(harness: Harness) -> None:
    sock, _, _ = harness.connect()
    assert ask(sock, 1)["ok"]
    left = _fail_select(harness.loop, 3)
    _wait(lambda: left[0] == 0)
    assert ask(sock, 2)["ok"]
    assert harness.loop.failed == ""


def test_a_loop_that_gives_up_closes_its_connections_and_takes_no_more(harness: Harness) -> None:
    sock, ended, _ = harness.connect()
    assert ask(sock, 1)["ok"]
    _fail_select(harness.loop, MAX_FAILED_TURNS + 5)
    _wait(lambda: ended.is_set())
    assert harness.loop.failed  # said (the status shows it)
    assert sock.recv(1) == b""  # its client sees the close, not a hang
    _, _, taken = harness.connect()
    assert taken is False  # the transport serves it by its own thread instead
