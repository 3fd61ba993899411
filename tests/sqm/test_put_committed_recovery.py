"""A persistent put outside syncpoint: its own unit of work, put on the CF first (put.lua, which refuses it before
anything is logged: capacity, a structure that is not ACTIVE, a disconnected persistent store), then its PUT and
forced COMMIT logged and the commit applied. The member does not use the put committed in one CF operation
(put_committed.lua, docs/cf-layout.md says why): a peer's or a restart's redo is a commit of a UOW whose put the CF
holds, so a message consumed since never comes back, a put the CF refused has no record any recovery could redo,
and no tombstone is left per put. In process, no background threads, against a real redis-server."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cfemu import keys
from cfemu.errors import MQError, NoMessageError
from sqm.core import records
from sqm.core.manager import QueueManager
from sqm.core.recovery import recover_peers
from tests.support.group import define_group, start_qm, warm
from tests.support.waits import wait_until


class Died(BaseException):
    """The member stops right here (what a kill leaves: no later line of it runs)."""


@pytest.fixture
def log_root(redis_url: str, tmp_path: Path) -> Path:
    define_group(redis_url, queues=("Q1",))
    return tmp_path / "logs"


def die_at(qm: QueueManager, monkeypatch: pytest.MonkeyPatch, kind: str, *, before: bool = False) -> None:
    """The member dies right after it appends its next record of this kind (a COMMIT is forced by then), or right
    before it."""
    append = qm.append

    def append_then_die(record: records.Record, **kw: Any) -> None:
        if record["k"] == kind and before:
            raise Died(kind)
        append(record, **kw)
        if record["k"] == kind:
            raise Died(kind)
    monkeypatch.setattr(qm, "append", append_then_die)


def crash(qm: QueueManager) -> None:
    qm.stop(checkpoint=False)


def died_before_its_end(qm: QueueManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """The member, warmed, puts b"once" outside syncpoint and dies after the CF call and its forced COMMIT, before
    its END (crashed: no checkpoint)."""
    warm(qm)
    die_at(qm, monkeypatch, "END", before=True)
    with pytest.raises(Died):
        qm.connect().put("Q1", b"once", syncpoint=False)
    crash(qm)


def tombstones(qm: QueueManager) -> dict[str, str]:
    return {keys.text(k): keys.text(v) for k, v in qm.redis.hgetall(keys.tomb("APP1")).items()}


def all_bodies(qm: QueueManager) -> list[bytes]:
    return sorted(m.body for m in qm.connect().browse("Q1", limit=100))


def test_a_put_goes_to_the_cf_before_its_records_and_leaves_no_tombstone(redis_url: str, log_root: Path) -> None:
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        warm(qm)
        qm.connect().put("Q1", b"one", syncpoint=False)
        assert qm.log is not None
        kinds = [r["k"] for _, r in qm.log.records()][-3:]
        assert kinds == ["PUT", "COMMIT", "END"]
        put = [r for _, r in qm.log.records() if r["k"] == "PUT"][-1]
        assert "c" not in put and put["d"] == b"one"  # a put the CF took in flight, committed after its COMMIT
        assert all_bodies(qm) == [b"one"] and qm.uows == {} and tombstones(qm) == {}
    finally:
        qm.stop()


@pytest.mark.parametrize("by", ["peer", "restart"])
def test_a_put_whose_member_died_after_its_commit_was_forced_is_committed_from_the_log(
        redis_url: str, log_root: Path, monkeypatch: pytest.MonkeyPatch, by: str) -> None:
    qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=300)
    qm2 = start_qm(redis_url, log_root, "QM2", background=False, lease_ms=60_000)
    try:
        warm(qm1)
        die_at(qm1, monkeypatch, "COMMIT")
        with pytest.raises(Died):
            qm1.connect().put("Q1", b"decided", syncpoint=False)
        crash(qm1)
        assert all_bodies(qm2) == []  # the CF holds it in flight, under QM1's UOW
        if by == "peer":
            time.sleep(0.4)  # QM1's lease lapses (its heartbeat is off)
            assert [(r.failed, r.committed) for r in recover_peers(qm2)] == [("QM1", 1)]
        else:
            monkeypatch.undo()
            qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=60_000)
            assert qm1.last_restart.in_commit == 1
        assert all_bodies(qm2) == [b"decided"]
        assert qm2.connect().get("Q1", syncpoint=False).body == b"decided"
    finally:
        qm1.stop(checkpoint=False)
        qm2.stop()


@pytest.mark.parametrize("by", ["peer", "restart"])
def test_a_redo_does_not_bring_back_a_message_consumed_since(redis_url: str, log_root: Path,
                                                             monkeypatch: pytest.MonkeyPatch, by: str) -> None:
    """The member died after the CF call, before its END: another member got the message and committed the get;
    the redo (the COMMIT has no END) finds the tombstone the put left."""
    qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=300)
    qm2 = start_qm(redis_url, log_root, "QM2", background=False, lease_ms=60_000)
    try:
        died_before_its_end(qm1, monkeypatch)
        assert qm2.connect().get("Q1", syncpoint=False).body == b"once"  # consumed
        if by == "peer":
            time.sleep(0.4)
            assert [(r.failed, r.committed) for r in recover_peers(qm2)] == [("QM1", 1)]
        else:
            monkeypatch.undo()
            qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=60_000)
            assert qm1.last_restart.in_commit == 1
        assert all_bodies(qm2) == []
        with pytest.raises(NoMessageError):
            qm2.connect().get("Q1", syncpoint=False)
    finally:
        qm1.stop(checkpoint=False)
        qm2.stop()


def test_puts_leave_no_tombstones_across_restarts(redis_url: str, log_root: Path) -> None:
    """Nothing on the CF outlives a put outside syncpoint once it is committed: no tombstone per put, none per
    member restart (a clean stop, with its checkpoint, and a kill)."""
    for i in range(4):
        qm = start_qm(redis_url, log_root, "QM1", background=False)
        try:
            for j in range(5):
                qm.connect().put("Q1", b"m%d.%d" % (i, j), syncpoint=False)
            qm.connect().get("Q1", syncpoint=False)
            assert tombstones(qm) == {}
        finally:
            qm.stop(checkpoint=i % 2 == 0)
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        assert tombstones(qm) == {} and len(all_bodies(qm)) == 16
    finally:
        qm.stop()


def test_a_put_the_cf_refused_is_never_logged_nor_redone(redis_url: str, log_root: Path) -> None:
    """Refused for capacity by the CF before anything is logged: no record of it, so a restart (or a peer) has
    nothing to redo."""
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        warm(qm)
        qm.redis.hset(keys.meta("APP1"), mapping={"max_entries": 1})
        conn = qm.connect()
        conn.put("Q1", b"fits", syncpoint=False)
        with pytest.raises(Exception, match="FULL|holds 1 of 1"):
            conn.put("Q1", b"refused", syncpoint=False)
        assert qm.uows == {} and qm.pending == {}
        assert qm.log is not None
        assert [r["d"] for _, r in qm.log.records() if r["k"] == "PUT"] == [b"warm", b"fits"]
    finally:
        crash(qm)
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        assert qm.last_restart.in_commit == 0
        assert all_bodies(qm) == [b"fits"]
    finally:
        qm.stop()


def test_a_peer_redo_after_the_owner_restarted_does_not_bring_back_a_consumed_message(
        redis_url: str, log_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QM1 dies after its put was committed on the CF, before its END. QM2 starts peer recovery (fences QM1, reads
    its log) and is slow. QM1 restarts meanwhile and completes the commit itself; a consumer takes the message, and
    more puts follow. QM2's recovery then commits the UOW from the log it read: the consumed message stays gone."""
    qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=300)
    qm2 = start_qm(redis_url, log_root, "QM2", background=False, lease_ms=60_000)
    entered, release = threading.Event(), threading.Event()
    complete = qm2.complete

    def slow_complete(uow: Any, commit: bool, **kw: Any) -> None:
        if kw.get("for_member") == "QM1":
            entered.set()
            assert release.wait(60)
        complete(uow, commit, **kw)
    monkeypatch.setattr(qm2, "complete", slow_complete)
    peer: threading.Thread | None = None
    try:
        died_before_its_end(qm1, monkeypatch)
        time.sleep(0.4)  # QM1's lease lapses
        peer = threading.Thread(target=recover_peers, args=(qm2,), daemon=True)
        peer.start()
        wait_until(entered.is_set, 30, "QM2's peer recovery of QM1 to reach the redo")

        qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=60_000)  # the restart
        assert qm1.last_restart.in_commit == 1
        assert qm1.connect().get("Q1", syncpoint=False).body == b"once"  # consumed
        warm(qm1)
        qm1.connect().put("Q1", b"next", syncpoint=False)
        assert qm1.connect().get("Q1", syncpoint=False).body == b"next"
        assert all_bodies(qm1) == []

        release.set()
        peer.join(60)
        assert not peer.is_alive()
        assert all_bodies(qm1) == [], "a consumed message came back (peer redo after the owner's restart)"
        with pytest.raises(NoMessageError):
            qm1.connect().get("Q1", syncpoint=False)
    finally:
        release.set()
        if peer is not None:
            peer.join(60)
        qm1.stop(checkpoint=False)
        qm2.stop()


