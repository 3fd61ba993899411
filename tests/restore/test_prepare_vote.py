"""A PREPARE's vote (sqm.core.outcomes.Outcomes.confirm_prepared): after the PREPARE is forced, each structure of the
unit of work is asked how it stands. One restored since the unit of work worked there has backed it out (or lost
its work), or one has failed: the prepare votes no (BackedOutError, "nothing of the unit of work took effect; do it
again"), the unit of work backed out with a BACKOUT forced after its PREPARE, which the member (its restart), the
CF and a later restore all agree with: backed out, never in doubt; the structures still serving release its work at
once. A member fenced by peer recovery during its prepare cannot tell what the peer decided from its log: it
answers OutcomeUnknownError; the peer, having read the PREPARE, keeps the unit of work in doubt for its
coordinator, and having backed it out (the PREPARE not yet on disk), a coordinator's later resolve-commit is never
told "committed". Real redis-server, real logs, real restores, a real restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.errors import BackedOutError, BadRequestError, OutcomeUnknownError
from tests.restore.test_restore import uow_records
from tests.support.crash import crash
from tests.support.fenced_prepare import fence_at_prepare, peer_beside
from tests.support.group import define_group, start_qm
from tests.support.restore_at_load import RestoreAtLoad, restore_at_load


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
    with restore_at_load(redis_url, tmp_path) as at, peer_beside(redis_url, at) as peer:
        at.conn.put("Q1", b"in doubt")
        assert at.conn.uow is not None
        uow = at.conn.uow.id
        recovered = fence_at_prepare(at, peer, monkeypatch, forced=True)
        with pytest.raises(OutcomeUnknownError, match="peer recovery fenced QM1") as told:
            at.conn.prepare("xid-fenced")
        assert "\n" not in str(told.value)
        assert recovered and recovered[0].in_doubt == 1, recovered  # the peer read the PREPARE
        crash(at.qm)
        at.qm = start_qm(redis_url, at.logs, "QM1", background=False, lease_ms=60_000)
        assert [u.id for u in at.qm.indoubt()] == [uow]
        at.qm.resolve(uow, True)  # the coordinator, told nothing certain, finds it in doubt and commits it
        assert at.view() == [(b"in doubt", 0)]


def test_a_member_fenced_before_its_prepare_reached_the_disk_never_reports_the_commit(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peer recovery fences QM1 and reads its log just before the PREPARE is written: the peer backs the unit of
    work out. The prepare answers OutcomeUnknownError; QM1's restarted log ends with that PREPARE, and a
    coordinator's resolve-commit there must not be told "committed" for a put that is gone."""
    with restore_at_load(redis_url, tmp_path) as at, peer_beside(redis_url, at) as peer:
        at.conn.put("Q1", b"in flight")
        assert at.conn.uow is not None
        uow = at.conn.uow.id
        recovered = fence_at_prepare(at, peer, monkeypatch, forced=False)
        with pytest.raises(OutcomeUnknownError, match="peer recovery fenced QM1"):
            at.conn.prepare("xid-fenced-before")
        assert recovered and recovered[0].in_doubt == 0, recovered  # the peer backed it out
        monkeypatch.undo()
        crash(at.qm)
        at.qm = start_qm(redis_url, at.logs, "QM1", background=False, lease_ms=60_000)
        if uow in [u.id for u in at.qm.indoubt()]:
            with pytest.raises(BackedOutError):
                at.qm.resolve(uow, True)
        assert at.view() == []
        assert not at.qm.indoubt() and not at.qm.pending


def test_a_prepare_finding_its_work_committed_by_recovery_on_one_structure_keeps_that_and_backs_out_the_rest(
        redis_url: str, tmp_path: Path) -> None:
    """A structure that answers 'C' (recovery committed the unit of work there, as a peer's recovery leaves it: the
    peer's own commit.lua call, decided by recovery) leaves no vote to give: a yes could not honour the coordinator's
    backout, and a backout cannot undo that commit (backout.lua answers COMPLETED). The prepare backs the unit of
    work out on the other structures, keeps the commit, and says so (OutcomeUnknownError); nothing stays locked."""
    define_group(redis_url, structure="APP2", queues=("Q3",))
    with restore_at_load(redis_url, tmp_path) as at, peer_beside(redis_url, at) as peer:
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


# --- a unit of work on one ACTIVE structure and one that failed ---------------------------------------------------
def _no_vote_with_app2_failed(at: RestoreAtLoad) -> str:
    """QM1's unit of work puts onto APP2 (touched first), then gets the persistent message on APP1; APP2 fails; the
    prepare votes no. Returns the unit of work's id."""
    conn = at.conn
    conn.put("Q1", b"taken", syncpoint=False)
    conn.put("Q3", b"put on APP2")
    assert conn.get("Q1").body == b"taken"
    uow = conn.uow
    assert uow is not None and list(uow.structures) == ["APP2", "APP1"]
    Admin(at.client).set_state("APP2", "FAILED")
    with pytest.raises(BackedOutError, match=f"unit of work {uow.id} was backed out, not prepared: structure APP2"):
        conn.prepare("xid-one-failed")
    return str(uow.id)


