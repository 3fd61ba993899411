"""Bugs the chaos suite found, each kept as a fast regression test of its root cause, with the seed that found it.

Found as messages whose get had committed coming back after a later restore (duplicated, and atomicity for
their UOWs). The seed-2 ones by `cfemu chaos run --seed 2 --duration 35 --faults sqm-kill,cf-kill` (seed 1 too),
the seed-3 ones by `cfemu chaos run --seed 3 --duration 90 --faults all`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import redis

from backup.run import run_backup
from cfemu import keys
from cfemu.admin import Admin
from cfemu.entry import Entry
from cfemu.errors import NoMessageError, OutcomePendingError, StructureFailedError
from restore.run import run_restore
from restore.settle import CONSUMED, decide_outcome, settle
from sqm.core import records
from sqm.log import LogReader
from tests.restore.test_restore import drain, rejoin
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf


@pytest.mark.parametrize("written", ["with at", "before at"])
def test_seed2_a_commit_completed_by_peer_recovery_takes_effect_at_the_owners_commit(written: str) -> None:
    """QM2 committed its put (and applied it), QM1 got and consumed the message, then QM2 died and QM3's peer
    recovery logged RECOVERY C for QM2's UOW. Restore placed the commit at the RECOVERY record's LRSN, after the
    consumption, and brought the message back. Peer recovery now writes where the commit counts (`at`, the
    owner's COMMIT); a record written before `at` existed is read the same way."""
    entry = {"id": "e1", "q": "Q1", "p": 0, "per": 1, "st": "", "l": 0, "u": ""}
    put_uow, get_uow = "QM2.1.1", "QM1.1.1"
    recovered = records.recovery(put_uow, 50, {"APP1": 1}, commit=True, of="QM2", by="QM3", at=20)
    if written == "before at":
        del recovered["at"]
    logged = {
        put_uow: [records.put(put_uow, 10, structure="APP1", gen=1, entry=dict(entry), data=b"x"),
                  records.commit(put_uow, 20, {"APP1": 1}),
                  recovered],
        get_uow: [records.get(get_uow, 30, structure="APP1", gen=1, entry_id="e1", queue="Q1"),
                  records.commit(get_uow, 40, {"APP1": 1})],
    }
    outcomes = {u: decide_outcome(recs) for u, recs in logged.items()}
    assert outcomes[put_uow] is not None and outcomes[put_uow].lrsn == 20
    entry_records = [r for recs in logged.values() for r in recs if r["k"] in ("PUT", "GET")]
    settled = settle("e1", None, entry_records, {u: o for u, o in outcomes.items() if o is not None}, now_ms=0)
    assert settled.disposition == CONSUMED


def test_seed2_a_commit_retried_after_a_restore_does_not_back_out_what_it_applied(redis_url: str,
                                                                                  tmp_path: Path) -> None:
    """An in-doubt UOW on two structures survived a CF loss; APP1 was restored, the coordinator committed (APP1
    applied, APP2 not restored yet: pending); APP2 was restored. The retry re-applied APP1 too, where the UOW,
    committed and gone from a structure with a new generation, looked 'lost with the CF and backed out by
    restore': the member logged BACKOUT after its COMMIT, and the next restore backed the whole UOW out."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client: redis.Redis = define_group(redis_url, queues=("Q1",))
    admin = Admin(client)
    admin.define_structure("APP2")
    admin.define_queue("Q3", "APP2")
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        conn = qm.connect()
        conn.put("Q1", b"one")
        conn.put("Q3", b"two")
        uow = conn.prepare("xid-1")
        for s in ("APP1", "APP2"):
            run_backup(client, s, backups, log_root=logs)
        lose_cf(client)  # the CF is lost
        run_restore(client, "APP1", backup_root=backups, log_root=logs)
        qm.resolve(uow, True)
        assert uow in qm.pending, "APP2 is not restored yet: the commit waits for it"
        run_restore(client, "APP2", backup_root=backups, log_root=logs)
        assert qm.retry_pending() == 1
        assert qm.log is not None
        qm.log.force()
        kinds = [r["k"] for _, r in LogReader(logs / "QM1").records() if r.get("u") == uow]
        assert kinds[-2:] == ["COMMIT", "END"] and "BACKOUT" not in kinds
        getter = qm.connect()
        assert getter.get("Q1").body == b"one" and getter.get("Q3").body == b"two"
        getter.commit()
    finally:
        qm.stop()


def test_seed3_a_relogged_backout_takes_effect_at_the_first_backout() -> None:
    """`cfemu chaos run --seed 3 --duration 90 --faults all`: a 2PC UOW that got a message was backed out by its
    coordinator (BACKOUT forced, the CF lost before it was applied); the restore applied it, another UOW got the
    message and committed; the owner's pending retry met the restored structure's floor and logged BACKOUT
    again. The next restore placed the backout at that second record, after the consumption, and brought the
    message back."""
    entry = {"id": "e1", "q": "Q1", "p": 0, "per": 1, "st": "", "l": 0, "u": ""}
    put_uow, held, taker = "QM1.1.1", "QM1.1.2", "QM2.1.1"
    logged = {
        put_uow: [records.put(put_uow, 10, structure="APP1", gen=1, entry=dict(entry), data=b"x"),
                  records.commit(put_uow, 20, {"APP1": 1})],
        held: [records.get(held, 30, structure="APP1", gen=1, entry_id="e1", queue="Q1"),
               records.prepare(held, 35, {"APP1": 1}, xid="x1"),
               records.backout(held, 40, {"APP1": 1}, reason="resolved by coordinator"),
               records.backout(held, 70, {"APP1": 1})],
        taker: [records.get(taker, 50, structure="APP1", gen=1, entry_id="e1", queue="Q1"),
                records.commit(taker, 60, {"APP1": 1})],
    }
    outcomes = {u: decide_outcome(recs) for u, recs in logged.items()}
    assert outcomes[held] is not None and outcomes[held].lrsn == 40
    entry_records = [r for recs in logged.values() for r in recs if r["k"] in ("PUT", "GET")]
    settled = settle("e1", None, entry_records, {u: o for u, o in outcomes.items() if o is not None}, now_ms=0)
    assert settled.disposition == CONSUMED


def test_seed3_a_put_outside_syncpoint_is_never_put_again_after_the_restore_replayed_it(
        redis_url: str, tmp_path: Path) -> None:
    """Chaos seed 3 found that a log-first put outside syncpoint, pending while the CF was lost, was put again by
    its retry after the restore had replayed it and a consumer had consumed it. Such a put is now a unit of work
    of its own: with the CF gone it fails cleanly; committed while the CF dies, restore completes it and the
    owner's retry of the commit is a no-op, even after the message was consumed."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client: redis.Redis = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        conn = qm.connect()
        conn.put("Q1", b"earlier")  # the member knows the queue (its definition is cached, as in a running SQM)
        conn.commit()
        run_backup(client, "APP1", backups, log_root=logs)
        lose_cf(client)  # the CF is lost
        with pytest.raises(StructureFailedError):
            conn.put("Q1", b"never", syncpoint=False)
        assert not qm.pending
        run_restore(client, "APP1", backup_root=backups, log_root=logs)

        # The CF dies between the forced COMMIT of the put's own UOW and its application.
        conn.put("Q1", b"once", syncpoint=False)
        uow = qm.new_uow()
        conn._put_entry("APP1", _entry("Q1"), b"in-commit", uow)
        client.hset(keys.meta("APP1"), "state", "FAILED")
        with pytest.raises(OutcomePendingError):
            qm.complete(uow, True)  # logged, then waits for the CF: the application hears it is pending
        assert qm.pending
        run_restore(client, "APP1", backup_root=backups, log_root=logs)  # completes it from the log
        getter = qm.connect()
        got = {getter.get("Q1").body for _ in range(3)}
        getter.commit()
        assert got == {b"earlier", b"once", b"in-commit"}
        qm.retry_pending()
        assert not qm.pending
        with pytest.raises(NoMessageError):
            qm.connect().get("Q1")
    finally:
        qm.stop()


def _entry(queue: str) -> Entry:
    return Entry(id=os.urandom(12).hex(), queue=queue, msgid=os.urandom(24).hex())



def test_seed4_a_uow_carried_across_a_restore_and_decided_later_is_decided_in_the_next_restore_too(
        redis_url: str, tmp_path: Path) -> None:
    """Chaos seed 4 (`--faults sqm-kill,cf-kill,sqm-pause,during-backup,cf-kill-twice,peer-clock-skew`, B12):
    in-doubt UOWs carried across a first restore were committed afterwards; after a second CF loss, restored from
    a backup taken after those commits, the messages they had got came back (backout count raised) and were
    consumed again. The relog pass between the two had copied their entries (RELOG, held by the in-doubt UOW, in
    the new generation); the next backup's replay reached back past the pass (another UOW in doubt since before
    the first loss holds its floor down), so the restore folded the copy, but the generation rule left out the
    UOW's COMMIT (logged in the generation it began in): the UOW looked in flight and restore backed it out."""
    b12_history(redis_url, tmp_path, "local")


def b12_history(redis_url: str, tmp_path: Path, engine: str, engine_options: dict[str, Any] | None = None) -> None:
    """B12's history, the second restore planned by `engine` (the Spark engine's test runs it too)."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client: redis.Redis = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        setup = qm.connect()
        for body in (b"got-by-D", b"got-by-E", b"stays"):
            setup.put("Q1", body)
        setup.commit()
        d, e = qm.connect(), qm.connect()
        assert d.get("Q1").body == b"got-by-D"
        uow_d = d.prepare("xid-D")
        assert e.get("Q1").body == b"got-by-E"
        uow_e = e.prepare("xid-E")  # in doubt to the end: every later backup replays from its first LRSN
        run_backup(client, "APP1", backups, log_root=logs)
        lose_cf(client)
        first = run_restore(client, "APP1", backup_root=backups, log_root=logs)
        assert first.in_doubt_uows == {uow_d: "QM1", uow_e: "QM1"}
        rejoin(qm)
        qm.checkpoint("test")  # a relog pass: RELOG copies of the held entries, in the restored generation
        relogged = [r for _, r in LogReader(logs / "QM1").records() if r["k"] == "RELOG"]
        assert {r["e"]["u"] for r in relogged} >= {uow_d, uow_e}
        qm.resolve(uow_d, True)  # got-by-D consumed, in the restored generation
        second_backup = run_backup(client, "APP1", backups, log_root=logs)
        assert second_backup["replay_from"] <= min(int(r["l"]) for r in relogged)
        lose_cf(client)
        second = run_restore(client, "APP1", backup_root=backups, log_root=logs, engine=engine,
                             engine_options=engine_options)
        rejoin(qm)
        assert second.in_doubt_uows == {uow_e: "QM1"}
        assert second.counts["uows in flight backed out"] == 0
        assert drain(qm.connect(), "Q1") == [(b"stays", 0)]
    finally:
        qm.stop()
