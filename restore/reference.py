"""The specification every engine is tested against; not used in production.

Restore's engines (the local engine's partitioned plan, restore.partitioned; the Spark engine,
restore.engine_spark) compute a plan in bounded memory, in pieces and in other processes. The functions here do
the same in the plainest way, everything in memory at once, with the same per-record stage and the same fold
(restore.plan, restore.settle): the tests compare every engine's plan, its order of loading and its reading of
the logs with them (tests/restore/test_partitioned.py, tests/restore/test_engine_spark.py,
tests/restore/test_log_slices.py; the backup's model check, tests/backup/test_model.py, restores with plan_local).

- plan_local: a restore plan from a backup's copies and the merged log, in memory.
- read_logs: the merged log of every member, in memory, ordered by (LRSN, member).
- stream_logs: every record, one log after another, each with its place in the merged log.
- load_order: the loaded entries in the order the CF holds them.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from cfemu.progress import Progress, no_progress
from restore.engine import READ_LOGS
from restore.log_slices import LogSlice
from restore.plan import (
    Copy,
    RestorePlan,
    base_of,
    copy_holder,
    ends_for_its_owner,
    in_flight_outcome,
    older_outcome,
    owner_of,
    prepare_record,
    restore_lrsn_above,
    revived,
    summarize,
)
from restore.settle import Outcome, Settled, best_copy, decide_outcome, load_key, settle, uows_named
from sqm.core.records import Record, Role, entry_ids, lookup
from sqm.log import merged_records, one_log_per_member


def plan_local(structure: str, backup: Iterable[Copy], records: Iterable[Record], *,
               now_ms: int | None = None, gen: int = 0, carried: Iterable[str] = (), lrsn: int = 0,
               registered: Collection[str] = ()) -> RestorePlan:
    """gen: the structure generation the backup was taken in (its manifest's "gen"; 0: unknown); carried: UOWs
    the base names besides its copies' (base_of); lrsn: the highest LRSN its manifest records (base_lrsn; 0:
    unknown); registered: the UOWs its manifest lists ("uows")."""
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    copies: dict[str, list[Copy]] = defaultdict(list)
    max_lrsn = 0
    for c in backup:
        copies[c[1]["id"]].append(c)
        max_lrsn = max(max_lrsn, int(c[1]["l"]))
    base = base_of({"gen": gen, "carried": list(carried), "end_lrsn": lrsn, "uows": registered},
                   (c[1].get("u", "") for cs in copies.values() for c in cs))
    by_entry: dict[str, list[Record]] = defaultdict(list)
    by_uow: dict[str, list[Record]] = defaultdict(list)
    ended: set[str] = set()
    per_member: Counter[str] = Counter()
    older: dict[str, list[Record]] = defaultdict(list)
    holders: set[str] = set()
    for raw in records:
        max_lrsn = max(max_lrsn, int(raw["l"]))
        rec = prepare_record(raw, structure, base)
        if rec is None:
            kept_aside = older_outcome(raw, structure, base)
            if kept_aside is not None:
                older[kept_aside["u"]].append(kept_aside)
            continue
        per_member[rec.get("m", "?")] += 1
        holder = copy_holder(rec)
        if holder:
            holders.add(holder)
        role = lookup(rec).role
        if role is Role.END:
            if ends_for_its_owner(rec["u"], rec.get("m")):
                ended.add(rec["u"])
            continue
        if role is Role.OUTCOME:
            by_uow[rec["u"]].append(rec)
        for eid in entry_ids(rec):
            by_entry[eid].append(rec)

    for uid, recs in revived(older, holders).items():
        by_uow[uid].extend(recs)
    best = {eid: best_copy(cs) for eid, cs in copies.items()}
    outcomes: dict[str, Outcome] = {}
    for uid, recs in by_uow.items():
        o = decide_outcome(recs)
        if o is not None:
            outcomes[uid] = o
    restore_lrsn = restore_lrsn_above(max_lrsn, base)
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


def read_logs(log_dirs: list[Path], replay_from: int, progress: Progress = no_progress) -> list[Record]:
    """The merged log of `log_dirs` from `replay_from` on, ordered by (LRSN, member), each record tagged with
    its member in "m". Progress counts log directories read."""
    per_member: list[list[Record]] = []
    one_log_per_member(log_dirs)
    progress(READ_LOGS, 0, len(log_dirs))
    for i, d in enumerate(log_dirs, 1):
        per_member.append(merged_records([d], min_lrsn=replay_from))
        progress(READ_LOGS, i, len(log_dirs))
    # Each list is already in (LRSN, position) order: a k-way merge keeps that order within a member.
    return list(heapq.merge(*per_member, key=lambda r: (r["l"], r["m"])))


def stream_logs(log_dirs: list[Path], replay_from: int,
                progress: Progress = no_progress) -> Iterator[tuple[tuple[int, str, int, int], Record]]:
    """Every record of `log_dirs` from `replay_from` on, one log after another, each tagged with its member in
    "m" and with its place in the merged log, (LRSN, member, segment, offset): the order read_logs gives, which
    the partitioned plan restores by sorting each partition. Progress counts log directories read."""
    one_log_per_member(log_dirs)
    progress(READ_LOGS, 0, len(log_dirs))
    for i, d in enumerate(log_dirs, 1):
        yield from LogSlice(str(d), None, replay_from).records()
        progress(READ_LOGS, i, len(log_dirs))


def load_order(settled: Iterable[Settled]) -> list[Settled]:
    """Loaded entries grouped by the list they go on, each list in the CF's order (settle.load_key)."""
    return sorted((s for s in settled if s.entry is not None), key=lambda s: load_key(s.id, s.entry or {}))


__all__ = ["load_order", "plan_local", "read_logs", "stream_logs"]
