"""The columnar restore engine: the plan of restore.plan as one relational plan over Arrow data, run by DuckDB.

Final disposition is a join of the backup's copies and the log's entry records with the outcomes of their UOWs,
ordered per entry and folded. Here every step of the reference (restore.plan.plan_local, restore.settle) is a
SQL statement over columns, so that no Python runs per record past the readers:

  read     the log segments and the backup's files are read by threads side by side, decoded in C into Arrow
           columns (restore.columns): a record a row of `recs`, its structures rows of `ss`, each entry it names a
           row of `ev`, each descriptor it or the backup carries a row of `descs` (its fields as columns, and
           where its bytes and its data are in the file: they are read back for the survivors only); then the
           records that matter (plan.relevant), with what the registry says of their kinds (kinds_table);
  base     the generation rule (plan.current_incarnation) as a predicate over `recs`; older outcome records kept
           aside count for the UOWs a relog copy shows holding an entry (plan.older_outcome, copy_holder);
  outcome  each UOW's outcome (settle.decide_outcome): a RECOVERY record's decision first, where the relogs of
           that decision count; else the owner's last run of records of one kind; the entries the decision's
           records carry, by the same precedence;
  fold     per entry, the best copy (settle.with_logged_copies), the UOWs it names (settle.uows_named: those
           without an outcome were in flight and are backed out by restore), the events in (LRSN, rank) order,
           an outcome never at or below its UOW's own operations; then the redo rule and the transitions of
           settle.settle, one event per entry at a time, a range of entries at a time (its memory bound:
           fold_rows_for): for the short histories (most entries) as one plain join of the states with their k-th
           events a step, for the longer ones as a recursive query keyed by entry;
  final    settle._final's rules; a UOW's control entry goes through sqm.conversations.uowstatus in Python
           (those entries only); the survivors in the CF's order (settle.load_key).

DuckDB keeps its tables in memory and spills them and its operators to the spill directory within the memory it
is given (a share of `--memory-limit`); the plan streams its survivors in load order from there.
The result equals plan_local's for the same input (tests/restore/test_engine_columnar.py).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import duckdb
import msgpack
import pyarrow as pa

from backup.files import Backup, entry_path
from cfemu.bulk import Staged
from cfemu.progress import Progress, no_progress
from cfemu.settings import ENV_MEMORY_LIMIT
from cfemu.uow_attributes import CONTROL_SUFFIX
from restore import columnar_staged
from restore.columns import (
    ENTRY_ID_SQL,
    SRC_BACKUP,
    SRC_DD,
    SRC_E,
    SRC_I,
    SRC_IDS,
    TABLES,
    Pieces,
    Scanned,
    Source,
    copies_as_frames,
    log_segments_read,
    read_back,
    require_readers,
    scan_backup_file,
    scan_segment,
)
from restore.engine import (
    READ_BACKUP,
    READ_LOGS,
    SETTLE,
    BackupSource,
    _counted,
    bounded_resources,
    register_engine,
)
from restore.partitioned import DEFAULT_MEMORY
from restore.plan import (
    BACKOUT,
    INDOUBT,
    Base,
    RestorePlan,
    SummarizedPlan,
    base_lrsn,
    base_of,
    restore_lrsn_above,
)
from restore.settle import (
    CONSUMED,
    EXPIRED,
    GONE,
    HELD_INDOUBT,
    PUT_BACKED_OUT,
    RESTORED,
    STATUS_DROPPED,
    Outcome,
    Settled,
)
from restore.spill import SpillDir
from restore.sql_statements import split_statements
from sqm.conversations.uowstatus import is_control_queue, restore_control_entry
from sqm.core.records import KINDS, OUTCOME_RANK, Role
from sqm.log import LogReader, one_log_per_member

FETCH_ROWS = 4_096  # survivors fetched at a time as the load reads them
CONTROL = "control"  # the fold's disposition of a surviving control entry, until uowstatus has ruled on it
# The fields the fold sets, as bits of a state's mask: the final descriptor is the base descriptor with these set.
ST, U, L, O1, O2, BC = 1, 2, 4, 8, 16, 32
FIELDS = (("st", ST), ("u", U), ("l", L), ("o1", O1), ("o2", O2), ("bc", BC))
# The redo steps of the fold's ENTRY kinds (settle.settle): a kind not here stops the plan.
REDO_KINDS = ("PUT", "GET", "EXPIRE")
# The types of a record's kind and role in the plan's tables: the registry's kinds and the roles as ENUMs, one byte
# each where a string takes sixteen.
KIND_ENUM, ROLE_ENUM = "record_kind", "record_role"
# A record's member (whose log it is in) as an ENUM of the members whose logs are read (MEMBER_ENUM), and whether
# its outcome field "o" is a commit as a boolean: one byte each where a string takes sixteen, on every record.
MEMBER_ENUM = "log_member"
RID_BITS = 36  # a scan's records get ids (job << RID_BITS) + i: distinct across scans, in order within one

_PACK = msgpack.Packer(use_bin_type=True, unicode_errors="surrogateescape").pack


def kinds_table() -> pa.Table:
    """What the plan needs of each kind of record, from the registry (sqm.core.records.KINDS): its role, fold rank,
    whether it is a copy, carries data, outranks the owner; the outcome it decides (dec_c when its "o" is a commit,
    dec_b otherwise: one value for most kinds); where its entry ids and its descriptors are (the readers' src
    codes: restore.columns). Each kind's own functions are asked about a record that has every field."""
    probe: dict[str, Any] = {"l": 1, "u": "U", "s": "S", "g": 1, "e": {"id": "E", "q": "Q", "u": "EU"},
                             "d": b"", "i": "I", "q": "Q", "ids": ["X"], "dd": [["S", {"id": "D", "q": "Q"}, b""]],
                             "ss": {"S": 1}, "by": "B", "of": "O", "x": "x", "r": "r"}
    id_src = {"E": SRC_E, "I": SRC_I, "X": SRC_IDS, "D": SRC_DD}
    rows: dict[str, list[Any]] = {c: [] for c in ("k", "role", "rank", "copy", "carries", "outranks", "dec_c", "dec_b",
                                                  "idsrc", "descsrc")}
    for code, kind in KINDS.items():
        rec = {**probe, "k": code}
        ids = kind.entry_ids(rec)
        descs = kind.descriptors(rec)
        rows["k"].append(code)
        rows["role"].append(kind.role.value)
        rows["rank"].append(kind.fold_rank)
        rows["copy"].append(kind.copy)
        rows["carries"].append(kind.carries_data)
        rows["outranks"].append(kind.outranks_owner)
        rows["dec_c"].append(kind.decides({**rec, "o": "C"}) if kind.decides is not None else None)
        rows["dec_b"].append(kind.decides({**rec, "o": "B"}) if kind.decides is not None else None)
        rows["idsrc"].append(id_src[ids[0]] if ids else None)
        rows["descsrc"].append((SRC_E if descs[0]["id"] == "E" else SRC_DD) if descs else None)
        if kind.role is Role.ENTRY and kind.structure(rec) != "S":
            raise AssertionError(f"the columnar plan reads an entry record's structure from 's', not so for {code}")
    return pa.table(rows, schema=pa.schema([("k", pa.string()), ("role", pa.string()), ("rank", pa.int8()),
                                            ("copy", pa.bool_()), ("carries", pa.bool_()), ("outranks", pa.bool_()),
                                            ("dec_c", pa.string()), ("dec_b", pa.string()), ("idsrc", pa.int64()),
                                            ("descsrc", pa.int64())]))


@dataclass(frozen=True)
class _Job:
    """One scan: a log segment, a backup entry file, or the copies of a backup that is not on disk."""

    n: int  # its rids start at n << RID_BITS; its sources are 2n (the file) and 2n + 1 (records packed again)
    log_dir: Path | None = None
    segment: int = 0
    path: Path | None = None
    member: str = ""
    is_last: bool = False
    backup_file: dict[str, Any] | None = None


def _scan(job: _Job, emit: Callable[[Scanned], None], *, backup_dir: Path | None, structure: str, replay_from: int,
          spill: Path) -> list[tuple[int, Source]]:
    """A job's tables, handed to `emit` a chunk at a time (in any thread: the C reader lets go of the GIL); returns
    the sources their bytes are in."""
    if job.backup_file is not None:
        assert backup_dir is not None
        scan_backup_file(backup_dir, job.backup_file, first_rid=job.n << RID_BITS, source=2 * job.n,
                         structure=structure, emit=emit)
        return [(2 * job.n, Source(str(entry_path(backup_dir, job.backup_file["name"]))))]
    assert job.log_dir is not None and job.path is not None
    sources = scan_segment(job.log_dir, job.segment, job.path, job.member, is_last=job.is_last, min_lrsn=replay_from,
                           first_rid=job.n << RID_BITS, source=2 * job.n, spill=spill, emit=emit)
    return [(2 * job.n + k, src) for k, src in enumerate(sources)]


