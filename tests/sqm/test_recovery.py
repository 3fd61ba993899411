"""Restart recovery, in process and deterministic (no background threads), against a real redis-server.

In-doubt UOWs survive a restart and resolve either way; restart completes in-commit work and backs out in-flight
work, reporting each phase; LOGLOAD checkpoints bound what restart reads; the merged log of several members
agrees with causality even when one member's clock is skewed; a torn tail is the normal end of the log, a
flipped byte before it is a clear error.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cfemu.errors import NoMessageError, OutcomeUnknownError
from sqm.core import records, recovery
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager
from sqm.core.recovery import recover_peers
from sqm.log import LogCorruptError, LogReader, find_log_dirs, merged_records
from tests.support.group import define_group, start_qm
from tests.support.waits import wait_until


@pytest.fixture
def log_root(redis_url: str, tmp_path: Path) -> Path:
    define_group(redis_url, queues=("Q1",))
    return tmp_path / "logs"


def bodies(conn: Connection, queue: str = "Q1") -> list[tuple[bytes, int]]:
    """Committed messages on the queue as sorted (body, backout count) pairs."""
    return sorted((m.body, m.backout_count) for m in conn.browse(queue, limit=1000))


def locked(qm: QueueManager) -> int:
    return sum(d["UP"] + d["UG"] for d in qm.structure("APP1").depths().values())


def crash(qm: QueueManager) -> None:
    """What a kill leaves behind, minus the torn tail: the log closed without a shutdown checkpoint, the
    member still registered, no work completed."""
    qm.stop(checkpoint=False)


@pytest.mark.parametrize("shutdown_checkpoint", [False, True], ids=["crash", "clean-stop"])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "backout"])
def test_indoubt_uow_survives_restart_and_resolves(redis_url: str, log_root: Path, commit: bool,
                                                   shutdown_checkpoint: bool) -> None:
    other = start_qm(redis_url, log_root, "QM2", background=False)
    o = other.connect()
    o.put("Q1", b"seed")
    o.commit()

    qm = start_qm(redis_url, log_root, "QM1", background=False)
    c = qm.connect()
    c.put("Q1", b"new-1")
    c.put("Q1", b"new-2")
    assert c.get("Q1").body == b"seed"
    uow_id = c.prepare("xid-42")
    assert [u.id for u in qm.indoubt()] == [uow_id]
    qm.stop(checkpoint=shutdown_checkpoint)

    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        rep = qm.last_restart
        assert (rep.in_doubt, rep.in_flight, rep.in_commit, rep.in_backout) == (1, 0, 0, 0)
        assert dict(rep.phases)["restart cleanup"] == {"in-doubt kept": 1}
        [uow] = qm.indoubt()
        assert (uow.id, uow.xid) == (uow_id, "xid-42")
        # Still locked: the puts are invisible and the got message stays got, to every member.
        with pytest.raises(NoMessageError):
            o.get("Q1")
        assert locked(qm) == 3
        # A second restart before resolution keeps it in doubt (its checkpoint carries it).
        qm.stop()
        qm = start_qm(redis_url, log_root, "QM1", background=False)
        assert [u.id for u in qm.indoubt()] == [uow_id]

        qm.resolve(uow_id, commit=commit)
        assert qm.indoubt() == []
        assert locked(qm) == 0
        if commit:
            assert bodies(o) == [(b"new-1", 0), (b"new-2", 0)]
        else:
            assert bodies(o) == [(b"seed", 1)]
        with pytest.raises(Exception, match="not in doubt"):
            qm.resolve(uow_id, commit=commit)
        qm.stop()
        qm = start_qm(redis_url, log_root, "QM1", background=False)
        assert qm.indoubt() == [] and qm.last_restart.in_doubt == 0
    finally:
        qm.stop()
        other.stop()


def test_restart_completes_in_commit_and_in_backout_and_backs_out_in_flight(redis_url: str,
                                                                             log_root: Path) -> None:
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    seeder = qm.connect()
    seeder.put("Q1", b"to-be-got")
    seeder.commit()

    in_flight, in_commit, in_backout = qm.connect(), qm.connect(), qm.connect()
    in_flight.put("Q1", b"flight-1")
    in_flight.put("Q1", b"flight-2")
    in_commit.put("Q1", b"commit-1")
    in_commit.put("Q1", b"commit-2")
    assert in_backout.get("Q1").body == b"to-be-got"
    # A crash between the forced COMMIT / BACKOUT record and the CF update: log the outcome, skip apply.
    for conn, decide in ((in_commit, records.commit), (in_backout, records.backout)):
        assert conn.uow is not None
        qm.append(decide(conn.uow.id, qm.clock.now(), conn.uow.structures))
    crash(qm)
    assert locked(qm) == 5

    phases: list[tuple[str, dict[str, int]]] = []
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        rep = qm.last_restart
        phases = rep.phases
        assert (rep.in_commit, rep.in_backout, rep.in_flight, rep.in_doubt) == (1, 1, 1, 0)
        assert dict(phases) == {
            "current status rebuild": {"records": rep.records_read, "in-commit": 1, "in-backout": 1,
                                       "in-flight": 1, "in-doubt": 0},
            "forward recovery": {"completed": 2, "waiting for CF": 0},
            "backward recovery": {"backed out": 1},
            "restart cleanup": {"in-doubt kept": 0},
        }
        assert rep.records_read > 0
        assert locked(qm) == 0
        assert bodies(qm.connect()) == [(b"commit-1", 0), (b"commit-2", 0), (b"to-be-got", 1)]
        # Restarting again finds nothing to do.
        qm.stop()
        qm = start_qm(redis_url, log_root, "QM1", background=False)
        assert (qm.last_restart.in_commit, qm.last_restart.in_backout, qm.last_restart.in_flight) == (0, 0, 0)
    finally:
        qm.stop()


def lifecycles(qm: QueueManager, n: int) -> None:
    conn = qm.connect()
    for i in range(n):
        conn.put("Q1", f"m{i}".encode())
        conn.commit()
        conn.get("Q1")
        conn.commit()


@pytest.mark.parametrize("logload", [10, 10_000])
def test_logload_checkpoints_bound_restart(redis_url: str, log_root: Path, logload: int) -> None:
    qm = start_qm(redis_url, log_root, "QM1", background=False, logload=logload)
    lifecycles(qm, 20)  # 6 records each (PUT COMMIT END GET COMMIT END): 120 records
    open_uow = qm.connect()
    open_uow.put("Q1", b"in-flight")  # restart must still find it, from the checkpoint's UOW table or after it
    crash(qm)

    reasons = [r.get("why") for _, r in LogReader(log_root / "QM1").records() if r["k"] == "CHECKPOINT"]
    qm = start_qm(redis_url, log_root, "QM1", background=False, logload=logload)
    try:
        rep = qm.last_restart
        assert rep.in_flight == 1
        if logload == 10:
            assert reasons.count("logload") >= 120 // 10
            assert rep.records_read <= logload + 1, rep.records_read  # the last checkpoint and what followed it
        else:
            assert reasons == ["start"]
            assert rep.records_read > 120
        assert bodies(qm.connect()) == []
    finally:
        qm.stop()


def test_logload_checkpoint_never_hides_a_prepare(redis_url: str, log_root: Path) -> None:
    """The PREPARE is the LOGLOAD-th record since the start checkpoint: a checkpoint right after it must not
    record the UOW as in flight, or restart (which reads from that checkpoint on) would back it out."""
    qm = start_qm(redis_url, log_root, "QM1", background=False, logload=3)
    conn = qm.connect()
    conn.put("Q1", b"a")
    conn.put("Q1", b"b")
    uow_id = conn.prepare("xid-7")
    crash(qm)
    qm = start_qm(redis_url, log_root, "QM1", background=False, logload=3)
    try:
        assert [u.id for u in qm.indoubt()] == [uow_id]
        qm.resolve(uow_id, commit=True)
        assert bodies(qm.connect()) == [(b"a", 0), (b"b", 0)]
    finally:
        qm.stop()


def test_merged_log_agrees_with_causality_with_skewed_clock(redis_url: str, log_root: Path) -> None:
    fast = start_qm(redis_url, log_root, "QM1", background=False)
    slow = start_qm(redis_url, log_root, "QM2", background=False, clock_skew_us=-5_000_000)
    try:
        f, s = fast.connect(), slow.connect()
        for i in range(5):
            # Messages made available on one member and consumed on the other, both ways, in and out of
            # syncpoint, with a backed-out get (redelivery) in between.
            s.put("Q1", f"slow-{i}".encode())
            s.commit()
            assert f.get("Q1").body == f"slow-{i}".encode()
            f.backout()
            assert f.get("Q1").backout_count == 1
            f.commit()
            f.put("Q1", f"fast-{i}".encode(), syncpoint=False)
            assert s.get("Q1", syncpoint=False).body == f"fast-{i}".encode()
            f.put("Q1", f"fast-uow-{i}".encode())
            f.commit()
            assert s.get("Q1").body == f"fast-uow-{i}".encode()
            s.commit()
    finally:
        fast.stop()
        slow.stop()

    merged = merged_records(find_log_dirs(log_root))
    assert [r["l"] for r in merged] == sorted(r["l"] for r in merged)
    outcome_at: dict[str, tuple[str, int]] = {}  # uow -> (COMMIT | BACKOUT, lrsn)
    for r in merged:
        if r["k"] in ("COMMIT", "BACKOUT"):
            outcome_at.setdefault(r["u"], (r["k"], r["l"]))
    # Walk the merged log in order: each GET must find its entry available, made so by an earlier record
    # with a smaller LRSN (a committed put, the COMMIT of its put's UOW, or the BACKOUT of an earlier get).
    puts_by_uow: dict[str, list[str]] = {}
    gets_by_uow: dict[str, list[str]] = {}
    available_since: dict[str, int] = {}
    checked = 0
    for r in merged:
        k = r["k"]
        if k == "PUT":
            if r.get("c"):
                available_since[r["e"]["id"]] = r["l"]
            else:
                puts_by_uow.setdefault(r["u"], []).append(r["e"]["id"])
        elif k == "GET":
            assert r["i"] in available_since, f"GET at {r['l']} of {r['i']} sorts before what made it available"
            assert r["l"] > available_since.pop(r["i"])
            gets_by_uow.setdefault(r["u"], []).append(r["i"])
            checked += 1
        elif k == "COMMIT":
            for eid in puts_by_uow.pop(r["u"], []):
                available_since[eid] = r["l"]
        elif k == "BACKOUT":
            for eid in gets_by_uow.pop(r["u"], []):
                available_since[eid] = r["l"]
    assert checked == 20
    skewed = [r for r in merged if r["m"] == "QM2" and r["k"] == "GET"]
    assert len(skewed) == 10


def test_torn_tail_is_the_end_of_the_log(redis_url: str, log_root: Path) -> None:
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    conn = qm.connect()
    for i in range(3):
        conn.put("Q1", f"m{i}".encode())
    conn.commit()
    crash(qm)
    *_, (last_pos, last) = LogReader(log_root / "QM1").records()
    assert last["k"] == "END"
    seg = log_root / "QM1" / f"seg-{last_pos.segment:08d}.log"
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size - 3)  # the END record's frame is cut in the middle

    qm = start_qm(redis_url, log_root, "QM1", background=False)
    try:
        assert qm.log is not None and qm.log.stats.torn_bytes_truncated == size - 3 - last_pos.offset
        assert qm.last_restart.in_commit == 1  # without its END the UOW is in commit; completing it again is a no-op
        assert bodies(qm.connect()) == [(b"m0", 0), (b"m1", 0), (b"m2", 0)]
        assert locked(qm) == 0
    finally:
        qm.stop()


def test_flipped_byte_mid_segment_is_a_clear_error(redis_url: str, log_root: Path) -> None:
    qm = start_qm(redis_url, log_root, "QM1", background=False)
    lifecycles(qm, 3)
    qm.stop()
    logged = list(LogReader(log_root / "QM1").records())
    pos, _ = logged[len(logged) // 2]
    seg = log_root / "QM1" / f"seg-{pos.segment:08d}.log"
    data = bytearray(seg.read_bytes())
    data[pos.offset + 10] ^= 0x40  # inside the frame's body
    seg.write_bytes(bytes(data))
    epoch = qm.admin.epoch("QM1")

    with pytest.raises(LogCorruptError) as err:
        start_qm(redis_url, log_root, "QM1", background=False)
    assert err.value.path == str(seg) and err.value.offset == pos.offset
    assert f"corrupt record log {seg} at byte offset {pos.offset}: CRC mismatch" in str(err.value)
    assert "\n" not in str(err.value)
    # Nothing durable changed: the segment is as we left it, and the member did not join the group.
    assert seg.read_bytes() == bytes(data)
    assert qm.admin.epoch("QM1") == epoch


@pytest.mark.parametrize("mount_point_left", [False, True], ids=["moved", "empty-mount-point"])
def test_a_peer_that_cannot_read_the_failed_members_log_does_not_guess(redis_url: str, log_root: Path,
                                                                      caplog: pytest.LogCaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      mount_point_left: bool) -> None:
    """QM2 forced a COMMIT and died before applying it; its log is not where its peer looks (a mount that did not
    come back, leaving its empty mount point or not, an operator who moved it). Peer recovery backed out every UOW
    it found only in the CF, that committed one too: a committed message lost. It must recover nothing it cannot
    read, say so, and recover it once the log is back (or leave it to QM2's own restart)."""
    monkeypatch.setattr(recovery, "_UNREADABLE_SAID", {})  # said once a minute: another test may have said it
    qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=300)
    qm2 = start_qm(redis_url, log_root, "QM2", background=False, lease_ms=300)
    try:
        conn = qm2.connect()
        conn.put("Q1", b"committed")
        assert conn.uow is not None
        qm2.append(records.commit(conn.uow.id, qm2.clock.now(), conn.uow.structures))
        crash(qm2)
        away = log_root.parent / "QM2-away"
        (log_root / "QM2").rename(away)
        if mount_point_left:
            (log_root / "QM2").mkdir()
        wait_until(lambda: "QM2" in qm1.admin.lapsed_members(), 10, "QM2's lease lapsed")
        assert recover_peers(qm1) == []
        assert "cannot read the log of QM2" in caplog.text
        assert locked(qm1) == 1, "nothing decided without the log"
        if mount_point_left:
            (log_root / "QM2").rmdir()
        away.rename(log_root / "QM2")
        reports = recover_peers(qm1)
        assert [(r.failed, r.committed, r.backed_out) for r in reports] == [("QM2", 1, 0)]
        assert bodies(qm1.connect()) == [(b"committed", 0)]
    finally:
        qm1.stop()