def test_a_no_vote_backs_out_at_once_on_the_structure_still_active(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url, structure="APP2", queues=("Q3",))
    with restore_at_load(redis_url, tmp_path) as at:
        _no_vote_with_app2_failed(at)
        at.qm.retry_pending()  # housekeeping's retry: APP2 is still failed
        # "do it again": the message the unit of work got on APP1, which stayed ACTIVE, is available again
        assert at.view("Q1") == [(b"taken", 1)]


def test_an_application_s_backout_releases_the_structures_still_serving_at_once(redis_url: str,
                                                                                 tmp_path: Path) -> None:
    """The same unit of work backed out by its application while APP2 is failed: the backout of APP2 waits for the
    structure (the application hears that its outcome is pending), and the get on APP1 is released now."""
    define_group(redis_url, structure="APP2", queues=("Q3",))
    with restore_at_load(redis_url, tmp_path) as at:
        conn = at.conn
        conn.put("Q1", b"taken", syncpoint=False)
        conn.put("Q3", b"put on APP2")
        assert conn.get("Q1").body == b"taken"
        Admin(at.client).set_state("APP2", "FAILED")
        conn.backout()  # acknowledged: the APP2 part is finished when the structure is back
        assert at.qm.pending
        assert at.view("Q1") == [(b"taken", 1)]
        Admin(at.client).set_state("APP2", "ACTIVE")
        at.qm.retry_pending()
        assert not at.qm.pending and at.view("Q3") == []


def test_a_restart_after_a_no_vote_finds_it_backed_out_never_in_doubt(redis_url: str, tmp_path: Path) -> None:
    """The log holds PREPARE then BACKOUT: the member's restart backs the unit of work out (the APP2 part waits for
    the structure), and nothing is in doubt for a coordinator to commit."""
    define_group(redis_url, structure="APP2", queues=("Q3",))
    with restore_at_load(redis_url, tmp_path) as at:
        uow = _no_vote_with_app2_failed(at)
        assert [k for k in uow_records(at.logs / "QM1", uow) if k in ("PREPARE", "BACKOUT")] == ["PREPARE", "BACKOUT"]
        crash(at.qm)
        at.qm = start_qm(redis_url, at.logs, "QM1", background=False, lease_ms=60_000)
        assert at.qm.indoubt() == []
        with pytest.raises(BadRequestError, match="not in doubt"):
            at.qm.resolve(uow, True)  # a coordinator retrying a commit after the no vote is refused
        Admin(at.client).set_state("APP2", "ACTIVE")
        at.qm.retry_pending()
        assert not at.qm.pending
        assert at.view("Q1") == [(b"taken", 1)] and at.view("Q3") == []  # backed out on both structures


def test_a_restore_that_read_the_prepare_before_the_no_votes_backout_agrees_with_it(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The structure is failed when the PREPARE is forced (a no vote), and its restore reads the logs between the
    PREPARE and the BACKOUT: it carries the unit of work over in doubt. The BACKOUT then completes on the restored
    structure (a carried-over in-doubt unit of work backed out by its owner), and a later restore agrees."""
    with restore_at_load(redis_url, tmp_path) as at:
        at.conn.put("Q1", b"taken", syncpoint=False)
        at.backup()
        assert at.conn.get("Q1").body == b"taken"
        at.conn.put("Q2", b"put")
        assert at.conn.uow is not None
        uow = at.conn.uow.id
        Admin(at.client).set_state("APP1", "FAILED")
        append = at.qm.append
        restored: list[bool] = []

        def restore_before_the_backout(record: dict[str, Any], **kw: Any) -> None:
            if record["k"] == "BACKOUT" and not restored:
                restored.append(True)
                at.restore()  # reads the PREPARE, not the BACKOUT: in doubt on the restored structure
            append(record, **kw)

        monkeypatch.setattr(at.qm, "append", restore_before_the_backout)
        with pytest.raises(BackedOutError, match=f"unit of work {uow} was backed out, not prepared"):
            at.conn.prepare("xid-restored-between")
        assert restored
        monkeypatch.undo()
        at.settle()
        assert not at.qm.indoubt()
        want = {"Q1": [(b"taken", 1)], "Q2": []}
        assert {q: at.view(q) for q in want} == want
        assert all(d["UP"] == d["UG"] == 0 for d in at.qm.structure("APP1").depths().values())
        at.restore()  # the logs as they are now: PREPARE then BACKOUT
        at.settle()
        assert {q: at.view(q) for q in want} == want
