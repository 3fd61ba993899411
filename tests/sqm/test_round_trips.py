"""What a message lifecycle costs in CF round trips and forced log writes, counted on a private
redis-server (INFO commandstats) and the log's own fsync counter. A put or get outside syncpoint is one CF script
to do it and one to commit it: its own script checked the persistent store (put.lua, get.lua refuse persistent work
while it is disconnected), so no standing.lua call comes between (docs/pstore.md). A UOW under syncpoint asks
standing.lua before its COMMIT is forced: the time between its last call and its commit is the application's."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from cfemu import server_module
from cfemu.cf import CF
from cfemu.embedded import EmbeddedRedis
from cfemu.errors import ClientGoneError, NoMessageError, PstoreUnavailableError
from cfemu.limits import CF_STEP
from sqm.core.client_watch import ClientWatch
from sqm.core.connection import Connection, PutSpec
from sqm.core.manager import QueueManager
from tests.support.group import define_group, start_qm


def _scripts(client: redis.Redis) -> int:
    """CF operations the server ran: scripts, and the server module's commands (each one a script's operation)."""
    stats = client.info("commandstats")
    names = ["evalsha", *(c.lower() for c in server_module.COMMANDS.values())]
    return sum(int(stats.get(f"cmdstat_{n}", {}).get("calls", 0)) for n in names)


def _fsyncs(qm: QueueManager) -> int:
    assert qm.log is not None
    return qm.log.stats.fsyncs


@pytest.fixture
def group(redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> tuple[redis.Redis, QueueManager]:
    srv = redis_factory()
    client = define_group(srv.url)
    # No background threads: their housekeeping scripts (expiry, sweeps) would be counted with the lifecycle's.
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    return client, qm


def counted_round_trips(qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the calls of each round trip the member makes to the CF (qm.cf.run_many), one entry a round
    trip."""
    rounds: list[int] = []
    run_many = qm.cf.run_many

    def counted_run_many(calls: list[tuple[str, str, list[object]]]) -> list[object]:
        rounds.append(len(calls))
        return run_many(calls)

    monkeypatch.setattr(qm.cf, "run_many", counted_run_many)
    return rounds


def test_outside_syncpoint_a_put_and_a_get_are_two_scripts_and_one_forced_write_each(
        group: tuple[redis.Redis, QueueManager]) -> None:
    """A persistent put outside syncpoint goes to the CF first, then its commit (put.lua, commit.lua: members do
    not use put_committed.lua, docs/cf-layout.md); a get likewise (get.lua, commit.lua). No standing.lua: each
    script checked the persistent store just now."""
    client, qm = group
    c = qm.connect()
    for _ in range(2):  # the scripts load
        c.put("Q1", b"warm", syncpoint=False)
        c.get("Q1", syncpoint=False)
    before, forced = _scripts(client), _fsyncs(qm)
    for i in range(10):
        c.put("Q1", b"m%d" % i, syncpoint=False)
    assert (_scripts(client) - before, _fsyncs(qm) - forced) == (20, 10)  # put.lua + commit.lua each
    before, forced = _scripts(client), _fsyncs(qm)
    assert [c.get("Q1", syncpoint=False).body for _ in range(10)] == [b"m%d" % i for i in range(10)]
    assert (_scripts(client) - before, _fsyncs(qm) - forced) == (20, 10)  # get.lua + commit.lua each
    qm.stop()


def test_under_syncpoint_the_commit_asks_standing_first(group: tuple[redis.Redis, QueueManager]) -> None:
    client, qm = group
    c = qm.connect()
    c.put("Q1", b"warm")
    c.commit()
    before = _scripts(client)
    c.put("Q1", b"m")
    c.commit()
    assert _scripts(client) - before == 3  # put.lua, standing.lua, commit.lua
    qm.stop()


def test_outside_syncpoint_a_disconnected_store_still_refuses(group: tuple[redis.Redis, QueueManager]) -> None:
    """A put and a get outside syncpoint are refused by their own script before anything is logged: no record, so
    no retry, restart or restore brings the put in; a later put and get, once the store is back, work."""
    client, qm = group
    c = qm.connect()
    CF(client).structure("APP1").pstore("disconnect")
    forced = _fsyncs(qm)
    with pytest.raises(PstoreUnavailableError):
        c.put("Q1", b"refused first", syncpoint=False)
    assert _fsyncs(qm) == forced
    CF(client).structure("APP1").pstore("connect")
    c.put("Q1", b"kept", syncpoint=False)
    CF(client).structure("APP1").pstore("disconnect")
    forced = _fsyncs(qm)
    with pytest.raises(PstoreUnavailableError):
        c.put("Q1", b"refused", syncpoint=False)
    with pytest.raises(PstoreUnavailableError):
        c.get("Q1", syncpoint=False)
    assert _fsyncs(qm) == forced  # nothing logged for either
    assert qm.uows == {} and qm.pending == {}  # nothing left to complete
    assert qm.log is not None
    assert [r["d"] for _, r in qm.log.records() if r["k"] == "PUT"] == [b"kept"]
    assert not [r for _, r in qm.log.records() if r["k"] == "BACKOUT"]
    CF(client).structure("APP1").pstore("connect")
    assert c.get("Q1", syncpoint=False).body == b"kept"
    with pytest.raises(NoMessageError):
        c.get("Q1", syncpoint=False)
    qm.stop()


