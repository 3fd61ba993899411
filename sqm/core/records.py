"""Every kind of log record, registered in one table, KINDS (like PostgreSQL's resource managers, rmgrlist.h).

A row names a kind's fields (a TypedDict), its constructor, whether it is forced (write-ahead: it decides an
outcome), its role for restore, the UOW state it leaves for restart, the properties restore's fold needs, how the
log printer describes it, and how to read the entries, queues and structure it is about. The rest of the house asks
the table rather than spelling kind codes, so adding a kind is its TypedDict, its constructor, one row here and
one row in docs/log-format.md's "Record kinds" catalogue (tests/sqm/test_records.py fails until all are there).

Records are msgpack maps with short keys (the on-disk format; old logs must keep reading, so never rename one):

  k kind   l LRSN   u UOW id   s structure   g structure generation   ss {structure: generation}
  e entry descriptor (cfemu.entry wire form)   d data
  i entry id   q queue   x XA transaction id   dd [[structure, descriptor, data], ...]   r reason
  o outcome 'C' | 'B'   of member whose UOW a recovery record decides   by who decided
  (m is not a record field: the merged log adds it, naming the log a record came from)   ids entry ids
  uows {uow: {st, ss, x, dl, rl, p}} (checkpoint: sqm.core.uow.UnitOfWork.snapshot)   n activity count   why reason
  at the LRSN at which a decision counts (COMMIT / BACKOUT re-logs, RECOVERY): see counts_at()
  rl {structure: relog pass} (checkpoint: the last complete relog pass of each structure, docs/log-management.md)
  b backup id   rf replay from (LRSN)   fl recovery floor (LRSN)   el end LRSN (a backup's, BACKUP)
  bk {structure: {b, l, rf}} (checkpoint: the last BACKUP record of each structure, carried forward)
  c 1: a PUT of a put committed in one CF operation (logged before the CF call, with its COMMIT: restart and
    peer recovery redo the put from the record when the UOW has no END); members do not write it
    (docs/cf-layout.md, "put_committed.lua is not used by members"), logs that hold it are recovered
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NoReturn, TypedDict, cast

Record = dict[str, Any]
Carried = list[Any]  # [structure, descriptor (wire form), data]: a backed-out get's entry, carried in "dd"

# UOW states (MQ's, DESIGN-NOTES section 6): in-flight, in-doubt, in-commit, in-backout, complete.
INFLIGHT, INDOUBT, INCOMMIT, INBACKOUT, DONE = "INFLIGHT", "INDOUBT", "INCOMMIT", "INBACKOUT", "DONE"

# The outcome an OUTCOME record decides for its UOW. A RECOVERY record's "o" holds C or B; D (in doubt, a
# PREPARE) is never written, only decided.
OUTCOME_COMMIT: Final = "C"
OUTCOME_BACKOUT: Final = "B"
OUTCOME_INDOUBT: Final = "D"

# restore's fold orders the events at one LRSN by rank (RecordKind.fold_rank): puts, then gets, then UOW outcomes,
# then expiry. The fold applies a UOW's outcome (decided from all its records), not a record: this is its rank.
OUTCOME_RANK = 2


class Role(enum.Enum):
    """What a kind is to restore (and to the printers, which show the outcomes of the UOWs a message went through)."""

    ENTRY = "entry"  # an event on entries of one structure: restore folds it into each entry it names
    OUTCOME = "outcome"  # decides a UOW's outcome, or leaves it in doubt: restore groups it by UOW
    END = "end"  # the UOW's outcome is applied on the CF: a committed UOW without one may still be completing
    NONE = "none"  # nothing for restore (a checkpoint; a kind this version does not know)


# --- the fields of each kind ----------------------------------------------------------------------------------
class Logged(TypedDict):
    """What every record has besides its kind "k": its LRSN."""

    l: int  # noqa: E741  (the on-disk key)


class CarriesData(TypedDict, total=False):
    """Only while a backup runs, and only when the UOW got persistent messages: their entries (the patent's
    exception: the backup cannot see a backed-out get's entry come back). total=False, as NotRequired is not
    seen at runtime under `from __future__ import annotations` on Python 3.11."""

    dd: list[Carried]


class CountsAt(TypedDict, total=False):
    """The LRSN at which the decision counts, when it is not the record's own `l`: a re-log after the CF refused
    the first record (below a backup's recovery floor, or a backup running) counts at the first one; a RECOVERY
    record that completes the owner's own decision counts at the owner's record. The CF stamps the entries with
    it and restore places the outcome there: the one rule of counts_at(), written in docs/log-format.md."""

    at: int


class RedoneFromLog(TypedDict, total=False):
    """1 on the PUT of a put committed in one CF operation (put_committed.lua): logged first, with its COMMIT, so
    the CF may never have seen it; a UOW found without its END has the put redone from this record."""

    c: int


class PutRecord(Logged, RedoneFromLog):
    k: Literal["PUT"]
    u: str
    s: str
    g: int
    e: dict[str, Any]
    d: bytes


class GetRecord(Logged):
    k: Literal["GET"]
    u: str
    s: str
    g: int
    i: str
    q: str


class PrepareRecord(Logged):
    k: Literal["PREPARE"]
    u: str
    x: str
    ss: dict[str, int]


class CommitRecord(Logged, CountsAt):
    k: Literal["COMMIT"]
    u: str
    ss: dict[str, int]


class BackoutRecord(Logged, CarriesData, CountsAt):
    k: Literal["BACKOUT"]
    u: str
    ss: dict[str, int]
    r: str


class RecoveryRecord(Logged, CarriesData, CountsAt):
    k: Literal["RECOVERY"]
    u: str
    ss: dict[str, int]
    o: Literal["C", "B"]
    of: str
    by: str


class EndRecord(Logged):
    k: Literal["END"]
    u: str


class ExpireRecord(Logged):
    k: Literal["EXPIRE"]
    s: str
    ids: list[str]


class RelogRecord(Logged):
    """A copy of one entry as the CF held it, written by a relog pass (selective relogging: docs/log-management.md)."""

    k: Literal["RELOG"]
    s: str
    g: int
    e: dict[str, Any]
    d: bytes


class RelogPasses(TypedDict, total=False):
    """The last complete relog pass of each structure the member relogged: {structure: {cpl, gen, w, b, e,
    held}} (sqm.core.relog.Pass.as_record): restore starts from the logs alone at the newest one's window `w`."""

    rl: dict[str, dict[str, Any]]


class BackupsNoted(TypedDict, total=False):
    """The last BACKUP record of each structure in the member's log, {structure: {b, l, rf}}, carried forward in
    every checkpoint: restart reads from the last checkpoint on, and still knows the newest backup (and does not
    note it again)."""

    bk: dict[str, dict[str, Any]]


class CheckpointRecord(Logged, RelogPasses, BackupsNoted):
    k: Literal["CHECKPOINT"]
    uows: dict[str, dict[str, Any]]
    n: int
    why: str


class BackupRecord(Logged):
    """A backup of a structure completed (BACKUP CFSTRUCT): its id, the structure's generation, and its log
    positions: CF recovery from it replays the members' logs from `rf` on (the recovery floor `fl` and the end
    `el` of the backup's LRSN range). The member notes it in its own log when it learns of it (sqm.core.backupnote)."""

    k: Literal["BACKUP"]
    s: str
    b: str
    g: int
    rf: int
    fl: int
    el: int


# --- constructors: the only place records are written as maps --------------------------------------------------
def _record(fields: Mapping[str, Any]) -> Record:
    """A kind's TypedDict as the plain dict the log and its readers take (to mypy a TypedDict is no dict[str, Any]);
    no copy. The TypedDict annotation in each constructor is what keeps it in step with its kind's fields."""
    return cast(Record, fields)


def put(uow: str, lrsn: int, *, structure: str, gen: int, entry: dict[str, Any], data: bytes,
        redo: bool = False) -> Record:
    """A persistent put in a UOW, logged after the CF took it, at the LRSN the CF returned; or (redo) a put committed
    in one CF operation, logged before it with the member's LRSN (RedoneFromLog)."""
    rec: PutRecord = {"k": "PUT", "l": lrsn, "u": uow, "s": structure, "g": gen, "e": entry, "d": data}
    if redo:
        rec["c"] = 1
    return _record(rec)


def get(uow: str, lrsn: int, *, structure: str, gen: int, entry_id: str, queue: str) -> Record:
    """A persistent get in a UOW, logged after the CF took it, at the entry's LRSN the CF returned."""
    rec: GetRecord = {"k": "GET", "l": lrsn, "u": uow, "s": structure, "g": gen, "i": entry_id, "q": queue}
    return _record(rec)


def prepare(uow: str, lrsn: int, ss: Mapping[str, int], *, xid: str) -> Record:
    """Two-phase commit, phase one: the UOW is in doubt until its coordinator resolves it."""
    rec: PrepareRecord = {"k": "PREPARE", "l": lrsn, "u": uow, "x": xid, "ss": dict(ss)}
    return _record(rec)


def commit(uow: str, lrsn: int, ss: Mapping[str, int], *, at: int = 0) -> Record:
    """The owner commits its UOW on the structures in ss (structure -> generation). at: a re-log of a commit
    the CF refused counts at the first record's LRSN (CountsAt)."""
    rec: CommitRecord = {"k": "COMMIT", "l": lrsn, "u": uow, "ss": dict(ss)}
    if at and at != lrsn:
        rec["at"] = at
    return _record(rec)


def backout(uow: str, lrsn: int, ss: Mapping[str, int], *, reason: str = "application",
            data: Sequence[Carried] = (), at: int = 0) -> Record:
    """The owner backs its UOW out. data: its persistent gets' entries, while a backup runs (CarriesData); at as
    in commit()."""
    rec: BackoutRecord = {"k": "BACKOUT", "l": lrsn, "u": uow, "ss": dict(ss), "r": reason}
    if data:
        rec["dd"] = list(data)
    if at and at != lrsn:
        rec["at"] = at
    return _record(rec)


def recovery(uow: str, lrsn: int, ss: Mapping[str, int], *, commit: bool, of: str, by: str,
             data: Sequence[Carried] = (), at: int = 0) -> Record:
    """Peer recovery (by a member) or restore (by "restore") decides another member's UOW; it outranks the
    owner's own records. data as in backout(). at: where the outcome counts, always written (CountsAt): the
    owner's own record of the same decision when the recovery completes it, else this record's LRSN."""
    rec: RecoveryRecord = {"k": "RECOVERY", "l": lrsn, "u": uow, "ss": dict(ss),
                           "o": OUTCOME_COMMIT if commit else OUTCOME_BACKOUT, "of": of, "by": by,
                           "at": at or lrsn}
    if data:
        rec["dd"] = list(data)
    return _record(rec)


def counts_at(record: Record) -> int:
    """The LRSN at which a decision record's outcome counts: its `at` when it has one, else its own LRSN. The CF
    stamps the UOW's entries with it (commit.lua, backout.lua) and restore places the outcome there
    (restore.settle.decide_outcome): one rule, docs/log-format.md "When an outcome counts"."""
    return int(record.get("at") or record["l"])


def end(uow: str, lrsn: int) -> Record:
    """The UOW's outcome is applied on every structure it touched."""
    rec: EndRecord = {"k": "END", "l": lrsn, "u": uow}
    return _record(rec)


def expire(lrsn: int, *, structure: str, ids: list[str]) -> Record:
    """The expiry task took these expired persistent messages off a structure."""
    rec: ExpireRecord = {"k": "EXPIRE", "l": lrsn, "s": structure, "ids": ids}
    return _record(rec)


def checkpoint(lrsn: int, *, uows: dict[str, dict[str, Any]], n: int, why: str,
               passes: Mapping[str, dict[str, Any]] | None = None,
               backups: Mapping[str, dict[str, Any]] | None = None) -> Record:
    """The active UOW table (snapshots), so that restart reads the log from here on; n: records since the last.
    passes: the last complete relog pass of each structure this member relogged (RelogPasses); backups: the last
    BACKUP record of each structure in this log (BackupsNoted)."""
    rec: CheckpointRecord = {"k": "CHECKPOINT", "l": lrsn, "uows": uows, "n": n, "why": why}
    if passes:
        rec["rl"] = dict(passes)
    if backups:
        rec["bk"] = dict(backups)
    return _record(rec)


def backup(lrsn: int, *, structure: str, backup_id: str, gen: int, replay_from: int, floor: int,
           end: int) -> Record:
    """A completed backup of a structure and its log positions (BackupRecord)."""
    rec: BackupRecord = {"k": "BACKUP", "l": lrsn, "s": structure, "b": backup_id, "g": gen, "rf": replay_from,
                         "fl": floor, "el": end}
    return _record(rec)


def relog(lrsn: int, *, structure: str, gen: int, entry: dict[str, Any], data: bytes) -> Record:
    """A relog pass's copy of one entry: its descriptor as the CF held it (state, UOW, LRSN and order included)
    and its data. Restore's fold takes it as a copy, as it takes a backup's (RecordKind.copy)."""
    rec: RelogRecord = {"k": "RELOG", "l": lrsn, "s": structure, "g": gen, "e": entry, "d": data}
    return _record(rec)


# --- what a record is about (the defaults read the carried data of a backout or recovery record) --------------
def _carried_descriptors(r: Record) -> list[dict[str, Any]]:
    return [d[1] for d in r.get("dd", ())]


def _carried_ids(r: Record) -> list[str]:
    return [d[1]["id"] for d in r.get("dd", ())]


def _carried_queues(r: Record) -> list[str]:
    return [d[1]["q"] for d in r.get("dd", ())]


def _no_structure(r: Record) -> str | None:
    return None


def _on_structure(r: Record) -> str | None:
    return cast(str, r["s"])


def _put_desc(r: Record) -> str:
    e = r["e"]
    return (f"put {e['id']} on {r['s']}/{e['q']} prio {e['p']} {len(r.get('d', b''))}B"
            + (f" uow {r['u']}" if r.get("u") else "") + (" (committed in one CF operation)" if r.get("c") else ""))


def _data_note(r: Record) -> str:
    return f", carries data of {len(r['dd'])} gets" if r.get("dd") else ""


def _at_note(r: Record) -> str:
    """Where a decision counts, when not at its own LRSN (a re-log, a peer completing the owner's decision)."""
    return f", counts at {r['at']}" if r.get("at") and r["at"] != r["l"] else ""


def _recovery_decides(r: Record) -> str:
    return OUTCOME_COMMIT if r["o"] == OUTCOME_COMMIT else OUTCOME_BACKOUT


def _unknown(r: Record, *args: Any, **kwargs: Any) -> NoReturn:
    raise UnknownRecordError(f"unknown log record kind {r.get('k')!r} at LRSN {r.get('l')}")


@dataclass(frozen=True)
class RecordKind:
    """One row of the registry: what the house needs to know about a kind of record."""

    code: str
    fields: type  # the kind's TypedDict
    build: Callable[..., Record]  # its constructor
    forced: bool  # QueueManager.append forces it to disk before the operation goes on (write-ahead)
    role: Role
    uow_state: str | None  # the UOW state it leaves for restart (uow.rebuild_table); None: it names none
    describe: Callable[[Record], str]  # the log printer's line
    # OUTCOME kinds: the outcome the record decides (OUTCOME_COMMIT, _BACKOUT or _INDOUBT); None for the others.
    decides: Callable[[Record], str] | None = None
    # A peer or restore decided it for another member: it outranks the owner's own outcome records.
    outranks_owner: bool = False
    # It may carry the data of its UOW's backed-out gets ("dd"): the entries it gives back are its entry_ids.
    carries_data: bool = False
    # ENTRY kinds: restore's fold ranks their events at one LRSN by this (and a UOW's outcome by OUTCOME_RANK).
    fold_rank: int | None = None
    entry_ids: Callable[[Record], list[str]] = _carried_ids  # the entries it is about
    descriptors: Callable[[Record], list[dict[str, Any]]] = _carried_descriptors  # the entry descriptors it holds
    queues: Callable[[Record], list[str]] = _carried_queues  # the queues of those entries
    structure: Callable[[Record], str | None] = _no_structure  # ENTRY kinds: the structure the event is on
    # ENTRY kinds that are a copy of an entry (a RELOG), not an event: the fold takes them as it takes a backup's
    # copies (the best one is its starting state; the redo rule does the rest).
    copy: bool = False


# Columns: code, fields, constructor, forced, role, UOW state for restart, describe; then what is not a default.
# ENTRY kinds say what they are about; the defaults read the entries an OUTCOME record carries (none, mostly).
KINDS: dict[str, RecordKind] = {k.code: k for k in [
    RecordKind("PUT", PutRecord, put, False, Role.ENTRY, INFLIGHT, _put_desc, fold_rank=0,
               entry_ids=lambda r: [r["e"]["id"]], descriptors=lambda r: [r["e"]],
               queues=lambda r: [r["e"]["q"]], structure=_on_structure),
    RecordKind("GET", GetRecord, get, False, Role.ENTRY, INFLIGHT,
               lambda r: f"get {r['i']} from {r['s']}/{r['q']} uow {r['u']}", fold_rank=1,
               entry_ids=lambda r: [r["i"]], descriptors=lambda r: [], queues=lambda r: [r["q"]],
               structure=_on_structure),
    RecordKind("PREPARE", PrepareRecord, prepare, True, Role.OUTCOME, INDOUBT,
               lambda r: f"prepare uow {r['u']} xid {r.get('x', '')} (in doubt)",
               decides=lambda r: OUTCOME_INDOUBT),
    RecordKind("COMMIT", CommitRecord, commit, True, Role.OUTCOME, INCOMMIT,
               lambda r: f"commit uow {r['u']} on {', '.join(r.get('ss', {})) or '-'}{_at_note(r)}",
               decides=lambda r: OUTCOME_COMMIT),
    RecordKind("BACKOUT", BackoutRecord, backout, True, Role.OUTCOME, INBACKOUT,
               lambda r: f"backout uow {r['u']} ({r.get('r', 'application')}){_data_note(r)}{_at_note(r)}",
               decides=lambda r: OUTCOME_BACKOUT, carries_data=True),
    RecordKind("RECOVERY", RecoveryRecord, recovery, True, Role.OUTCOME, None,
               lambda r: (f"{'commit' if r['o'] == OUTCOME_COMMIT else 'backout'} of {r['of']}'s uow {r['u']} "
                          f"decided by {r['by']}{_data_note(r)}{_at_note(r)}"),
               decides=_recovery_decides, outranks_owner=True, carries_data=True),
    RecordKind("END", EndRecord, end, False, Role.END, DONE, lambda r: f"uow {r['u']} complete on the CF"),
    RecordKind("EXPIRE", ExpireRecord, expire, False, Role.ENTRY, None,
               lambda r: f"expired {len(r['ids'])} messages on {r['s']}", fold_rank=3,
               entry_ids=lambda r: list(r["ids"]), descriptors=lambda r: [], queues=lambda r: [],
               structure=_on_structure),
    RecordKind("CHECKPOINT", CheckpointRecord, checkpoint, True, Role.NONE, None,
               lambda r: f"checkpoint: {len(r.get('uows', {}))} active UOWs, activity {r.get('n', 0)}"
                         + (f" ({r['why']})" if r.get("why") else "")
                         + "".join(f", relog window of {s} from {p['w']}" for s, p in sorted(r.get("rl", {}).items()))
                         + "".join(f", last backup of {s} {b['b']} replays from {b['rf']}"
                                   for s, b in sorted(r.get("bk", {}).items()))),
    RecordKind("BACKUP", BackupRecord, backup, True, Role.NONE, None,
               lambda r: (f"backup {r['b']} of {r['s']} (generation {r['g']}) completed: CF recovery from it replays "
                          f"the logs from LRSN {r['rf']} (floor {r['fl']}, backup ends at LRSN {r['el']})")),
    RecordKind("RELOG", RelogRecord, relog, False, Role.ENTRY, None,
               lambda r: (f"relog {r['e']['id']} on {r['s']}/{r['e']['q']} ({r['e'].get('st', '')}"
                          + (f" uow {r['e']['u']}" if r['e'].get('u') else "") + f") {len(r.get('d', b''))}B"),
               entry_ids=lambda r: [r["e"]["id"]], descriptors=lambda r: [r["e"]],
               queues=lambda r: [r["e"]["q"]], structure=_on_structure, copy=True),
]}


class _ForeignRecord(Logged):
    k: str


# A kind this version does not know (a newer writer's): readers that pass over records they do not need (restore,
# the printers' filters, the archive) see it through lookup() as this; restart, which must not, asks kind_of().
FOREIGN = RecordKind("?", _ForeignRecord, _unknown, False, Role.NONE, None, _unknown)


class UnknownRecordError(ValueError):
    pass


def kind_of(record: Record) -> RecordKind:
    """The record's kind; UnknownRecordError for a kind this version does not know."""
    kind = KINDS.get(record.get("k", ""))  # a record without "k" is of an unknown kind too
    if kind is None:
        _unknown(record)
    return kind


def lookup(record: Record) -> RecordKind:
    """The record's kind, or FOREIGN for a kind this version does not know."""
    return KINDS.get(record["k"], FOREIGN)


def codes(*roles: Role) -> tuple[str, ...]:
    """The codes of the kinds with these roles (for filters pushed down to Parquet and Spark)."""
    return tuple(code for code, kind in KINDS.items() if kind.role in roles)


def describe(record: Record) -> str:
    return kind_of(record).describe(record)


def entry_ids(record: Record) -> list[str]:
    """The entries a record is about (for filters and for restore's grouping by entry)."""
    return lookup(record).entry_ids(record)


def queues_of(record: Record) -> list[str]:
    """The queues of the entries a record is about."""
    return lookup(record).queues(record)
