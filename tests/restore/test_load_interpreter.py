"""What a load asks of the interpreter (restore.interpreter.loading): while restore.load.load_plan sends its batches
the switch interval is short and the cyclic collector's own runs paused, and both are given back when it ends,
whether it ends well, fails or is interrupted, and only when the last of several overlapping loads ends; meanwhile
the young generations are still collected, so that a member serving clients in the load's process does not pile up
their garbage. A real redis-server, and a member's server and client in the test's process."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from cfemu import bulk, keys
from cfemu.admin import Admin, StructureDef
from cfemu.entry import Entry
from cfemu.errors import NoMessageError
from restore import interpreter
from restore.engine import LOAD
from restore.interpreter import SWITCH_INTERVAL_S, loading
from restore.load import load_plan
from restore.plan import RestorePlan
from restore.settle import RESTORED, Settled
from sqm.service.client import Client
from sqm.service.server import ServerConfig, SQMServer
from tests.support.group import define_group

S = "APP1"
N = 2500  # three batches


@pytest.fixture(autouse=True)
def _default_settings() -> Iterator[None]:
    """Each test starts with CPython's defaults (the collector on, a 5 ms switch interval) and leaves them so."""
    before = sys.getswitchinterval(), gc.isenabled()
    sys.setswitchinterval(0.005)
    gc.enable()
    yield
    sys.setswitchinterval(before[0])
    (gc.enable if before[1] else gc.disable)()


def _plan(n: int = N, bad_at: int = -1) -> RestorePlan:
    settled = []
    for i in range(n):
        e = Entry(id=f"m{i:08d}", queue="Q1", put_time=1, msgid=f"{i:016x}").wire()
        e.update(st="CP", l=1000 + i, o1=i, o2=i)
        if i == bad_at:  # a string that is not UTF-8 (a raw byte a backup kept): its batch cannot be written
            e["cid"] = "\udcff"
        settled.append(Settled(e["id"], RESTORED, S, e, b"x" * 100))
    return RestorePlan(S, 10**7, settled, {})


def _load(client: redis.Redis, plan: RestorePlan, seen: list[tuple[bool, float]]) -> None:
    def progress(phase: str, done: int, total: int | None) -> None:
        if phase == LOAD and done:  # in the loading thread, between two batches
            seen.append((gc.isenabled(), sys.getswitchinterval()))

    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        load_plan(owner, plan, StructureDef(S), ["Q1"], progress=progress)


def _group(redis_url: str) -> redis.Redis:
    client = redis.Redis.from_url(redis_url)
    Admin(client).define_structure(S)
    Admin(client).define_queue("Q1", S)
    return client


def test_a_load_sends_its_batches_with_a_short_switch_interval_and_the_collector_paused(redis_url: str) -> None:
    client = _group(redis_url)
    seen: list[tuple[bool, float]] = []
    _load(client, _plan(), seen)
    assert client.hlen(keys.data(S)) == N
    assert len(seen) == 3
    assert all(not enabled and interval <= SWITCH_INTERVAL_S for enabled, interval in seen), seen
    assert gc.isenabled() and sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)


def test_a_load_that_fails_gives_the_settings_back(redis_url: str) -> None:
    client = _group(redis_url)
    seen: list[tuple[bool, float]] = []
    with pytest.raises(ValueError, match="not UTF-8"):
        _load(client, _plan(n=3500, bad_at=2500), seen)
    # the first batch went in, the third failed (the second was sent, and perhaps applied: bulk.LOAD_DEPTH)
    assert seen == [(False, pytest.approx(SWITCH_INTERVAL_S, rel=0.05))]
    assert gc.isenabled() and sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)


def test_overlapping_loads_give_the_settings_back_when_the_last_one_ends() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    during: list[tuple[bool, float]] = []

    def second() -> None:
        first_in.wait(30)
        with loading():
            second_in.set()
            first_out.wait(30)
            during.append((gc.isenabled(), sys.getswitchinterval()))

    t = threading.Thread(target=second)
    t.start()
    with loading():
        first_in.set()
        assert second_in.wait(30)
    first_out.set()  # the first has left; the second still loads
    t.join(30)
    assert during == [(False, pytest.approx(SWITCH_INTERVAL_S, rel=0.05))]
    assert gc.isenabled() and sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)


def test_a_collector_paused_before_the_load_stays_paused_after_it() -> None:
    gc.disable()
    sys.setswitchinterval(0.0001)  # shorter than the load's: kept
    with loading():
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
    assert not gc.isenabled() and sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)