class _Stopped(Exception):
    """The plan stopped while a reader waited to hand over its rows."""


class _Readers:
    """`workers` threads that read the jobs side by side, each chunk's tables handed over through a queue of a few
    (so that what waits to be inserted stays bounded); results() gives ("rows", Scanned) and ("done", job,
    sources) as they come, and raises a reader's failure."""

    def __init__(self, jobs: list[_Job], workers: int,
                 scan: Callable[[_Job, Callable[[Scanned], None]], list[tuple[int, Source]]]) -> None:
        self.queue: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=2 * workers)
        self.stopping = threading.Event()
        self.jobs, self.scan = iter(jobs), scan
        self.lock = threading.Lock()
        self.count = len(jobs)
        self.threads = [threading.Thread(target=self._run, name=f"restore-read-{k}", daemon=True)
                        for k in range(min(workers, len(jobs)))]
        for t in self.threads:
            t.start()

    def _put(self, item: tuple[Any, ...]) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise _Stopped

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                with self.lock:
                    job = next(self.jobs, None)
                if job is None:
                    return
                sources = self.scan(job, lambda sc: self._put(("rows", sc)))
                self._put(("done", job, sources))
        except _Stopped:
            return
        except BaseException as e:  # handed to results(), which raises it
            with contextlib.suppress(_Stopped):
                self._put(("failed", e))

    def results(self) -> Iterator[tuple[Any, ...]]:
        done = 0
        while done < self.count:
            item = self.queue.get()
            if item[0] == "failed":
                raise item[1]
            done += item[0] == "done"
            yield item

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join()


# ------------------------------------------------------------------------------------------------ the plan
# Each statement is one step of the reference; $-names are bound by _run. Tables: re and ro (a record a row: an
# entry record, an outcome record; `seq` its place in the merged log), eev (an entry a record names, with the
# record), descs (a descriptor a row, where the readers put it: a backup's copy, "B" where the fold names its
# source; the one an entry record carries, a put's "P" or a relog copy's "R"; a copy an outcome record carries,
# "D"), base_uows (plan.Base.carried). A descriptor is found by its record's rid alone, but for a "D": an outcome
# record may carry several (the fold's states name theirs by source label, rid and entry id).

# An entry's state before any event (the fold's start): its best copy b (or none), of which a copy that is expired
# is not folded.
BEST_STATE = """0::BIGINT AS ord, b.st, b.u, b.l, b.o1, b.o2, b.bc, b.src, b.rid, 0::BIGINT AS mask,
       CASE WHEN b.st = 'EX' THEN 'expired' ELSE 'gone' END AS fate"""

