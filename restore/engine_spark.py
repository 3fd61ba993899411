"""The Spark restore engine: the restore plan as a PySpark job (docs/spark.md).

The job is the local engine's plan, stage for stage, with the same functions running inside Spark's Python
workers (restore.plan.prepare_record / in_flight_outcome, restore.settle.decide_outcome / best_copy /
uows_named / settle):

  read backup  one task per backup entry file (backup.files.Backup verifies each file as it reads it);
  read logs    one task per log segment, decoded by sqm.log's own SegmentScan (or, for segments archived by
               restore.archive, a Parquet scan with the LRSN and relevance filters pushed down), each record
               passed through prepare_record; the relevant records stay cached for the next phase;
  settle       a shuffle by UOW id: each UOW's outcome records (and its END, and the entries that name it) meet in
               one partition, where decide_outcome decides it (a UOW with none was in flight: backed out at
               restore_lrsn, as in restore/reference.py's plan_local) and sends its outcome to the entries that
               need it; then a shuffle by entry id of entry records, backup copies and those outcomes -> best
               copy + settle. The join of entries with outcomes is a hash join in Spark: no outcome goes through
               the driver's memory.

Within a group, records are put in merged-log order (LRSN, member, segment, offset) and copies in backup-file order
before the fold sees them: that is the order the local engine reads them in, so ties fold the same way. Each settle
partition's survivors are sorted in load order by its worker and written as restore.partitioned's runs: the plan is
a restore.partitioned.SpilledPlan, its survivors read by the load as a k-way merge of the runs, and the UOWs'
decided outcomes, in the same spill directory, read as restore.partitioned's SpilledOutcomes. Executors that share
the driver's spill directory (local[N], a standalone cluster on this machine: spill.share) write those files
themselves, each task its partition's, and hand back only what the plan sums up; elsewhere the driver fetches the
rows and appends them to the same files. Either way the driver's memory does not grow with the history (what it
keeps: counts, the UOWs still open at the failure, and the UOWs the base's copies name). Nothing the driver needs
is collect()ed whole: every result whose size grows with the backup or the logs comes back through
restore.spark_fetch.stream, in jobs of bounded bytes under spark.driver.maxResultSize, however many records it
holds (a plan of 1M records of 1 KiB is 1.07 GB, over the 1 GiB default: a count of records cannot say when to
stream).
Spark runs quietly: its log4j output, and the JVM's stderr, go to a log file; its stages report through the
engine's progress callback as the restore phases (a thread polls the status tracker). A backup error a worker
raises (a changed entry file, a corrupt frame) comes back to the driver as the same error, one
line naming the file, not the worker's traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pyspark import AccumulatorParam, SparkConf, StorageLevel
from pyspark.sql import SparkSession

from cfemu.credentials import BackupKeys
from cfemu.progress import Progress, no_progress
from restore.engine import (
    READ_BACKUP,
    READ_LOGS,
    SETTLE,
    BackupSource,
    bounded_resources,
    register_engine,
)
from restore.log_slices import LogSlice
from restore.partitioned import (
    DEFAULT_MEMORY,
    SpilledOutcomes,
    SpilledPlan,
    SpilledSettled,
    buffers_for,
    merge_read_size,
    pack_outcome,
    partition_of,
)
from restore.plan import (
    COMMIT,
    INDOUBT,
    Base,
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
    uow_owner,
)
from restore.settle import BACKOUT, Outcome, best_copy, decide_outcome, load_key, settle, uows_named
from restore.spark_conf import memory_conf
from restore.spark_fetch import stream
from restore.spill import Partitioned, SpillDir, TaskFiles, remove_files, share
from sqm.core.records import Record, Role, entry_ids, lookup
from sqm.log import LogFormatError, one_log_per_member
from sqm.log.format import SegmentInfo, SegmentScan, log_segments, read_manifest, trusted_segments

DEFAULT_LOG_FILE = Path("var") / "spark" / "spark.log"
# Records per shuffle partition: small enough that one Python worker groups a partition in memory.
RECORDS_PER_PARTITION = 100_000
# Input bytes (backup files and log segments) per shuffle partition: big messages make a partition big in bytes
# long before it is big in records; a partition's plan is fetched in runs of bounded bytes (spark_fetch), and
# fewer runs per partition means fewer re-reads of it.
BYTES_PER_PARTITION = 64 * 2**20
POLL_SECONDS = 0.25
TASK_BYTES = 32 * 2**20  # input bytes per reading task

# merged-log order of a record: (LRSN, member, segment, offset)
OrderKey = tuple[int, str, int, int]
#: (member, segment number, path, is the member's last segment, the manifest's entry for a sealed one or None)
SegmentTask = tuple[str, int, str, bool, SegmentInfo | None]


# The last line of a worker's traceback that names one of the product's errors: "<module>.<Class>: <message>".
_WORKER_ERROR = re.compile(r"^((?:backup|sqm)(?:\.\w+)+)\.(\w+Error): (.+)$", re.MULTILINE)


def worker_error(e: BaseException) -> Exception | None:
    """The backup error (backup.files.BackupError) or LogFormatError a Spark worker raised, as found in the
    traceback Spark hands the driver, rebuilt with its message; None for anything else (a LogCorruptError too:
    it is built from its parts, and still comes back as Spark's error)."""
    from backup.files import BackupError  # as read_backup_file does: the workers import backup.files lazily

    for module, name, message in reversed(_WORKER_ERROR.findall(str(e))):
        with contextlib.suppress(ImportError):
            cls = getattr(importlib.import_module(module), name, None)
            if isinstance(cls, type) and issubclass(cls, (BackupError, LogFormatError)):
                return cls(message)
    return None


class _MaxParam(AccumulatorParam):
    """A max accumulator: re-running a task cannot change it (max is idempotent)."""

    def zero(self, value: int) -> int:
        return 0

    def addInPlace(self, value1: int, value2: int) -> int:
        return max(value1, value2)


# ------------------------------------------------------------------------------------------ worker functions
# Module-level functions: Spark pickles them by reference, and the workers import this module.


def scan_segment(task: SegmentTask, replay_from: int) -> Iterator[tuple[OrderKey, Record]]:
    """Every record of one segment with LRSN >= replay_from, tagged with its member (the merged log's "m"). The
    member's last segment when the plan listed them is read with every segment its log has gained since: the
    backup is read between the listing and the reading, and a member still logging meanwhile (the re-plan after
    the claim of an ACTIVE structure) rolls into segments the listing never named (as restore.log_slices)."""
    member, segno, path, is_last, expected = task
    if is_last:  # an active segment: in its log's own directory
        yield from LogSlice(str(Path(path).parent), (segno,), replay_from, to_end=True).records()
        return
    for pos, rec in SegmentScan(Path(path), segno, member, is_last=is_last, expected=expected):
        if rec["l"] >= replay_from:
            rec["m"] = member
            yield (rec["l"], member, pos.segment, pos.offset), rec


def read_backup_file(backup_path: str, manifest: dict[str, Any], index: int
                     ) -> Iterator[tuple[str, tuple[tuple[int, int], Copy]]]:
    """The copies of one backup entry file, keyed by entry id, with their (file, frame) position."""
    from backup.files import Backup  # the workers import it; the driver may be handed any BackupSource

    one_file = Backup(Path(backup_path), dict(manifest, files=[manifest["files"][index]]))
    for frame, copy in enumerate(one_file.copies()):
        yield copy[1]["id"], ((index, frame), copy)


CURRENT, OLDER = 0, 1  # prepared's tags: a record the plan uses, an older outcome record kept aside


def prepared(keyed: tuple[OrderKey, Record], structure: str, max_seen: Any,
             base: Base) -> list[tuple[int, tuple[OrderKey, Record]]]:
    """prepare_record on one record (the LRSN of every record read counts towards max_lrsn, as in
    restore/reference.py), tagged CURRENT; an outcome record the generation rule leaves out is kept aside, tagged
    OLDER (plan.older_outcome: it decides its UOW if a relog copy shows that UOW holding an entry)."""
    key, rec = keyed
    max_seen.add(key[0])
    out = prepare_record(rec, structure, base)
    if out is not None:
        return [(CURRENT, (key, out))]
    aside = older_outcome(rec, structure, base)
    return [] if aside is None else [(OLDER, (key, aside))]


def by_key(pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, list[Any]]]:
    """The groups of one hash partition. PySpark's groupByKey combines (and spills) on the map side in Python,
    which costs more than the whole fold here: partitionBy only routes records, and the grouping is this dict.
    The groups come out sorted by key: the order shuffle blocks arrive in varies from run to run, and
    spark_fetch.stream needs a partition recomputed after a lost executor to come out the same."""
    groups: dict[str, list[Any]] = {}
    for key, value in pairs:
        groups.setdefault(key, []).append(value)
    return iter(sorted(groups.items(), key=lambda kv: kv[0]))


