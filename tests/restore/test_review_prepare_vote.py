"""Review of the PREPARE vote (sqm.core.outcomes.Outcomes.confirm_prepared) where a unit of work spans one ACTIVE
structure and one that failed: the prepare votes no (BackedOutError, "nothing of the unit of work took effect; do it
again"), the BACKOUT is forced after the PREPARE, and every reader of the log (the member's restart, a restore)
takes the unit of work as backed out, never in doubt. Real redis-server, real logs, a real restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cfemu import keys
from cfemu.admin import Admin
from cfemu.errors import BackedOutError, BadRequestError, OutcomeUnknownError
from sqm.core.recovery import recover_peer
from tests.restore.test_restore import uow_records
from tests.support.crash import crash
from tests.support.group import define_group, start_qm
from tests.support.restore_at_load import RestoreAtLoad, restore_at_load


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


def test_a_member_fenced_before_its_prepare_reached_the_disk_never_reports_the_commit(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peer recovery fences QM1 and reads its log just before the PREPARE is written: the peer backs the unit of
    work out. The prepare answers OutcomeUnknownError; QM1's restarted log ends with that PREPARE, and a
    coordinator's resolve-commit there must not be told "committed" for a put that is gone."""
    with restore_at_load(redis_url, tmp_path) as at:
        peer = start_qm(redis_url, at.logs, "QM2", background=False)
        try:
            at.conn.put("Q1", b"in flight")
            assert at.conn.uow is not None
            uow = at.conn.uow.id
            append = at.qm.append
            recovered: list[Any] = []

            def fenced_before_the_prepare(record: dict[str, Any], **kw: Any) -> None:
                if record["k"] == "PREPARE" and not recovered:
                    peer.redis.delete(keys.lease("QM1"))  # its lease has lapsed
                    recovered.append(recover_peer(peer, "QM1"))
                append(record, **kw)

            monkeypatch.setattr(at.qm, "append", fenced_before_the_prepare)
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
        finally:
            peer.stop(checkpoint=False)