PLAN_SQL = """
-- the readers' rows as the plan takes them: the records that matter for the structure (plan.relevant), each
-- with what its kind's row says of it, then the entries each names (kind.entry_ids, once each, and of an outcome
-- record the entries it carries of this structure, plan.restrict), then the descriptors (a backup's copy "B", a
-- put's "P", a relog copy "R", a copy an outcome record carries "D": the last it carries of each entry)
-- the UOWs whose outcome is applied on the CF (their END records, each kept by the generation rule), and how many
-- of those records each member logged (members, below): re and ro hold the records the rest of the plan reads
CREATE TABLE endrecs AS SELECT x.u, x.m FROM raw_recs x JOIN kinds kd USING (k) WHERE kd.role = 'end';
-- only an owner's END ends a UOW for the in-commit tombstones (plan.ends_for_its_owner): a peer's does not
CREATE TABLE ended AS SELECT DISTINCT u FROM endrecs WHERE split_part(u, '.', 1) = m;
CREATE TABLE ends AS SELECT m, count(*) AS n FROM endrecs GROUP BY m;
DROP TABLE endrecs;
-- the records the rest of the plan reads, the entry records of the structure (re) apart from the outcome records
-- (ro), each with what its kind's row says of it that the plan reads of it, and `kept`: the generation rule
-- (plan.current_incarnation), by an entry record's own generation and by an outcome record's of the structure
CREATE TABLE re AS
SELECT x.rid, x.l, x.m, x.k, x.u, CASE WHEN kd.copy THEN coalesce(x.eu, '') ELSE '' END AS holder,
       ($G <= 0 OR coalesce(x.u IN (SELECT u FROM base_uows), false) OR x.g IS NULL OR (x.g <> 0 AND x.g >= $G))
         AS kept
FROM raw_recs x JOIN kinds kd USING (k) WHERE kd.role = 'entry' AND x.mine;
CREATE TABLE ro AS
SELECT x.rid, x.l, x.m, x.k, x.u, x."at", CASE WHEN x.oc THEN kd.dec_c ELSE kd.dec_b END AS dec, kd.outranks,
       x.by AS dby,
       ($G <= 0 OR coalesce(x.u IN (SELECT u FROM base_uows), false) OR sg.g IS NULL OR sg.g = 0 OR sg.g >= $G)
         AS kept
FROM raw_recs x JOIN kinds kd USING (k) LEFT JOIN (SELECT rid, g FROM raw_ss WHERE s = $S) sg USING (rid)
WHERE kd.role = 'outcome';
DROP TABLE raw_recs;
-- the records on each entry (plan_local's by_entry; `kept` as re and ro say: an outcome record not kept still
-- counts for the entries a decision's records carry, odata below), each entry a record names once: a record names
-- an entry once where it names it by its descriptor ("e") or "i", and a list ("ids", "dd") may name one twice
DELETE FROM raw_ev WHERE src IN ($SRC_IDS, $SRC_DD) AND rowid NOT IN (
  SELECT min(rowid) FROM raw_ev WHERE src IN ($SRC_IDS, $SRC_DD) GROUP BY rid, src, eid, dds);
CREATE TABLE eev AS
SELECT e.eid, r.rid, r.l, r.k, kd.role, r.u, kd.rank, kd.copy, kd.carries, r.kept
FROM raw_ev e JOIN re r USING (rid) JOIN kinds kd USING (k) WHERE e.src = kd.idsrc
UNION ALL
SELECT e.eid, r.rid, r.l, r.k, kd.role, r.u, kd.rank, kd.copy, kd.carries, r.kept
FROM raw_ev e JOIN ro r USING (rid) JOIN kinds kd USING (k) WHERE e.src = $SRC_DD AND e.dds = $S;
-- (an entry record's structure is $S: re keeps no other)
-- the descriptors, where the readers put them (their src: $SRC_BACKUP a backup's copy "B", $SRC_E the one an
-- entry record carries, a put's "P" or a relog copy's "R", $SRC_DD a copy an outcome record carries "D"), less
-- those no statement reads: an entry record's of another structure, and of an outcome record's copies those of
-- another structure and all but the last it carries of each entry; named by their labels where they are read
DELETE FROM raw_descs
WHERE src = $SRC_E AND rid NOT IN (SELECT rid FROM re JOIN kinds USING (k) WHERE descsrc = $SRC_E);
CREATE TABLE dkeep AS
SELECT d.rid, d.eid, max(d.pos) AS pos FROM raw_descs d JOIN ro USING (rid)
WHERE d.src = $SRC_DD AND d.s = $S GROUP BY d.rid, d.eid;
DELETE FROM raw_descs d WHERE d.src = $SRC_DD AND NOT EXISTS (
  SELECT 1 FROM dkeep k WHERE k.rid = d.rid AND k.eid = d.eid AND k.pos = d.pos);
DROP TABLE dkeep;
ALTER TABLE raw_descs RENAME TO descs;
DROP TABLE raw_ev;

-- the UOWs a relog copy of this incarnation shows holding an entry: their older outcome records count
CREATE TABLE holders AS SELECT DISTINCT holder AS u FROM re WHERE kept AND holder <> '';
-- (each with where it lies in the merged log, `seq`: by (LRSN, member, segment, offset), which is (LRSN, rid), since
-- the readers number the records of each member's log in order, the members' logs in the order of their names
-- (ColumnarEngine._jobs): no sort needed)
CREATE TABLE orecs AS
SELECT *, l::HUGEINT * 18446744073709551616 + rid AS seq FROM ro
WHERE kept OR u IN (SELECT u FROM holders);

-- settle.decide_outcome: a decision that outranks the owner's (RECOVERY): its first by (LRSN, by) decides
CREATE TABLE firsts AS
SELECT u, dec AS kind, dby AS decided_by, l AS fl FROM (
  SELECT u, dec, dby, l, row_number() OVER (PARTITION BY u ORDER BY l, dby, seq) AS rn FROM orecs WHERE outranks)
WHERE rn = 1;
CREATE TABLE oa AS
SELECT f.u, f.kind, f.decided_by, f.fl,
       CASE WHEN bool_or(o.at IS NOT NULL) FILTER (WHERE o.outranks AND o.dec = f.kind)
            THEN min(coalesce(nullif(o.at, 0), o.l)) FILTER (WHERE o.outranks AND o.dec = f.kind)
            ELSE coalesce(min(o.l) FILTER (WHERE NOT o.outranks AND o.dec = f.kind AND o.l < f.fl), f.fl)
       END AS lrsn
FROM firsts f JOIN orecs o USING (u) GROUP BY f.u, f.kind, f.decided_by, f.fl;
-- else the owner's last record decides, and counts where the first of its run of one kind counts
CREATE TABLE own AS
SELECT * FROM orecs WHERE NOT outranks AND dec IS NOT NULL AND u NOT IN (SELECT u FROM firsts);
CREATE TABLE lastrec AS
SELECT u, arg_max(dec, seq) AS kind, arg_max(k, seq) AS lk, arg_max(m::VARCHAR, seq) AS decided_by FROM own GROUP BY u;
CREATE TABLE ob AS
WITH brk AS (SELECT o.u, max(o.seq) AS b FROM own o JOIN lastrec x USING (u) WHERE o.k <> x.lk GROUP BY o.u)
SELECT x.u, x.kind, x.decided_by, coalesce(brk.b, -1) AS b, min(coalesce(nullif(o.at, 0), o.l)) AS lrsn
FROM lastrec x JOIN own o USING (u) LEFT JOIN brk USING (u)
WHERE o.seq > coalesce(brk.b, -1)
GROUP BY x.u, x.kind, x.decided_by, brk.b;
CREATE TABLE structs AS
SELECT o.u, coalesce(list_sort(list_distinct(list(x.s) FILTER (WHERE x.s IS NOT NULL))),
                     []::VARCHAR[]) AS structures
FROM orecs o LEFT JOIN raw_ss x USING (rid) GROUP BY o.u;
DROP TABLE raw_ss;
CREATE TABLE outc AS
SELECT o.u, o.kind, o.lrsn, o.decided_by, s.structures FROM (
  SELECT u, kind, lrsn, decided_by FROM oa UNION ALL SELECT u, kind, lrsn, decided_by FROM ob) o
JOIN structs s USING (u);
-- the entries a decision's records carry: the owner's own of that decision first (by LRSN), then the decision's
-- relogs (by LRSN, by), and of the owner's run its last
CREATE TABLE odata AS
SELECT u, eid, rid FROM (
  SELECT *, row_number() OVER (PARTITION BY u, eid ORDER BY grp, l, dby, ord) AS rn FROM (
    SELECT o.u, e.eid, o.rid, CASE WHEN o.outranks THEN 1 ELSE 0 END AS grp, o.l, coalesce(o.dby, '') AS dby,
           o.seq AS ord
    FROM orecs o JOIN oa USING (u) JOIN eev e ON e.rid = o.rid
    WHERE o.dec = oa.kind AND (o.outranks OR o.l < oa.fl)
    UNION ALL
    SELECT o.u, e.eid, o.rid, 0, 0, '', -o.seq
    FROM own o JOIN ob USING (u) JOIN eev e ON e.rid = o.rid WHERE o.seq > ob.b))
WHERE rn = 1;
-- (each table is dropped after the last statement that reads it: DuckDB's share of a small memory limit goes to
-- the statements that follow rather than to spilling what no statement reads again)
DROP TABLE holders; DROP TABLE firsts; DROP TABLE oa; DROP TABLE own; DROP TABLE lastrec; DROP TABLE ob;
DROP TABLE structs; DROP TABLE orecs;

DELETE FROM eev WHERE NOT kept;
-- the records and their entry ids are not read past here: their memory goes to the statements that follow
CREATE TABLE members AS
SELECT m, sum(n)::BIGINT AS n FROM (
  SELECT m, count(*) AS n FROM re WHERE kept GROUP BY m UNION ALL SELECT m, count(*) FROM ro WHERE kept GROUP BY m
  UNION ALL SELECT m, n FROM ends)
GROUP BY m;
DROP TABLE ends;
DROP TABLE re;
DROP TABLE ro;
-- (with what quick asks of each: how many records name it and how many backup copies it has, and of the one
-- record that may be its only one, the rid, kind, UOW, LRSN, and whether it is a PUT, GET or EXPIRE rather than a
-- copy or an outcome)
CREATE TABLE ents AS
SELECT eid, row_number() OVER () AS eix, count(rid) AS nrec, count(*) - count(rid) AS nb, any_value(rid) AS rid,
       any_value(k) AS k, any_value(u) AS u, any_value(l) AS l, bool_and(plain) AS plain
FROM (
  SELECT eid, NULL::BIGINT AS rid, NULL::$KIND_ENUM AS k, NULL::VARCHAR AS u, NULL::BIGINT AS l,
         NULL::BOOLEAN AS plain
  FROM descs WHERE src = $SRC_BACKUP
  UNION ALL
  SELECT eid, rid, k, u, l, role = 'entry' AND NOT copy FROM eev)
GROUP BY eid;
-- the best copy: the backup's of the latest transition, else a relog pass's (settle.with_logged_copies)
CREATE TABLE best AS
SELECT eid, src, rid, st, u, l, o1, o2, bc FROM (
  SELECT *, row_number() OVER (PARTITION BY eid ORDER BY l DESC, grp, ord) AS rn FROM (
    SELECT eid, 'B' AS src, rid, st, u, l, o1, o2, bc, 0 AS grp, rid AS ord FROM descs WHERE src = $SRC_BACKUP
    UNION ALL
    SELECT d.eid, 'R', d.rid, d.st, d.u, d.l, d.o1, d.o2, d.bc, 1, e.l::HUGEINT * 18446744073709551616 + e.rid
    FROM eev e JOIN descs d ON d.src = $SRC_E AND d.rid = e.rid AND d.eid = e.eid WHERE e.copy))
WHERE rn = 1;
-- the UOWs each entry's fold needs (settle.uows_named), and the highest LRSN of each one's operations on it
CREATE TABLE named AS
SELECT eid, u, max(top) AS top FROM (
  SELECT eid, u, CASE WHEN role = 'entry' AND NOT copy THEN l END AS top FROM eev
  WHERE u IS NOT NULL AND u <> '' AND (role = 'entry' OR carries)
  UNION ALL
  SELECT eid, u, l FROM best WHERE u IS NOT NULL AND u <> '')
GROUP BY eid, u;
-- UOWs with no outcome were in flight: restore backs them out, at its own LRSN (plan.in_flight_outcome)
CREATE TABLE inflight AS
SELECT DISTINCT u FROM named WHERE u NOT IN (SELECT u FROM outc);
INSERT INTO outc SELECT u, 'B', $R, 'restore', []::VARCHAR[] FROM inflight;

-- the commonest histories folded in one step, their events not ordered (settle._committed_put, and the same for a
-- get): an entry whose one record is a PUT, with no copy, its UOW committed (CP where the commit counts, first
-- in FIFO order there, put order kept), and an entry whose one record is a GET above its backup copy, a committed
-- copy held by no UOW, the GET's UOW committed (consumed). The commit counts above the UOW's own operation on the
-- entry, as in evs. The event by event fold below gives the same (test_the_one_step_fold_agrees_with_the_fold).
-- One join a statement, each of a materialized table (its size exact, not a filter's guess) with a smaller one:
-- DuckDB holds the memory it is given only where a statement builds one large hash table at a time: it does not
-- spill a hash table it misjudged as small, and two at once (the entries' and a join's output) overrun its share
-- (BENCHMARKS.md, "The columnar engine holds its memory limit"). An entry whose one record is plain has no relog
-- copy: its best copy is its backup copy, if any (nb).
CREATE TABLE commits AS SELECT u, lrsn FROM outc WHERE kind = 'C';
CREATE TABLE qone AS
SELECT eix, eid, k, u, l, rid FROM ents
WHERE nrec = 1 AND plain AND u <> '' AND ((k = 'PUT' AND nb = 0) OR (k = 'GET' AND nb > 0));
CREATE TABLE qcommitted AS SELECT x.*, o.lrsn FROM qone x JOIN commits o USING (u);
DROP TABLE qone;
DROP TABLE commits;
CREATE TABLE quick AS
SELECT eix, eid, 2::BIGINT AS ord, 'CP' AS st, '' AS u, greatest(lrsn, l + 1) AS l, greatest(lrsn, l + 1) AS o1,
       l AS o2, NULL::BIGINT AS bc, 'P' AS src, rid, $ST | $U | $L | $O1 | $O2 AS mask, 'gone' AS fate
FROM qcommitted WHERE k = 'PUT';
INSERT INTO quick
SELECT x.eix, x.eid, 2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 'consumed'
FROM qcommitted x JOIN best b USING (eid)
WHERE x.k = 'GET' AND b.st = 'CP' AND coalesce(b.u, '') = '' AND b.l < x.l;
DROP TABLE qcommitted;

-- the events of each other entry (its records': PUT, GET, EXPIRE at their LRSN, by rank, and its UOWs' outcomes,
-- never at or below the UOW's own operations on it), each with its place in the fold's order (records of one
-- LRSN and rank by rid: their merged-log order); `slow` holds the entries quick did not fold (a few, where quick
-- holds most: joined by id, a smaller table to build), `folds` those of them whose best copy is not expired (an
-- expired copy is not folded: its entry has no events). One or two joins a statement, as above: the events made
-- in one statement of eight joins and a window held 54-68 MiB, mostly hash tables, whatever the history's size
-- (each join's partitions, one set per thread), against DuckDB's floor of 64 MiB (DUCKDB_MIN_MEMORY).
CREATE TABLE slow AS SELECT eix, eid FROM ents ANTI JOIN quick USING (eix);
DROP TABLE ents;
CREATE TABLE folds AS SELECT eix, eid FROM slow ANTI JOIN (SELECT eid FROM best WHERE st = 'EX') USING (eid);
CREATE TABLE evd AS
SELECT f.eix, e.eid, e.l AS pos, e.rank, e.rid AS tie, e.k::VARCHAR AS kind, e.u AS eu, NULL::VARCHAR AS ok,
       CASE WHEN d.rid IS NOT NULL THEN 'P' END AS d_src, d.rid AS d_rid, d.st AS d_st, d.u AS d_u, d.l AS d_l,
       d.o1 AS d_o1, d.o2 AS d_o2, d.bc AS d_bc
FROM eev e JOIN folds f USING (eid)
LEFT JOIN descs d ON e.k = 'PUT' AND d.src = $SRC_E AND d.rid = e.rid AND d.eid = e.eid
WHERE e.role = 'entry' AND NOT e.copy;
DROP TABLE eev;
CREATE TABLE evo AS
SELECT f.eix, n.eid, CASE WHEN o.lrsn > coalesce(n.top, 0) THEN o.lrsn ELSE coalesce(n.top, 0) + 1 END AS pos,
       n.u, o.kind
FROM named n JOIN folds f USING (eid) JOIN outc o USING (u) WHERE o.kind <> 'D';
DROP TABLE named;
INSERT INTO evd
SELECT x.eix, x.eid, x.pos, $OUTCOME_RANK, NULL, 'O', x.u, x.kind, CASE WHEN d.rid IS NOT NULL THEN 'D' END, d.rid,
       d.st, d.u, d.l, d.o1, d.o2, d.bc
FROM evo x LEFT JOIN odata od ON x.kind = 'B' AND od.u = x.u AND od.eid = x.eid
LEFT JOIN descs d ON d.src = $SRC_DD AND d.rid = od.rid AND d.eid = x.eid;
DROP TABLE evo;
CREATE TABLE evs AS
SELECT eix, row_number() OVER (PARTITION BY eix ORDER BY pos, rank, tie, eu) AS ord, * EXCLUDE (eix) FROM evd;
DROP TABLE evd;
DROP TABLE folds;

-- the fold (settle.settle): an entry no event names stays as its best copy is (still: a copy that is expired is
-- not folded), those folded in one step are as quick says, and the others are folded by FOLD_SQL into folded, a
-- range of them at a time; still and quick carry each entry's id, and touched the ids of those folded's hold, so
-- that fin joins no state with ents for its entry's id
CREATE TABLE touched AS SELECT eix, any_value(eid) AS eid, max(ord) AS cnt FROM evs GROUP BY eix;
-- (and the state each of those starts from: its best copy, or none; made once here, not a range at a time)
CREATE TABLE starts AS
SELECT t.eix, t.eid, t.cnt, $BEST_STATE
FROM touched t LEFT JOIN best b USING (eid);
CREATE TABLE still AS
SELECT n.eix, n.eid, $BEST_STATE
FROM slow n LEFT JOIN best b USING (eid) ANTI JOIN touched t USING (eix);
CREATE TABLE folded AS SELECT * EXCLUDE (eid) FROM still LIMIT 0;
DROP TABLE best;
DROP TABLE slow;
""".replace("$BEST_STATE", BEST_STATE).replace("$KIND_ENUM", KIND_ENUM)  # bound here, the others by _run