# The rows of the UOW shuffle, keyed by UOW id: what decides its outcome, and who needs it.
OUTCOME_RECORD, OLDER_RECORD, ENDED, HOLDS, NEED = 0, 1, 2, 3, 4


def uow_rows(keyed: tuple[OrderKey, Record]) -> list[tuple[str, tuple[int, Any]]]:
    """A current record's rows in the UOW shuffle: an outcome record or an END for its UOW, a HOLDS mark for the
    UOW a relog copy shows holding its entry (copy_holder: that UOW's older outcome records count), and a NEED
    (UOW, entry id) for every UOW whose outcome the fold of each entry it names may ask for (settle.uows_named
    takes them from the records' UOWs and the best copy's holder: these, and the backup copies' holders
    (copy_need), cover every UOW it can name)."""
    _, rec = keyed
    role = lookup(rec).role
    u = rec.get("u") or ""
    out: list[tuple[str, tuple[int, Any]]] = []
    if role is Role.OUTCOME:
        out.append((u, (OUTCOME_RECORD, keyed)))
    elif role is Role.END and ends_for_its_owner(u, rec.get("m")):
        out.append((u, (ENDED, None)))
    holder = copy_holder(rec)
    if holder:
        out.append((holder, (HOLDS, None)))
    eids = entry_ids(rec)
    for named in {u, holder} - {""}:
        out.extend((named, (NEED, eid)) for eid in eids)
    return out


def copy_need(keyed: tuple[str, tuple[tuple[int, int], Copy]]) -> list[tuple[str, tuple[int, Any]]]:
    """A backup copy's NEED: the UOW it shows holding its entry, if any."""
    eid, (_, copy) = keyed
    u = copy[1].get("u") or ""
    return [(u, (NEED, eid))] if u else []


