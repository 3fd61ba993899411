"""When an outcome counts (docs/log-format.md, "When an outcome counts"): one rule for the LRSN at which a UOW's
outcome takes effect, shared by the CF scripts and restore; peer recovery by a member whose clock lags; UOW
atomicity across structures (invariant 2, docs/invariants.md). Against a real redis-server, real logs and, where a
test needs one, a real queue manager process killed by a failpoint (tests/support/sqm_child.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.errors import BackedOutError
from restore.reference import plan_local
from restore.run import run_restore
from restore.settle import CONSUMED, HELD_INDOUBT, RESTORED
from sqm.core import records
from sqm.core.manager import QueueManager
from sqm.core.recovery import PeerRecoveryReport, recover_peers
from sqm.log import LogReader
from tests.sqm.test_crash import DEAD, Child
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

LAG_US = 3_000_000  # QM1's LRSN clock runs 3 s behind; the child's lease is 1 s


def recover(qm: QueueManager, timeout: float = 15.0) -> PeerRecoveryReport:
    """Run qm's peer recovery until it has recovered the dead child (its lease must lapse first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [r for r in recover_peers(qm) if r.failed == DEAD]
        if done:
            return done[0]
        time.sleep(0.1)
    pytest.fail(f"{qm.name} did not recover {DEAD} within {timeout:g}s")


def die_after_commit(url: str, logs: Path, scenario: str, count: int) -> None:
    """QM2 as a real process runs `scenario` in one UOW and is killed right after its COMMIT is forced."""
    child = Child(url, logs, scenario, failpoints="after-log-force", count=count)
    try:
        child.expect("committing")
        assert child.wait() == -9, child.stderr_tail()
    finally:
        child.kill()


def lose_cf_and_restore(client: redis.Redis, backups: Path, logs: Path, structure: str = "APP1") -> object:
    lose_cf(client)  # the CF is lost
    return run_restore(client, structure, backup_root=backups, log_root=logs)


def bodies(qm: QueueManager, queue: str) -> list[str]:
    return [m.body.decode() for m in qm.connect().browse(queue, limit=100)]


def test_peer_recovery_by_a_member_whose_clock_lags_leaves_nothing_locked_after_a_restore(
        redis_url: str, tmp_path: Path) -> None:
    """QM1's clock runs 3 s behind (lease 1 s). QM2, a real process, gets P0 and P1 and puts their replies in one
    UOW and is killed right after its COMMIT is forced; QM1's peer recovery commits the UOW. Its RECOVERY record
    once sorted below QM2's operations: after a CF loss and restore the replies stayed uncommitted puts and P0, P1
    uncommitted gets for good, reported as entries in doubt with 0 UOWs in doubt, listed under QM1."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False, clock_skew_us=-LAG_US)
    try:
        conn = qm1.connect()
        for body in (b"P0", b"P1"):
            conn.put("Q1", body)
            conn.commit()
        run_backup(client, "APP1", backups, log_root=logs)
        die_after_commit(redis_url, logs, "get", count=2)
        rep = recover(qm1)
        assert rep.committed == 1

        result = lose_cf_and_restore(client, backups, logs)
        assert result.counts.get(HELD_INDOUBT, 0) == 0, result.counts  # type: ignore[attr-defined]
        assert result.counts["uows in doubt"] == len(result.in_doubt_uows) == 0  # type: ignore[attr-defined]
        assert sorted(bodies(qm1, "Q2")) == ["reply-P0", "reply-P1"] and bodies(qm1, "Q1") == []
        assert not any(d["UP"] or d["UG"] for d in qm1.structure("APP1").depths().values())
        recoveries = [r for _, r in LogReader(logs / "QM1").records() if r["k"] == "RECOVERY"]
        high = max(r["l"] for _, r in LogReader(logs / DEAD).records())
        assert [r["l"] > high for r in recoveries] == [True], "one RECOVERY record, after everything QM2 logged"
    finally:
        qm1.stop()


def test_get_order_after_peer_recovery_is_the_same_on_the_live_cf_and_after_a_restore(
        redis_url: str, tmp_path: Path) -> None:
    """QM2 puts C0 (priority 0) and dies after its COMMIT is forced; QM1 puts X0 (priority 0) and commits; QM1's
    peer recovery commits QM2's UOW. The live CF stamped the recovered commit at the RECOVERY record's LRSN (X0
    then C0), restore at the owner's COMMIT (C0 then X0)."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm1 = start_qm(redis_url, logs, "QM1", background=False)
    try:
        run_backup(client, "APP1", backups, log_root=logs)
        die_after_commit(redis_url, logs, "put", count=1)
        conn = qm1.connect()
        conn.put("Q1", b"X0")
        conn.commit()
        recover(qm1)
        live = bodies(qm1, "Q1")
        assert sorted(live) == ["X0", "put-0"]
        lose_cf_and_restore(client, backups, logs)
        assert bodies(qm1, "Q1") == live
        assert live == ["put-0", "X0"], "C0's commit counts at QM2's COMMIT, before X0's"
    finally:
        qm1.stop()