# The fold of the entries some event names, eix from $LO to below $HI (a range holds its entries' states and
# events in memory, hence the ranges). settle.settle's transition (STEP_SQL) is applied to each entry's state once
# for each of its events: for the short histories (most entries: a put and its commit, a get and its commit) as
# statements, the k-th joining the states with the k-th events; for the longer ones as a recursive query keyed by
# entry, one event of every entry at a time.
UNROLLED = 6  # histories of up to this many events are folded without recursion
EVENT = ("kind", "pos", "eu", "ok", "d_src", "d_rid", "d_st", "d_u", "d_l", "d_o1", "d_o2", "d_bc")
STATE = ("st", "u", "l", "o1", "o2", "bc", "src", "rid", "mask", "fate")
STATE_IN = ("st0", "u0", "l0", "o1_0", "o2_0", "bc0", "src0", "rid0", "mask0", "fate")

# One event on one state (settle.settle): $SOURCE has eix, ord, the event's columns (EVENT) and the state before
# it (STATE_IN); the result, eix, ord and the state after it (STATE).
STEP_SQL = """
SELECT eix, ord,
  CASE WHEN c_cp THEN 'CP' WHEN c_none THEN NULL WHEN c_put THEN 'UP' WHEN c_get THEN 'UG' ELSE st1 END AS st,
  CASE WHEN c_cp THEN '' WHEN c_put OR c_get THEN eu ELSE u1 END AS u,
  CASE WHEN c_cp OR c_put OR c_get THEN pos ELSE l1 END AS l,
  CASE WHEN c_commit THEN pos WHEN c_put THEN 0 ELSE o1_1 END AS o1,
  CASE WHEN c_put THEN pos ELSE o2_1 END AS o2,
  CASE WHEN c_put THEN d_bc WHEN c_back THEN bc1 + 1 ELSE bc1 END AS bc,
  CASE WHEN c_put THEN d_src ELSE src1 END AS src,
  CASE WHEN c_put THEN d_rid ELSE rid1 END AS rid,
  CASE WHEN c_put THEN $ST | $U | $L | $O1 | $O2
       WHEN c_commit THEN mask1 | $ST | $U | $L | $O1
       WHEN c_back THEN mask1 | $ST | $U | $L | $BC
       WHEN c_get THEN mask1 | $ST | $U | $L ELSE mask1 END AS mask,
  CASE WHEN c_consumed THEN 'consumed' WHEN c_backed_out THEN 'put-backed-out' WHEN c_exp THEN 'expired'
       ELSE fate END AS fate
FROM (
  SELECT *, c_commit OR c_back AS c_cp, c_consumed OR c_backed_out OR c_exp AS c_none
  FROM (
    SELECT *,
      held AND ok = 'C' AND st1 = 'UP' AS c_commit,
      held AND ok = 'C' AND st1 = 'UG' AS c_consumed,
      held AND ok = 'B' AND st1 = 'UP' AS c_backed_out,
      held AND ok = 'B' AND st1 = 'UG' AS c_back,
      NOT skip AND kind = 'PUT' AND st1 IS NULL AS c_put,
      NOT skip AND kind = 'GET' AND st1 = 'CP' AS c_get,
      NOT skip AND kind = 'EXPIRE' AND st1 = 'CP' AS c_exp
    FROM (
      SELECT *,
        CASE WHEN rep THEN d_st ELSE st0 END AS st1,
        CASE WHEN rep THEN d_u ELSE u0 END AS u1,
        CASE WHEN rep THEN d_l ELSE l0 END AS l1,
        CASE WHEN rep THEN d_o1 ELSE o1_0 END AS o1_1,
        CASE WHEN rep THEN d_o2 ELSE o2_0 END AS o2_1,
        CASE WHEN rep THEN d_bc ELSE bc0 END AS bc1,
        CASE WHEN rep THEN d_src ELSE src0 END AS src1,
        CASE WHEN rep THEN d_rid ELSE rid0 END AS rid1,
        CASE WHEN rep THEN 0 ELSE mask0 END AS mask1,
        NOT skip AND kind = 'O' AND (CASE WHEN rep THEN d_st ELSE st0 END) IN ('UP', 'UG')
          AND coalesce(CASE WHEN rep THEN d_u ELSE u0 END, '') = eu AS held
      FROM (
        SELECT *,
          -- a backout carrying the entry newer than what the fold holds: the entry is taken from it
          NOT skip AND kind = 'O' AND ok = 'B' AND d_src IS NOT NULL AND (st0 IS NULL OR d_l > l0) AS rep
        FROM (
          -- the redo rule: a state already reflects a transition at or below its LRSN
          SELECT *, st0 IS NOT NULL AND pos <= l0 AS skip FROM ($SOURCE))))))
"""

