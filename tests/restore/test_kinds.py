"""Restore knows every record kind the registry (sqm.core.records.KINDS) gives it: the plan takes each as its role says,
the fold has a redo step for each ENTRY kind, and each OUTCOME kind decides a UOW. A new kind fails here until
restore has what it needs for it."""

from __future__ import annotations

import pytest

from restore.plan import relevant
from restore.settle import decide_outcome, settle
from sqm.core.records import KINDS, Role, codes, counts_at, entry_ids
from tests.support.samples import SAMPLES


@pytest.mark.parametrize("code", list(KINDS))
def test_the_plan_takes_a_record_as_its_role_says(code: str) -> None:
    rec, role = SAMPLES[code][0], KINDS[code].role
    assert relevant(rec, "APP1") == (role is not Role.NONE)  # every sample is about APP1
    assert relevant(rec, "OTHER") == (role in (Role.OUTCOME, Role.END))


@pytest.mark.parametrize("code", codes(Role.ENTRY))
def test_the_fold_has_a_redo_step_for_every_entry_kind(code: str) -> None:
    rec = SAMPLES[code][0]
    for eid in entry_ids(rec):
        settle(eid, None, [rec], {}, now_ms=0)


@pytest.mark.parametrize("code", codes(Role.OUTCOME))
def test_every_outcome_kind_decides_its_uow(code: str) -> None:
    rec = SAMPLES[code][0]
    decides = KINDS[code].decides
    assert decides is not None
    outcome = decide_outcome([rec])
    assert outcome is not None and (outcome.kind, outcome.lrsn) == (decides(rec), counts_at(rec))