def test_the_fold_never_lets_an_outcome_count_below_the_uows_own_operations() -> None:
    """A RECOVERY record without `at` (the form older logs hold), written by a lagging peer below the UOW's
    operations: the
    restore still commits the UOW, and the report's count of UOWs in doubt agrees with what it holds."""
    entry = {"id": "c0", "q": "Q2", "p": 0, "per": 1, "st": "", "l": 0, "u": ""}
    p0 = {"id": "p0", "q": "Q1", "p": 0, "per": 1, "st": "CP", "l": 5, "u": "", "o1": 5, "o2": 5}
    uow = "QM2.1.1"
    recovered = records.recovery(uow, 50, {"APP1": 1}, commit=True, of="QM2", by="QM1")
    recovered.pop("at", None)  # the form older logs hold
    logged = [records.get(uow, 100, structure="APP1", gen=1, entry_id="p0", queue="Q1"),
              records.put(uow, 101, structure="APP1", gen=1, entry=dict(entry), data=b"C0"),
              records.commit(uow, 102, {"APP1": 1}), recovered]
    for r, m in zip(logged, ("QM2", "QM2", "QM2", "QM1"), strict=True):
        r["m"] = m
    plan = plan_local("APP1", [("APP1", p0, b"P0")], sorted(logged, key=lambda r: r["l"]), now_ms=0)
    fates = {s.id: s.disposition for s in plan.settled}
    assert fates == {"c0": RESTORED, "p0": CONSUMED}
    assert plan.counts["uows in doubt"] == len(plan.in_doubt_uows()) == 0


def test_a_uow_in_doubt_is_counted_listed_and_owned_by_the_member_that_prepared_it() -> None:
    entry = {"id": "c0", "q": "Q1", "p": 0, "per": 1, "st": "", "l": 0, "u": ""}
    logged = [records.put("QM2.1.1", 10, structure="APP1", gen=1, entry=dict(entry), data=b"C0"),
              records.prepare("QM2.1.1", 11, {"APP1": 1}, xid="x1"),
              records.prepare("QM2.1.2", 12, {"APP1": 1}, xid="x2")]  # non-persistent work only: no entry
    for r in logged:
        r["m"] = "QM2"
    plan = plan_local("APP1", [], logged, now_ms=0)
    assert plan.counts[HELD_INDOUBT] == 1
    assert plan.in_doubt_uows() == {"QM2.1.1": "QM2", "QM2.1.2": "QM2"}
    assert plan.counts["uows in doubt"] == 2


def two_structures(url: str) -> redis.Redis:
    client = define_group(url, queues=("Q1",))
    admin = Admin(client)
    admin.define_structure("APP2")
    admin.define_queue("Q3", "APP2")
    return client


