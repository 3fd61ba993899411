"""Scan slots (sqm.core.scans): at most N calls of a member's multi-call scans (a browse's pages, a peek scan's
batches) are in the CF at once; the others wait for a slot in the member, and a call waiting for one gives its
request slot up first."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cfemu.cf import Structure
from sqm.core.manager import QueueManager
from sqm.core.scans import ScanSlots
from sqm.request_slots import RequestSlots
from sqm.service.config import ServerConfig, ServerConfigError
from sqm.service.server import SQMServer


class Overlap:
    """How many calls run at once, and the most that ever did."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0

    def __enter__(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.now -= 1


def _together(n: int, work: Any) -> None:
    """``work`` in ``n`` threads started at once; re-raises the first failure."""
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def run() -> None:
        start.wait()
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def test_no_more_scan_calls_run_at_once_than_there_are_slots() -> None:
    slots, overlap = ScanSlots(2), Overlap()

    def scan() -> None:
        for _ in range(5):
            with slots.call(), overlap:
                time.sleep(0.01)

    _together(6, scan)
    assert overlap.most == 2 and slots.waits > 0 and (slots.running, slots.waiting) == (0, 0)


def test_a_call_waiting_for_a_scan_slot_gives_its_request_slot_up() -> None:
    scans, requests = ScanSlots(1), RequestSlots(1)
    held, other_ran = threading.Event(), threading.Event()

    def holder() -> None:
        with scans.call():
            held.set()
            assert other_ran.wait(5)  # another request ran while the waiter below waited for this scan slot

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(5)

    def other() -> None:
        with requests.running():
            other_ran.set()

    with requests.running():
        threading.Timer(0.05, lambda: threading.Thread(target=other).start()).start()
        with scans.call():
            pass
    t.join(5)
    assert other_ran.is_set()


def test_a_call_past_its_lease_no_longer_keeps_a_waiter_out() -> None:
    """A call on a CF that does not answer held its slot for its whole socket timeout, and the scans behind it
    failed one timeout after another. Past LEASE_S its slot is a waiter's."""
    slots = ScanSlots(1, lease_s=0.2)
    stuck, release = threading.Event(), threading.Event()

    def silent_cf() -> None:
        with slots.call():
            stuck.set()
            release.wait(5)

    t = threading.Thread(target=silent_cf)
    t.start()
    assert stuck.wait(5)
    t0 = time.monotonic()
    with slots.call():
        took = time.monotonic() - t0
        assert slots.running == 2
    release.set()
    t.join(5)
    assert 0.15 <= took < 1.0 and slots.expired == 1 and (slots.running, slots.waiting) == (0, 0)


def test_calls_past_their_lease_still_count_toward_twice_the_slots() -> None:
    """A slow CF (not a silent one) must not be sent more scans the slower it gets: past their lease, calls still
    count toward a bound of 2n."""
    slots = ScanSlots(1, lease_s=0.05)
    release = threading.Event()
    inside = threading.Semaphore(0)

    def slow_call() -> None:
        with slots.call():
            inside.release()
            release.wait(5)

    threads = [threading.Thread(target=slow_call) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.1)  # past the lease of the one before
    assert inside.acquire(timeout=5) and inside.acquire(timeout=5)
    assert not inside.acquire(timeout=0.3)  # the third waits: 2 in the CF, both past their lease
    assert slots.running == 2 and slots.waiting == 2
    release.set()
    for t in threads:
        t.join(5)
    assert (slots.running, slots.waiting) == (0, 0)


def test_scan_slots_are_1_to_1024() -> None:
    for bad in (0, 1025):
        with pytest.raises(ValueError, match="scan slots must be 1-1024"):
            ScanSlots(bad)


@pytest.fixture
def slow_pages(monkeypatch: pytest.MonkeyPatch) -> Iterator[Overlap]:
    """Every browse page's CF call takes 20 ms more: the pages of browses at once overlap unless slots keep them
    apart."""
    overlap, real = Overlap(), Structure.browse_page

    def page(self: Structure, *args: Any, **kw: Any) -> Any:
        with overlap:
            time.sleep(0.02)
            return real(self, *args, **kw)

    monkeypatch.setattr(Structure, "browse_page", page)
    yield overlap


def test_the_pages_of_a_members_browses_run_under_its_scan_slots(qm: QueueManager, slow_pages: Overlap) -> None:
    conn = qm.connect()
    for i in range(5):
        conn.put("Q1", b"m%d" % i, syncpoint=False)
    qm.scans = ScanSlots(2)

    def browse() -> None:
        c = qm.connect()
        try:
            for _ in range(3):
                assert [m.body for m in c.browse("Q1", 10)] == [b"m%d" % i for i in range(5)]
        finally:
            c.close()

    _together(6, browse)
    assert slow_pages.most == 2 and qm.scans.waits > 0
    conn.close()


def test_sqm_run_gives_its_member_the_scan_slots_it_was_told(redis_url: str, tmp_path: Any) -> None:
    server = SQMServer(ServerConfig(name="QM1", log_root=tmp_path, redis_url=redis_url, token="t", scan_slots=3))
    try:
        assert server.qm.scans.n == 3
        stats = server.server_stats()  # what /metrics shows of them
        assert (stats["scan_slots"], stats["waiting_for_scan_slot"], stats["scan_slot_waits"]) == (3, 0, 0)
    finally:
        server.qm.redis.close()
    with pytest.raises(ServerConfigError, match="scan slots must be at least 1 and at most 1024, not 0"):
        ServerConfig(name="QM1", log_root=tmp_path, token="t", scan_slots=0).check()
