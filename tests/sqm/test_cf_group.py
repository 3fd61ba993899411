"""Concurrent requests' CF calls share round trips (sqm.core.cfgroup.GroupedCF), on a real redis-server.

The CF is held still (CLIENT PAUSE) while one call is on its way, so that the calls of the other threads queue
behind it for sure; once it is let go, they go in one pipelined round trip. Each caller gets its own reply, its own
refusal, or (the connection lost, the CF killed) a failure that says its reply was lost; each thread's calls stay
in its order; a queue manager's concurrent units of work each complete as if alone; and a member killed (SIGKILL)
inside a shared round trip loses no acknowledged message and applies no unacknowledged one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cfemu import resp
from cfemu.admin import Admin
from cfemu.cf import Caller, PutReply
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from cfemu.entry import Entry
from cfemu.errors import StructureFullError
from sqm.core.cfcall import reply_lost
from sqm.core.cfgroup import UNGROUPED_ENV, GroupedCF
from sqm.core.clock import LrsnClock
from sqm.core.manager import QueueManager
from sqm.request_slots import RequestSlots
from tests.sqm.test_batch import client as batch_client
from tests.support.group import define_group, start_qm
from tests.support.killed_member import killed_by_failpoint
from tests.support.service_proc import ServerProc
from tests.support.waits import sigstop

THREADS = 8
DEADLINE_S = 30.0  # generous: the machine may be loaded


def _wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def cf_url(fresh_redis: EmbeddedRedis) -> str:
    client = define_group(fresh_redis.url, queues=("Q1", "Q2"))
    Admin(client).ensure_structure("TINY", ("FULLQ",), max_entries=1)
    client.close()
    return str(fresh_redis.url)


@pytest.fixture
def grouped(cf_url: str) -> Iterator[tuple[GroupedCF, redis.Redis]]:
    cf = GroupedCF(connect(cf_url, max_connections=THREADS + 2))
    side = connect(cf_url)  # pauses, unpauses and kills: a connection of its own
    yield cf, side
    side.execute_command("CLIENT", "UNPAUSE")
    side.close()


def _caller(cf: GroupedCF) -> Caller:
    """QM1 as the CF knows it: the member the fixture joined, at its epoch."""
    return Caller("QM1", Admin(cf.redis).join("QM1", {}, 60_000), LrsnClock())


def _entry(i: int, queue: str = "Q1") -> Entry:
    return Entry(id=f"{i:024x}", queue=queue, priority=0, persistent=False, msgid=f"{i:048x}", correlid="",
                 expiry=0, put_time=int(time.time() * 1000), properties={})


def _held_round_trip(cf: GroupedCF, side: redis.Redis, calls: list[Callable[[], Any]],
                     unpaused: threading.Event | None = None) -> list[Future[Any]]:
    """Start the first call while the CF holds its writes (scripts among them), queue the others behind it, then let
    the CF go (`unpaused` is set once the CF has answered that)."""
    side.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
    pool = ThreadPoolExecutor(len(calls))
    futures = [pool.submit(calls[0])]
    _wait_for(lambda: cf._leading, "the first call to lead")
    futures += [pool.submit(c) for c in calls[1:]]
    _wait_for(lambda: len(cf._queue) == len(calls) - 1, "the other calls to queue")
    side.execute_command("CLIENT", "UNPAUSE")
    if unpaused is not None:
        unpaused.set()
    for f in futures:
        f.exception(timeout=DEADLINE_S)
    pool.shutdown()
    return futures


def test_calls_queued_behind_a_round_trip_go_together_each_with_its_own_reply(
        grouped: tuple[GroupedCF, redis.Redis]) -> None:
    cf, side = grouped
    caller = _caller(cf)
    s = cf.structure("APP1")
    futures = _held_round_trip(cf, side, [partial(s.put, caller, _entry(i), b"m%d" % i) for i in range(THREADS)])
    assert all(f.result().clock > 0 for f in futures)
    assert (cf.round_trips, cf.calls, cf.largest) == (2, THREADS, THREADS - 1)  # the first alone, the rest together
    bodies = sorted(d for _, d in s.browse("Q1", 100, int(time.time() * 1000)))
    assert bodies == sorted(b"m%d" % i for i in range(THREADS))


def test_a_refusal_in_a_shared_round_trip_is_its_callers_alone(grouped: tuple[GroupedCF, redis.Redis]) -> None:
    cf, side = grouped
    caller = _caller(cf)
    app, tiny = cf.structure("APP1"), cf.structure("TINY")
    tiny.put(caller, _entry(99, "FULLQ"), b"fills it")  # TINY holds one entry: every later put there is refused
    calls: list[Callable[[], Any]] = [partial(tiny.put, caller, _entry(i, "FULLQ"), b"x") if i == 3 else
                                      partial(app.put, caller, _entry(i), b"x") for i in range(THREADS)]
    futures = _held_round_trip(cf, side, calls)
    assert isinstance(futures[3].exception(), StructureFullError)
    assert all(f.exception() is None for i, f in enumerate(futures) if i != 3)
    assert cf.largest == THREADS - 1


def test_a_call_that_cannot_be_sent_fails_alone_in_a_shared_round_trip(
        grouped: tuple[GroupedCF, redis.Redis]) -> None:
    """One caller's argument that no command carries (None for the message data) is its own DataError, as it is
    alone; the other calls of its round trip still go, each with its reply (the error failed every caller's call,
    none of them sent)."""
    cf, side = grouped
    caller = _caller(cf)
    s = cf.structure("APP1")
    calls: list[Callable[[], Any]] = [partial(s.put, caller, _entry(i), None if i == 3 else b"m%d" % i)
                                      for i in range(THREADS)]
    futures = _held_round_trip(cf, side, calls)
    assert isinstance(futures[3].exception(), redis.exceptions.DataError)
    assert all(f.result().clock > 0 for i, f in enumerate(futures) if i != 3)
    assert cf.largest == THREADS - 1
    bodies = sorted(d for _, d in s.browse("Q1", 100, int(time.time() * 1000)))
    assert bodies == sorted(b"m%d" % i for i in range(THREADS) if i != 3)


def test_a_script_the_cf_does_not_hold_is_loaded_inside_a_shared_round_trip(
        grouped: tuple[GroupedCF, redis.Redis]) -> None:
    """Scripts are loaded on first use: the shared round trip's NOSCRIPT replies are made again by its leader
    (CF.run_many), which must not queue them behind the round trip they belong to."""
    cf, side = grouped
    caller = _caller(cf)
    s = cf.structure("APP1")
    side.script_flush()
    calls: list[Callable[[], Any]] = [partial(s.standing, caller, "no-such-uow", gen=0)]
    calls += [partial(s.put, caller, _entry(i), b"m%d" % i) for i in range(1, THREADS)]
    futures = _held_round_trip(cf, side, calls)
    assert futures[0].result() == "N"
    assert all(f.result().clock > 0 for f in futures[1:])
    assert cf.largest == THREADS - 1


def test_a_request_queued_for_a_round_trip_gives_its_slot_to_another_that_joins_it(
        grouped: tuple[GroupedCF, redis.Redis]) -> None:
    """Two request slots (sqm.request_slots), three requests: the first leads a round trip, the second queues for
    the next one and gives its slot up, so the third runs and joins that round trip instead of waiting for a slot
    (the lease is long: no slot comes back on its own). The third may wait a moment for the slot the second is
    about to give up (it queues, then gives it), but never for a lease to run out."""
    cf, side = grouped
    caller = _caller(cf)
    s = cf.structure("APP1")
    slots = RequestSlots(2, lease_s=60)

    def request(i: int) -> PutReply:
        with slots.running():
            return s.put(caller, _entry(i), b"m%d" % i)

    futures = _held_round_trip(cf, side, [partial(request, i) for i in range(3)])
    assert all(f.result().clock > 0 for f in futures)
    assert (cf.largest, slots.expired) == (2, 0)


def test_a_lost_connection_fails_each_caller_of_its_round_trip(grouped: tuple[GroupedCF, redis.Redis]) -> None:
    cf, side = grouped
    caller = _caller(cf)
    s = cf.structure("APP1")
    side.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
    pool = ThreadPoolExecutor(THREADS)
    first = pool.submit(s.put, caller, _entry(0), b"first")
    _wait_for(lambda: cf._leading, "the first call to lead")
    rest = [pool.submit(s.put, caller, _entry(i), b"x") for i in range(1, THREADS)]
    _wait_for(lambda: len(cf._queue) == THREADS - 1, "the other calls to queue")
    # Every connection but ours is dropped, again and again while the CF stays paused: the first call's, while its
    # request waits for the pause to end (its reply is lost), then the shared round trip's.
    deadline = time.monotonic() + DEADLINE_S
    while not all(f.done() for f in (first, *rest)):
        assert time.monotonic() < deadline, "the callers were not answered"
        side.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        time.sleep(0.02)
    pool.shutdown()
    lost = first.exception()
    assert isinstance(lost, redis.exceptions.ConnectionError) and reply_lost(lost), lost
    failures = [f.exception() for f in rest]
    assert all(isinstance(e, redis.exceptions.ConnectionError) for e in failures), failures
    assert len({id(e) for e in failures}) == len(failures)  # each caller raises an exception of its own
    assert cf.largest == THREADS - 1


def test_a_cf_killed_during_a_shared_round_trip_fails_each_caller_as_a_lost_reply(
        fresh_redis: EmbeddedRedis, cf_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CF dies (SIGKILL) with a shared round trip's pipeline written to it and unanswered (it is stopped, the
    pipeline sent, then it is killed): each caller of the round trip gets what it would have got alone, a
    ConnectionError that says its reply was lost (its script may have run: the member takes the outcome as
    unknown), each an exception of its own."""
    cf = GroupedCF(connect(cf_url, max_connections=THREADS + 2))
    caller = _caller(cf)
    s = cf.structure("APP1")
    side = connect(cf_url)
    real_send = resp.send

    unpaused = threading.Event()

    def sent_to_a_cf_killed_before_it_answers(conn: Any, sock: Any, chunks: Any) -> None:
        # The shared round trip's pipeline (CF.run_many; a lone call is sent by cfemu.cf's own path). The CF may
        # write the lone call's reply before the reply to UNPAUSE: it is stopped only once that one is read.
        assert unpaused.wait(DEADLINE_S), "the CF did not answer UNPAUSE"
        assert fresh_redis.pid is not None
        sigstop(fresh_redis.pid)
        real_send(conn, sock, chunks)
        fresh_redis.kill()

    monkeypatch.setattr(resp, "send", sent_to_a_cf_killed_before_it_answers)
    futures = _held_round_trip(cf, side, [partial(s.put, caller, _entry(i), b"m%d" % i) for i in range(THREADS)],
                               unpaused)
    assert futures[0].result().clock > 0  # the lone call, before the CF died
    failures = [f.exception() for f in futures[1:]]
    assert all(isinstance(e, redis.exceptions.ConnectionError) and reply_lost(e) for e in failures), failures
    assert len({id(e) for e in failures}) == len(failures)
    assert (cf.round_trips, cf.largest) == (2, THREADS - 1)
    side.close()


