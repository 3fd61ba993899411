"""Restore planning: compute the final state of every message off the CF. restore.reference.plan_local does it in
memory, all at once: the specification every engine is tested against; the local engine runs the same steps one
partition at a time (restore.partitioned), the Spark engine as DataFrame operations.

The plan is data-parallel (the Spark engine runs the same steps as DataFrame operations):
  1 group the backup's copies by entry id, keep the best copy of each (settle.best_copy);
  2 group the log records of the structure by entry id, and the outcome records by UOW, leaving out the
    records of older incarnations of the structure (current_incarnation, the generation rule), but keeping
    aside the older outcome records (older_outcome): those of a UOW a copy of this incarnation shows holding an
    entry (copy_holder: a relog pass's RELOG) decide it after all (revived);
  3 decide each UOW's outcome (settle.decide_outcome); UOWs with no outcome were in flight when the CF was lost:
    restore decides them backed out, at an LRSN above everything it read (written to its own log later);
  4 fold each entry (settle.settle).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from restore.settle import (
    BACKOUT,
    COMMIT,
    INDOUBT,
    Outcome,
    Settled,
    load_key,
)
from sqm.core.records import Record, Role, lookup

T = TypeVar("T")

Copy = tuple[str, dict[str, Any], bytes]  # (structure, descriptor wire form, data)


@dataclass
class RestorePlan:
    structure: str
    restore_lrsn: int  # above every LRSN read: the restore's own decisions and the CF clock start here
    settled: Collection[Settled]  # a list in memory, or read back from spill files (restore.partitioned)
    outcomes: Mapping[str, Outcome]
    decisions: dict[str, str] = field(default_factory=dict)  # UOW -> owner, decided backed out by this restore
    in_commit: set[str] = field(default_factory=set)  # committed UOWs the owner may still be completing
    counts: Counter[str] = field(default_factory=Counter)
    records_by_member: Counter[str] = field(default_factory=Counter)
    max_lrsn: int = 0

    def loaded(self) -> Iterable[Settled]:
        return [s for s in self.settled if s.entry is not None]

    def in_load_order(self) -> Iterator[Settled]:
        """The entries to load, in the CF's order (settle.load_key)."""
        return iter(sorted(self.loaded(), key=lambda s: load_key(s.id, s.entry or {})))

    def loaded_total(self) -> int:
        return sum(1 for s in self.settled if s.entry is not None)

    def in_doubt_uows(self) -> dict[str, str]:
        """The UOWs the restored structure holds, in doubt: UOW -> owner (restore.plan.held_uows)."""
        return held_uows(self.structure, self.settled, self.outcomes)

    def loaded_first_lrsn(self) -> dict[str, int]:
        """UOW -> the lowest LRSN of the loaded entries it holds."""
        first: dict[str, int] = {}
        for s in self.loaded():
            if s.entry and s.entry.get("u"):
                u, lrsn = s.entry["u"], int(s.entry["l"])
                first[u] = min(first.get(u, lrsn), lrsn)
        return first

    def backed_out_by_restore(self) -> set[str]:
        """The UOWs restore decided backed out (in flight at the failure): now, or in an earlier run."""
        return {u for u, o in self.outcomes.items() if o.kind == BACKOUT and o.decided_by == "restore"}

    def close(self) -> None:
        """Free what the plan keeps outside memory (a partitioned plan's spill files); nothing for this one."""


class SummarizedPlan(RestorePlan):
    """A RestorePlan whose settled entries live outside memory (spill files, a database) and are read on demand, in
    load order (in_load_order): what the restore asks of them besides is summed up once, when the plan is made."""

    loaded_count: int
    held: dict[str, str]  # in_doubt_uows
    first_lrsn: dict[str, int]  # loaded_first_lrsn
    restore_decided: set[str]  # backed_out_by_restore

    def loaded(self) -> Iterator[Settled]:
        return self.in_load_order()

    def loaded_total(self) -> int:
        return self.loaded_count

    def in_doubt_uows(self) -> dict[str, str]:
        return dict(self.held)

    def loaded_first_lrsn(self) -> dict[str, int]:
        return dict(self.first_lrsn)

    def backed_out_by_restore(self) -> set[str]:
        return set(self.restore_decided)


@dataclass(frozen=True)
class Base:
    """What the plan knows of its base (the backup or restore point it starts from) before it reads the logs:
    the structure generation the base was taken in, and the UOWs that hold entries in it."""

    gen: int = 0  # 0: unknown (the generation rule then keeps every record)
    carried: frozenset[str] = frozenset()
    lrsn: int = 0  # the highest LRSN the base records (base_lrsn): the restore's own LRSN lies above it


# A key restore.run adds to the base's manifest as the engines see it (never written): the highest generation the
# structure has had, by any restore or purge (their restore points) or in the CF now. A restore from a base an
# earlier restore already used, that reads no record above that one's, must still start a new generation.
EARLIER_GENERATIONS = "earlier_generations"


def base_lrsn(manifest: Mapping[str, Any]) -> int:
    """The highest LRSN a backup's manifest records: its start, floor, replay start and end (the CF's clock while
    it ran), and the structure's earlier generations (EARLIER_GENERATIONS). It may lie above every LRSN in any
    log: the CF's clock moves with unlogged work too (a non-persistent put of a member whose clock runs ahead)."""
    return max(int(manifest.get(k, 0) or 0)
               for k in ("start_lrsn", "floor_lrsn", "replay_from", "end_lrsn", EARLIER_GENERATIONS))


