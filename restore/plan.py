"""Restore planning, in-process engine: compute the final state of every message off the CF.

The plan is data-parallel (the Spark engine runs the same steps as DataFrame operations):
  1 group the backup's copies by entry id, keep the best copy of each (settle.best_copy);
  2 group the log records of the structure by entry id, and the outcome records by UOW;
  3 decide each UOW's outcome (settle.decide_outcome); UOWs with no outcome were in flight when the CF was lost:
    restore decides them backed out, at an LRSN above everything it read (written to its own log later);
  4 fold each entry (settle.settle).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from restore.settle import (
    BACKOUT,
    COMMIT,
    INDOUBT,
    Outcome,
    Settled,
    best_copy,
    decide_outcome,
    settle,
    uows_named,
)
from sqm.records import Record, Role, entry_ids, lookup

Copy = tuple[str, dict[str, Any], bytes]  # (structure, descriptor wire form, data)


@dataclass
class RestorePlan:
    structure: str
    restore_lrsn: int  # above every LRSN read: the restore's own decisions and the CF clock start here
    settled: list[Settled]
    outcomes: dict[str, Outcome]
    decisions: dict[str, str] = field(default_factory=dict)  # UOW -> owner, decided backed out by this restore
    in_commit: set[str] = field(default_factory=set)  # committed UOWs the owner may still be completing
    counts: Counter[str] = field(default_factory=Counter)
    records_by_member: Counter[str] = field(default_factory=Counter)
    max_lrsn: int = 0

    def loaded(self) -> list[Settled]:
        return [s for s in self.settled if s.entry is not None]

    def in_doubt_uows(self) -> dict[str, str]:
        """The UOWs the restored structure holds, in doubt: UOW -> owner (restore.plan.held_uows)."""
        return held_uows(self.structure, self.settled, self.outcomes)


def owner_of(uow: str) -> str:
    """UOW ids are '<member>.<epoch>.<sequence>'."""
    return uow.split(".", 1)[0]


def uow_owner(uow: str, outcome: Outcome | None) -> str:
    """The member that owns a UOW: the one that logged its PREPARE for an in-doubt one, else the one its id
    names (never the peer whose RECOVERY record decided it: that member cannot resolve it)."""
    if outcome is not None and outcome.kind == INDOUBT and outcome.decided_by:
        return outcome.decided_by
    return owner_of(uow)


def held_uows(structure: str, settled: Iterable[Settled], outcomes: Mapping[str, Outcome]) -> dict[str, str]:
    """The UOWs the restored structure holds, UOW -> owner: those holding loaded entries, and the in-doubt UOWs
    whose records name the structure though none of their work on it survives (non-persistent work only: the
    load registers them too, so that their coordinator can still commit or back them out). The report's count
    of UOWs in doubt and its list are both this set, so they cannot disagree."""
    out = {s.entry["u"]: uow_owner(s.entry["u"], outcomes.get(s.entry["u"]))
           for s in settled if s.entry and s.entry.get("u")}
    for u, o in outcomes.items():
        if o.kind == INDOUBT and structure in o.structures and u not in out:
            out[u] = uow_owner(u, o)
    return dict(sorted(out.items()))


def relevant(record: Record, structure: str) -> bool:
    """Does a record matter for restoring this structure? Its events on the structure's entries, and every UOW's
    outcome and END (a UOW may span structures: its outcome record names them all)."""
    kind = lookup(record)
    if kind.role is Role.ENTRY:
        return kind.structure(record) == structure
    return kind.role in (Role.OUTCOME, Role.END)


def restrict(record: Record, structure: str) -> Record:
    """Drop the data other structures' entries carry in an outcome record."""
    if record.get("dd"):
        record = dict(record)
        record["dd"] = [d for d in record["dd"] if d[0] == structure]
    return record


def prepare_record(record: Record, structure: str) -> Record | None:
    """The per-record stage: the record as the plan uses it, or None when it does not matter for `structure`."""
    if not relevant(record, structure):
        return None
    return restrict(record, structure)


def restore_lrsn_above(max_lrsn: int) -> int:
    """The restore's own LRSN: above every LRSN read, and not below the wall clock (microseconds)."""
    return max(max_lrsn + 1, time.time_ns() // 1000)


def in_flight_outcome(restore_lrsn: int) -> Outcome:
    """The outcome restore gives a UOW that has no outcome record: it was in flight when the CF was lost."""
    return Outcome(BACKOUT, restore_lrsn, "restore")


def summarize(structure: str, settled: list[Settled], outcomes: Mapping[str, Outcome],
              decisions: Mapping[str, str], ended: Collection[str]) -> tuple[Counter[str], set[str]]:
    """The plan's report counts and its in-commit UOWs (committed, with no END record yet)."""
    counts = Counter(s.disposition for s in settled)
    in_commit = {u for u, o in outcomes.items() if o.kind == COMMIT and u not in ended}
    counts["uows in doubt"] = len(held_uows(structure, settled, outcomes))
    counts["uows in flight backed out"] = len(decisions)
    return counts, in_commit


def plan_local(structure: str, backup: Iterable[Copy], records: Iterable[Record], *,
               now_ms: int | None = None) -> RestorePlan:
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    copies: dict[str, list[Copy]] = defaultdict(list)
    max_lrsn = 0
    for c in backup:
        copies[c[1]["id"]].append(c)
        max_lrsn = max(max_lrsn, int(c[1]["l"]))
    by_entry: dict[str, list[Record]] = defaultdict(list)
    by_uow: dict[str, list[Record]] = defaultdict(list)
    ended: set[str] = set()
    per_member: Counter[str] = Counter()
    for raw in records:
        max_lrsn = max(max_lrsn, int(raw["l"]))
        rec = prepare_record(raw, structure)
        if rec is None:
            continue
        per_member[rec.get("m", "?")] += 1
        role = lookup(rec).role
        if role is Role.END:
            ended.add(rec["u"])
            continue
        if role is Role.OUTCOME:
            by_uow[rec["u"]].append(rec)
        for eid in entry_ids(rec):
            by_entry[eid].append(rec)

    best = {eid: best_copy(cs) for eid, cs in copies.items()}
    outcomes: dict[str, Outcome] = {}
    for uid, recs in by_uow.items():
        o = decide_outcome(recs)
        if o is not None:
            outcomes[uid] = o
    restore_lrsn = restore_lrsn_above(max_lrsn)
    decisions: dict[str, str] = {}
    for eid in best.keys() | by_entry.keys():
        for uid in uows_named(best.get(eid), by_entry.get(eid, ())):
            if uid not in outcomes:
                outcomes[uid] = in_flight_outcome(restore_lrsn)
                decisions[uid] = owner_of(uid)

    settled = [settle(eid, best.get(eid), by_entry.get(eid, ()), outcomes, now_ms)
               for eid in best.keys() | by_entry.keys()]
    counts, in_commit = summarize(structure, settled, outcomes, decisions, ended)
    return RestorePlan(structure, restore_lrsn, settled, outcomes, decisions, in_commit, counts, per_member,
                       max_lrsn)