def test_each_caller_gets_its_own_reply_whatever_round_trip_carries_it(cf_url: str) -> None:
    """Threads ask again and again, all at once, for a message of their own by its id (peek): every reply is the
    asker's own, never a neighbour's in the same round trip."""
    cf = GroupedCF(connect(cf_url, max_connections=THREADS + 2))
    caller = _caller(cf)
    s = cf.structure("APP1")
    for t in range(THREADS):
        s.put(caller, _entry(t), b"m%d" % t)

    def asker(t: int) -> None:
        mine = _entry(t)
        for _ in range(50):
            [(entry, data)] = s.peek("Q1", "m", mine.msgid)
            assert (entry.id, data) == (mine.id, b"m%d" % t)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(asker, range(THREADS)))
    assert cf.calls == THREADS * 51 and cf.largest > 1  # the askers' calls shared round trips


def test_each_threads_calls_stay_in_its_order(cf_url: str) -> None:
    cf = GroupedCF(connect(cf_url, max_connections=THREADS + 2))
    caller = _caller(cf)
    s = cf.structure("APP1")
    per = 30

    def producer(t: int) -> None:
        for k in range(per):
            s.put(caller, _entry(t * 1000 + k), b"%d:%d" % (t, k))

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(producer, range(THREADS)))
    assert cf.calls == THREADS * per
    seen = [d for _, d in s.browse("Q1", THREADS * per, int(time.time() * 1000))]
    for t in range(THREADS):
        mine = [int(d.split(b":")[1]) for d in seen if d.startswith(b"%d:" % t)]
        assert mine == list(range(per))