# Each entry of the range with $WHICH events (a predicate on cnt), its state before its first event (starts).
START_SQL = """
SELECT * EXCLUDE (cnt, eid) FROM starts WHERE eix >= $LO AND eix < $HI AND $WHICH
"""

FOLD_RANGE_SQL = """
CREATE OR REPLACE TEMP TABLE evs_range AS
SELECT e.*, t.cnt FROM evs e JOIN touched t USING (eix) WHERE e.eix >= $LO AND e.eix < $HI;
"""

FOLD_LONG_SQL = """
INSERT INTO folded
WITH RECURSIVE f(eix, ord, st, u, l, o1, o2, bc, src, rid, mask, fate) USING KEY (eix) AS (
  $START
  UNION
  $STEP)
SELECT * FROM f;
"""


def _step_source(state: str, event_ord: str) -> str:
    """STEP_SQL's source: the states of `state` (a relation named s) each with its event of rank `event_ord`."""
    return (f"SELECT e.eix, e.ord, {', '.join('e.' + c for c in EVENT)}, "
            f"{', '.join(f's.{a} AS {b}' for a, b in zip(STATE, STATE_IN, strict=True))} "
            f"FROM {state} JOIN evs_range e ON e.eix = s.eix AND e.ord = {event_ord}")


def fold_sql(unrolled: int = UNROLLED) -> str:
    """The fold of one range of entries ($LO, $HI): the histories of up to `unrolled` events one statement an
    event (fs: their states), those done after k events set aside before the k+1-th; the longer ones recursive."""
    parts = [FOLD_RANGE_SQL]
    if unrolled:
        parts.append(f"CREATE OR REPLACE TEMP TABLE fs AS {START_SQL.replace('$WHICH', f'cnt <= {unrolled}')};")
    for k in range(1, unrolled + 1):
        if k > 1:
            parts.append(f"INSERT INTO folded SELECT * FROM fs s SEMI JOIN evs_range e ON e.eix = s.eix "
                         f"AND e.ord = 1 AND e.cnt = {k - 1};")
        parts.append(f"CREATE OR REPLACE TEMP TABLE fs AS {STEP_SQL.replace('$SOURCE', _step_source('fs s', str(k)))};")
    if unrolled:
        parts.append("INSERT INTO folded SELECT * FROM fs;")
    parts.append(FOLD_LONG_SQL.replace("$START", START_SQL.replace("$WHICH", f"cnt > {unrolled}"))
                 .replace("$STEP", STEP_SQL.replace("$SOURCE", _step_source("f s", "s.ord + 1"))))
    return "\n".join(parts)


FOLD_SQL = fold_sql()

FINAL_SQL = """
-- settle._final: what a folded entry that still exists becomes
-- (with where its base descriptor and data are, and for a committed put quick folded its put's backout count, its
-- descriptor's, read here)
CREATE TABLE fin AS
SELECT f.eix, f.eid, f.st, f.u, f.l, f.o1, f.o2, coalesce(f.bc, d.bc) AS bc, f.src, f.rid, f.mask,
  coalesce(d.s, $S) AS s, d.q, d.p,
  d.f, d.boff, d.blen, d.doff, d.dlen,
  CASE WHEN f.st IS NULL THEN f.fate
       WHEN f.ord = 0 AND f.st = 'EX' THEN 'expired'
       WHEN f.st IN ('UP', 'UG') THEN 'in-doubt'
       WHEN d.exp > 0 AND d.exp <= $NOW THEN 'expired'
       WHEN suffix(d.q, $CONTROL_SUFFIX) THEN 'control'
       ELSE 'restored' END AS disp
FROM (SELECT * FROM quick UNION ALL BY NAME SELECT * FROM still
      UNION ALL BY NAME SELECT f.*, t.eid FROM folded f JOIN touched t USING (eix)) f
LEFT JOIN descs d ON d.rid = f.rid AND (f.src <> 'D' OR d.eid = f.eid);
DROP TABLE quick; DROP TABLE still; DROP TABLE folded; DROP TABLE starts; DROP TABLE touched; DROP TABLE evs;
DROP TABLE IF EXISTS evs_range; DROP TABLE IF EXISTS fs;
-- of the descriptors, the plan's outcomes (SqlOutcomes) read those outcome records carry ("D") from here on
CREATE TABLE carried AS SELECT 'D' AS src, * EXCLUDE (src) FROM descs WHERE src = $SRC_DD;
DROP TABLE descs;
ALTER TABLE carried RENAME TO descs;
"""

# The survivors in the CF's order (settle.load_key), each with its base descriptor and data.
SURVIVORS_SQL = """
SELECT entry_id(f.eid) AS eid, f.disp, f.s, f.st, f.u, f.l, f.o1, f.o2, f.bc, f.mask, f.src, f.f::BIGINT AS f, f.boff,
       f.blen::BIGINT AS blen, f.doff, f.dlen::BIGINT AS dlen, c.blob, c.data
FROM fin f LEFT JOIN ctl c ON c.eix = f.eix
WHERE f.disp IN ('restored', 'in-doubt')
ORDER BY f.q, CASE f.st WHEN 'CP' THEN 0 WHEN 'UP' THEN 1 ELSE 2 END,
         CASE f.st WHEN 'CP' THEN -f.p WHEN 'UP' THEN f.o2 ELSE f.l END,
         CASE f.st WHEN 'CP' THEN f.o1 ELSE 0 END, CASE f.st WHEN 'CP' THEN f.o2 ELSE 0 END, entry_id(f.eid)
"""


_unpack = partial(msgpack.unpackb, raw=False, unicode_errors="surrogateescape", strict_map_key=False)


def _descriptor(desc: bytes, src: str) -> dict[str, Any]:
    """A descriptor as its bytes say; a backup's copy as backup.files reads it (a property table that is not a map
    is the CF's empty one)."""
    entry: dict[str, Any] = _unpack(desc)
    if src == "B" and not isinstance(entry.get("pr", {}), dict):
        entry["pr"] = {}
    return entry


def _entry(desc: bytes, src: str, mask: int, row: tuple[Any, ...]) -> dict[str, Any]:
    """The final descriptor: the base one with the fields the fold set (row: st, u, l, o1, o2, bc)."""
    entry = _descriptor(desc, src)
    if mask:
        for (name, bit), value in zip(FIELDS, row, strict=True):
            if mask & bit:
                entry[name] = value
    return entry


def _literal(value: str | int) -> str:
    """A string quoted as SQL spells it, a number as itself."""
    return "'" + value.replace("'", "''") + "'" if isinstance(value, str) else str(int(value))


def _bind(sql: str, params: Mapping[str, Any]) -> str:
    """The statements with their $-names replaced by literals (numbers, and strings quoted)."""
    for name in sorted(params, key=len, reverse=True):
        sql = sql.replace(f"${name}", _literal(params[name]))
    return sql


def _batches(cur: duckdb.DuckDBPyConnection, sql: str) -> Iterator[pa.RecordBatch]:
    """The result of `sql` as Arrow record batches of FETCH_ROWS rows, read as they are asked for."""
    reader = cur.sql(sql).to_arrow_reader(FETCH_ROWS)
    if reader is not None:
        yield from reader


