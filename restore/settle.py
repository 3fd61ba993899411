"""The fold that settles one message's final disposition: the same code in every restore engine.

Inputs, for one entry id: its copy in the backup (if any), the log records that name it (PUT, GET, EXPIRE, and
BACKOUT / RECOVERY records that carry its data), and the outcome of every UOW those name. The fold applies the
events in LRSN order under the redo rule: an event applies only if its LRSN is above the entry's current `l`
(the LRSN of the last transition the copy reflects), which makes replay idempotent and lets the replay start
early. See docs/architecture.md, "Restore".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqm.conversations.uowstatus import is_control_queue, restore_control_entry
from sqm.core.records import (
    OUTCOME_BACKOUT,
    OUTCOME_COMMIT,
    OUTCOME_INDOUBT,
    OUTCOME_RANK,
    Record,
    RecordKind,
    Role,
    counts_at,
    lookup,
)

# An Outcome's kind: the outcome letters of sqm.core.records.
COMMIT, BACKOUT, INDOUBT = OUTCOME_COMMIT, OUTCOME_BACKOUT, OUTCOME_INDOUBT

# Final dispositions, one per message, as the restore report counts them.
RESTORED = "restored"  # available (committed put), loaded
HELD_INDOUBT = "in-doubt"  # held by an in-doubt UOW, loaded and locked
CONSUMED = "consumed"  # deleted by a committed get
PUT_BACKED_OUT = "put-backed-out"  # its put was backed out (or in flight at the failure)
EXPIRED = "expired"
GONE = "gone"  # named by the log, but gone before the replay range (nothing to restore)
STATUS_DROPPED = "status-dropped"  # a UOW's status that the restart tables do not keep (sqm.conversations.uowstatus.after_restart)

_OUTCOME = "OUTCOME"  # the fold's event kind for a UOW's outcome (the other events are records, by their kind)


@dataclass(frozen=True)
class Outcome:
    kind: str  # COMMIT, BACKOUT or INDOUBT
    lrsn: int  # where it counts (sqm.core.records.counts_at of the record that decided it)
    decided_by: str = ""  # the member whose record decided it (for INDOUBT: the owner that prepared), or restore
    data: Mapping[str, tuple[str, dict[str, Any], bytes]] = field(default_factory=dict)  # entry id -> copy
    structures: tuple[str, ...] = ()  # every structure its records name (ss)


@dataclass
class Settled:
    id: str
    disposition: str
    structure: str = ""
    entry: dict[str, Any] | None = None  # final descriptor (wire form) when the message is loaded
    data: bytes = b""


def decide_outcome(records: Iterable[Record]) -> Outcome | None:
    """A UOW's outcome from its COMMIT / BACKOUT / PREPARE / RECOVERY records (any order), and where it counts.

    A RECOVERY record (peer recovery or restore decided it) outranks the owner's own records: the owner may have
    written a COMMIT after the decision, which the CF then refused. Otherwise the owner's last record decides
    (a COMMIT followed by a BACKOUT is a commit the CF refused); a last PREPARE leaves the UOW in doubt.

    Where it counts is one rule, shared with the CF (docs/log-format.md, "When an outcome counts"): at
    sqm.core.records.counts_at of the first record of the decision. Records of one decision in a row are re-logs of it
    (the CF refused the first: below a backup's floor, or a backup running), and say in `at` where the first one
    counts; a RECOVERY record that completes the owner's own COMMIT or BACKOUT counts at the owner's record (the
    owner may have applied it on the CF before it failed, and other UOWs may have got, and consumed, the entries
    since: placing it later would bring consumed messages back, chaos seed 2). The CF stamps the entries with the
    same LRSN, so get order is the same on the live CF and after a restore. Records written before `at` existed
    are read as they always were: the owner's earlier record of the same decision, else the record's own LRSN.
    """
    recs = list(records)
    structures = tuple(sorted({s for r in recs for s in r.get("ss", {})}))
    decided = sorted((r for r in recs if lookup(r).outranks_owner), key=lambda r: (r["l"], r["by"]))
    if decided:
        r = decided[0]
        kind = _decision(r)
        relogs = [d for d in decided if _decision(d) == kind]
        own = sorted((o for o in recs if _owners_decision(o) == kind and o["l"] < r["l"]), key=lambda o: o["l"])
        carried: dict[str, tuple[str, dict[str, Any], bytes]] = {}
        for x in (*relogs[::-1], *own[::-1]):
            carried.update(_carried(x))
        if any("at" in d for d in relogs):
            lrsn = min(counts_at(d) for d in relogs)
        else:  # written before `at`: the owner's first record of the same decision, if any
            lrsn = own[0]["l"] if own else r["l"]
        return Outcome(kind, lrsn, r["by"], carried, structures)
    own = sorted((r for r in recs if _owners_decision(r) is not None), key=lambda r: r["l"])
    if not own:
        return None
    r = own[-1]
    kind = _decision(r)
    run = [r]
    for earlier in reversed(own[:-1]):
        if earlier["k"] != r["k"]:
            break
        run.append(earlier)
    carried = {}
    for x in reversed(run):
        carried.update(_carried(x))
    return Outcome(kind, min(counts_at(x) for x in run), r.get("m", ""), carried, structures)


def _decision(r: Record) -> str:
    """The outcome an OUTCOME record decides (COMMIT, BACKOUT or INDOUBT)."""
    decides = lookup(r).decides
    assert decides is not None, r["k"]
    return decides(r)


def _owners_decision(r: Record) -> str | None:
    """The outcome the owner's own record decides (a commit, backout or prepare); None for any other record."""
    kind = lookup(r)
    return None if kind.decides is None or kind.outranks_owner else kind.decides(r)


def _carried(r: Record) -> dict[str, tuple[str, dict[str, Any], bytes]]:
    return {d[1]["id"]: (d[0], d[1], d[2]) for d in r.get("dd", ())}


def best_copy(copies: Iterable[tuple[str, dict[str, Any], bytes]]) -> tuple[str, dict[str, Any], bytes] | None:
    """A backup may copy an entry twice (steps 1 and 4): keep the copy of the later transition."""
    best = None
    for c in copies:
        if best is None or c[1]["l"] > best[1]["l"]:
            best = c
    return best


def with_logged_copies(backup: tuple[str, dict[str, Any], bytes] | None,
                       records: Iterable[Record]) -> tuple[str, dict[str, Any], bytes] | None:
    """The entry's best copy: the backup's, or a copy a relog pass logged (a kind whose row says `copy`: RELOG),
    whichever reflects the later transition (best_copy). A RELOG is a copy, not an event: read twice, from an
    incomplete pass, or older than the backup's copy, it changes nothing the redo rule would not
    (docs/log-management.md)."""
    logged = [(r["s"], r["e"], r.get("d", b"")) for r in records if lookup(r).copy]
    if not logged:
        return backup
    return best_copy([*([backup] if backup is not None else []), *logged])


def _holds_entries(kind: RecordKind) -> bool:
    """A put or get holds an entry in its UOW; a backout carrying an entry's data gives it back with its outcome."""
    return kind.role is Role.ENTRY or kind.carries_data


def uows_named(backup: tuple[str, dict[str, Any], bytes] | None, records: Iterable[Record]) -> set[str]:
    """The UOWs whose outcome the fold of one entry needs: those that put or got it (an event on it), and those
    whose backout carries its data (their outcome gives it back); and the UOW the best copy shows holding it (a
    backup's, or a relog's: with_logged_copies)."""
    records = records if isinstance(records, list) else list(records)
    out: set[str] = set()
    logged = False
    for r in records:  # one pass, one lookup a record: restore folds a million entries
        rk = lookup(r)
        logged = logged or rk.copy
        u = r.get("u")
        if u and _holds_entries(rk):
            out.add(u)
    if logged:
        backup = with_logged_copies(backup, records)
    if backup is not None and backup[1].get("u"):
        out.add(backup[1]["u"])
    return out


def _committed_put(backup: tuple[str, dict[str, Any], bytes] | None, recs: list[Record],
                   outcomes: Mapping[str, Outcome]) -> tuple[str, dict[str, Any], bytes] | None:
    """The commonest history, folded in one step: no copy, one PUT, and its UOW's COMMIT counted after it. The
    event loop below gives the same (the PUT makes the entry UP at its LRSN, the outcome commits it: CP at the
    outcome's LRSN, first in FIFO order there, put order kept); None for any other history."""
    if backup is not None or len(recs) != 1:
        return None
    r = recs[0]
    if r["k"] != "PUT":
        return None
    o = outcomes.get(r["u"])
    if o is None or o.kind != COMMIT or o.lrsn <= r["l"]:
        return None
    state = dict(r["e"])
    state.update(st="CP", u="", l=o.lrsn, o1=o.lrsn, o2=r["l"])
    return r["s"], state, r["d"]


def settle(entry_id: str, backup: tuple[str, dict[str, Any], bytes] | None, records: Iterable[Record],
           outcomes: Mapping[str, Outcome], now_ms: int) -> Settled:
    """Fold one entry's history into its final state. `outcomes` must hold a decision for every UOW the entry's
    history names (restore decides undecided, in-flight UOWs as backed out before folding)."""
    recs = records if isinstance(records, list) else list(records)
    events: list[tuple[int, int, str, Any]] = []
    quick = _committed_put(backup, recs, outcomes)
    if quick is not None:
        return _final(entry_id, *quick, now_ms)
    if recs or (backup is not None and backup[1].get("u")):  # else: untouched since its copy, held by no UOW
        kinds = [lookup(r) for r in recs]
        if any(rk.copy for rk in kinds):
            backup = with_logged_copies(backup, recs)
        named: set[str] = set()
        # Where a UOW's outcome counts for this entry: never at or below the UOW's own operations on it (`top`). A
        # decision always sorts after them as written today (a peer adopts the failed member's highest LRSN first,
        # an owner's clock has seen the CF's answer to each operation), but a RECOVERY record written by a peer
        # whose clock lagged could lie below them in logs written before that rule (docs/log-format.md, "When an
        # outcome counts"): the fold then met the outcome before the put or get, skipped it, and left the entries
        # locked for good by a UOW that was decided. Defensive, so such logs restore too.
        top: dict[str, int] = {}  # UOW -> the highest LRSN of its own operations on the entry
        for r, rk in zip(recs, kinds, strict=True):
            u = r.get("u")
            if rk.role is Role.ENTRY and not rk.copy:
                assert rk.fold_rank is not None, rk.code
                events.append((r["l"], rk.fold_rank, rk.code, r))
                if u:
                    top[u] = max(top.get(u, 0), r["l"])
            if u and _holds_entries(rk):
                named.add(u)
        held_by = backup[1].get("u") if backup is not None else None
        if held_by:
            named.add(held_by)
            top[held_by] = max(top.get(held_by, 0), int(backup[1]["l"]))  # type: ignore[index]
        for u in named:
            o = outcomes.get(u)
            if o is not None and o.kind != INDOUBT:
                t = top.get(u, 0)
                events.append((o.lrsn if o.lrsn > t else t + 1, OUTCOME_RANK, _OUTCOME, (u, o)))
        events.sort(key=lambda e: (e[0], e[1]))

    structure = backup[0] if backup else ""
    state: dict[str, Any] | None = dict(backup[1]) if backup else None
    data: bytes = backup[2] if backup else b""
    fate = GONE
    if state is not None and state.get("st") == "EX":
        return Settled(entry_id, EXPIRED)

    for lrsn, _, kind, payload in events:
        if state is not None and lrsn <= state["l"]:
            continue  # the redo rule: the copy already reflects this transition
        if kind == _OUTCOME:
            uow, o = payload
            copy = o.data.get(entry_id) if o.kind == BACKOUT else None
            if copy is not None and (state is None or int(copy[1]["l"]) > int(state["l"])):
                # A backout carrying the entry as its get held it, newer than what the fold holds: the patent's
                # exception (a get backed out while a backup ran), or a recovery's backout of a get whose GET
                # record died with its member (sqm.core.manager.complete). The get is taken from the copy, so the
                # backout below raises the count the CF raised.
                structure, state, data = copy[0], dict(copy[1]), copy[2]
            if state is None:
                continue
            if state.get("u") != uow or state["st"] not in ("UP", "UG"):
                continue
            if o.kind == COMMIT:
                if state["st"] == "UP":
                    state.update(st="CP", u="", l=lrsn, o1=lrsn)
                else:
                    state, fate = None, CONSUMED
            elif state["st"] == "UP":
                state, fate = None, PUT_BACKED_OUT
            else:
                state.update(st="CP", u="", l=lrsn, bc=int(state.get("bc", 0)) + 1)
        # The redo step of each ENTRY kind (sqm.core.records.Role): a new one needs its step here.
        elif kind == "PUT":
            if state is None:
                structure, state, data = payload["s"], dict(payload["e"]), payload["d"]
                state.update(st="UP", u=payload["u"], l=lrsn, o1=0, o2=lrsn)
        elif kind == "GET":
            if state is not None and state["st"] == "CP":
                state.update(st="UG", u=payload["u"], l=lrsn)
        elif kind == "EXPIRE":
            if state is not None and state["st"] == "CP":
                state, fate = None, EXPIRED
        else:
            raise ValueError(f"restore's fold has no redo step for {kind} records")

    if state is None:
        return Settled(entry_id, fate)
    return _final(entry_id, structure, state, data, now_ms)


def _final(entry_id: str, structure: str, state: dict[str, Any], data: bytes, now_ms: int) -> Settled:
    """What a folded entry that still exists becomes: held in doubt, expired, a UOW status by the restart tables,
    or restored."""
    if state["st"] in ("UP", "UG"):
        return Settled(entry_id, HELD_INDOUBT, structure, state, data)
    if 0 < int(state.get("exp", 0)) <= now_ms:
        return Settled(entry_id, EXPIRED)
    if is_control_queue(str(state.get("q", ""))):  # a UOW's status: EntireX's UOW restart tables (sqm.conversations.uowstatus)
        kept = restore_control_entry(state, data)
        if kept is None:
            return Settled(entry_id, STATUS_DROPPED)
        state, data = kept
    return Settled(entry_id, RESTORED, structure, state, data)


def fifo_key(entry: Mapping[str, Any]) -> tuple[int, int, int]:
    """Get order within a queue: priority (highest first), then commit order, then put order."""
    return (-int(entry.get("p", 0)), int(entry.get("o1", 0)), int(entry.get("o2", 0)))


def load_key(entry_id: str, entry: Mapping[str, Any]) -> tuple[str, int, int, int, int, str]:
    """Where a loaded entry goes in the CF: grouped by the list it goes on, each list in the CF's order: committed
    puts by priority then FIFO (fifo_key), uncommitted puts in put order, uncommitted gets in get order. Unique
    (the id is last), and of the same types at every position, so that keys compare as plain tuples (or lists)."""
    if entry["st"] == "CP":
        return (entry["q"], 0, *fifo_key(entry), entry_id)
    if entry["st"] == "UP":
        return (entry["q"], 1, int(entry.get("o2", 0)), 0, 0, entry_id)
    return (entry["q"], 2, int(entry["l"]), 0, 0, entry_id)