@pytest.mark.parametrize("syncpoint", [True, False], ids=["uow", "put-outside-syncpoint"])
def test_a_commit_fenced_after_its_log_force_is_outcome_unknown_not_failed(redis_url: str, log_root: Path,
                                                                            syncpoint: bool,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A persistent put outside syncpoint whose COMMIT was forced, then whose member a peer fenced before the CF
    applied it, is completed by peer recovery from the log: the application hears 'outcome unknown', never
    'failed' (MQRC_CONNECTION_BROKEN) for a message delivered later."""
    qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=300)
    qm2 = start_qm(redis_url, log_root, "QM2", background=False, lease_ms=60_000)
    try:
        conn = qm1.connect()
        if syncpoint:
            conn.put("Q1", b"logged")
        time.sleep(0.4)  # QM1's lease lapses (its heartbeat is off)
        append = qm1.append

        def append_then_fenced(record: records.Record, **kw: Any) -> None:
            append(record, **kw)
            if record["k"] == "COMMIT":  # forced: a peer fences QM1 before the CF applies it
                assert qm1.admin.fence("QM1")

        monkeypatch.setattr(qm1, "append", append_then_fenced)
        with pytest.raises(OutcomeUnknownError, match="peer decides it from this member's log, committed if its "
                                                      "COMMIT was on disk when the peer read the log") as e:
            if syncpoint:
                conn.commit()
            else:
                conn.put("Q1", b"logged", syncpoint=False)
        assert "completes it" not in str(e.value)
        assert qm1.fenced
        reports = recover_peers(qm2)
        assert [(r.failed, r.committed) for r in reports] == [("QM1", 1)]
        assert bodies(qm2.connect()) == [(b"logged", 0)]
    finally:
        qm1.stop(checkpoint=False)
        qm2.stop()


def test_a_commit_forced_after_the_peer_read_the_log_is_not_said_to_be_completed(redis_url: str,
                                                                                 log_root: Path) -> None:
    """The peer read the fenced member's log before its COMMIT was forced, and backed the unit of work out; the
    member, unaware, forced its COMMIT and was refused as fenced. The application must not be told the peer
    completes it (it was backed out): it hears how the peer decides, and the outcome unknown."""
    qm1 = start_qm(redis_url, log_root, "QM1", background=False, lease_ms=300)
    qm2 = start_qm(redis_url, log_root, "QM2", background=False, lease_ms=60_000)
    try:
        conn = qm1.connect()
        conn.put("Q1", b"backed out by the peer")
        time.sleep(0.4)  # QM1's lease lapses (its heartbeat is off)
        reports = recover_peers(qm2)  # no COMMIT in QM1's log yet: in flight, backed out
        assert [(r.failed, r.committed, r.backed_out) for r in reports] == [("QM1", 0, 1)]
        with pytest.raises(OutcomeUnknownError) as e:
            conn.commit()  # the COMMIT is forced now, after the peer read the log
        text = str(e.value)
        assert "completes it" not in text and "else backed out" in text and "not known here" in text, text
        assert bodies(qm2.connect()) == []
    finally:
        qm1.stop(checkpoint=False)
        qm2.stop()
