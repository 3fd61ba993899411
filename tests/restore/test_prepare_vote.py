"""A PREPARE's vote (sqm.core.outcomes.Outcomes.confirm_prepared): after the PREPARE is forced, each structure of the
unit of work is asked how it stands. One restored since the unit of work worked there has backed it out (or lost
its work): the prepare votes no (BackedOutError), the unit of work backed out with a record after its PREPARE, which
the member, the CF and a later restore all agree with. A member fenced by peer recovery during its prepare cannot
tell what the peer decided from its log: it answers OutcomeUnknownError, and the peer, having read the PREPARE,
keeps the unit of work in doubt for its coordinator. Real redis-server, real logs, real restores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cfemu import keys
from cfemu.errors import BackedOutError, OutcomeUnknownError
from sqm.core.recovery import recover_peer
from tests.restore.test_restore import uow_records
from tests.support.crash import crash
from tests.support.group import define_group, start_qm
from tests.support.restore_at_load import restore_at_load


@pytest.mark.parametrize("persistent", [True, False], ids=["a-get-and-a-put-logged", "a-non-persistent-put-only"])
def test_a_prepare_after_its_structure_was_restored_votes_no(redis_url: str, tmp_path: Path,
                                                            persistent: bool) -> None:
    """persistent: the unit of work got a persistent message and put one (logged, forced before the restore: the
    restore backs it out); else it put one non-persistent message (nothing logged: the restore never knew it, and
    its work there is lost)."""
    with restore_at_load(redis_url, tmp_path) as at:
        at.conn.put("Q1", b"taken", syncpoint=False)
        at.backup()
        if persistent:
            assert at.conn.get("Q1").body == b"taken"
        at.conn.put("Q2", b"put", persistent=persistent)
        assert at.conn.uow is not None and at.qm.log is not None
        uow = at.conn.uow.id
        at.qm.log.force()
        at.restore()  # the structure fails and is restored: the unit of work was in flight there
        at.settle()
        with pytest.raises(BackedOutError, match=f"unit of work {uow} was backed out, not prepared: structure APP1"):
            at.conn.prepare("xid-after-restore")
        assert not at.qm.indoubt() and not at.qm.pending
        assert [k for k in uow_records(at.logs / "QM1", uow) if k in ("PREPARE", "BACKOUT")] == ["PREPARE", "BACKOUT"]
        want = {"Q1": [(b"taken", 1 if persistent else 0)], "Q2": []}  # the get backed out once, by the restore
        assert {q: at.view(q) for q in want} == want
        at.restore()  # a restore of the logs as they are now agrees
        at.settle()
        assert {q: at.view(q) for q in want} == want


def test_a_member_fenced_during_its_prepare_answers_outcome_unknown(redis_url: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with restore_at_load(redis_url, tmp_path) as at:
        peer = start_qm(redis_url, at.logs, "QM2", background=False)
        try:
            at.conn.put("Q1", b"in doubt")
            assert at.conn.uow is not None
            uow = at.conn.uow.id
            append = at.qm.append
            recovered: list[Any] = []

            def fenced_after_the_prepare(record: dict[str, Any], **kw: Any) -> None:
                append(record, **kw)  # forced: on disk when the peer reads the log
                if record["k"] == "PREPARE":
                    peer.redis.delete(keys.lease("QM1"))  # its lease has lapsed
                    recovered.append(recover_peer(peer, "QM1"))

            monkeypatch.setattr(at.qm, "append", fenced_after_the_prepare)
            with pytest.raises(OutcomeUnknownError, match="peer recovery fenced QM1") as told:
                at.conn.prepare("xid-fenced")
            assert "\n" not in str(told.value)
            assert recovered and recovered[0].in_doubt == 1, recovered  # the peer read the PREPARE
            crash(at.qm)
            at.qm = start_qm(redis_url, at.logs, "QM1", background=False, lease_ms=60_000)
            assert [u.id for u in at.qm.indoubt()] == [uow]
            at.qm.resolve(uow, True)  # the coordinator, told nothing certain, finds it in doubt and commits it
            assert at.view() == [(b"in doubt", 0)]
        finally:
            peer.stop(checkpoint=False)


def test_a_prepare_finding_its_work_committed_by_recovery_on_one_structure_keeps_that_and_backs_out_the_rest(
        redis_url: str, tmp_path: Path) -> None:
    """A structure that answers 'C' (recovery committed the unit of work there, as a peer's recovery leaves it: the
    peer's own commit.lua call, decided by recovery) leaves no vote to give: a yes could not honour the coordinator's
    backout, and a backout cannot undo that commit (backout.lua answers COMPLETED). The prepare backs the unit of
    work out on the other structures, keeps the commit, and says so (OutcomeUnknownError); nothing stays locked."""
    define_group(redis_url, structure="APP2", queues=("Q3",))
    with restore_at_load(redis_url, tmp_path) as at:
        peer = start_qm(redis_url, at.logs, "QM2", background=False)
        try:
            at.conn.put("Q1", b"on APP1")
            at.conn.put("Q3", b"on APP2")
            uow = at.conn.uow
            assert uow is not None
            peer.structure("APP2").commit(peer.caller, uow.id, gen=uow.structures["APP2"], lrsn=0,
                                          decided_by_recovery=True)
            with pytest.raises(OutcomeUnknownError, match="recovery committed it on APP2") as told:
                at.conn.prepare("xid-committed-by-recovery")
            assert "structure APP2 has it committed by recovery" in str(told.value) and "\n" not in str(told.value)
            assert not at.qm.indoubt() and not at.qm.pending
            assert at.view("Q1") == [] and at.view("Q3") == [(b"on APP2", 0)]
            for s in ("APP1", "APP2"):  # no entry left locked
                assert all(d["UP"] == d["UG"] == 0 for d in at.qm.structure(s).depths().values())
        finally:
            peer.stop(checkpoint=False)