def _survivors(batch: pa.RecordBatch, pieces: Pieces) -> list[Settled]:
    """A batch of SURVIVORS_SQL's rows as Settled entries: each base descriptor read back (with its data) and
    unpacked, the fields the fold set (its mask) set in it; a control entry as the restart tables keep it."""
    c = batch.columns
    descs, datas = pieces.read(*c[11:16])
    eids, disps, structures, masks, srcs = (c[k].to_pylist() for k in (0, 1, 2, 9, 10))
    fields: list[list[Any] | None] = [None] * len(FIELDS)  # st, u, l, o1, o2, bc: read once a batch needs one
    setting: dict[int, list[tuple[str, list[Any]]]] = {}  # mask -> (field, its column) of each field it sets
    ruled = c[16].to_pylist() if c[16].null_count < len(batch) else None
    unpack = _unpack
    out = []
    for k, eid in enumerate(eids):
        if ruled is not None and ruled[k] is not None:  # a control entry as the restart tables keep it: final
            out.append(Settled(eid, disps[k], structures[k], _descriptor(ruled[k], ""), c[17][k].as_py()))
            continue
        entry: dict[str, Any] = unpack(descs[k])
        if srcs[k] == "B" and not isinstance(entry.get("pr", {}), dict):
            entry["pr"] = {}
        mask = masks[k]
        if mask:
            sets = setting.get(mask)
            if sets is None:
                sets = setting[mask] = []
                for j, (name, bit) in enumerate(FIELDS):
                    if mask & bit:
                        column = fields[j]
                        if column is None:
                            column = fields[j] = c[3 + j].to_pylist()
                        sets.append((name, column))
            for name, column in sets:
                entry[name] = column[k]
        out.append(Settled(eid, disps[k], structures[k], entry, datas[k]))
    return out


class SqlOutcomes(Mapping[str, Outcome]):
    """Every UOW's outcome (RestorePlan.outcomes), read from the plan's tables as asked."""

    def __init__(self, cursor: Callable[[], duckdb.DuckDBPyConnection], count: int, sources: list[Source]) -> None:
        self.cursor, self.count, self.sources = cursor, count, sources

    def __getitem__(self, uow: str) -> Outcome:
        cur = self.cursor()
        row = cur.execute("SELECT kind, lrsn, decided_by, structures FROM outc WHERE u = ?", [uow]).fetchone()
        if row is None:
            raise KeyError(uow)
        rows = cur.execute(
            "SELECT entry_id(od.eid), d.s, d.f, d.boff, d.blen, d.doff, d.dlen FROM odata od JOIN descs d ON "
            "d.src = 'D' AND d.rid = od.rid AND d.eid = od.eid WHERE od.u = ? AND ? = 'B' ORDER BY 1",
            [uow, row[0]]).fetchall()
        read = read_back(self.sources, [r[2:] for r in rows])
        data = {r[0]: (r[1], _descriptor(desc, "D"), blob) for r, (desc, blob) in zip(rows, read, strict=True)}
        return Outcome(row[0], int(row[1]), row[2], data, tuple(row[3] or ()))

    def __iter__(self) -> Iterator[str]:
        for batch in _batches(self.cursor(), "SELECT u FROM outc"):
            yield from batch.column(0).to_pylist()

    def __len__(self) -> int:
        return self.count


class ColumnarSettled(Collection[Settled]):
    """Every settled entry (RestorePlan.settled): the survivors in load order, then the others."""

    def __init__(self, plan: ColumnarPlan) -> None:
        self.plan = plan

    def __iter__(self) -> Iterator[Settled]:
        yield from self.plan.in_load_order()
        for batch in _batches(self.plan.cursor(),
                              "SELECT entry_id(eid), disp FROM fin WHERE disp NOT IN ('restored', 'in-doubt') "
                              "ORDER BY 1"):
            for eid, disp in zip(*(c.to_pylist() for c in batch.columns), strict=True):
                yield Settled(eid, disp)

    def __len__(self) -> int:
        return self.plan.settled_count

    def __contains__(self, item: object) -> bool:
        return any(s == item for s in self)


class ColumnarPlan(SummarizedPlan):
    """A RestorePlan whose tables live in a DuckDB database in its spill directory until close()."""

    spill: SpillDir
    con: duckdb.DuckDBPyConnection
    settled_count: int
    loaded_bytes: int
    worker_peak_bytes: int
    workers: int
    partitions: int = 1
    sources: list[Source]  # where the descriptors' bytes and the data are (restore.columns.read_back)
    timings: dict[str, float]  # seconds of each statement of the plan (where the time goes)
    read_cpu_s: float = 0.0  # CPU seconds of this process while the logs and the backup were read

    def cursor(self) -> duckdb.DuckDBPyConnection:
        return self.con.cursor()  # a connection of its own: the load reads the survivors from another thread

    def in_load_order(self) -> Iterator[Settled]:
        pieces = Pieces(self.sources)
        try:
            for batch in _batches(self.cursor(), SURVIVORS_SQL):
                yield from _survivors(batch, pieces)
        finally:
            pieces.close()

    def staged(self, structure: str, batch: int, batch_bytes: int) -> Iterator[tuple[Staged, int]]:
        """The load's prepared batches (restore.load.staged of in_load_order), made in C where they can be."""
        pieces = Pieces(self.sources)
        try:
            yield from columnar_staged.staged(structure, _batches(self.cursor(), SURVIVORS_SQL), pieces, _survivors,
                                              FIELDS, batch, batch_bytes)
        finally:
            pieces.close()

    def close(self) -> None:
        try:
            self.con.close()
        finally:
            self.spill.close()


class PlanMemoryError(ValueError):
    """The plan needed more memory than the restore's memory limit gives DuckDB (duckdb_memory_for): a limit too
    small for the history, said in one line with what to do. The plan runs before the restore claims the structure:
    nothing was written."""

    def __init__(self, memory: int, cause: duckdb.OutOfMemoryException) -> None:
        making = [note.split(" making ", 1)[1] for note in getattr(cause, "__notes__", ()) if " making " in note]
        where = f" in its statement making {making[0]}" if making else ""
        super().__init__(
            f"the restore's plan ran out of memory{where} (--memory-limit {_size(memory)}, DuckDB's share "
            f"{duckdb_memory_for(memory) >> 20} MiB): nothing was written; run it again with a larger "
            f"--memory-limit (${ENV_MEMORY_LIMIT} for RECAUTO's restores)")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