def test_concurrent_units_of_work_share_round_trips_and_complete_each_as_alone(cf_url: str, tmp_path: Path) -> None:
    qm: QueueManager = start_qm(cf_url, tmp_path / "logs", "QM2", lease_ms=60_000, background=False)
    per = 20
    gate = threading.Barrier(THREADS)

    def lifecycle(t: int) -> list[bytes]:
        c = qm.connect()
        gate.wait(timeout=DEADLINE_S)
        for k in range(per):
            c.put("Q2", b"%d:%d" % (t, k))
            c.commit()
        got = []
        for _ in range(per):
            got.append(c.get("Q2", wait_ms=5000).body)
            c.commit()
        return got

    try:
        with ThreadPoolExecutor(THREADS) as pool:
            taken = [b for got in pool.map(lifecycle, range(THREADS)) for b in got]
        assert sorted(taken) == sorted(b"%d:%d" % (t, k) for t in range(THREADS) for k in range(per))
        status = qm.status()
        assert status["cf_calls"] >= THREADS * per * 4
        assert status["cf_round_trips"] <= status["cf_calls"]
    finally:
        qm.stop()


def test_a_connection_that_retries_on_its_own_is_not_grouped(cf_url: str) -> None:
    """A round trip shared by several callers is never sent again; a client whose connections send a call again
    on their own (not the member's: cfemu.connection makes one attempt) keeps each call alone, retried as before."""
    assert GroupedCF(connect(cf_url, max_connections=2)).groups
    cf = GroupedCF(connect(cf_url, max_connections=2, retry=Retry(NoBackoff(), 2)))
    assert not cf.groups
    cf.structure("APP1").put(_caller(cf), _entry(1), b"alone")
    assert (cf.round_trips, cf.calls, cf.largest) == (1, 1, 0)  # a round trip of its own


