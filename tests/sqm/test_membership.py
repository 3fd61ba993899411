"""A member's lease survives what the CF throws at its heartbeat.

A heartbeat rides out every Redis error, not only connection errors: a transient out-of-memory refusal or a script
error on one malformed {ADMIN} entry is reported and retried, and never stops the heartbeat thread (a stopped
heartbeat lets the lease lapse, peers fence the member, and a whole group of `sqm run` processes exits fenced).
Real redis-server, real threads, real leases.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cfemu.admin import MEMBERS, STRUCTURES, Admin
from cfemu.cf import Caller
from cfemu.embedded import EmbeddedRedis
from cfemu.entry import Entry
from cfemu.errors import FencedError
from sqm.core.connection import Message, PutSpec
from sqm.core.lifecycles import Lifecycles, OnePut
from sqm.core.manager import QueueManager
from sqm.core.recovery import recover_peers
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

LEASE_MS = 900


def _lease_renewed_after(admin: Admin, member: str, t: float, timeout: float = 3.0) -> bool:
    """Does the member's lease get renewed (its TTL jumps back up) after monotonic time t?"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if time.monotonic() > t and admin.redis.pttl(f"{{ADMIN}}:lease:{member}") > LEASE_MS * 0.8:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def member(redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> Iterator[tuple[QueueManager, Admin]]:
    """QM1 with a short lease on a CF of its own (the test may change the CF's settings), and the CF's Admin."""
    srv = redis_factory()
    define_group(srv.url)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", lease_ms=LEASE_MS)
    try:
        yield qm, Admin(srv.client())
    finally:
        qm.stop()


def test_the_heartbeat_rides_out_a_transient_out_of_memory_refusal(member: tuple[QueueManager, Admin]) -> None:
    qm, admin = member
    try:
        admin.redis.config_set("maxmemory-policy", "noeviction")
        admin.redis.config_set("maxmemory", 1)  # every write, the lease's SET included, is refused with OOM
        time.sleep(LEASE_MS / 1000 * 0.7)  # two heartbeats fail
        admin.redis.config_set("maxmemory", 0)
        assert _lease_renewed_after(admin, "QM1", time.monotonic()), "the heartbeat died on an OOM refusal"
        assert not qm.fenced
        conn = qm.connect()
        conn.put("Q1", b"still serving")
        conn.commit()
    finally:
        admin.redis.config_set("maxmemory", 0)


