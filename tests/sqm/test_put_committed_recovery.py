"""A persistent put outside syncpoint made as one CF operation (put_committed.lua): its PUT and forced COMMIT are
logged first, so a member that dies before the CF call leaves a decided put the CF never saw, which restart and
peer recovery redo from the PUT record; one that dies after it, before its END is on disk, leaves a put the CF
applied and perhaps a consumer took since, which the redo must not bring back (the CF's tombstone). In process,
no background threads, against a real redis-server."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cfemu import keys
from cfemu.errors import NoMessageError
from sqm.core import records
from sqm.core.manager import QueueManager
from sqm.core.recovery import recover_peers
from tests.support.group import define_group, start_qm


class Died(BaseException):
    """The member stops right here (what a kill leaves: no later line of it runs)."""


@pytest.fixture
def log_root(redis_url: str, tmp_path: Path) -> Path:
    define_group(redis_url, queues=("Q1",))
    return tmp_path / "logs"


def warm(qm: QueueManager) -> None:
    """One put outside syncpoint, got: the member learns the structure's generation, later puts are fused."""
    conn = qm.connect()
    conn.put("Q1", b"warm", syncpoint=False)
    assert conn.get("Q1", syncpoint=False).body == b"warm"
    assert qm.known_gens == {"APP1": 1}


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


def tombstones(qm: QueueManager) -> dict[str, str]:
    return {keys.text(k): keys.text(v) for k, v in qm.redis.hgetall(keys.tomb("APP1")).items()}


def all_bodies(qm: QueueManager) -> list[bytes]:
    return sorted(m.body for m in qm.connect().browse("Q1", limit=100))


def test_a_put_is_one_cf_call_after_its_records(redis_url: str, log_root: Path) -> None:
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        warm(qm)
        qm.connect().put("Q1", b"fused", syncpoint=False)
        assert qm.log is not None
        kinds = [r["k"] for _, r in qm.log.records()][-3:]
        assert kinds == ["PUT", "COMMIT", "END"]
        put = [r for _, r in qm.log.records() if r["k"] == "PUT"][-1]
        assert put.get("c") == 1 and put["d"] == b"fused" and put["g"] == 1
        assert all_bodies(qm) == [b"fused"] and qm.uows == {}
    finally:
        qm.stop()


@pytest.mark.parametrize("by", ["peer", "restart"])
def test_a_put_whose_member_died_before_the_cf_call_is_redone_from_the_log(
        redis_url: str, log_root: Path, monkeypatch: pytest.MonkeyPatch, by: str) -> None:
    qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=300)
    qm2 = start_qm(redis_url, log_root, "QM2", background=False, lease_ms=60_000)
    try:
        warm(qm1)
        die_at(qm1, monkeypatch, "COMMIT")
        with pytest.raises(Died):
            qm1.connect().put("Q1", b"decided", syncpoint=False)
        crash(qm1)
        assert all_bodies(qm2) == []  # the CF never saw it
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
        warm(qm1)
        die_at(qm1, monkeypatch, "END", before=True)
        with pytest.raises(Died):
            qm1.connect().put("Q1", b"once", syncpoint=False)
        crash(qm1)
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


def test_tombstones_go_once_their_end_is_on_disk(redis_url: str, log_root: Path) -> None:
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        warm(qm)
        conn = qm.connect()
        for i in range(20):
            conn.put("Q1", b"m%d" % i, syncpoint=False)
            assert len(tombstones(qm)) <= 1  # each put drops the one before it (its END forced with this COMMIT)
        assert len(all_bodies(qm)) == 20
    finally:
        qm.stop()


def test_a_refused_put_is_logged_backed_out_and_never_redone(redis_url: str, log_root: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused for capacity after its COMMIT was forced: the BACKOUT after it decides it, so a restart does not
    force it in."""
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        warm(qm)
        qm.redis.hset(keys.meta("APP1"), mapping={"max_entries": 1})
        conn = qm.connect()
        conn.put("Q1", b"fits", syncpoint=False)
        with pytest.raises(Exception, match="FULL|holds 1 of 1"):
            conn.put("Q1", b"refused", syncpoint=False)
        assert qm.uows == {} and qm.pending == {}
    finally:
        crash(qm)
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        assert qm.last_restart.in_commit == 0
        assert all_bodies(qm) == [b"fits"]
    finally:
        qm.stop()
