"""The record-kind registry (sqm.core.records.KINDS) is complete: every kind has its fields, constructor, role, describe
and a row in docs/log-format.md's "Record kinds" table that agrees with the registry, so that adding a kind is its
row, its TypedDict and its constructor (and a sample in tests/support/samples.py), and forgetting one fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sqm.core import records
from sqm.core.records import KINDS, Role, lookup
from sqm.log import LogReader, RecordLog
from tests.support.samples import SAMPLES

DOC = Path(__file__).resolve().parents[2] / "docs" / "log-format.md"


def doc_rows() -> dict[str, list[str]]:
    """The cells of each row of the "Record kinds" table, by kind."""
    section = DOC.read_text().split("\n## Record kinds\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        code = re.fullmatch(r"`([A-Z]+)`", cells[0])
        if line.startswith("|") and code:
            rows[code.group(1)] = cells
    return rows


def test_every_kind_has_a_sample_and_a_doc_row_and_nothing_else_does() -> None:
    assert set(SAMPLES) == set(KINDS)
    assert set(doc_rows()) == set(KINDS)


def test_the_fold_orders_the_events_at_one_lrsn_totally() -> None:
    ranks = [k.fold_rank for k in KINDS.values() if k.role is Role.ENTRY and not k.copy] + [records.OUTCOME_RANK]
    assert len(set(ranks)) == len(ranks)


@pytest.mark.parametrize("code", list(KINDS))
def test_the_constructor_writes_the_kinds_fields_as_they_are_on_disk(code: str) -> None:
    kind = KINDS[code]
    built, on_disk = SAMPLES[code]
    assert kind.code == code and kind.build is getattr(records, code.lower())
    assert built == on_disk and built["k"] == code
    required, optional = kind.fields.__required_keys__, kind.fields.__optional_keys__
    assert {"k", "l"} <= required and required <= built.keys() <= required | optional


@pytest.mark.parametrize("code", list(KINDS))
def test_the_doc_row_agrees_with_the_registry(code: str) -> None:
    kind = KINDS[code]
    _, fields, forced, role = doc_rows()[code][:4]
    listed = dict(re.findall(r"`(\w+)`(\??)", fields))
    assert {f for f, opt in listed.items() if not opt} == kind.fields.__required_keys__ - {"k", "l"}
    assert {f for f, opt in listed.items() if opt} == kind.fields.__optional_keys__
    assert forced == ("yes" if kind.forced else "no")
    assert role == kind.role.value


@pytest.mark.parametrize("code", list(KINDS))
def test_each_kind_answers_the_questions_the_house_asks(code: str) -> None:
    kind, (rec, _) = KINDS[code], SAMPLES[code]
    assert isinstance(kind.role, Role) and lookup(rec) is kind
    assert isinstance(kind.describe(rec), str) and kind.describe(rec) == records.describe(rec)
    assert kind.uow_state in (None, records.INFLIGHT, records.INDOUBT, records.INCOMMIT, records.INBACKOUT,
                              records.DONE)
    # restore groups OUTCOME records by UOW and asks what they decide; the log decides first (write-ahead)
    assert (kind.decides is not None) == (kind.role is Role.OUTCOME)
    if kind.decides is not None:
        assert kind.forced and rec.get("u")
        assert kind.decides(rec) in (records.OUTCOME_COMMIT, records.OUTCOME_BACKOUT, records.OUTCOME_INDOUBT)
    # restore folds ENTRY records into the entries of one structure, ordered by rank at one LRSN
    if kind.role is Role.ENTRY:  # a copy (RELOG) is the fold's starting state, not an event: it has no rank
        assert (kind.fold_rank is None) == kind.copy and kind.structure(rec) == rec["s"] and kind.entry_ids(rec)
    else:
        assert kind.structure(rec) is None
    assert all(isinstance(i, str) for i in kind.entry_ids(rec))
    assert all(isinstance(q, str) for q in kind.queues(rec))
    assert {d["id"] for d in kind.descriptors(rec)} <= set(kind.entry_ids(rec))
    if kind.carries_data:
        assert kind.entry_ids(rec) == [d[1]["id"] for d in rec["dd"]]


def test_every_sample_survives_the_log(tmp_path: Path) -> None:
    with RecordLog(tmp_path / "QM1", "QM1") as log:
        for rec, _ in SAMPLES.values():
            log.append(rec)
    assert [rec for _, rec in LogReader(tmp_path / "QM1").records()] == [on_disk for _, on_disk in SAMPLES.values()]


def test_a_kind_this_version_does_not_know() -> None:
    """Restart refuses it; the readers that pass over records (restore, the printers' filters) see a kind with no
    role, about the entries it carries, if any."""
    rec = {"k": "FUTURE", "l": 7, "dd": [["APP1", {"id": "e9", "q": "Q9"}, b""]]}
    with pytest.raises(records.UnknownRecordError, match="FUTURE"):
        records.kind_of(rec)
    with pytest.raises(records.UnknownRecordError):
        records.describe(rec)
    assert lookup(rec).role is Role.NONE and lookup(rec) is records.FOREIGN
    assert records.entry_ids(rec) == ["e9"] and records.queues_of(rec) == ["Q9"]