def _interrupt_once_at(monkeypatch: pytest.MonkeyPatch, module: object, name: str,
                       when: Callable[..., bool] = lambda *args: True) -> list[int]:
    """The first call of module.name for which when(*args) holds is met by a real SIGINT (Ctrl-C), which Python
    raises as KeyboardInterrupt right after the call, where it came from; returns the list of interrupts sent."""
    real = getattr(module, name)
    sent: list[int] = []

    def interrupted(*args: object) -> object:
        out = real(*args)
        if not sent and when(*args):
            sent.append(1)
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(module, name, interrupted)
    return sent


@pytest.mark.parametrize("where", ["on the way in", "on the way out"])
def test_a_load_interrupted_while_it_takes_or_gives_back_the_settings_gives_them_back(
        monkeypatch: pytest.MonkeyPatch, where: str, ctrl_c_raises: None) -> None:
    """A Ctrl-C that lands while the settings are being taken (the collector just paused) or given back (the
    switch interval given back, the collector not yet) is raised once they are back; a process that goes on (a
    member, a notebook) and loads again gets its own settings back after that load too."""
    if where == "on the way in":
        sent = _interrupt_once_at(monkeypatch, gc, "disable")
    else:
        sent = _interrupt_once_at(monkeypatch, sys, "setswitchinterval", lambda s: s > SWITCH_INTERVAL_S)
    ran: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        with loading():
            ran.append(1)
    assert sent == [1] and ran == ([] if where == "on the way in" else [1])
    monkeypatch.undo()
    assert gc.isenabled() and sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)
    with loading():
        assert not gc.isenabled() and sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S, rel=0.05)
    assert gc.isenabled() and sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)


class _Node:
    """An object in a cycle of its own once made (reference counting never frees it: only the collector does)."""

    def __init__(self) -> None:
        self.me = self


def _cycles(n: int) -> list[weakref.ref[_Node]]:
    """n objects in cycles, each garbage as soon as it is made (only the one being made is ever in use: what a
    collection finds in use it keeps until the collector's own runs come back)."""
    return [weakref.ref(_Node()) for _ in range(n)]


def _left_after(refs: list[weakref.ref[_Node]], timeout: float, most: int = 0) -> int:
    """How many of `refs` are still alive after `timeout`, or as soon as `most` or fewer are."""
    deadline = time.monotonic() + timeout
    while True:
        left = sum(r() is not None for r in refs)
        if left <= most or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def test_garbage_in_cycles_made_while_a_load_runs_is_collected_as_it_runs() -> None:
    """The collector's own runs stay paused for the whole load, but the young generations are collected every
    COLLECT_EVERY_S: cycles that the process makes meanwhile (a member's requests) do not pile up until it ends."""
    with loading():
        refs = _cycles(1000)
        assert _left_after(refs, timeout=30, most=2) <= 2  # the one being made when a collection came may stay
        assert not gc.isenabled()


def test_a_collector_the_process_paused_is_not_run_by_a_load() -> None:
    gc.disable()
    with loading():
        refs = _cycles(10)
        assert _left_after(refs, timeout=3 * interpreter.COLLECT_EVERY_S) == 10
    assert not gc.isenabled()
    gc.collect()


def _no_message_errors() -> int:
    return sum(isinstance(o, NoMessageError) for o in gc.get_objects())


@pytest.mark.slow
def test_a_members_refused_requests_leave_no_garbage_piling_up_while_a_load_runs_in_its_process(
        redis_url: str, tmp_path: Path) -> None:
    """A load in a member's process (RECAUTO) while the member serves clients: each GET refused with
    MQRC_NO_MSG_AVAILABLE leaves its exception, traceback and frames in a cycle (a few KiB), on the client's side and on
    the member's; they are collected while the load runs, not kept until it ends."""
    define_group(redis_url)
    server = SQMServer(ServerConfig(name="QM1", log_root=tmp_path / "logs", redis_url=redis_url, token="t0ken"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.run(install_signals=False),))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.port and time.monotonic() < deadline:  # the queue manager started, then its port
            time.sleep(0.05)
        client = Client("127.0.0.1", server.port, token="t0ken")
        try:
            with loading():
                gc.collect(1)  # what came before the load is not counted
                for _ in range(300):
                    with pytest.raises(NoMessageError):
                        client.get("Q1")
                # Two of the load's collections after the last request, then one count: a count lists every object
                # of the process, and a collection run meanwhile would find the garbage still listed, so live.
                swept = interpreter.young_collections + 2
                deadline = time.monotonic() + 60
                while interpreter.young_collections < swept and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert _no_message_errors() <= 20
                assert not gc.isenabled()
        finally:
            client.close()
    finally:
        loop.call_soon_threadsafe(server.request_stop)
        thread.join(60)
        loop.close()
