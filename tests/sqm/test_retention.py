"""What recovery still needs of a member's log (sqm.core.retention; seed 002's active and inactive log;
docs/log-management.md).
The decision is pure logic (recovery_needs, structure_start, Retention.inactive_below), tested here on its own; the
integration tests with real members and logs are in test_log_management.py."""

from __future__ import annotations

from pathlib import Path

from sqm.core.records import INDOUBT, INFLIGHT
from sqm.core.retention import RESTART, STRUCTURE, UOW, Need, recovery_needs, structure_start
from sqm.core.uow import UnitOfWork
from sqm.log import LogPosition, SegmentInfo


def seg(n: int, lo: int | None, hi: int | None, *, sealed: bool = True) -> SegmentInfo:
    return SegmentInfo(n, Path(f"seg-{n}"), None, None, LogPosition(n, 0), lo, hi, 1 if lo is not None else 0,
                       sealed)


LOG = [seg(1, 100, 199), seg(2, 200, 299), seg(3, 300, 399), seg(4, 400, 499), seg(5, 500, 599, sealed=False)]


def uow(uid: str, first: int, state: str = INFLIGHT, persistent: bool = True) -> UnitOfWork:
    return UnitOfWork(uid, "QM1", state, persistent=persistent, first_lrsn=first)


def test_the_oldest_need_decides_and_only_a_prefix_is_inactive() -> None:
    starts = {"APP1": Need(STRUCTURE, 350, "CF recovery of APP1")}
    ret = recovery_needs("QM1", (LogPosition(4, 80), 450), [], starts)
    assert ret.lrsn == 350
    assert ret.inactive_below(LOG) == 3  # segments 1, 2 end below 350; 3 holds 350..399
    assert ret.kept_for(LOG[2]) == ["CF recovery of APP1"]
    assert [w.split(":")[0] for w in ret.kept_for(LOG[3])] == ["restart and peer recovery", "CF recovery of APP1"]
    assert ret.kept_for(LOG[4]) == ["the segment being written"]


def test_the_restart_checkpoint_keeps_its_segment_whatever_the_lrsns_say() -> None:
    """Restart reads by position from its checkpoint: a segment at or after it is kept even if every LRSN need is
    above its records (records of one log are only roughly in LRSN order)."""
    ret = recovery_needs("QM1", (LogPosition(2, 10), 250), [], {"APP1": Need(STRUCTURE, 450, "s")})
    assert ret.inactive_below(LOG) == 2


def test_an_active_or_in_doubt_uow_keeps_its_first_record() -> None:
    starts = {"APP1": Need(STRUCTURE, 450, "s")}
    ret = recovery_needs("QM1", (LogPosition(4, 0), 460),
                         [uow("QM1.1.7", 120, INDOUBT), uow("QM1.1.8", 50, persistent=False)], starts)
    assert ret.inactive_below(LOG) == 1
    assert any("unit of work QM1.1.7" in w for w in ret.kept_for(LOG[0]))
    assert [n.kind for n in ret.needs] == [RESTART, UOW, STRUCTURE]  # the non-persistent one logged nothing


def test_a_uow_whose_first_record_is_unknown_keeps_everything() -> None:
    ret = recovery_needs("QM1", (LogPosition(4, 0), 460), [uow("QM1.1.9", 0)], {})
    assert ret.inactive_below(LOG) == 1


def test_unknown_structure_starts_keep_everything() -> None:
    ret = recovery_needs("QM1", (LogPosition(4, 0), 460), [], None)
    assert ret.inactive_below(LOG) == 1 and ret.lrsn == 0
    assert ret.kept_for(LOG[0])[0].startswith("unknown")


def test_no_checkpoint_keeps_everything() -> None:
    ret = recovery_needs("QM1", None, [], {"APP1": Need(STRUCTURE, 450, "s")})
    assert ret.inactive_below(LOG) == 1


def test_empty_sealed_segments_before_the_needs_are_inactive() -> None:
    log = [seg(1, None, None), seg(2, 200, 299), seg(3, 300, 399, sealed=False)]
    ret = recovery_needs("QM1", (LogPosition(3, 0), 300), [], {"APP1": Need(STRUCTURE, 300, "s")})
    assert ret.inactive_below(log) == 3


def test_structure_start_chooses_as_restore_does() -> None:
    """restore.run.choose_start: the relog window when its generation is at least the backup's and it starts later;
    else the backup's replay start; neither: the definition (everything)."""
    relog = ("QM2", {"w": 500, "gen": 7, "e": 600})
    b_old = {"id": "b1", "start_lrsn": 300, "replay_from": 280, "gen": 7}
    b_new = {"id": "b2", "start_lrsn": 700, "replay_from": 650, "gen": 7}
    restored = {"id": "r1", "start_lrsn": 800, "replay_from": 790, "gen": 800}
    assert structure_start("S", [b_old], relog).lrsn == 500
    assert structure_start("S", [b_old, b_new], relog).lrsn == 650
    assert structure_start("S", [b_old, restored], relog).lrsn == 790  # the pass is of an older generation
    assert structure_start("S", [], relog).lrsn == 500
    assert structure_start("S", [b_old], None).lrsn == 280
    assert structure_start("S", [], None).lrsn == 0
    no_gen = {"id": "b0", "start_lrsn": 300, "replay_from": 280}  # a catalog entry from before it said
    assert structure_start("S", [no_gen], relog).lrsn == 280
    assert "relog window" in structure_start("S", [b_old], relog).why
