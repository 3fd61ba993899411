"""Restore planning in bounded memory: the plan of restore.plan, partitioned by entry id through spill files.

restore/reference.py's plan_local holds every copy, record and settled entry in memory at once; this planner holds
one partition at a time, so its memory is set by the number of partitions, not by the size of the backup and the logs
(docs/architecture.md, "Restore in bounded memory"). Three passes, each a sequential read and write of spill files
(restore.spill), then a streamed result:

  1 scan: each backup copy goes to the entry partition of its id; each log record that matters (prepare_record,
    the generation rule) goes to the entry partition of every entry it names, its outcome records and END to
    the UOW partition of its UOW, and a "need" (UOW, entry partition) to the UOW partition for each UOW an entry
    partition will ask about (a grace hash join of entries with their UOWs' outcomes); an outcome record the
    generation rule leaves out goes to its UOW partition aside (plan.older_outcome), with a "held" mark for each
    UOW a relog copy shows holding an entry (plan.copy_holder); the logs are read by the workers while this
    process reads the backup, setting aside what the backup's UOWs may bring back under the generation rule
    (filed once they are known: _file_deferred);
  2 per UOW partition: decide each UOW's outcome (settle.decide_outcome) and send it to the entry partitions that
    need it;
  3 per entry partition: fold each entry (settle.best_copy, uows_named, settle: the one fold every engine uses),
    deciding in-flight UOWs backed out as restore/reference.py's plan_local does; the survivors are written as a run
    sorted in load order (settle.load_key), the others as (id, disposition).

The plan's survivors are then one k-way merge of the sorted runs, in the CF's order, read as the load (and the
restore point) goes. What stays in memory besides one partition is what the report and the load need about UOWs still
open at the failure: those in doubt, in commit, decided by restore (bounded by the work in flight, not by the
history's size). The result equals restore.reference.plan_local's for the same input
(tests/restore/test_partitioned.py, and the engines' differential tests).
"""

from __future__ import annotations

import gc
import heapq
import math
import os
import queue
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any, Generic, TypeVar
from zlib import crc32

from cfemu.bulk import unloadable
from restore.log_slices import LogSlice
from restore.plan import (
    COMMIT,
    INDOUBT,
    Base,
    Copy,
    SummarizedPlan,
    base_of,
    copy_holder,
    ends_for_its_owner,
    in_flight_outcome,
    older_outcome,
    owner_of,
    prepare_record,
    relevant,
    restore_lrsn_above,
    revived,
    uow_owner,
)
from restore.settle import BACKOUT, Outcome, Settled, best_copy, decide_outcome, load_key, settle, uows_named
from restore.spill import Partitioned, SpillDir, SpillWriter, read_frames
from restore.workers import Workers
from sqm.core.records import Record, Role, lookup

Key = tuple[Any, ...]  # a record's place in the merged log: (LRSN, member, segment, offset)
R = TypeVar("R")
Progress = Callable[[str, int, int | None], None]

# Frames of the entry partitions, and of the UOW partitions.
_COPY, _RECORD = 0, 1
_OUTCOME_REC, _END, _NEED, _OLDER_OUTCOME, _HELD = 0, 1, 2, 3, 4

DEFAULT_MEMORY = 1 << 30  # the working memory a restore may use by default (cfemu.settings: restore_memory)
MAX_PARTITIONS = 4096
# Python objects take this many times the bytes of their msgpack frames in a spill file, for the kind of record
# that expands most (small log records), so that a partition of them fits (BENCHMARKS.md, "restore in bounded
# memory", "Figures behind the restore's constants").
EXPANSION = 6