def test_a_failed_renewal_is_tried_again_soon_not_a_period_later(member: tuple[QueueManager, Admin],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A cut of 2/3 of the lease (the chaos suite's cf-link-cut of 2 s against a lease of 3 s): the renewal after
    the link came back waited a whole period, and the lease set just under a period before the cut lapsed first:
    peers fenced a member reachable again. Failed renewals are now tried again every HEARTBEAT_RETRY_S."""
    qm, admin = member
    attempts: list[float] = []
    real = qm.renew_membership
    cut = threading.Event()
    cut.set()

    def renew() -> None:
        attempts.append(time.monotonic())
        if cut.is_set():
            raise ConnectionError("the link to the CF is cut")
        real()

    monkeypatch.setattr(qm, "renew_membership", renew)
    time.sleep(LEASE_MS / 1000)  # a third of the lease a period: failing from the first
    cut.clear()
    healed = time.monotonic()
    assert _lease_renewed_after(admin, "QM1", healed, timeout=2.0)
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert len(attempts) >= 4 and min(gaps) < 0.2, gaps  # retried within HEARTBEAT_RETRY_S, not LEASE_MS / 3
    assert not qm.fenced


def test_one_malformed_admin_entry_is_reported_and_skipped_not_fatal(member: tuple[QueueManager, Admin]) -> None:
    qm, admin = member
    admin.redis.hset(MEMBERS, "QMBAD", b"\xc1 not msgpack")
    admin.redis.hset(STRUCTURES, "APPBAD", b"\x92\x01")  # msgpack, but not a structure definition
    assert [s.name for s in admin.structures()] == ["APP1"]
    assert "QMBAD" not in admin.members()
    assert {k for k, _ in admin.bad_entries} == {MEMBERS, STRUCTURES}
    recover_peers(qm)  # reads every member: must not raise
    qm.expire_messages()  # reads every structure: must not raise
    time.sleep(LEASE_MS / 1000 * 1.5)
    assert _lease_renewed_after(admin, "QM1", time.monotonic())
    assert not qm.fenced


def test_a_call_that_left_before_the_member_rejoined_a_new_cf_does_not_fence_it(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    """The CF was lost and came back empty; the member re-joined it with a higher epoch while one of its calls,
    built with the old epoch, was still on its way. The structure answers that call FENCED (the epoch is stale),
    yet no peer fenced anyone: the member must retry it with its new epoch, not stop as fenced (it did, and a
    whole healthy member exited with code 3)."""
    srv = redis_factory()
    define_group(srv.url)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", background=False)
    try:
        old = Caller(qm.caller.member, qm.caller.epoch, qm.caller.clock)
        lose_cf(srv.client())
        define_group(srv.url)
        s = qm.structure("APP1")
        entry = Entry(id="e1", queue="Q1", priority=0, persistent=False, msgid="00", correlid="", expiry=0,
                      put_time=0, properties={})
        calls: list[int] = []

        def put() -> object:
            calls.append(qm.caller.epoch)
            if len(calls) == 1:  # on its way with the old epoch while the heartbeat re-joins (a higher epoch)
                qm.renew_membership()
                return s.put(old, entry, b"after the re-join")
            return s.put(qm.caller, entry, b"after the re-join")

        qm.cf_call(put)
        assert qm.caller.epoch > old.epoch and len(calls) == 2
        assert not qm.fenced
        assert [m.body for m in qm.connect().browse("Q1")] == [b"after the re-join"]
    finally:
        qm.stop()


def test_a_batch_made_again_after_the_rejoin_carries_the_new_epoch(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    """Lifecycles.begin builds its batch's calls, each with the member's epoch, before it sends them. The CF was lost
    and came back empty: the batch is refused NOTJOINED, and its call made again (Connection._batch_cf_call) re-joins
    the group with a higher epoch, then was made again with the epoch it was built with: refused FENCED, made again
    for the new epoch, still with the old one, refused again, and taken for a peer's fencing. Members of a chaos run
    (cf-hang, seed 10) stopped as fenced from their begin thread 10 ms after re-joining."""
    srv = redis_factory()
    define_group(srv.url)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", background=False)
    try:
        old_epoch = qm.caller.epoch
        lose_cf(srv.client())
        define_group(srv.url)
        out = Lifecycles(qm).run([OnePut(PutSpec("Q1", b"after the re-join")), OnePut(PutSpec("Q1", b"and this"))])
        assert qm.caller.epoch > old_epoch
        assert not qm.fenced, f"the member took its own re-join for a fencing: {out}"
        assert all(isinstance(m, Message) for m in out), out
        assert [m.body for m in qm.connect().browse("Q1")] == [b"after the re-join", b"and this"]
    finally:
        qm.stop(checkpoint=not qm.fenced)


def test_a_call_refused_while_the_rejoin_raises_the_fences_does_not_fence_the_member(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    """The re-join after the loss of the CF raises the structures' fences to the new epoch (Admin.join) before the
    member's caller takes that epoch. A call made in between, with the old epoch, is refused FENCED (current: the new
    epoch) and, seen before the caller's epoch moved, was taken for a peer's fencing: all three members of a chaos
    run (cf-hang) stopped as fenced 10 ms after re-joining. The refusal must wait for the re-join to end, and the
    call be made again with the new epoch."""
    srv = redis_factory()
    define_group(srv.url)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", background=False)
    try:
        old_epoch = qm.caller.epoch
        lose_cf(srv.client())
        define_group(srv.url)
        s = qm.structure("APP1")
        entry = Entry(id="e1", queue="Q1", priority=0, persistent=False, msgid="00", correlid="", expiry=0,
                      put_time=0, properties={})
        refused = threading.Event()
        epochs: list[int] = []
        outcome: list[object] = []

        def put() -> object:
            epochs.append(qm.caller.epoch)
            try:
                return s.put(qm.caller, entry, b"beside the re-join")
            except FencedError:
                refused.set()
                raise

        def call() -> None:
            try:
                outcome.append(qm.cf_call(put))
            except Exception as e:  # noqa: BLE001 - the test reports it
                outcome.append(e)

        admin = qm.lease_admin
        join = admin.join
        caller = threading.Thread(target=call)

        def join_with_a_call_beside(member: str, info: dict[str, object], lease_ms: int) -> int:
            epoch = join(member, info, lease_ms)  # the fences hold the new epoch; the caller still has the old one
            caller.start()
            assert refused.wait(5), "the call beside the re-join was not refused"
            time.sleep(0.05)  # the refusal's handling, before the caller takes the new epoch
            return epoch

        admin.join = join_with_a_call_beside  # type: ignore[method-assign]
        try:
            qm.renew_membership()
        finally:
            admin.join = join  # type: ignore[method-assign]
        caller.join(5)
        assert not caller.is_alive()
        assert qm.caller.epoch > old_epoch
        assert not qm.fenced, f"the member took its own re-join for a fencing: {outcome}"
        assert epochs == [old_epoch, qm.caller.epoch] and not isinstance(outcome[0], Exception), outcome
        assert [m.body for m in qm.connect().browse("Q1")] == [b"beside the re-join"]
    finally:
        qm.stop(checkpoint=not qm.fenced)


def test_a_member_fenced_by_a_peer_still_stops(redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    srv = redis_factory()
    define_group(srv.url)
    qm = start_qm(srv.url, tmp_path / "logs", "QM1", background=False)
    try:
        stale = Caller(qm.caller.member, qm.caller.epoch - 1, qm.caller.clock)
        entry = Entry(id="e1", queue="Q1", priority=0, persistent=False, msgid="00", correlid="", expiry=0,
                      put_time=0, properties={})
        s = qm.structure("APP1")
        with pytest.raises(FencedError):
            qm.cf_call(lambda: s.put(stale, entry, b"x"))
        assert qm.fenced
    finally:
        qm.stop(checkpoint=False)