def outcome_for(eid: str, o: Outcome) -> tuple[Any, ...]:
    """The part of a UOW's outcome the fold of entry `eid` reads (its data for that entry alone: a UOW's backout may
    carry the data of many), as a plain tuple (cheaper to pickle than the dataclass)."""
    data = o.data.get(eid)
    return o.kind, o.lrsn, o.decided_by, data, o.structures


def outcome_of(eid: str, t: tuple[Any, ...]) -> Outcome:
    kind, lrsn, decided_by, data, structures = t
    return Outcome(kind, lrsn, decided_by, {} if data is None else {eid: data}, structures)


def decide_partition(index: int, rows: Iterable[tuple[str, tuple[int, Any]]], structure: str
                     ) -> Iterator[tuple[Any, ...]]:
    """One UOW partition of the UOW shuffle (the partition of a UOW id is partitioned.partition_of): each UOW's
    outcome decided (settle.decide_outcome on its outcome records in merged-log order, its older ones too if a
    relog copy shows it holding an entry: plan.revived), then, for the driver, ("o", index, (uow, packed
    outcome)) and what the plan sums up of it: ("c", uow) committed with no END yet, ("i", uow, owner) in doubt
    with records naming the structure, ("b", uow) backed out by an earlier restore; and for the entry shuffle,
    ("n", entry id, (uow, outcome_for or None)) for each entry that needs it (None: no outcome, in flight)."""
    for u, items in by_key(rows):
        recs: list[tuple[OrderKey, Record]] = []
        older: list[tuple[OrderKey, Record]] = []
        needs: set[str] = set()
        ended = holds = False
        for tag, item in items:
            if tag == OUTCOME_RECORD:
                recs.append(item)
            elif tag == NEED:
                needs.add(item)
            elif tag == OLDER_RECORD:
                older.append(item)
            elif tag == ENDED:
                ended = True
            else:
                holds = True
        if holds:
            recs.extend(older)
        recs.sort(key=lambda kr: kr[0])
        o = decide_outcome(r for _, r in recs) if recs else None
        if o is not None:
            yield "o", index, (u, pack_outcome(o))
            if o.kind == COMMIT and not ended:
                yield "c", u
            elif o.kind == INDOUBT and structure in o.structures:
                yield "i", u, uow_owner(u, o)
            elif o.kind == BACKOUT and o.decided_by == "restore":
                yield "b", u
        for eid in sorted(needs):
            yield "n", eid, (u, None if o is None else outcome_for(eid, o))


def entry_group(values: Iterable[tuple[int, Any]]
                ) -> tuple[Copy | None, list[Record], dict[str, tuple[Any, ...] | None]]:
    """One entry's best backup copy, its records in merged-log order, and the outcomes of the UOWs it may name
    as the UOW shuffle delivered them (tag 0: a record, 1: a copy, 2: (uow, outcome_for or None))."""
    records: list[tuple[OrderKey, Record]] = []
    copies: list[tuple[tuple[int, int], Copy]] = []
    delivered: list[tuple[str, Any]] = []
    for tag, item in values:
        (records if tag == 0 else copies if tag == 1 else delivered).append(item)
    copies.sort(key=lambda pc: pc[0])
    records.sort(key=lambda kr: kr[0])
    return (best_copy(c for _, c in copies), [r for _, r in records],
            dict(delivered))


def settle_group(group: tuple[str, Iterable[tuple[int, Any]]], restore_lrsn: int, now_ms: int
                 ) -> list[tuple[str, Any]]:
    """settle() one entry: ("s", Settled); ("d", uow) for each UOW it names that has no outcome: restore decides
    those backed out at restore_lrsn, as restore/reference.py's plan_local does; and ("h", (uow, owner)) for the
    UOW that holds it, if it is loaded held."""
    eid, values = group
    best, records, delivered = entry_group(values)
    named: dict[str, Outcome] = {}
    out: list[tuple[str, Any]] = []
    for uow in uows_named(best, records):
        t = delivered.get(uow)
        if t is None:
            out.append(("d", uow))
        named[uow] = in_flight_outcome(restore_lrsn) if t is None else outcome_of(eid, t)
    s = settle(eid, best, records, named, now_ms)
    holder = s.entry.get("u") if s.entry is not None else None
    if holder:
        out.append(("h", (holder, uow_owner(holder, named.get(holder)))))
    return [("s", s), *out]


def run_of_partition(index: int, rows: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, int, Any]]:
    """One settle partition's rows, tagged with its index, ready for its spill files (restore.partitioned's
    frames): ("d", i, uow) for each UOW restore decides, ("h", i, (uow, owner)) for the holder of each entry
    loaded held, ("g", i, (id, disposition)) for each entry not loaded, then ("r", i, run frame) for each survivor, in load order (settle.load_key): one partition's survivors are
    sorted here, where its groups are held already, so that the driver only appends them."""
    run: list[tuple[Any, ...]] = []
    for tag, item in rows:
        if tag != "s":
            yield tag, index, item
        elif item.entry is None:
            yield "g", index, (item.id, item.disposition)
        else:
            run.append((load_key(item.id, item.entry), item.id, item.disposition, item.structure, item.entry,
                        item.data))
    run.sort(key=lambda t: t[0])
    for frame in run:
        yield "r", index, frame