@pytest.mark.slow
def test_kill_9_inside_a_shared_cf_round_trip_loses_no_acknowledged_message(fresh_redis: EmbeddedRedis,
                                                                           tmp_path: Path) -> None:
    """Eight clients run lifecycles (put, commit, get, commit, each a request) on one `sqm run` member served by a
    thread per connection, whose concurrent requests' CF calls share round trips (the event loop's batches have
    kill tests of their own: tests/sqm/test_service_event_loop.py, test_service_syncpoint_batches.py). The member dies (SIGKILL) once the CF answered its thirtieth
    shared round trip, before any caller of it has its reply: the CF applied those scripts, and no client knows.
    After peer recovery: no acknowledged put is lost (unless a get of it is in doubt), no acknowledged get comes
    back, no put whose own request failed (its unit of work never committed) is there, and nothing is there that
    was not acknowledged or in doubt."""
    acked_puts: set[bytes] = set()
    unknown_puts: set[bytes] = set()
    failed_puts: set[bytes] = set()
    acked_gets: set[bytes] = set()
    unknown_gets: set[bytes] = set()
    lock = threading.Lock()
    lost = Exception  # the member died: each request fails as its client reports it (MQError, OSError...)

    def lifecycles(victim: ServerProc, k: int) -> None:
        with batch_client(victim, reconnect_timeout=1) as c:
            for n in range(2000):
                body = b"c%d-m%d" % (k, n)
                try:
                    c.put("K4", body)
                except lost:
                    with lock:
                        failed_puts.add(body)
                    return
                try:
                    c.commit()
                except lost:
                    with lock:
                        unknown_puts.add(body)
                    return
                with lock:
                    acked_puts.add(body)
                try:  # a message is there: each client's committed puts are at least its gets
                    got = c.get("K4", wait_ms=10_000).body
                except lost:
                    return
                try:
                    c.commit()
                except lost:
                    with lock:
                        unknown_gets.add(got)
                    return
                with lock:
                    acked_gets.add(got)

    with killed_by_failpoint(str(fresh_redis.url), tmp_path, "K4", "shared-cf-round-trip=30",
                             "--thread-per-connection") as killed:
        killed.run_clients(lifecycles, THREADS, join_timeout=180, what="the member was not killed in a shared round trip")
        assert acked_gets, "no lifecycle was acknowledged before the kill"
        with batch_client(killed.peer) as check:
            left = [m.body for m in check.get_batch("K4", 1000, commit=True)]
        assert len(left) == len(set(left)), left
        there = set(left)
        assert not there & acked_gets, "an acknowledged get came back"
        assert acked_puts - acked_gets - unknown_gets <= there, "an acknowledged put was lost"
        assert not there & failed_puts, "a put whose unit of work never committed was applied"
        assert there <= acked_puts | unknown_puts, "a message no client had acknowledged or had in doubt"


def test_the_benchmarks_baseline_sends_each_call_alone(cf_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """UNGROUPED_ENV (bench/bench_peers.py's sqm-service-ungrouped sets it for its members): concurrent calls each
    go in a round trip of their own, counted as such."""
    monkeypatch.setenv(UNGROUPED_ENV, "1")
    cf = GroupedCF(connect(cf_url, max_connections=THREADS + 2))
    assert not cf.groups
    caller = _caller(cf)
    s = cf.structure("APP1")
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda t: [s.put(caller, _entry(t * 100 + k), b"x") for k in range(10)], range(THREADS)))
    assert cf.largest == 0 and cf.round_trips > 0  # none shared (the counts are a metric, unlocked)
