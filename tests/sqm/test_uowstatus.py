"""The UOW status model as pure logic: the state table, its refusals, and seed 003's restart Tables 1 and 2 as one
rule (sqm.conversations.uowstatus.after_restart), row by row. The same rule on real processes: tests/sqm/test_uow_restart.py."""

from __future__ import annotations

import pytest

from sqm.conversations.uowstatus import (
    ACCEPTED,
    BACKEDOUT,
    CANCELLED,
    DELIVERED,
    DISCARDED,
    FINAL,
    OPERATOR,
    POSTPONED,
    PROCESSED,
    RECEIVED,
    RECEIVER,
    SENDER,
    STATUSES,
    SYSTEM,
    TABLE,
    TIMEOUT,
    Control,
    TransitionError,
    after_backout,
    after_restart,
    restore_control_entry,
    status_letter_hex,
    transition,
)
from tests.support.restart_table import RESTART_TABLE_1

# Seed 003, "ACI Function SYNCPOINT used for Units of Work" and the normal-status diagram, written out by hand.
EXPECTED = {
    (SENDER, "COMMIT", RECEIVED): ACCEPTED,
    (SENDER, "EOC", RECEIVED): ACCEPTED,
    (SENDER, "EOCCANCEL", RECEIVED): ACCEPTED,
    (SENDER, "BACKOUT", RECEIVED): BACKEDOUT,
    (SENDER, "CANCEL", ACCEPTED): CANCELLED,
    (SENDER, "CANCEL", POSTPONED): CANCELLED,
    (RECEIVER, "RECEIVE", ACCEPTED): DELIVERED,
    (RECEIVER, "COMMIT", DELIVERED): PROCESSED,
    (RECEIVER, "BACKOUT", DELIVERED): ACCEPTED,
    (RECEIVER, "CANCEL", DELIVERED): CANCELLED,
    (RECEIVER, "POSTPONE", DELIVERED): POSTPONED,
    (SYSTEM, "TIMEOUT", ACCEPTED): TIMEOUT,
    (SYSTEM, "RESUME", POSTPONED): ACCEPTED,
    # ETBCMD SET-UOW-STATUS (seed 003 names it; docs/uow.md): only what no session holds, and no final status
    (OPERATOR, "SET-UOW-STATUS ACCEPTED", POSTPONED): ACCEPTED,
    (OPERATOR, "SET-UOW-STATUS CANCELLED", ACCEPTED): CANCELLED,
    (OPERATOR, "SET-UOW-STATUS CANCELLED", POSTPONED): CANCELLED,
}


def test_the_table_is_the_seed_s() -> None:
    assert TABLE == EXPECTED


@pytest.mark.parametrize(("who", "event", "status"), sorted(EXPECTED))
def test_every_allowed_transition(who: str, event: str, status: str) -> None:
    assert transition(who, event, status) == EXPECTED[(who, event, status)]


REFUSED = sorted({(w, e, s) for (w, e, _) in EXPECTED for s in STATUSES} - set(EXPECTED))


@pytest.mark.parametrize(("who", "event", "status"), REFUSED)
def test_every_other_transition_is_refused_naming_the_event_and_the_status(who: str, event: str,
                                                                           status: str) -> None:
    with pytest.raises(TransitionError) as e:
        transition(who, event, status)
    assert event in str(e.value) and f"status {status}" in str(e.value)


def c(status: str, persistent: bool, persistent_status: bool, **kw: object) -> Control:
    return Control(uow="ab" * 16, service="S", status=status, persistent=persistent,
                   status_mult=2 if persistent_status else 0, owner="QM1.1.7" if status in (RECEIVED, DELIVERED)
                   else "", **kw)  # type: ignore[arg-type]


TABLE_1 = RESTART_TABLE_1  # Seed 003, Restart Table 1 (tests.support.restart_table)
# Restart Table 2: only a persistent status exists, and stays.
TABLE_2 = [(s, p, True, s) for s in (CANCELLED, DISCARDED, BACKEDOUT, TIMEOUT) for p in (True, False)]


@pytest.mark.parametrize(("before", "persistent", "persistent_status", "after"), TABLE_1 + TABLE_2)
def test_restart_tables(before: str, persistent: bool, persistent_status: bool, after: str | None) -> None:
    got = after_restart(c(before, persistent, persistent_status, deliveries=3))
    assert (got.status if got else None) == after
    if got is not None:
        assert got.owner == ""  # whatever held it is gone
        if got.status == ACCEPTED:  # a delivery that was under way counts
            assert got.deliveries == (4 if before == DELIVERED else 3)


def test_a_final_status_without_persistent_status_leaves_no_trace() -> None:
    assert all(after_restart(c(s, True, False)) is None for s in FINAL)


def test_a_live_backout_keeps_a_non_persistent_uow() -> None:
    """A receiver's scope backed out while its member lives: its messages are still on the CF, persistent or not."""
    got = after_backout(c(DELIVERED, False, False, deliveries=1), pc=50)
    assert got is not None and (got.status, got.deliveries, got.changed_pc) == (ACCEPTED, 2, 50)
    sent = after_backout(c(RECEIVED, False, True), pc=60)
    assert sent is not None and sent.status == BACKEDOUT and sent.final_pc == 60
    assert after_backout(c(RECEIVED, True, False), pc=60) is None


def test_the_restore_fold_step_follows_the_status_in_the_correlation_id() -> None:
    entry = {"id": "e1", "q": "S.UOWCTL", "cid": status_letter_hex(DELIVERED)}
    kept = restore_control_entry(entry, c(DELIVERED, True, False).pack())
    assert kept is not None
    assert kept[0]["cid"] == status_letter_hex(ACCEPTED) and Control.unpack(kept[1]).status == ACCEPTED
    assert restore_control_entry(entry, c(RECEIVED, True, False).pack()) is None


def test_outlived_names_only_gone_incarnations() -> None:
    ctl = Control(uow="ab" * 16, service="S", status=DELIVERED, owner="QM2.3.9", home="QM1.2")
    assert ctl.outlived({"QM1": 2, "QM2": 3}) == (False, False)
    assert ctl.outlived({"QM1": 5, "QM2": 3}) == (False, True)  # QM1 restarted
    assert ctl.outlived({"QM1": 2}) == (True, False)  # QM2 is not a member any more