def base_of(manifest: Mapping[str, Any], held_by: Iterable[str]) -> Base:
    """The Base of a backup: its manifest's generation and highest LRSN, and the UOWs it holds: those its copies
    name (`held_by`: the copies' "u" fields, empty ones included), those its manifest lists as registered ("uows":
    an in-doubt UOW registered without entries, its work there non-persistent), and, for a base of the logs alone
    (restore.run.LogsBase), those in "carried": UOWs of older generations that hold entries its relog copies show
    (docs/log-management.md)."""
    held = {u for u in [*held_by, *manifest.get("carried", ())] if u} | set(manifest.get("uows") or ())
    return Base(int(manifest.get("gen", 0) or 0), frozenset(held), base_lrsn(manifest))


def current_incarnation(record: Record, structure: str, base: Base) -> bool:
    """The generation rule. A structure's generation changes with every restore and purge (a new incarnation); a UOW
    runs in the generation it first touched the structure in (PUT / GET "g", outcome "ss"). The work of a UOW from a
    generation below the base's either took effect before the base (it is in the base) or never did (the CF refuses
    an older generation's UOW it does not know): its records are left out, however late they reached the disk and
    whatever their LRSN (a GET appended before a CF loss and forced after the restore must not be folded into a later
    restore: docs/architecture.md, "The group's durable history"). A UOW that holds entries in the base (an in-doubt
    UOW carried across a restore, or a UOW a fuzzy backup caught in flight) is current whatever its generation: its
    outcome still applies to the entries it holds; so does a UOW a relog copy of this incarnation shows holding an
    entry (older_outcome: its outcome records are kept aside and count after all). A generation 0 (restore's own
    RECOVERY records before generations were recorded in them) counts as current."""
    if base.gen <= 0 or record.get("u") in base.carried:
        return True
    kind = lookup(record)
    if kind.role is Role.ENTRY:
        gen = record.get("g")
    elif kind.role is Role.OUTCOME:
        gen = (record.get("ss") or {}).get(structure)
    else:
        return True
    if gen is None:  # EXPIRE (no UOW: expiry is idempotent by time), or a UOW that never touched the structure
        return True
    if int(gen) == 0:
        return kind.role is Role.OUTCOME
    return int(gen) >= base.gen


def owner_of(uow: str) -> str:
    """UOW ids are '<member>.<epoch>.<sequence>'."""
    return uow.split(".", 1)[0]


def ends_for_its_owner(uow: str, member: str | None) -> bool:
    """Whether an END record, logged by `member`, tells the restore that nobody retries the UOW's outcome: only the
    owner's own END does. A peer that completed the owner's commit in its recovery logs an END too, but the
    owner's log still holds the COMMIT without one, and the owner completes it again when it restarts: the
    restored structure must leave that retry a 'C' tombstone (plan.in_commit), or it answers "lost with the CF"
    and the owner logs a BACKOUT after its COMMIT (invariant 2), which a later restore folds into the loss of
    messages whose put was committed. The columnar plan's `ended` table says the same in SQL."""
    return member == owner_of(uow)


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


def prepare_record(record: Record, structure: str, base: Base = Base()) -> Record | None:
    """The per-record stage: the record as the plan uses it, or None when it does not matter for `structure`
    (another structure's, or an older incarnation's: current_incarnation)."""
    if not relevant(record, structure) or not current_incarnation(record, structure, base):
        return None
    return restrict(record, structure)


def older_outcome(record: Record, structure: str, base: Base = Base()) -> Record | None:
    """An outcome record the generation rule leaves out (prepare_record: its UOW began in an older incarnation),
    as the plan keeps it aside: it still decides its UOW when a copy of this incarnation shows that UOW holding
    an entry (copy_holder). Such a UOW was carried across the restore that began this incarnation (in doubt),
    and a relog pass copied what it held; when the base no longer holds those entries (a backup taken after its
    decision) but its replay reaches back past the pass, the relog copy is the entry's best copy, and leaving
    out the UOW's outcome would make it look in flight, and restore back out a committed get. None for any other
    record."""
    if lookup(record).role is not Role.OUTCOME or not relevant(record, structure):
        return None
    if current_incarnation(record, structure, base):
        return None
    return restrict(record, structure)


def copy_holder(record: Record) -> str:
    """The UOW a copy record (a relog pass's RELOG) shows holding its entry; "" for none, or another record.
    Applied to the records prepare_record keeps: the UOWs named are those whose older outcome records count
    (older_outcome)."""
    if not lookup(record).copy:
        return ""
    return str((record.get("e") or {}).get("u") or "")


def revived(older: Mapping[str, list[T]], holders: Collection[str]) -> dict[str, list[T]]:
    """The older outcome records (older_outcome, by UOW) that count: those of the UOWs a copy of this
    incarnation shows holding an entry (copy_holder)."""
    return {u: recs for u, recs in older.items() if u in holders}


def restore_lrsn_above(max_lrsn: int, base: Base = Base()) -> int:
    """The restore's own LRSN, which is also the new generation: above every LRSN read, above the base's
    generation (generations only grow, even when no record was read) and above every LRSN the base records (its
    replay start: else work logged on the restored structure, at LRSNs from here on, lies below the replay of the
    next restore from the same base and is skipped; and a restore point sorts after its base), and not below the
    wall clock (µs)."""
    return max(max_lrsn + 1, base.gen + 1, base.lrsn + 1, time.time_ns() // 1000)


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