def test_a_batch_is_one_round_trip_for_its_scripts_one_for_its_commit_and_one_forced_write(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """put_batch and get_batch of 100 with their commit: the 100 scripts in one pipeline (CF.run_many), the commit
    in one more, one fsync; no standing.lua (each persistent put or get checked the persistent store just now).
    No housekeeping runs meanwhile (its expiry calls would be counted)."""
    srv = redis_factory()
    client = define_group(srv.url)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    trips = {"run": 0, "run_many": 0}
    run, run_many = qm.cf.run, qm.cf.run_many

    def counted_run(*a: object) -> object:
        trips["run"] += 1
        return run(*a)  # type: ignore[arg-type]

    def counted_run_many(calls: list[tuple[str, str, list[object]]]) -> list[object]:
        trips["run_many"] += 1
        return run_many(calls)

    monkeypatch.setattr(qm.cf, "run", counted_run)
    monkeypatch.setattr(qm.cf, "run_many", counted_run_many)
    c = qm.connect()
    c.put_batch([PutSpec("Q1", b"warm")], commit=True)
    c.get_batch("Q1", 1, commit=True)
    for batch in (1, 10, 100):
        trips.update(run=0, run_many=0)
        before, forced = _scripts(client), _fsyncs(qm)
        done = c.put_batch([PutSpec("Q1", b"m%d" % i, priority=i % 2) for i in range(batch)], commit=True)
        assert done.committed and done.error is None and len(done.messages) == batch
        assert (trips["run_many"], trips["run"], _scripts(client) - before, _fsyncs(qm) - forced) == (
            1, 1, batch + 1, 1)
        trips.update(run=0, run_many=0)
        before, forced = _scripts(client), _fsyncs(qm)
        got = c.get_batch("Q1", batch, commit=True)
        assert got.committed and len(got.messages) == batch
        assert (trips["run_many"], trips["run"], _scripts(client) - before, _fsyncs(qm) - forced) == (
            1, 1, batch + 1, 1)
    qm.stop()


def test_a_batch_behind_a_long_run_of_expired_messages_makes_its_gets_again_in_order(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More expired messages at the head of the queue than the batch's gets may move in one round (each get moves at
    most CF_STEP and answers 'again', taking nothing): as many gets are made again in a round of their own, and
    the batch takes the live messages behind them, in get order, no more than it asked for."""
    srv = redis_factory()
    client = define_group(srv.url)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    c = qm.connect()
    expired = 4 * CF_STEP + 76
    for i in range(0, expired, 1000):
        c.put_batch([PutSpec("Q1", b"x", persistent=False, expiry_ms=1) for _ in range(min(1000, expired - i))],
                    syncpoint=False)
    c.put_batch([PutSpec("Q1", b"L%d" % i) for i in range(6)], commit=True)
    time.sleep(0.01)  # every expiry passed
    rounds = counted_round_trips(qm, monkeypatch)
    got = c.get_batch("Q1", 4, commit=True)
    assert got.committed and got.error is None
    assert [m.body for m in got.messages] == [b"L0", b"L1", b"L2", b"L3"]
    # The four gets: each 'again' (CF_STEP moved); made again: 76 moved and L0, then L1-L3.
    assert rounds == [4, 4]
    assert CF(client).structure("APP1").depths()["Q1"] == {"UP": 0, "CP": 2, "UG": 0, "EX": expired}
    rounds.clear()
    assert [m.body for m in c.get_batch("Q1", 10, commit=True).messages] == [b"L4", b"L5"]
    assert rounds == [10]
    qm.stop()


def test_a_batch_that_finds_only_expired_messages_ends_when_a_get_finds_none(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A get after the last 'again' of a round that found no message: the queue held none then, no new round."""
    srv = redis_factory()
    define_group(srv.url)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=60_000, background=False)
    c = qm.connect()
    c.put_batch([PutSpec("Q1", b"x", persistent=False, expiry_ms=1) for _ in range(CF_STEP + 10)], syncpoint=False)
    time.sleep(0.01)
    rounds = counted_round_trips(qm, monkeypatch)
    got = c.get_batch("Q1", 3)
    assert got.messages == [] and got.error is None and c.uow is None
    assert rounds == [3]  # again, then 10 moved and none, none
    qm.stop()


class _Watch(ClientWatch):
    """A client watch that counts its looks at the connection (a service's reads the socket each time)."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        return super().is_set()


def test_a_get_that_finds_a_message_at_once_does_not_look_at_its_connection(
        group: tuple[redis.Redis, QueueManager]) -> None:
    _, qm = group
    watch = _Watch()
    c = Connection(qm, gone=watch)
    c.put("Q1", b"m")
    c.commit()
    assert c.get("Q1").body == b"m" and watch.looks == 0
    c.commit()
    with pytest.raises(NoMessageError):
        c.get("Q1", wait_ms=30)  # waits: each attempt after a wait looks
    assert watch.looks >= 1
    watch.set()  # the client was seen to leave: a get ends at once, and takes nothing
    c.put("Q1", b"later", syncpoint=False)
    with pytest.raises(ClientGoneError):
        c.get("Q1")
    assert qm.connect().get("Q1", syncpoint=False).body == b"later"
    qm.stop()