def partitions_for(input_bytes: int, memory: int) -> int:
    """How many partitions keep one partition's objects within about half of `memory` (the other half: the
    scan's buffers, the merge's read buffers, a load batch, and the sort of one partition's survivors)."""
    return max(1, min(MAX_PARTITIONS, math.ceil(input_bytes * EXPANSION / max(1, memory // 2))))


def merge_read_size(memory: int, runs: int) -> int:
    """The read size of each sorted run in the final merge, so that the runs' read buffers together take about a
    quarter of `memory`. Each run costs about 3x its read size: msgpack's Unpacker doubles its buffer when a frame
    straddles two reads, and each read is a transient bytes object besides; a floor of 4 KiB, so that many runs
    of a small restore stay within its memory (BENCHMARKS.md, "restore in bounded memory", "Figures behind the
    restore's constants")."""
    return max(4 << 10, min(1 << 20, memory // (12 * max(1, runs))))


def buffers_for(memory: int) -> int:
    """The bytes the scan may buffer in all before it writes to its spill files."""
    return max(64 << 10, min(64 << 20, memory // 8))


def _first(kr: tuple[Any, Any]) -> Any:
    return kr[0]


def _by_partition(ids: list[str], part: Callable[[str], int]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = defaultdict(list)
    for eid in ids:
        out[part(eid)].append(eid)
    return out


def pack_outcome(o: Outcome) -> list[Any]:
    """An outcome as a msgpack frame (the decided outcomes' spill files)."""
    return [o.kind, o.lrsn, o.decided_by, [[eid, *c] for eid, c in o.data.items()], list(o.structures)]


def unpack_outcome(f: list[Any]) -> Outcome:
    """The outcome of a pack_outcome frame."""
    return Outcome(f[0], f[1], f[2], {d[0]: (d[1], d[2], d[3]) for d in f[3]}, tuple(f[4]))


class SpilledOutcomes(Mapping[str, Outcome]):
    """Every UOW's outcome, as RestorePlan.outcomes: read from the UOW partitions' decided outcomes, one partition
    at a time (the last one read is kept), and the in-flight UOWs restore decided."""

    def __init__(self, decided: Partitioned, part: Callable[[str], int], count: int,
                 in_flight: Mapping[str, Outcome]) -> None:
        self.decided, self.part, self.count, self.in_flight = decided, part, count, in_flight
        self._cached: tuple[int, dict[str, Outcome]] | None = None

    def _partition(self, j: int) -> dict[str, Outcome]:
        if self._cached is None or self._cached[0] != j:
            self._cached = (j, {u: unpack_outcome(o) for u, o in self.decided.read(j)})
        return self._cached[1]

    def __getitem__(self, uow: str) -> Outcome:
        if uow in self.in_flight:
            return self.in_flight[uow]
        return self._partition(self.part(uow))[uow]

    def __iter__(self) -> Iterator[str]:
        for j in range(self.decided.n):
            yield from self._partition(j)
        yield from self.in_flight

    def __len__(self) -> int:
        return self.count + len(self.in_flight)


class SpilledSettled(Collection[Settled]):
    """Every settled entry of a partitioned plan (RestorePlan.settled), read back from the spill files: the
    survivors in load order, then the others."""

    def __init__(self, plan: SpilledPlan) -> None:
        self.plan = plan

    def __iter__(self) -> Iterator[Settled]:
        yield from self.plan.in_load_order()
        for i in range(self.plan.partitions):
            for eid, disposition in read_frames(self.plan.spill.file(f"gone-{i}")):
                yield Settled(eid, disposition)

    def __len__(self) -> int:
        return self.plan.settled_count

    def __contains__(self, item: object) -> bool:
        return any(s == item for s in self)


@dataclass(frozen=True)
class Runs:
    """A partitioned plan's sorted runs of survivors: run-<i> in `spill`, for i below `partitions`."""

    spill: str
    partitions: int
    read_size: int


def merged_runs(runs: Runs) -> Iterator[Settled]:
    """The survivors in the CF's order: a k-way merge of the partitions' sorted runs."""
    spill = Path(runs.spill)
    for f in heapq.merge(*(read_frames(spill / f"run-{i}", runs.read_size) for i in range(runs.partitions))):
        yield Settled(f[1], f[2], f[3], f[4], f[5])


class SpilledPlan(SummarizedPlan):
    """A RestorePlan whose settled entries and outcomes live in spill files (restore.spill) until close()."""

    spill: SpillDir
    partitions: int
    settled_count: int
    loaded_bytes: int  # the survivors' data, in all
    read_size: int
    worker_peak_bytes: int  # the worker processes' peak resident memory, summed (0: planned in this process)
    deferred_records: int = 0  # log records the slices' readers set aside until the backup was read

    workers: int  # the processes its engine may use (the load's batches are then prepared in one of them)

    def in_load_order(self) -> Iterator[Settled]:
        return merged_runs(self.runs())

    def runs(self) -> Runs:
        """Where its sorted runs are: enough for another process to read them in load order (merged_runs)."""
        return Runs(str(self.spill.path), self.partitions, self.read_size)

    def close(self) -> None:
        self.spill.close()


def plan_partitioned(structure: str, backup: Iterable[Copy], records: Iterable[tuple[Key, Record]], *,
                     spill: SpillDir, partitions: int, memory: int = DEFAULT_MEMORY, now_ms: int, gen: int = 0,
                     carried: Iterable[str] = (), lrsn: int = 0, registered: Collection[str] = (),
                     progress: Progress | None = None, workers: int = 1,
                     slices: Sequence[LogSlice] | None = None) -> SpilledPlan:
    """The plan of restore.reference.plan_local (same arguments; `records` each with its place in the merged log, in
    any order), computed one partition at a time in `spill` (see the module doc). The plan owns `spill`: close() it.
    `slices`: more records, the logs' slices (restore.log_slices), read by the worker processes side by side, the
    phase "read logs" reported as they are (also when there are none: a restore of no logs still reads them)."""
    # The plan makes millions of small dicts, lists and tuples, none of them in a cycle; the cyclic collector
    # would scan the growing partition again and again as they are made (BENCHMARKS.md, "restore in bounded
    # memory", "Speed, second pass"), so it is off while the plan runs (reference counting still frees everything).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan_partitioned(structure, backup, records, spill=spill, partitions=partitions, memory=memory,
                                 now_ms=now_ms, gen=gen, carried=carried, lrsn=lrsn, registered=registered,
                                 progress=progress, workers=workers, slices=slices)
    finally:
        if was_enabled:
            gc.enable()


def _plan_partitioned(structure: str, backup: Iterable[Copy], records: Iterable[tuple[Key, Record]], *,
                      spill: SpillDir, partitions: int, memory: int, now_ms: int, gen: int, carried: Iterable[str],
                      lrsn: int, registered: Collection[str], progress: Progress | None,
                      workers: int, slices: Sequence[LogSlice] | None) -> SpilledPlan:
    P = max(1, partitions)

    def part(key: str) -> int:
        return partition_of(key, P)

    buffers = buffers_for(memory)
    per_worker = max(4096, buffers // (2 * max(1, workers)))  # one worker's write buffers, in all
    manifest = {"gen": gen, "carried": list(carried), "end_lrsn": lrsn, "uows": registered}
    pool = Workers(min(workers, P))
    logs: _Background[_Scanned] | None = None
    try:
        with pool:
            # The workers read the logs' slices while this process reads the backup (they share two cores: the
            # backup was a phase of its own, one core idle). Which UOWs the backup holds is not known until it is
            # read, so they read with the base the manifest gives, and set aside each record that base leaves
            # out and the backup's UOWs may bring back (deferred: filed below, once the base is whole).
            if pool.procs and slices:
                known = base_of(manifest, ())
                logs = _Background(pool.map(partial(_scan_slice, _ScanJob(spill.path, P, structure, known,
                                                                          per_worker, defer=True)), slices))
            # 1 scan
            ent = Partitioned(spill, "entries", P, buffers // 2)
            uow = Partitioned(spill, "uows", P, buffers // 2)
            max_lrsn = 0
            held_by: set[str] = set()
            for n, c in enumerate(backup, 1):
                if logs is not None and not n % 1024:
                    logs.check()  # a worker that failed stops the plan now, not once the whole backup is read
                desc = c[1]
                try:
                    i = part(desc["id"])
                    ent.add(i, (_COPY, c[0], desc, c[2]))
                    u = desc.get("u", "")
                    if u:
                        uow.add(part(u), (_NEED, u, i))
                except UnicodeEncodeError as x:  # a raw byte the backup kept (surrogateescape): say which entry
                    raise unloadable(str(desc.get("id")), x) from None
                max_lrsn = max(max_lrsn, int(desc["l"]))
                held_by.add(u)
            base = base_of(manifest, held_by)
            logs_lrsn, per_member, _ = _scan_records(records, structure, base, part, ent, uow)
            max_lrsn = max(max_lrsn, logs_lrsn)
            ent.close()
            uow.close()
            # The logs' slices, read side by side; each process files what it reads in partition files of its own.
            scanned: set[str] = set()
            peaks: dict[int, int] = {}
            if slices is not None and progress is not None:
                progress("read logs", 0, len(slices))
            if logs is None:
                scan = partial(_scan_slice, _ScanJob(spill.path, P, structure, base, per_worker))
                results: Iterable[_Scanned] = pool.map(scan, slices or ())
            else:
                results = logs.results()
            deferred = 0
            for done, sc in enumerate(results, 1):
                max_lrsn = max(max_lrsn, sc.max_lrsn)
                per_member.update(sc.per_member)
                scanned.add(sc.name)
                deferred += sc.deferred
                spill.bytes_written += sc.bytes_written
                peaks[sc.pid] = max(peaks.get(sc.pid, 0), sc.peak)
                if progress is not None:
                    progress("read logs", done, len(slices or ()))
            if deferred:
                per_member.update(_file_deferred(spill, sorted(scanned), structure, base, P, buffers))
                scanned.add(_DEFERRED)
            plan = _settle_partitions(pool, structure, spill, P, max_lrsn, base, per_member, peaks, per_worker,
                                      memory, now_ms, tuple(sorted(scanned)), progress, workers)
            plan.deferred_records = deferred
            return plan
    finally:
        if logs is not None:
            logs.join()


_DEFERRED = "deferred"  # the suffix of the partition files of the records the workers set aside


def _file_deferred(spill: SpillDir, names: Sequence[str], structure: str, base: Base, P: int,
                   buffers: int) -> Counter[str]:
    """Step 1 for the records the log slices' readers set aside (their deferred.<name> files), now that the base
    is whole: filed as _scan_records files any record, in partition files of their own (entries.deferred,
    uows.deferred). Returns the records kept per member."""
    ent = Partitioned(spill, f"entries.{_DEFERRED}", P, buffers // 2)
    uow = Partitioned(spill, f"uows.{_DEFERRED}", P, buffers // 2)
    files = [spill.file(f"{_DEFERRED}.{name}") for name in names]
    records = ((tuple(key), raw) for key, raw in chain.from_iterable(read_frames(f) for f in files))
    _, per_member, _ = _scan_records(records, structure, base, lambda key: partition_of(key, P), ent, uow)
    ent.close()
    uow.close()
    for f in files:
        f.unlink(missing_ok=True)
    return per_member


class _Background(Generic[R]):
    """A Workers.map consumed by a thread of its own while this one does other work; results() hands over what it
    produced, in the order produced, then raises its failure if it failed."""

    def __init__(self, results: Iterator[R]) -> None:
        self.queue: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(results,), name="restore-scan-logs", daemon=True)
        self.thread.start()

    def _run(self, results: Iterator[R]) -> None:
        try:
            for r in results:
                self.queue.put((True, r))
        except BaseException as e:  # handed to results() and check(), which raise it
            self.failure = e
            self.queue.put((False, e))
            return
        self.queue.put((False, None))

    def results(self) -> Iterator[R]:
        while True:
            ok, value = self.queue.get()
            if ok:
                yield value
            elif value is None:
                return
            else:
                raise value

    def check(self) -> None:
        """Raise the map's failure, if it has failed already (a worker died: no need to wait for results())."""
        if self.failure is not None:
            raise self.failure

    def join(self) -> None:
        self.thread.join()


def _settle_partitions(pool: Workers, structure: str, spill: SpillDir, P: int, max_lrsn: int, base: Base,
                       per_member: Counter[str], peaks: dict[int, int], per_worker: int, memory: int, now_ms: int,
                       scanned: tuple[str, ...], progress: Progress | None, workers: int) -> SpilledPlan:
    """Steps 2 and 3, in `pool`, and the plan they make."""

    def part(key: str) -> int:
        return partition_of(key, P)

    restore_lrsn = restore_lrsn_above(max_lrsn, base)
    if progress is not None:
        progress("settle", 0, P)

    # 2 outcomes, per UOW partition, sent to the entry partitions that need them; then 3 the fold, per entry
    # partition. Each partition is settled on its own (one process may take one partition while another takes the
    # next): what a partition needs of the others comes through spill files, and what the plan keeps of each is
    # small (counts, and the UOWs still open at the failure).
    job = _Job(spill.path, P, now_ms, restore_lrsn, per_worker, scanned=scanned)
    chunks = _chunks(P, pool.n)
    in_commit: set[str] = set()
    in_doubt: dict[str, str] = {}  # in-doubt UOWs whose records name the structure (plan.held_uows)
    restore_decided: set[str] = set()
    n_decided = 0
    for d in pool.map(partial(_decide, job, structure), enumerate(chunks)):
        n_decided += d.decided
        in_commit |= d.in_commit
        in_doubt.update(d.in_doubt)
        restore_decided |= d.restore_decided
        spill.bytes_written += d.bytes_written
        peaks[d.pid] = max(peaks.get(d.pid, 0), d.peak)
    in_flight: dict[str, Outcome] = {}
    outcomes = SpilledOutcomes(_reader(spill, "decided", P), part, n_decided, in_flight)

    counts: Counter[str] = Counter()
    held: dict[str, str] = {}
    first: dict[str, int] = {}
    decisions: dict[str, str] = {}
    flight = in_flight_outcome(restore_lrsn)
    settled_count = loaded_count = loaded_bytes = 0
    fold = partial(_fold, replace(job, needed=tuple(f"needed.{c}" for c in range(len(chunks)))))
    for done, f in enumerate(pool.map(fold, range(P)), 1):
        counts.update(f.counts)
        settled_count += f.settled
        loaded_count += f.loaded
        loaded_bytes += f.loaded_bytes
        held.update(f.held)
        for u, lrsn_u in f.first.items():
            first[u] = min(first.get(u, lrsn_u), lrsn_u)
        for u in f.in_flight:
            in_flight[u] = flight
            decisions[u] = owner_of(u)
            restore_decided.add(u)
        spill.bytes_written += f.bytes_written
        peaks[f.pid] = max(peaks.get(f.pid, 0), f.peak)
        if progress is not None:
            progress("settle", done, P)
    peaks.pop(os.getpid(), None)  # this process's own peak is its own to report (getrusage)

    for u, owner in in_doubt.items():
        held.setdefault(u, owner)
    held = dict(sorted(held.items()))
    counts["uows in doubt"] = len(held)
    counts["uows in flight backed out"] = len(decisions)
    plan = SpilledPlan(structure, restore_lrsn, [], outcomes, decisions, in_commit, counts, per_member, max_lrsn)
    plan.spill, plan.partitions = spill, P
    plan.settled_count, plan.loaded_count, plan.loaded_bytes = settled_count, loaded_count, loaded_bytes
    plan.read_size = merge_read_size(memory, P)
    plan.held, plan.first_lrsn, plan.restore_decided = held, first, restore_decided
    plan.worker_peak_bytes = sum(peaks.values())
    plan.workers = workers
    plan.settled = SpilledSettled(plan)
    return plan


# ------------------------------------------------------------------------ one partition at a time, anywhere

def _scan_records(records: Iterable[tuple[Key, Record]], structure: str, base: Base, part: Callable[[str], int],
                  ent: Partitioned, uow: Partitioned,
                  defer: SpillWriter | None = None) -> tuple[int, Counter[str], int]:
    """Step 1 for log records: file each record that matters in the partitions of the entries and the UOW it
    names (see the module doc). Returns the highest LRSN seen, the records kept per member, and how many went to
    `defer`. defer: where a record goes, as (key, record), when `base` is not yet whole (the backup's UOWs
    unknown) and leaves it out though it is the structure's and names a UOW: the generation rule may keep it
    once the backup's UOWs are known (plan.current_incarnation), and it is filed then (_file_deferred)."""
    max_lrsn = 0
    deferred = 0
    per_member: Counter[str] = Counter()
    for key, raw in records:
        max_lrsn = max(max_lrsn, int(raw["l"]))
        rec = prepare_record(raw, structure, base)
        if rec is None:
            if defer is not None and raw.get("u") and relevant(raw, structure):
                defer.add((key, raw))
                deferred += 1
                continue
            kept_aside = older_outcome(raw, structure, base)
            if kept_aside is not None:
                uow.add(part(kept_aside["u"]), (_OLDER_OUTCOME, key, kept_aside))
            continue
        per_member[rec.get("m", "?")] += 1
        kind = lookup(rec)
        u = rec.get("u", "")
        holder = copy_holder(rec)
        if holder:
            uow.add(part(holder), (_HELD, holder))
        if kind.role is Role.END:
            if ends_for_its_owner(u, rec.get("m")):
                uow.add(part(u), (_END, u))
            continue
        if kind.role is Role.OUTCOME:
            uow.add(part(u), (_OUTCOME_REC, key, rec))
        ids = kind.entry_ids(rec)
        # Each frame carries the ids it is filed under in its partition, so that the fold need not find them again.
        filed = {part(ids[0]): ids} if len(ids) == 1 else _by_partition(ids, part)
        for i, mine in filed.items():
            ent.add(i, (_RECORD, key, rec, mine))
            if u:
                uow.add(part(u), (_NEED, u, i))
            if holder:
                uow.add(part(holder), (_NEED, holder, i))
    return max_lrsn, per_member, deferred




def partition_of(key: str, n: int) -> int:
    """The partition of an entry or UOW id among `n`: the same in every process (str's hash() is salted per
    process, and the partitions are settled by worker processes of their own)."""
    return crc32(key.encode()) % n


@dataclass(frozen=True)
class _Job:
    """What settling one partition needs (sent to worker processes: small and picklable)."""

    spill: Path
    P: int
    now_ms: int
    restore_lrsn: int
    buffer_bytes: int  # the write buffers of one worker, in all
    needed: tuple[str, ...] = ()  # the names of the "needed" sets, one per chunk of UOW partitions
    scanned: tuple[str, ...] = ()  # the suffixes of the partition files the log slices' readers wrote


@dataclass(frozen=True)
class _ScanJob:
    """What reading a log slice needs (sent to worker processes)."""

    spill: Path
    P: int
    structure: str
    base: Base
    buffer_bytes: int
    defer: bool = False  # `base` is the manifest's alone: set aside what the backup's UOWs may bring back


@dataclass
class _Scanned:
    """What step 1 keeps of a log slice (its records are in the partition files `entries.<name>`, `uows.<name>`)."""

    name: str
    max_lrsn: int
    per_member: Counter[str]
    bytes_written: int
    pid: int
    peak: int
    deferred: int = 0  # records set aside in deferred.<name> (_ScanJob.defer)


def _scan_slice(job: _ScanJob, sl: LogSlice) -> _Scanned:
    """Step 1 for one slice of a log, in any process: its partition files are this process's (named by its pid,
    appended to by each slice it reads)."""
    gc.disable()
    spill = SpillDir.at(job.spill)
    name = f"p{os.getpid()}"
    ent = Partitioned(spill, f"entries.{name}", job.P, job.buffer_bytes // 2)
    uow = Partitioned(spill, f"uows.{name}", job.P, job.buffer_bytes // 2)
    defer = SpillWriter(spill, f"{_DEFERRED}.{name}", 64 << 10) if job.defer else None
    max_lrsn, per_member, deferred = _scan_records(sl.records(), job.structure, job.base,
                                                   lambda key: partition_of(key, job.P), ent, uow, defer)
    ent.close()
    uow.close()
    if defer is not None:
        defer.flush()
    return _Scanned(name, max_lrsn, per_member, spill.bytes_written, os.getpid(), _vm_hwm(), deferred)


@dataclass
class _Decided:
    """What step 2 keeps of a chunk of UOW partitions."""

    decided: int = 0
    in_commit: set[str] = field(default_factory=set)
    in_doubt: dict[str, str] = field(default_factory=dict)
    restore_decided: set[str] = field(default_factory=set)
    bytes_written: int = 0
    pid: int = 0
    peak: int = 0


@dataclass
class _Folded:
    """What step 3 keeps of one entry partition (its survivors and the others are in its spill files)."""

    counts: Counter[str] = field(default_factory=Counter)
    settled: int = 0
    loaded: int = 0
    loaded_bytes: int = 0
    held: dict[str, str] = field(default_factory=dict)
    first: dict[str, int] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)  # UOWs with no outcome: in flight at the failure
    bytes_written: int = 0
    pid: int = 0
    peak: int = 0


def _reader(spill: SpillDir, name: str, n: int) -> Partitioned:
    return Partitioned(spill, name, n, 0)


def _chunks(n: int, workers: int) -> list[list[int]]:
    """range(n) in `workers` interleaved chunks (partitions are alike in size)."""
    return [list(range(k, n, workers)) for k in range(min(n, workers))] or [[]]


def _vm_hwm() -> int:
    """This process's peak resident memory (VmHWM: a worker forked from a big parent would report the parent's
    through ru_maxrss)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _decide(job: _Job, structure: str, chunk: tuple[int, list[int]]) -> _Decided:
    """Step 2 for a chunk of UOW partitions: decide each UOW's outcome (settle.decide_outcome) and send it to the
    entry partitions that need it (into this chunk's own "needed" set: chunks run side by side)."""
    gc.disable()  # as plan_partitioned: acyclic objects (a worker process starts with the collector on)
    c, js = chunk
    spill = SpillDir.at(job.spill)
    uows = [_reader(spill, name, job.P) for name in ("uows", *(f"uows.{s}" for s in job.scanned))]
    decided = Partitioned(spill, "decided", job.P, job.buffer_bytes // 2)
    needed = Partitioned(spill, f"needed.{c}", job.P, job.buffer_bytes // 2)
    out = _Decided()
    for j in js:
        by_uow: dict[str, list[tuple[Key, Record]]] = defaultdict(list)
        ended: set[str] = set()
        needs: dict[str, set[int]] = defaultdict(set)
        older: dict[str, list[tuple[Key, Record]]] = defaultdict(list)
        holders: set[str] = set()
        for f in chain.from_iterable(u.read(j) for u in uows):
            if f[0] == _OUTCOME_REC:
                by_uow[f[2]["u"]].append((f[1], f[2]))
            elif f[0] == _END:
                ended.add(f[1])
            elif f[0] == _OLDER_OUTCOME:
                older[f[2]["u"]].append((f[1], f[2]))
            elif f[0] == _HELD:
                holders.add(f[1])
            else:
                needs[f[1]].add(f[2])
        for u_set in uows:
            u_set.remove(j)
        for u, keyed_aside in revived(older, holders).items():
            by_uow[u].extend(keyed_aside)
        del older, holders
        packed: dict[str, list[Any]] = {}
        for u, keyed in by_uow.items():
            keyed.sort(key=_first)
            o = decide_outcome(r for _, r in keyed)
            if o is None:
                continue
            out.decided += 1
            packed[u] = pack_outcome(o)
            decided.add(j, (u, packed[u]))
            if o.kind == COMMIT and u not in ended:
                out.in_commit.add(u)
            elif o.kind == INDOUBT and structure in o.structures:
                out.in_doubt[u] = uow_owner(u, o)
            elif o.kind == BACKOUT and o.decided_by == "restore":
                out.restore_decided.add(u)
        for u, targets in needs.items():
            for i in targets:
                needed.add(i, (u, packed.get(u)))
        del by_uow, needs, packed
    decided.close()
    needed.close()
    out.bytes_written, out.pid, out.peak = spill.bytes_written, os.getpid(), _vm_hwm()
    return out


def _fold(job: _Job, i: int) -> _Folded:
    """Step 3 for entry partition i: fold each entry (settle.best_copy, uows_named, settle: the one fold every
    engine uses), deciding in-flight UOWs backed out as restore/reference.py's plan_local does; the survivors are
    written as a run sorted in load order (run-i), the others as (id, disposition) (gone-i)."""
    gc.disable()
    spill = SpillDir.at(job.spill)
    outcomes = SpilledOutcomes(_reader(spill, "decided", job.P), lambda u: partition_of(u, job.P), 0, {})
    flight = in_flight_outcome(job.restore_lrsn)
    out = _Folded()
    outs: dict[str, Outcome | None] = {}
    for name in job.needed:
        needed = _reader(spill, name, job.P)
        outs.update((u, None if o is None else unpack_outcome(o)) for u, o in needed.read(i))
        needed.remove(i)
    copies: dict[str, list[Copy]] = defaultdict(list)
    by_entry: dict[str, list[tuple[Key, Record]]] = defaultdict(list)
    ents = [_reader(spill, name, job.P) for name in ("entries", *(f"entries.{s}" for s in job.scanned))]
    for f in chain.from_iterable(e.read(i) for e in ents):
        if f[0] == _COPY:
            copies[f[2]["id"]].append((f[1], f[2], f[3]))
            continue
        one = (f[1], f[2])
        for eid in f[3]:
            by_entry[eid].append(one)
    for e in ents:
        e.remove(i)
    run: list[tuple[Any, ...]] = []
    gone = SpillWriter(spill, f"gone-{i}")
    for eid in copies.keys() | by_entry.keys():
        named = by_entry.get(eid)
        if named is None:
            recs = []
        elif len(named) == 1:
            recs = [named[0][1]]
        else:
            named.sort(key=_first)
            recs = [r for _, r in named]
        cs = copies.get(eid)
        best = (cs[0] if len(cs) == 1 else best_copy(cs)) if cs else None
        for u in (uows_named(best, recs) if recs or (best and best[1].get("u")) else ()):
            if outs.get(u) is None:
                o = outcomes.get(u) if u not in outs else None  # a UOW no need named (defensive)
                if o is None:
                    o = flight
                    out.in_flight.add(u)
                outs[u] = o
        s = settle(eid, best, recs, outs, job.now_ms)  # type: ignore[arg-type]  # every named UOW is decided
        out.settled += 1
        out.counts[s.disposition] += 1
        if s.entry is None:
            gone.add((s.id, s.disposition))
            continue
        out.loaded += 1
        out.loaded_bytes += len(s.data)
        run.append((load_key(s.id, s.entry), s.id, s.disposition, s.structure, s.entry, s.data))
        holder = s.entry.get("u")
        if holder:
            out.held[holder] = uow_owner(holder, outs.get(holder))
            out.first[holder] = min(out.first.get(holder, int(s.entry["l"])), int(s.entry["l"]))
    gone.flush()
    run.sort(key=_first)
    w = SpillWriter(spill, f"run-{i}")
    for t in run:
        w.add(t)
    w.flush()
    out.bytes_written, out.pid, out.peak = spill.bytes_written, os.getpid(), _vm_hwm()
    return out