def test_a_put_the_cf_refused_is_not_delivered_by_a_peer_that_read_its_log(
        redis_url: str, log_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CF refuses a put for capacity. A peer recovers the member as soon as it can: while the member is still
    deciding the refused UOW (where its COMMIT could be on disk before the CF was asked), or else right after the
    application was told. Either way the peer has nothing of it to redo: the refused message is never delivered,
    or the application was not told it failed."""
    from cfemu.errors import OutcomeUnknownError
    qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=300)
    qm2 = start_qm(redis_url, log_root, "QM2", background=False, lease_ms=60_000)
    complete = qm1.complete
    recovered: list[tuple[str, int]] = []

    def peer_recovers_first(uow: Any, commit: bool, **kw: Any) -> None:
        if not commit and not recovered:
            time.sleep(0.4)  # QM1's lease lapses (its heartbeat is off)
            recovered.extend((r.failed, r.committed) for r in recover_peers(qm2))
        complete(uow, commit, **kw)
    try:
        warm(qm1)
        qm1.redis.hset(keys.meta("APP1"), mapping={"max_entries": 1})
        conn = qm1.connect()
        conn.put("Q1", b"fits", syncpoint=False)
        monkeypatch.setattr(qm1, "complete", peer_recovers_first)
        told: MQError | None = None
        try:
            conn.put("Q1", b"refused", syncpoint=False)
        except MQError as e:
            told = e
        if not recovered:
            crash(qm1)
            time.sleep(0.4)  # QM1's lease lapses
            recovered.extend((r.failed, r.committed) for r in recover_peers(qm2))
        assert recovered == [("QM1", 0)]
        bodies = all_bodies(qm2)
        assert b"refused" not in bodies or told is None or isinstance(told, OutcomeUnknownError), \
            f"told {type(told).__name__}: {told}; the queue holds {bodies} (max_entries 1)"
        assert told is not None and bodies == [b"fits"]
    finally:
        qm1.stop(checkpoint=False)
        qm2.stop()


def log_a_put_committed_in_one_operation(qm: QueueManager, body: bytes) -> None:
    """What a member that made puts committed in one CF operation (put_committed.lua) left when it died before the
    CF call: the put's PUT record (its 'c' flag: redo it from the record) and its forced COMMIT."""
    from cfemu.entry import Entry
    uow = qm.new_uow()
    entry = Entry(id=os.urandom(12).hex(), queue="Q1", msgid=os.urandom(24).hex(), put_time=int(time.time() * 1000))
    qm.append(records.put(uow.id, qm.clock.now(), structure="APP1", gen=1, entry=entry.wire(), data=body, redo=True))
    qm.append(records.commit(uow.id, qm.clock.now(), {"APP1": 1}))
    assert qm.log is not None
    qm.log.force()


@pytest.mark.parametrize("by", ["peer", "restart"])
def test_a_logged_put_committed_in_one_operation_is_still_redone_once(
        redis_url: str, log_root: Path, by: str) -> None:
    """A log written while members made puts committed in one CF operation stays recoverable: its decided put is
    redone from its record (put_committed.lua, as a redo), once, whoever recovers it."""
    qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=300)
    qm2 = start_qm(redis_url, log_root, "QM2", background=False, lease_ms=60_000)
    try:
        warm(qm1)
        log_a_put_committed_in_one_operation(qm1, b"logged")
        crash(qm1)
        assert all_bodies(qm2) == []
        if by == "peer":
            time.sleep(0.4)  # QM1's lease lapses (its heartbeat is off)
            assert [(r.failed, r.committed) for r in recover_peers(qm2)] == [("QM1", 1)]
        qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=60_000)
        assert qm1.last_restart.in_commit == 1  # its own log has no END for it: redone, answered 'applied'
        assert qm2.connect().get("Q1", syncpoint=False).body == b"logged"
        assert all_bodies(qm2) == []
    finally:
        qm1.stop(checkpoint=False)
        qm2.stop()