class ColumnarEngine:
    """The plan as one columnar plan on DuckDB, in bounded memory: its tables and spilled operators in a private
    temporary directory under `work_dir`, within `memory` bytes (DuckDB is given duckdb_memory_for(memory), the
    process, its readers and the load the rest). The log segments and the backup's files are read by `workers` threads side by side (the C reader
    lets go of the GIL: restore.columns), each file's rows handed to DuckDB as it is read; DuckDB runs that many
    threads."""

    name = "columnar"

    def __init__(self, memory: int = DEFAULT_MEMORY, work_dir: Path | None = None,
                 partitions: int | None = None, workers: int | None = None) -> None:
        self.memory, self.work_dir, self.workers = bounded_resources(memory, work_dir, workers)
        require_readers()

    def plan(self, structure: str, backup: BackupSource, log_dirs: list[Path], replay_from: int, now_ms: int,
             progress: Progress = no_progress) -> RestorePlan:
        spill = SpillDir(self.work_dir)
        try:
            return self._plan(spill, structure, backup, log_dirs, replay_from, now_ms, progress)
        except duckdb.OutOfMemoryException as e:
            spill.close()
            raise PlanMemoryError(self.memory, e) from None
        except BaseException:
            spill.close()
            raise

    def _jobs(self, backup: BackupSource, log_dirs: list[Path], replay_from: int) -> list[_Job]:
        """The backup's files (when it is one on disk), then every log segment a restore reads, largest first."""
        jobs: list[_Job] = []
        if _on_disk(backup) is not None:
            for info in backup.manifest["files"]:
                jobs.append(_Job(len(jobs), backup_file=info))
        # The members' logs in the order of their names: the plan's merged-log order rests on it (PLAN_SQL, r).
        for member, d in sorted((LogReader(d).member, d) for d in log_dirs):
            for segno, path, is_last in log_segments_read(d, replay_from):
                jobs.append(_Job(len(jobs), log_dir=d, segment=segno, path=path, member=member, is_last=is_last))
        return jobs

    def _plan(self, spill: SpillDir, structure: str, backup: BackupSource, log_dirs: list[Path], replay_from: int,
              now_ms: int, progress: Progress) -> ColumnarPlan:
        manifest = backup.manifest
        one_log_per_member(log_dirs)
        cpu0 = time.process_time()
        con = self._connect(spill)
        try:
            members = sorted({LogReader(d).member for d in log_dirs})
            con.execute(f"CREATE TYPE {MEMBER_ENUM} AS ENUM ({', '.join(_literal(m) for m in members)})")
            raw = raw_columns(structure)
            for name, schema in TABLES.items():
                con.from_arrow(schema.empty_table()).project(raw[name]).create(f"raw_{name}")
            sources: dict[int, Source] = {}
            max_lrsn = 0
            jobs = self._jobs(backup, log_dirs, replay_from)
            on_disk = _on_disk(backup)
            backup_dir = on_disk.path if on_disk is not None else None
            n_logs = sum(1 for j in jobs if j.backup_file is None)
            # The backup's files and the logs are read side by side; progress shows the backup's reading, then the
            # logs' (those read meanwhile counted): one phase after the other, as every engine shows them.
            backup_left = len(jobs) - n_logs
            with _Streams(con, raw) as streams:
                if on_disk is None:  # copies from elsewhere (a test's, or a base with no files)
                    total = manifest.get("entries")
                    n = len(jobs)
                    scanned, src = copies_as_frames(
                        _counted(backup.copies(), progress, int(total) if total is not None else None),
                        n << RID_BITS, 2 * n, spill.path)
                    sources[2 * n] = src
                    streams.put(scanned)
                logs_done = copies_done = 0
                total_copies = int(manifest.get("entries") or 0) or None
                if on_disk is not None:
                    progress(READ_BACKUP, 0, total_copies)
                if not backup_left:
                    progress(READ_LOGS, 0, n_logs)
                readers = _Readers(jobs, self.workers, partial(
                    _scan, backup_dir=backup_dir, structure=str(manifest.get("structure", structure)),
                    replay_from=replay_from, spill=spill.path))
                try:
                    for item in readers.results():
                        if item[0] == "rows":
                            streams.put(item[1])
                            max_lrsn = max(max_lrsn, item[1].max_lrsn)
                            continue
                        job, srcs = item[1], item[2]
                        sources.update(srcs)
                        if job.backup_file is None:
                            logs_done += 1
                        else:
                            copies_done += int(job.backup_file.get("frames", 0))
                            progress(READ_BACKUP, copies_done, total_copies)
                            backup_left -= 1
                        if not backup_left:
                            progress(READ_LOGS, logs_done, n_logs)
                finally:
                    readers.stop()
            read_cpu = time.process_time() - cpu0
            held_by = [u for (u,) in con.execute(
                f"SELECT DISTINCT u FROM raw_descs WHERE src = {SRC_BACKUP}").fetchall()]
            backup_max = con.execute(f"SELECT max(l) FROM raw_descs WHERE src = {SRC_BACKUP}").fetchone()
            max_lrsn = max(max_lrsn, int(backup_max[0] or 0) if backup_max else 0)
            base = base_of({"gen": int(manifest.get("gen", 0) or 0), "carried": manifest.get("carried", ()),
                            "end_lrsn": base_lrsn(manifest), "uows": list(manifest.get("uows") or ())}, held_by)
            unknown = con.execute(
                "SELECT DISTINCT x.k::VARCHAR FROM raw_recs x JOIN kinds kd USING (k) WHERE kd.role = 'entry' AND NOT "
                "kd.copy AND x.mine AND x.k::VARCHAR NOT IN (SELECT unnest(?::VARCHAR[])) ORDER BY 1",
                [list(REDO_KINDS)]).fetchall()
            if unknown:
                raise ValueError(f"restore's fold has no redo step for {unknown[0][0]} records")
            restore_lrsn = restore_lrsn_above(max_lrsn, base)
            progress(SETTLE, 0, 1)
            source_list = [sources.get(i, Source("")) for i in range(max(sources, default=-1) + 1)]
            plan = _run(con, spill, structure, base, now_ms, restore_lrsn, max_lrsn, source_list,
                        fold_rows_for(self.memory))
        except BaseException:
            con.close()
            raise
        plan.worker_peak_bytes = 0  # the readers are threads of this process
        plan.workers = self.workers
        plan.read_cpu_s = read_cpu
        progress(SETTLE, 1, 1)
        return plan

    def _connect(self, spill: SpillDir) -> duckdb.DuckDBPyConnection:
        # An in-memory database: its tables are neither compressed nor checkpointed to a file (a third less CPU
        # than a database file at 100k), and DuckDB still spills them to temp_directory past memory_limit
        # (BENCHMARKS.md, "The columnar engine, second pass").
        con = duckdb.connect(":memory:")
        tmp = spill.file("duckdb-tmp")
        tmp.mkdir(mode=0o700)
        con.execute(f"SET memory_limit = '{duckdb_memory_for(self.memory) >> 20}MiB'")
        con.execute(f"SET temp_directory = '{tmp}'")
        con.execute(f"SET threads = {self.workers}")
        con.execute("SET preserve_insertion_order = false")
        con.execute(ENTRY_ID_SQL)
        kinds = kinds_table()
        for enum, values in ((KIND_ENUM, kinds["k"].to_pylist()), (ROLE_ENUM, [r.value for r in Role])):
            con.execute(f"CREATE TYPE {enum} AS ENUM ({', '.join(_literal(v) for v in values)})")
        con.from_arrow(kinds).project(f"* REPLACE (k::{KIND_ENUM} AS k, role::{ROLE_ENUM} AS role, "
                                      "idsrc::TINYINT AS idsrc, descsrc::TINYINT AS descsrc)").create("kinds")
        return con


# What the restore's process holds besides DuckDB's memory while the plan reads: the interpreter and its libraries
# (about 125 MiB), the readers' chunks and the Arrow tables queued for DuckDB (about 80 MiB), and what the
# allocators keep of them (BENCHMARKS.md, "The columnar engine holds its memory limit").
PROCESS_MEMORY = 320 << 20
# The least DuckDB is given. Under a small history a statement's peak is mostly its hash tables' fixed partitions,
# per join and per thread (about 22 MiB for the largest statements at three threads, whatever the history's size:
# one or two joins a statement, PLAN_SQL); the floor holds twice that, since which threads take partitions varies
# from run to run (test_the_plan_holds_at_duckdbs_floor_with_a_margin_of_two).
DUCKDB_MIN_MEMORY = 64 << 20


