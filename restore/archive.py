"""A columnar archive of the record logs: each closed segment as one Parquet file (docs/spark.md).

    <archive>/<member>/seg-00000001.parquet     one file per sealed segment, written once

Columns, one row per log record, in the segment's append order:

    lrsn int64 · member string · segment int32 · offset int64 (where the frame starts in its segment) ·
    kind string · uow string (null when the record names none) · entry_ids list<string> (sqm.core.records.entry_ids) ·
    structure string (PUT/GET/EXPIRE: the structure; null otherwise) · queue string (PUT/GET; null otherwise) ·
    record binary (the record, msgpack, as in the log frame)

Only closed segments are archived: every segment but a member's last one, which its writer may still append
to. A segment's file is written to a temporary name, fsynced and renamed, so an archive never holds part of a
segment; archiving again skips the segments already there. The Spark engine reads the archived segments
instead of the segment files (with the LRSN and relevance filters pushed into the Parquet scan), and the
archive answers audit questions such as "where did message X go?" (audit_message).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cfemu.durable import fsync_directory
from cfemu.progress import Progress, no_progress
from sqm.core.records import Record, Role, codes, lookup
from sqm.log import LogReader, find_log_dirs
from sqm.log.format import SegmentScan, log_segments, read_manifest, segment_name

SCHEMA = pa.schema([
    ("lrsn", pa.int64()),
    ("member", pa.string()),
    ("segment", pa.int32()),
    ("offset", pa.int64()),
    ("kind", pa.string()),
    ("uow", pa.string()),
    ("entry_ids", pa.list_(pa.string())),
    ("structure", pa.string()),
    ("queue", pa.string()),
    ("record", pa.binary()),
])
ROW_GROUP_ROWS = 64_000
# For the filters pushed into Parquet and Spark scans (restore.plan.relevant as column predicates): the kinds with
# a structure column, and the kinds restore and the audit take by UOW.
ENTRY_KINDS = codes(Role.ENTRY)
UOW_KINDS = codes(Role.OUTCOME, Role.END)
ARCHIVE = "archive"  # the progress phase of archive_logs


def archived_segment(archive_dir: Path, member: str, segment: int) -> Path | None:
    """The Parquet file of one archived segment, or None when that segment is not archived."""
    path = archive_dir / member / segment_name(segment).replace(".log", ".parquet")
    return path if path.is_file() else None


def segment_table(path: Path, segment: int, member: str) -> pa.Table:
    """One closed segment as an Arrow table (decoded by sqm.log's SegmentScan: a damaged frame raises)."""
    cols: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    pack = msgpack.Packer(use_bin_type=True).pack
    for pos, rec in SegmentScan(path, segment, member, is_last=False):
        kind = lookup(rec)
        # An event's queue; a backout's carried entries are in entry_ids, but their queues are not the record's.
        queues = kind.queues(rec) if kind.role is Role.ENTRY else []
        cols["lrsn"].append(rec["l"])
        cols["member"].append(member)
        cols["segment"].append(pos.segment)
        cols["offset"].append(pos.offset)
        cols["kind"].append(rec["k"])
        cols["uow"].append(rec.get("u") or None)
        cols["entry_ids"].append(kind.entry_ids(rec))
        cols["structure"].append(kind.structure(rec))
        cols["queue"].append(queues[0] if queues else None)
        cols["record"].append(pack(rec))
    return pa.table(cols, schema=SCHEMA)


@dataclass
class ArchiveResult:
    archived: list[Path]  # Parquet files written by this run
    skipped: int  # closed segments already archived
    records: int  # records written by this run


def closed_segments(log_dir: Path) -> list[tuple[int, Path]]:
    """A log's closed segments: all but the last (the writer rolls to a new segment only after sealing), those
    linear logging archived included, read where they are archived (docs/log-management.md)."""
    return log_segments(log_dir, read_manifest(log_dir))[:-1]


def archive_logs(log_root: str | Path, out_dir: str | Path, progress: Progress = no_progress) -> ArchiveResult:
    """Archive every closed segment of every log under log_root into out_dir (idempotent).
    progress(ARCHIVE, done, total) counts closed segments."""
    out = Path(out_dir)
    log_dirs = find_log_dirs(log_root)
    if not log_dirs:
        raise FileNotFoundError(f"{log_root}: no record logs here (expected one directory per member)")
    work = [(LogReader(d).member, segno, path) for d in log_dirs for segno, path in closed_segments(d)]
    result = ArchiveResult([], 0, 0)
    for done, (member, segno, path) in enumerate(work, 1):
        if archived_segment(out, member, segno) is not None:
            result.skipped += 1
        else:
            table = segment_table(path, segno, member)
            result.archived.append(_write_atomically(table, out / member, segno))
            result.records += table.num_rows
        progress(ARCHIVE, done, len(work))
    return result


def _write_atomically(table: pa.Table, directory: Path, segment: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / segment_name(segment).replace(".log", ".parquet")
    tmp = final.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS, compression="zstd")
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_directory(directory)
    return final


def archive_files(archive_dir: str | Path) -> list[Path]:
    return sorted(Path(archive_dir).glob("*/seg-*.parquet"))


def decode(record: bytes, member: str) -> Record:
    """A record from the archive, tagged with its member like the merged log's records."""
    rec: Record = msgpack.unpackb(record, raw=False, strict_map_key=False)
    rec["m"] = member
    return rec


# ---------------------------------------------------------------------------------------------- Spark reader


def archived_records(spark: Any, files: list[str], structure: str, replay_from: int) -> tuple[Any, int]:
    """(RDD of (merged-log order key, record), highest LRSN >= replay_from in the files) for the Spark engine.

    The LRSN range and the relevance test (restore.plan.relevant) are pushed into the Parquet scan; the highest
    LRSN is taken over every record in range, relevant or not, as the reference plan does (restore/reference.py)."""
    from pyspark.sql import functions as F

    df = spark.read.schema(SCHEMA_DDL).parquet(*files).where(F.col("lrsn") >= replay_from)
    top = df.agg(F.max("lrsn")).first()[0]
    wanted = df.where((F.col("kind").isin(*ENTRY_KINDS) & (F.col("structure") == structure))
                      | F.col("kind").isin(*UOW_KINDS))
    rdd = wanted.select("lrsn", "member", "segment", "offset", "record").rdd.map(
        lambda row: ((row[0], row[1], row[2], row[3]), decode(row[4], row[1])))
    return rdd, int(top or 0)


SCHEMA_DDL = ("lrsn BIGINT, member STRING, segment INT, offset BIGINT, kind STRING, uow STRING, "
              "entry_ids ARRAY<STRING>, structure STRING, queue STRING, record BINARY")


# -------------------------------------------------------------------------------------------------- audit


def audit_message(archive_dir: str | Path, entry_id: str) -> list[Record]:
    """Where did message `entry_id` go? Every archived record that names it (its put, its gets, expiry, a
    backout carrying its data) and the outcome records (COMMIT, BACKOUT, PREPARE, RECOVERY, END) of the UOWs
    those name, in merged-log order (LRSN, member, segment, offset). Each record carries its member in "m"."""
    files = archive_files(archive_dir)
    naming = list(_scan(files, lambda t: _names_entry(t, entry_id)))
    uows = sorted({r["u"] for _, r in naming if r.get("u")})
    outcomes = list(_scan(files, lambda t: pc.and_(pc.is_in(t["kind"], pa.array(UOW_KINDS)),
                                                   pc.is_in(t["uow"], pa.array(uows, pa.string())))))
    found = {key: rec for key, rec in naming + outcomes}
    return [found[key] for key in sorted(found)]


def _names_entry(table: pa.Table, entry_id: str) -> pa.ChunkedArray:
    ids = pc.list_flatten(table["entry_ids"])
    rows = pc.list_parent_indices(table["entry_ids"])
    hit = pc.filter(rows, pc.equal(ids, entry_id))
    return pc.is_in(pa.array(range(table.num_rows)), hit)


def _scan(files: Iterable[Path], predicate: Callable[[pa.Table], Any]
          ) -> Iterator[tuple[tuple[int, str, int, int], Record]]:
    for f in files:
        table = pq.read_table(f)
        if table.num_rows == 0:
            continue
        for row in table.filter(predicate(table)).to_pylist():
            yield (row["lrsn"], row["member"], row["segment"], row["offset"]), decode(row["record"], row["member"])