def log_stats(keyed: Iterator[tuple[OrderKey, Record]]) -> Iterator[Counter[str]]:
    """Per partition: its relevant records per member."""
    yield Counter(rec.get("m", "?") for _, rec in keyed)


# ------------------------------------------------------------------------------------- the plan, on the driver


@dataclass
class Decided:
    """What the driver keeps of the UOWs' outcomes written to the "decided" spill files (partitioned's
    SpilledOutcomes reads them): how many, and the UOWs still open at the failure or decided by a restore."""

    count: int = 0
    in_commit: set[str] = field(default_factory=set)  # committed, no END record yet
    in_doubt: dict[str, str] = field(default_factory=dict)  # in doubt, with records naming the structure: owner
    restore_decided: set[str] = field(default_factory=set)  # backed out by an earlier restore
    bytes: int = 0  # of the spill files a task wrote

    def take(self, row: tuple[Any, ...], add: Callable[[int, Any], None]) -> None:
        """One of decide_partition's rows for the driver: an outcome to `add` (its partition, its frame), or a UOW
        the plan sums up."""
        tag = row[0]
        if tag == "o":
            add(row[1], row[2])
            self.count += 1
        elif tag == "c":
            self.in_commit.add(row[1])
        elif tag == "i":
            self.in_doubt[row[1]] = row[2]
        else:
            self.restore_decided.add(row[1])

    def merge(self, other: Decided) -> None:
        self.count += other.count
        self.in_commit |= other.in_commit
        self.in_doubt.update(other.in_doubt)
        self.restore_decided |= other.restore_decided
        self.bytes += other.bytes


def write_decided(rows: Iterable[tuple[Any, ...]], spill: SpillDir, parts: int, buffer_bytes: int) -> Decided:
    """Append decide_partition's rows for the driver to the spill files "decided-<j>" (j: the UOW's partition,
    partitioned.partition_of) through buffers of at most buffer_bytes in all; keep the sets the plan sums up."""
    decided = Partitioned(spill, "decided", parts, buffer_bytes)
    out = Decided()
    for row in rows:
        out.take(row, decided.add)
    decided.close()
    return out


def decided_by_task(index: int, rows: Iterable[tuple[Any, ...]], spill_path: str, token: str
                    ) -> Iterator[tuple[int, Decided | None]]:
    """On an executor that shares the driver's spill directory: write_decided's work for one UOW partition, its
    file "decided-<index>" written there by this task (spill.TaskFiles); None when it does not share it."""
    files = TaskFiles.open(Path(spill_path), token, index)
    if files is None:
        yield index, None
        return
    out = Decided()
    with files:
        for row in rows:
            out.take(row, lambda _, frame: files.add("decided", frame))
    out.bytes = sum(files.sizes.values())
    yield index, out


@dataclass
class Written:
    """What the driver keeps of the settled entries written to spill files: counts, and the UOWs that hold
    loaded entries (bounded by the work in flight at the failure, not by the history)."""

    dispositions: Counter[str] = field(default_factory=Counter)
    decisions: dict[str, str] = field(default_factory=dict)
    loaded: int = 0
    loaded_bytes: int = 0
    first: dict[str, int] = field(default_factory=dict)  # UOW -> lowest LRSN of the loaded entries it holds
    held: dict[str, str] = field(default_factory=dict)  # UOW -> owner, of the UOWs holding loaded entries
    bytes: int = 0  # of the spill files a task wrote

    def take(self, tag: str, i: int, item: Any, run: Callable[[int, Any], None],
             gone: Callable[[int, Any], None]) -> None:
        """One of run_of_partition's rows: a survivor to `run`, an entry not loaded to `gone` (each with its
        partition), or a UOW the plan sums up."""
        if tag == "d":
            self.decisions[item] = owner_of(item)
        elif tag == "h":
            self.held[item[0]] = item[1]
        elif tag == "g":
            self.dispositions[item[1]] += 1
            gone(i, item)
        else:
            run(i, item)
            self.dispositions[item[2]] += 1
            self.loaded += 1
            self.loaded_bytes += len(item[5])
            holder = item[4].get("u")
            if holder:
                lrsn = int(item[4]["l"])
                self.first[holder] = min(self.first.get(holder, lrsn), lrsn)

    def merge(self, other: Written) -> None:
        self.dispositions.update(other.dispositions)
        self.decisions.update(other.decisions)
        self.loaded += other.loaded
        self.loaded_bytes += other.loaded_bytes
        for u, lrsn in other.first.items():
            self.first[u] = min(self.first.get(u, lrsn), lrsn)
        self.held.update(other.held)
        self.bytes += other.bytes