def duckdb_memory_for(memory: int) -> int:
    """DuckDB's share of the restore's memory limit: half, the load's read of the survivors and the process the
    other half; under a small limit, what the process's own needs (PROCESS_MEMORY) leave, so that the whole
    process stays within the limit; never less than DUCKDB_MIN_MEMORY."""
    return max(DUCKDB_MIN_MEMORY, min(memory // 2, memory - PROCESS_MEMORY))


def fold_rows_for(memory: int) -> int:
    """How many entries the recursive fold takes at a time: about 2 KiB of DuckDB's memory (duckdb_memory_for) an
    entry, the recursion's state and its hash tables (BENCHMARKS.md, "The columnar engine")."""
    return max(1_000, duckdb_memory_for(memory) // 2048)


def raw_columns(structure: str) -> dict[str, str]:
    """What the plan keeps of each reader table (restore.columns.TABLES), as a select list over it: the columns its
    statements read, a record's kind as an ENUM of the registry's kinds (one byte, not a string: every statement
    over the records joins or compares it), its member as an ENUM of the members read (MEMBER_ENUM), whether its
    outcome field is a commit (`oc`) and whether an entry record's structure is the one restored (`mine`) instead
    of their strings. Narrow tables are what lets DuckDB keep them within its share of the memory limit rather
    than spill them (BENCHMARKS.md, "The plan's tables narrowed")."""
    return {"recs": f"rid, l, TRY_CAST(k AS {KIND_ENUM}) AS k, u, s = {_literal(structure)} AS mine, g, \"at\", "
                    f"o = 'C' AS oc, \"by\", eu, m::{MEMBER_ENUM} AS m",
            "ss": "rid, s, g", "ev": "rid, src::TINYINT AS src, eid, dds",
            "descs": "rid, src::TINYINT AS src, pos::INTEGER AS pos, eid, s, q, p, exp, st, u, l, o1, o2, bc, boff, "
                     "blen::INTEGER AS blen, doff, dlen::INTEGER AS dlen, f::INTEGER AS f"}


def _on_disk(backup: BackupSource) -> Backup | None:
    """The backup's files, when it is one on disk (itself, or the base restore.run plans from)."""
    for b in (backup, getattr(backup, "base", None)):
        if isinstance(b, Backup):
            return b
    return None


class _Streams:
    """The readers' rows into the plan's raw tables: one INSERT a table for the whole read, each reading an Arrow
    stream its chunks are handed to (a queue of a few: what waits to be inserted stays bounded), in a thread and a
    cursor of its own. One INSERT a chunk cost DuckDB about 8 ms a statement at 1M records, more as the table grew:
    six times the CPU of these streams (BENCHMARKS.md, "The columnar engine, fourth pass"). Use it in a `with`:
    leaving normally waits until every chunk is in and raises an INSERT's failure."""

    DEPTH = 4

    def __init__(self, con: duckdb.DuckDBPyConnection, columns: Mapping[str, str]) -> None:
        self.columns = columns
        self.queues: dict[str, queue.Queue[pa.Table | None]] = {n: queue.Queue(maxsize=self.DEPTH) for n in TABLES}
        self.failure: BaseException | None = None
        self.threads = [threading.Thread(target=self._insert, args=(con.cursor(), name), name=f"restore-insert-{name}",
                                         daemon=True) for name in TABLES]

    def _batches(self, name: str) -> Iterator[pa.RecordBatch]:
        while (table := self.queues[name].get()) is not None:
            yield from table.to_batches()

    def _insert(self, cur: duckdb.DuckDBPyConnection, name: str) -> None:
        try:
            cur.register(f"stream_{name}", pa.RecordBatchReader.from_batches(TABLES[name], self._batches(name)))
            cur.execute(f"INSERT INTO raw_{name} SELECT {self.columns[name]} FROM stream_{name}")
        except BaseException as e:  # raised by put() and __exit__
            self.failure = self.failure or e
            while self.queues[name].get() is not None:  # what is still handed over goes nowhere
                pass
        finally:
            cur.close()

    def put(self, scanned: Scanned) -> None:
        for name, table in scanned.tables.items():
            if len(table):
                self._hand(name, table)

    def _hand(self, name: str, table: pa.Table | None) -> None:
        while self.failure is None:
            with contextlib.suppress(queue.Full):
                self.queues[name].put(table, timeout=0.2)
                return
        raise self.failure

    def __enter__(self) -> _Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for name, q in self.queues.items():
            if exc_type is None:
                self._hand(name, None)
            else:  # the threads' INSERTs end with what they were given
                while True:
                    with contextlib.suppress(queue.Full):
                        q.put(None, timeout=0.2)
                        break
        for t in self.threads:
            t.join()
        if exc_type is None and self.failure is not None:
            raise self.failure


def _execute(con: duckdb.DuckDBPyConnection, sql: str, timings: dict[str, float], name: str = "") -> None:
    """Each statement of `sql`, its seconds added to timings[its table's name]."""
    for statement in split_statements(sql):
        t0 = time.perf_counter()
        what = name or (statement.split("CREATE TABLE ", 1)[-1].split()[0] if "CREATE TABLE" in statement else (
            "drop" if "DROP TABLE" in statement else "insert"))
        try:
            con.execute(statement)
        except duckdb.Error as e:
            e.add_note(f"in the columnar plan's statement making {what}")
            raise
        timings[what] = round(timings.get(what, 0.0) + time.perf_counter() - t0, 3)


def _run(con: duckdb.DuckDBPyConnection, spill: SpillDir, structure: str, base: Base, now_ms: int,
         restore_lrsn: int, max_lrsn: int, sources: list[Source], fold_rows: int) -> ColumnarPlan:
    """The plan's statements on the rows read, and the plan they make; the fold `fold_rows` entries at a time."""
    con.from_arrow(pa.table({"u": pa.array(sorted(base.carried), pa.string())})).create("base_uows")
    timings: dict[str, float] = {}
    params = {"G": base.gen, "R": restore_lrsn, "NOW": now_ms, "OUTCOME_RANK": OUTCOME_RANK,
              "CONTROL_SUFFIX": CONTROL_SUFFIX, "ST": ST, "U": U, "L": L, "O1": O1, "O2": O2, "BC": BC,
              "S": structure, "SRC_E": SRC_E, "SRC_IDS": SRC_IDS, "SRC_DD": SRC_DD, "SRC_BACKUP": SRC_BACKUP}
    _execute(con, _bind(PLAN_SQL, params), timings)
    touched = con.execute("SELECT count(*), coalesce(max(eix), 0) FROM touched").fetchone() or (0, 0)
    step = max(1, int(touched[1]) * fold_rows // max(1, int(touched[0]))) if touched[0] else 1
    for lo in range(0, int(touched[1]) + 1, step):
        _execute(con, _bind(FOLD_SQL, {**params, "LO": lo, "HI": lo + step}), timings, "fold")
    _execute(con, _bind(FINAL_SQL, params), timings)
    _rule_on_control_entries(con, sources)

    plan = ColumnarPlan(structure, restore_lrsn, [], {}, {}, set(), Counter(), Counter(), max_lrsn)
    plan.spill, plan.con, plan.sources = spill, con, sources
    plan.timings = timings
    one = con.execute
    plan.records_by_member = Counter(dict(one("SELECT m, n FROM members").fetchall()))
    plan.counts = Counter(dict(one("SELECT disp, count(*) FROM fin GROUP BY disp").fetchall()))
    plan.settled_count = sum(plan.counts.values())
    plan.loaded_count, plan.loaded_bytes = (int(v or 0) for v in one(
        "SELECT count(*), sum(coalesce(octet_length(c.data), f.dlen)) FROM fin f LEFT JOIN ctl c ON c.eix = f.eix "
        "WHERE f.disp IN ('restored', 'in-doubt')").fetchone() or (0, 0))
    plan.decisions = {u: u.split(".", 1)[0] for (u,) in one("SELECT u FROM inflight").fetchall()}
    plan.restore_decided = {u for (u,) in one(
        "SELECT u FROM outc WHERE kind = ? AND decided_by = 'restore'", [BACKOUT]).fetchall()}
    plan.in_commit = {u for (u,) in one(
        "SELECT u FROM outc WHERE kind = 'C' AND u NOT IN (SELECT u FROM ended)").fetchall()}
    # The UOWs the restored structure holds (plan.held_uows): those holding loaded entries, and the in-doubt ones
    # whose records name the structure; each with its owner (plan.uow_owner), and its lowest loaded LRSN.
    holding = one("SELECT f.u, min(f.l), any_value(o.kind), any_value(o.decided_by) FROM fin f LEFT JOIN outc o "
                  "USING (u) WHERE f.disp IN ('restored', 'in-doubt') AND f.u IS NOT NULL AND f.u <> '' "
                  "GROUP BY f.u").fetchall()
    held = {u: _owner(u, kind, by) for u, _, kind, by in holding}
    plan.first_lrsn = {u: int(lrsn) for u, lrsn, _, _ in holding}
    for u, by in one("SELECT u, decided_by FROM outc WHERE kind = ? AND list_contains(structures, ?)",
                     [INDOUBT, structure]).fetchall():
        held.setdefault(u, _owner(u, INDOUBT, by))
    plan.held = dict(sorted(held.items()))
    plan.counts["uows in doubt"] = len(plan.held)
    plan.counts["uows in flight backed out"] = len(plan.decisions)
    count = one("SELECT count(*) FROM outc").fetchone()
    plan.outcomes = SqlOutcomes(plan.cursor, int(count[0]) if count else 0, sources)
    plan.settled = ColumnarSettled(plan)
    return plan


def _owner(uow: str, kind: str | None, decided_by: str | None) -> str:
    """plan.uow_owner: the member that prepared an in-doubt UOW, else the one its id names."""
    return decided_by if kind == INDOUBT and decided_by else uow.split(".", 1)[0]


def _rule_on_control_entries(con: duckdb.DuckDBPyConnection, sources: list[Source]) -> None:
    """A surviving UOW's control entry keeps what the restart tables keep (settle._final): restored with its
    status as restart leaves it (table ctl: its final descriptor and data), or dropped."""
    con.execute("CREATE TABLE ctl (eix BIGINT, blob BLOB, data BLOB)")
    rows = con.execute(
        "SELECT f.eix, f.st, f.u, f.l, f.o1, f.o2, f.bc, f.mask, f.src, f.f, f.boff, f.blen, f.doff, f.dlen "
        "FROM fin f WHERE f.disp = 'control'").fetchall()
    dropped: list[int] = []
    kept: list[tuple[int, bytes, bytes]] = []
    read = read_back(sources, [r[9:14] for r in rows])
    for (eix, st, u, lrsn, o1, o2, bc, mask, src, *_), (desc, data) in zip(rows, read, strict=True):
        entry = _entry(desc, src, mask, (st, u, lrsn, o1, o2, bc))
        assert is_control_queue(str(entry.get("q", "")))
        ruled = restore_control_entry(entry, bytes(data))
        if ruled is None:
            dropped.append(eix)
        else:
            kept.append((eix, _PACK(ruled[0]), ruled[1]))
    if kept:
        con.executemany("INSERT INTO ctl VALUES (?, ?, ?)", kept)
    con.execute(f"UPDATE fin SET disp = '{STATUS_DROPPED}' WHERE eix IN (SELECT unnest(?::BIGINT[]))", [dropped])
    con.execute(f"UPDATE fin SET disp = '{RESTORED}' WHERE disp = '{CONTROL}'")


def make_engine(**options: Any) -> ColumnarEngine:
    return ColumnarEngine(**options)


register_engine("columnar", make_engine)

# The dispositions the plan's SQL spells (settle's names): kept equal to them here.
assert (CONSUMED, PUT_BACKED_OUT, EXPIRED, GONE, HELD_INDOUBT, RESTORED) == (
    "consumed", "put-backed-out", "expired", "gone", "in-doubt", "restored")