def test_a_uow_across_two_structures_one_restored_before_its_commit_applies_is_not_half_applied(
        redis_url: str, tmp_path: Path) -> None:
    """A UOW puts on APP1 and APP2; APP2 fails and is restored while the UOW is in flight (restore backs it out
    there); then the application commits. The COMMIT is forced, APP1 committed it, APP2 refused it: committed on
    one structure, backed out on the other (and the next restore of APP1 would back it out there too)."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = two_structures(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        for s in ("APP1", "APP2"):
            run_backup(client, s, backups, log_root=logs)
        conn = qm.connect()
        conn.put("Q1", b"one")
        conn.put("Q3", b"two")
        assert qm.log is not None
        qm.log.force()  # the PUT records reach the disk (any later force would carry them)
        run_restore(client, "APP2", backup_root=backups, log_root=logs, mark_failed=True)
        with pytest.raises(BackedOutError):
            conn.commit()
        assert bodies(qm, "Q1") == [] and bodies(qm, "Q3") == []
        assert not any(d["UP"] or d["UG"] for s in ("APP1", "APP2") for d in qm.structure(s).depths().values())
        for s in ("APP1", "APP2"):
            run_restore(client, s, backup_root=backups, log_root=logs, mark_failed=True)
        assert bodies(qm, "Q1") == [] and bodies(qm, "Q3") == []
    finally:
        qm.stop()


def test_an_in_doubt_uow_with_only_non_persistent_work_can_be_committed_after_a_cf_loss(
        redis_url: str, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        conn = qm.connect()
        conn.put("Q1", b"np", persistent=False)
        uow = conn.prepare("xid-np")
        run_backup(client, "APP1", backups, log_root=logs)
        result = lose_cf_and_restore(client, backups, logs)
        qm.resolve(uow, True)  # the non-persistent message was lost with the CF (allowed); the commit completes
        assert qm.indoubt() == [] and uow not in qm.pending
        assert result.in_doubt_uows == {uow: "QM1"}  # type: ignore[attr-defined]
        assert result.counts["uows in doubt"] == 1  # type: ignore[attr-defined]
        assert qm.log is not None
        qm.log.force()
        kinds = [r["k"] for _, r in LogReader(logs / "QM1").records() if r.get("u") == uow]
        assert kinds[-2:] == ["COMMIT", "END"] and "BACKOUT" not in kinds
    finally:
        qm.stop()


def test_the_structures_a_uow_applied_are_known_after_a_restart(redis_url: str, tmp_path: Path) -> None:
    """An in-doubt UOW on APP1 and APP2 survives a CF loss (both restored, still in doubt); the coordinator
    commits; the member dies after APP1 applied it. Its restart re-applied APP1, which no longer knew the UOW in
    its new generation and called it 'lost with the CF': the member logged BACKOUT, left APP2 locked, and the next
    restore backed out a UOW whose APP1 half had committed."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = two_structures(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        conn = qm.connect()
        conn.put("Q1", b"one")
        conn.put("Q3", b"two")
        uow_id = conn.prepare("xid-1")
        for s in ("APP1", "APP2"):
            run_backup(client, s, backups, log_root=logs)
        lose_cf(client)
        for s in ("APP1", "APP2"):
            run_restore(client, s, backup_root=backups, log_root=logs)
        uow = qm.uows[uow_id]
        qm.log_decision(uow, True)  # the coordinator's commit, forced ...
        qm._apply_one(uow, "APP1", True, None)  # ... applied on APP1, then the member dies (no END, no checkpoint)
        assert qm.log is not None
        qm.log.close()
        qm.log = None
        qm.running = False
    finally:
        qm.stop(checkpoint=False)
    again = start_qm(redis_url, logs, "QM1", background=False)  # restart: completes the in-commit UOW
    try:
        assert again.last_restart.in_commit == 1
        assert bodies(again, "Q1") == ["one"] and bodies(again, "Q3") == ["two"]
        assert again.log is not None
        again.log.force()
        kinds = [r["k"] for _, r in LogReader(logs / "QM1").records() if r.get("u") == uow_id]
        assert "BACKOUT" not in kinds and kinds[-1] == "END"
        for s in ("APP1", "APP2"):  # and a restore agrees
            run_restore(client, s, backup_root=backups, log_root=logs, mark_failed=True)
        assert bodies(again, "Q1") == ["one"] and bodies(again, "Q3") == ["two"]
    finally:
        again.stop()