def write_runs(rows: Iterable[tuple[str, int, Any]], spill: SpillDir, parts: int, buffer_bytes: int) -> Written:
    """Append run_of_partition's rows to the spill files of restore.partitioned (run-<i>, gone-<i>) through
    buffers of at most buffer_bytes in all; each partition's survivors arrive in load order, so each run-<i> is
    sorted."""
    runs = Partitioned(spill, "run", parts, buffer_bytes // 2)
    gone = Partitioned(spill, "gone", parts, buffer_bytes // 2)
    out = Written()
    for tag, i, item in rows:
        out.take(tag, i, item, runs.add, gone.add)
    runs.close()
    gone.close()
    return out


def runs_by_task(index: int, rows: Iterable[tuple[str, Any]], spill_path: str, token: str
                 ) -> Iterator[tuple[int, Written | None]]:
    """On an executor that shares the driver's spill directory: write_runs's work for one settle partition, its
    files "run-<index>" (its survivors, in load order) and "gone-<index>" written there by this task
    (spill.TaskFiles); None when it does not share it."""
    files = TaskFiles.open(Path(spill_path), token, index)
    if files is None:
        yield index, None
        return
    out = Written()
    with files:
        for tag, i, item in run_of_partition(index, rows):
            out.take(tag, i, item, lambda _, frame: files.add("run", frame),
                     lambda _, frame: files.add("gone", frame))
    out.bytes = sum(files.sizes.values())
    yield index, out


def spilled_plan(structure: str, spill: SpillDir, parts: int, written: Written, decided: Decided,
                 restore_lrsn: int, per_member: Counter[str], max_lrsn: int, read_size: int) -> SpilledPlan:
    """The plan over the spill files write_decided and write_runs wrote, summed up as restore.plan.summarize and
    held_uows would sum up the same entries and outcomes held in memory."""
    in_flight = {u: in_flight_outcome(restore_lrsn) for u in written.decisions}
    outcomes = SpilledOutcomes(Partitioned(spill, "decided", parts, 0), partial(partition_of, n=parts),
                               decided.count, in_flight)
    held = dict(written.held)
    for u, owner in decided.in_doubt.items():
        held.setdefault(u, owner)
    counts = Counter(written.dispositions)
    counts["uows in doubt"] = len(held)
    counts["uows in flight backed out"] = len(written.decisions)
    plan = SpilledPlan(structure, restore_lrsn, [], outcomes, written.decisions, decided.in_commit, counts,
                       per_member, max_lrsn)
    plan.spill, plan.partitions, plan.read_size = spill, parts, read_size
    plan.settled_count = sum(written.dispositions.values())
    plan.loaded_count, plan.loaded_bytes = written.loaded, written.loaded_bytes
    plan.held, plan.first_lrsn = dict(sorted(held.items())), written.first
    plan.restore_decided = decided.restore_decided | set(written.decisions)
    plan.worker_peak_bytes = 0  # Spark's executors and Python workers are not this process's to measure
    plan.workers = 1  # the load merges the runs in this process
    plan.settled = SpilledSettled(plan)
    return plan


Summary = TypeVar("Summary", Decided, Written)


def _by_tasks(rdd: Any, by_task: Callable[..., Iterator[tuple[int, Summary | None]]], total: Summary,
              spill: SpillDir, token: str) -> Summary | None:
    """Each partition of rdd written into the spill directory by its own task (by_task), their summaries merged
    into `total` in partition order; None when a task's executor does not share the directory (the caller then
    brings the rows through the driver: files the others wrote are the caller's to remove)."""
    parts = rdd.mapPartitionsWithIndex(partial(by_task, spill_path=str(spill.path), token=token)).collect()
    if not all(summary is not None for _, summary in parts):
        return None
    for _, summary in sorted(parts, key=lambda t: t[0]):
        total.merge(summary)
    spill.bytes_written += total.bytes
    return total


# ------------------------------------------------------------------------------------------------ the engine


class SparkEngine:
    """Restore planning on Spark. master: any Spark master URL ("local[*]", "spark://host:7077", ...); conf:
    further Spark settings; log_file: where Spark's own logging goes; archive_dir: a restore.archive directory
    whose Parquet copies of sealed segments are read instead of the segment files; spark: an existing
    SparkSession to use (tests share one); memory: the restore's memory limit, from which the session's memory
    settings are derived (spark_conf.memory_conf; `conf` wins) and the driver's buffers sized; work_dir: where
    the plan's spill files go (the settled entries: the driver streams them there, in load order, and keeps none);
    backup_keys: the group's backup keys, which check the archive's seals (default: those the settings find).
    """

    name = "spark"

    def __init__(self, master: str = "local[*]", conf: Mapping[str, str] | None = None,
                 log_file: str | Path = DEFAULT_LOG_FILE, archive_dir: str | Path | None = None,
                 spark: SparkSession | None = None, memory: int = DEFAULT_MEMORY,
                 work_dir: Path | None = None, backup_keys: BackupKeys | None = None,
                 keep_session: bool = False) -> None:
        self.memory, self.work_dir, _ = bounded_resources(memory, work_dir, 1)
        self.master = master
        self.conf = {**memory_conf(master, self.memory), **dict(conf or {})}
        self.log_file = Path(log_file).absolute()
        self.archive_dir = Path(archive_dir) if archive_dir is not None else None
        self.backup_keys = backup_keys  # check the archive's seals (None: those the settings find)
        self._spark = spark
        self._started = False  # the session is this engine's own (started by it), not one it was given
        self.keep_session = keep_session
        self.phase_seconds: dict[str, float] = {}

    # --- the session ---------------------------------------------------------------------------------------
    def session(self) -> SparkSession:
        """The SparkSession (started on first use, quietly: logging and JVM stderr go to log_file)."""
        if self._spark is None:
            self._spark = start_session(self.master, self.conf, self.log_file)
            self._started = True
        return self._spark

    def end_session(self) -> None:
        """End the session this engine started, and its JVM (end_session); one it was given is left alone. After
        each plan unless keep_session: the plan is in spill files, and the load that reads them next must not share
        the restore's memory limit with an idle JVM (a JVM whose heap grew to its limit, and its Python workers).
        The next plan starts a session again."""
        if self._spark is not None and self._started:
            spark, self._spark, self._started = self._spark, None, False
            end_session(spark)

    # --- the plan --------------------------------------------------------------------------------------------
    def plan(self, structure: str, backup: BackupSource, log_dirs: list[Path], replay_from: int, now_ms: int,
             progress: Progress = no_progress) -> RestorePlan:
        try:
            return self._plan(structure, backup, log_dirs, replay_from, now_ms, progress)
        except Exception as e:
            raised = worker_error(e)
            if raised is None:
                raise
            raise raised from None
        finally:
            if not self.keep_session:
                self.end_session()

    def _plan(self, structure: str, backup: BackupSource, log_dirs: list[Path], replay_from: int, now_ms: int,
              progress: Progress) -> RestorePlan:
        spark = self.session()
        sc = spark.sparkContext
        segments, archived = self._log_sources(log_dirs, replay_from)
        with _StageProgress(sc, progress) as phases:
            phases.start(READ_BACKUP)
            copies = self._backup_copies(sc, backup).persist(StorageLevel.MEMORY_AND_DISK)
            n_copies, backup_max = copies.map(lambda kv: int(kv[1][1][1]["l"])).aggregate(
                (0, 0), lambda acc, lrsn: (acc[0] + 1, max(acc[1], lrsn)),
                lambda a, b: (a[0] + b[0], max(a[1], b[1])))
            # The UOWs the base's copies name: the generation rule keeps their older records (plan.Base).
            base = base_of(backup.manifest, list(stream(
                copies.map(lambda kv: kv[1][1][1].get("u", "")).distinct().mapPartitions(_sorted))))
            phases.done(READ_BACKUP)

            phases.start(READ_LOGS)
            max_seen = sc.accumulator(0, _MaxParam())
            raw, archive_max = self._records(spark, segments, archived, structure, replay_from)
            tagged = raw.flatMap(lambda kr: prepared(kr, structure, max_seen, base)).persist(
                StorageLevel.MEMORY_AND_DISK)
            records = tagged.filter(lambda t: t[0] == CURRENT).values()
            per_member: Counter[str] = Counter()
            for counted in stream(records.mapPartitions(log_stats)):
                per_member.update(counted)
            phases.done(READ_LOGS)

            phases.start(SETTLE)
            n_records = sum(per_member.values()) + n_copies
            parts = max(sc.defaultParallelism, n_records // RECORDS_PER_PARTITION,
                        self._input_bytes(backup, segments, archived) // BYTES_PER_PARTITION)
            max_lrsn = max(backup_max, archive_max, max_seen.value)
            restore_lrsn = restore_lrsn_above(max_lrsn, base)
            # The UOWs' outcomes are joined with the entries in Spark, never held by the driver: a shuffle by UOW
            # decides each UOW's outcome and sends it to the entries that need it (a hash join), and the driver
            # only appends the outcomes to spill files as they stream past, and keeps the UOWs still open.
            part_of = partial(partition_of, n=parts)
            older = tagged.filter(lambda t: t[0] == OLDER).values().map(
                lambda kr: (kr[1]["u"], (OLDER_RECORD, kr)))
            uows = (records.flatMap(uow_rows).union(copies.flatMap(copy_need)).union(older)
                    .partitionBy(parts, part_of)
                    .mapPartitionsWithIndex(lambda i, rows: decide_partition(i, rows, structure))
                    .persist(StorageLevel.MEMORY_AND_DISK))
            spill = SpillDir(self.work_dir)
            try:
                token = share(spill)
                decided = self._decided(uows.filter(lambda row: row[0] != "n"), spill, token, parts)
                results = (records.flatMap(lambda kr: [(eid, (0, kr)) for eid in entry_ids(kr[1])])
                           .union(copies.mapValues(lambda pc: (1, pc)))
                           .union(uows.filter(lambda row: row[0] == "n").map(lambda row: (row[1], (2, row[2]))))
                           .partitionBy(parts).mapPartitions(by_key)
                           .flatMap(lambda group: settle_group(group, restore_lrsn, now_ms)))
                written = self._written(results, spill, token, parts)
            except BaseException:
                spill.close()
                raise
            phases.done(SETTLE)
            for rdd in (copies, tagged, uows):
                rdd.unpersist()
        self.phase_seconds = phases.seconds
        return spilled_plan(structure, spill, parts, written, decided, restore_lrsn, per_member, max_lrsn,
                            merge_read_size(self.memory, parts))

    # --- the plan's output -----------------------------------------------------------------------------------
    # Executors that share the driver's spill directory (local[N]; a standalone cluster on this machine) write the
    # plan's spill files themselves and hand back only what the plan sums up: the settled entries and the outcomes
    # never pass through the driver (spill.TaskFiles). Where one does not (another machine), everything comes back
    # through the driver in fetches of bounded bytes (spark_fetch.stream), which it appends to the same files.

    def _decided(self, rows: Any, spill: SpillDir, token: str, parts: int) -> Decided:
        """The UOWs' outcomes in the spill files "decided-<j>"."""
        decided = _by_tasks(rows, decided_by_task, Decided(), spill, token)
        if decided is not None:
            return decided
        remove_files(spill, "decided")
        return write_decided(stream(rows), spill, parts, buffers_for(self.memory) // 2)

    def _written(self, settled: Any, spill: SpillDir, token: str, parts: int) -> Written:
        """The settled entries in the spill files "run-<i>" (each partition's survivors, sorted in load order) and
        "gone-<i>"."""
        written = _by_tasks(settled, runs_by_task, Written(), spill, token)
        if written is not None:
            return written
        remove_files(spill, "run")
        remove_files(spill, "gone")
        return write_runs(stream(settled.mapPartitionsWithIndex(run_of_partition)), spill, parts,
                          buffers_for(self.memory))

    # --- inputs ---------------------------------------------------------------------------------------------
    @staticmethod
    def _input_bytes(backup: BackupSource, segments: list[SegmentTask], archived: list[str]) -> int:
        """Bytes of the files the plan reads (what sizes its shuffle partitions); a file gone since counts 0."""
        total = sum(int(f.get("size", 0)) for f in backup.manifest.get("files") or [] if isinstance(f, dict))
        for p in [t[2] for t in segments] + archived:
            with contextlib.suppress(OSError):
                total += Path(p).stat().st_size
        return total

    def _backup_copies(self, sc: Any, backup: BackupSource) -> Any:
        manifest = backup.manifest
        path = getattr(backup, "path", None)
        if path is not None and manifest.get("files"):
            sizes = [int(f["size"]) for f in manifest["files"]]
            return sc.parallelize(range(len(sizes)), _slices(sc, sizes)).flatMap(
                lambda i: read_backup_file(str(path), manifest, i))
        # Any other BackupSource: read on the driver, then distributed.
        copies = [(c[1]["id"], ((0, n), c)) for n, c in enumerate(backup.copies())]
        return sc.parallelize(copies, max(1, min(sc.defaultParallelism, len(copies))))

    def _log_sources(self, log_dirs: list[Path], replay_from: int) -> tuple[list[SegmentTask], list[str]]:
        """The segments to scan, and the archived (Parquet) segment files to read instead of their segments.
        A sealed segment whose manifest says every LRSN is below replay_from is skipped, as LogReader does. An
        archived file is read only once its seal is checked against the group's backup keys and the log's own
        information on the segment (restore.archive.verified_segment): one that does not pass is refused, with
        its name, before anything is read, never passed over (docs/spark.md, "The log archive")."""
        from restore.archive import refuse_unsafe_archive, verified_segment

        if self.archive_dir is not None:
            refuse_unsafe_archive(self.archive_dir)
        tasks: list[SegmentTask] = []
        archived: list[str] = []
        for member, d in one_log_per_member(log_dirs).items():
            segs = log_segments(Path(d), read_manifest(Path(d)))  # archived segments read where archived
            trusted = trusted_segments(Path(d), read_manifest(Path(d)))
            last = segs[-1][0] if segs else -1
            for segno, path in segs:
                info = trusted.get(segno)
                if segno != last and info is not None and (info.max_lrsn is None or info.max_lrsn < replay_from):
                    continue
                parquet = (verified_segment(self.archive_dir, member, segno, info, self.backup_keys)
                           if self.archive_dir is not None and segno != last else None)
                if parquet is not None:
                    archived.append(str(parquet))
                else:
                    tasks.append((member, segno, str(path.absolute()), segno == last, info))
        return tasks, archived

    def _records(self, spark: SparkSession, segments: list[SegmentTask], archived: list[str], structure: str,
                 replay_from: int) -> tuple[Any, int]:
        """(merged-log order key, record) of the records read from segment files and archived segments, and
        the highest LRSN in range of the archived ones (their irrelevant records are filtered out in the scan)."""
        sc = spark.sparkContext
        rdd = sc.parallelize(segments, _slices(sc, [Path(t[2]).stat().st_size for t in segments])).flatMap(
            lambda t: scan_segment(t, replay_from))
        if not archived:
            return rdd, 0
        from restore.archive import archived_records

        from_archive, archive_max = archived_records(spark, archived, structure, replay_from)
        return rdd.union(from_archive), archive_max


def _sorted(items: Iterable[str]) -> Iterator[str]:
    return iter(sorted(items))


def _slices(sc: Any, sizes: list[int]) -> int:
    """How many tasks read these files: one per file when files are big (a 64 MiB log segment is a good
    task), fewer for many small ones (a task costs even when it reads nothing: BENCHMARKS.md, "spark"), at least
    one per core."""
    wanted = max(sc.defaultParallelism, sum(sizes) // TASK_BYTES)
    return max(1, min(len(sizes), wanted))


# ------------------------------------------------------------------------------------------- session set-up


LOG4J2_TEMPLATE = """\
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log_file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{{ISO8601}} %p %c{{1}}: %m%n
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = warn
"""


def start_session(master: str, conf: Mapping[str, str], log_file: Path) -> SparkSession:
    """Start (or join) a SparkSession whose log output and JVM stderr go to log_file, not the console."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    props = log_file.with_suffix(".log4j2.properties")
    props.write_text(LOG4J2_TEMPLATE.format(log_file=log_file))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    java_opts = f"-Dlog4j2.configurationFile=file:{props}"
    if master.startswith("local"):
        # The one JVM runs every task of a batch job on a few cores, within the restore's memory limit: the serial
        # collector keeps no per-region bookkeeping beside the heap (G1's), and two malloc arenas (LOCAL_JVM_ENV)
        # keep its hundred threads from each growing one of their own. Measured on the plan of 1M messages of
        # 1 KiB within 2 GiB: the JVM's resident memory 1,054 MiB with a heap of 768, 790 with both, no slower.
        java_opts += " -XX:+UseSerialGC"
    spark_conf = SparkConf().setMaster(master).setAppName("cfrestore").setAll([
        ("spark.ui.showConsoleProgress", "false"),
        ("spark.ui.enabled", "false"),
        ("spark.driver.extraJavaOptions", java_opts),
        ("spark.executor.extraJavaOptions", java_opts),
        ("spark.sql.shuffle.partitions", "8"),
        ("spark.python.worker.reuse", "true"),
        # A worker holds the broadcast outcomes and one partition's groups: under PySpark's default 512m, its
        # shuffle writer thinks memory is short and flushes ever smaller batches (a 4x slowdown at 1M records).
        ("spark.python.worker.memory", "2g"),
    ])
    spark_conf.setAll(list(conf.items()))
    # A new SparkContext installs a SIGINT handler of its own in the main thread (it cancels the jobs, then raises
    # KeyboardInterrupt) and leaves it there after the session stops: the process's own is put back, so that
    # Ctrl-C does what the program (cfrestore, a member's RECAUTO, a test run) made it do.
    sigint = signal.getsignal(signal.SIGINT)
    env = LOCAL_JVM_ENV if master.startswith("local") else {}
    try:
        # The JVM inherits stderr and the environment when it starts: its early warnings go to the file too
        with _stderr_to(log_file), _environment(env):
            spark = SparkSession.builder.config(conf=spark_conf).getOrCreate()
    finally:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not sigint:
            signal.signal(signal.SIGINT, signal.SIG_DFL if sigint is None else sigint)
    if not master.startswith("local"):
        # Executors on other machines import this code: ship the project's packages with the job.
        spark.sparkContext.addPyFile(str(_packages_zip(log_file.parent)))
    return spark


def end_session(spark: SparkSession) -> None:
    """Stop the session and end the JVM PySpark launched for it. PySpark keeps that JVM for the life of the process
    (a stopped session's too, with the heap it grew to); it exits when its stdin closes (pyspark.java_gateway
    launches it so), and the next session launches another."""
    from pyspark import SparkContext

    spark.stop()
    gateway = SparkContext._gateway
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)
    with contextlib.suppress(Exception):  # its connections closed; the JVM may be gone already
        gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is None:
        return
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: What a local master's JVM (and the Python workers it starts) gets in its environment unless this process has
#: it set already: glibc's malloc otherwise gives each allocating thread an arena of its own, up to eight a core.
LOCAL_JVM_ENV = {"MALLOC_ARENA_MAX": "2"}


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """values in os.environ for the block (for a process started in it), where not set already."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _packages_zip(work_dir: Path) -> Path:
    """The project's packages as one zip (Spark serves it to the executors while the session lives)."""
    root = Path(__file__).resolve().parent.parent
    path = work_dir / "cfrestore-packages.zip"
    tmp = path.with_suffix(".zip.tmp")
    with zipfile.ZipFile(tmp, "w") as z:
        for package in ("cfemu", "sqm", "backup", "restore"):
            for f in sorted((root / package).rglob("*")):
                if f.suffix in (".py", ".lua"):
                    z.write(f, f.relative_to(root))
    os.replace(tmp, path)
    return path


class _StageProgress:
    """Reports the Spark jobs of the current restore phase (tasks done / total) through progress(), from a
    polling thread; records each phase's wall time in `seconds`."""

    def __init__(self, sc: Any, progress: Progress) -> None:
        self.sc = sc
        self.progress = progress
        self.phase: str | None = None
        self.seconds: dict[str, float] = {}
        self._started = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="spark-progress", daemon=True)
        self._run = uuid.uuid4().hex[:8]  # job groups of this plan only (the tracker remembers earlier plans')

    def __enter__(self) -> _StageProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sc.setLocalProperty("spark.jobGroup.id", None)

    def start(self, phase: str) -> None:
        with self._lock:
            self.phase = phase
            self._started = time.monotonic()
        self.sc.setJobGroup(self._group(phase), f"cfrestore: {phase}")
        self.progress(phase, 0, None)

    def done(self, phase: str) -> None:
        with self._lock:  # after any report the poller is making: the final report is the last one
            self.seconds[phase] = time.monotonic() - self._started
            self.phase = None
            _, total = self._tasks(phase)
            self.progress(phase, total, total)

    def _group(self, phase: str) -> str:
        return f"cfrestore-{self._run}-{phase}"

    def _tasks(self, phase: str) -> tuple[int, int]:
        tracker = self.sc.statusTracker()
        done = total = 0
        for job_id in tracker.getJobIdsForGroup(self._group(phase)):
            job = tracker.getJobInfo(job_id)
            if job is None:
                continue
            for stage_id in job.stageIds:
                stage = tracker.getStageInfo(stage_id)
                if stage is not None:
                    done += stage.numCompletedTasks
                    total += stage.numTasks
        return done, total

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            with self._lock:
                if self.phase is not None:
                    done, total = self._tasks(self.phase)
                    if total:
                        self.progress(self.phase, done, total)


def make_engine(**options: Any) -> SparkEngine:
    return SparkEngine(**options)


register_engine("spark", make_engine)
