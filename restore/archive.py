"""A columnar archive of the record logs: each closed segment as one Parquet file (docs/spark.md).

    <archive>/<member>/seg-00000001.parquet     one file per sealed segment, written once

Columns, one row per log record, in the segment's append order:

    lrsn int64 · member string · segment int32 · offset int64 (where the frame starts in its segment) ·
    kind string · uow string (null when the record names none) · entry_ids list<string> (sqm.core.records.entry_ids) ·
    structure string (PUT/GET/EXPIRE: the structure; null otherwise) · queue string (PUT/GET; null otherwise) ·
    record binary (the record, msgpack, as in the log frame)

Only closed segments are archived: every segment but a member's last one, which its writer may still append
to. A segment's file is written to a temporary name, fsynced and renamed, so an archive never holds part of a
segment; archiving again skips the segments already there (and sealed). The Spark engine reads the archived
segments instead of the segment files (with the LRSN and relevance filters pushed into the Parquet scan), and
the archive answers audit questions such as "where did message X go?" (audit_message).

Each Parquet file has a seal beside it, seg-00000001.seal: its size and sha256 and the segment's member, number,
LRSN range and record count, signed with the group's backup key like a backup manifest (HMAC-SHA256, its own
context: a seal is never taken for a manifest). A restore brings archived records back into a structure, so
an archived file is read only when its seal is the group's, its digest matches and the segment it describes
is the log's (verified_segment); anything else is refused with one line naming the file. The archive directory,
and each member's directory in it, are refused when other users can write them (cfemu.private_files).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from backup.bounded_json import JSONFileError, read_json_file
from backup.files import canonical_json, resolve_keys, signing_key
from cfemu.credentials import BackupKeys, key_id
from cfemu.durable import fsync_directory
from cfemu.private_files import open_private, private_dir, refuse_others_writing, write_private
from cfemu.progress import Progress, no_progress
from sqm.core.records import Record, Role, codes, lookup
from sqm.log import LogReader, find_log_dirs
from sqm.log.format import (
    SegmentInfo,
    SegmentScan,
    log_segments,
    read_manifest,
    segment_name,
    trusted_segments,
)

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


SEAL_FORMAT = 1
SEAL_ALG = "hmac-sha256"
_SEAL_CONTEXT = b"cfemu log archive seal v1\n"  # what the MAC is of: only a seal, never a backup manifest
_HASH_CHUNK = 4 * 2**20


class ArchiveError(ValueError):
    """An archived segment that may not be read; the message is one line naming the file and what to do."""


def parquet_path(archive_dir: Path, member: str, segment: int) -> Path:
    return archive_dir / member / segment_name(segment).replace(".log", ".parquet")


def seal_path(parquet: Path) -> Path:
    return parquet.with_suffix(".seal")


def refuse_unsafe_archive(archive_dir: Path, member: str | None = None) -> None:
    """UnsafeDirectoryError when other users can write the archive directory (or a member's directory in it):
    whoever can write there could replace an archived segment, or remove one and its seal."""
    refuse_others_writing(archive_dir)
    if member is not None:
        refuse_others_writing(archive_dir / member)


def verified_segment(archive_dir: Path, member: str, segment: int, live: SegmentInfo | None = None,
                     backup_keys: BackupKeys | None = None) -> Path | None:
    """The Parquet file of one archived segment once its seal is checked, or None when the segment is not
    archived. ArchiveError, naming the file, when it has no seal (archived before archives were sealed: archive
    again), when the seal is not signed with one of the group's backup keys or does not describe this member's
    segment, when the file is not the one sealed (size, sha256), or when the segment the seal describes is not
    the log's segment `live` (its LRSN range and record count, from the log's manifest): archived from another
    log of the same member."""
    path = parquet_path(archive_dir, member, segment)
    if not path.is_file():
        return None
    refuse_unsafe_archive(archive_dir, member)
    seal = _read_seal(path)
    _check_signature(path, seal, resolve_keys(backup_keys))
    if (seal.get("member"), seal.get("segment"), seal.get("file")) != (member, segment, path.name):
        raise ArchiveError(f"{path}: its seal is for {seal.get('member')}'s segment {seal.get('segment')} "
                           f"({seal.get('file')}), not {member}'s segment {segment}: {_ARCHIVE_AGAIN}")
    size, digest = _digest(path)
    if (size, digest) != (seal.get("size"), seal.get("sha256")):
        raise ArchiveError(f"{path}: not the file that was archived (size {size}, sha256 {digest[:16]}..., "
                           f"sealed: size {seal.get('size')}, sha256 {str(seal.get('sha256'))[:16]}...): "
                           f"{_ARCHIVE_AGAIN}")
    if live is not None:
        sealed = (seal.get("min_lrsn"), seal.get("max_lrsn"), seal.get("records"))
        if sealed != (live.min_lrsn, live.max_lrsn, live.records):
            raise ArchiveError(f"{path}: archived from another log than {member}'s segment {segment} (archived: "
                               f"LRSN {sealed[0]}-{sealed[1]}, {sealed[2]} records; the log's: LRSN "
                               f"{live.min_lrsn}-{live.max_lrsn}, {live.records} records): {_ARCHIVE_AGAIN}")
    return path


_ARCHIVE_AGAIN = "remove it and run 'cfrestore archive' again (it archives the segment anew)"
SEAL_MAX_BYTES = 64 * 1024  # a seal is a few hundred bytes: its fields, digest and signature


def _read_seal(path: Path) -> dict[str, Any]:
    """The seal beside an archived file: a regular file of at most SEAL_MAX_BYTES (a planted one of any size, or a
    link, is refused before it is read)."""
    try:
        seal = read_json_file(seal_path(path), SEAL_MAX_BYTES, "its seal")
    except FileNotFoundError:
        raise ArchiveError(f"{path}: no seal ({seal_path(path).name}): archived before archives were signed, or "
                           f"its seal was removed; run 'cfrestore archive' again to re-archive it") from None
    except JSONFileError as e:
        raise ArchiveError(f"{e}: {_ARCHIVE_AGAIN}") from None
    except OSError as e:
        raise ArchiveError(f"{seal_path(path)}: cannot be read ({e.strerror or e}): {_ARCHIVE_AGAIN}") from None
    if not isinstance(seal, dict) or not isinstance(seal.get("signature"), dict):
        raise ArchiveError(f"{seal_path(path)}: not a signed seal: {_ARCHIVE_AGAIN}")
    return seal


def _check_signature(path: Path, seal: dict[str, Any], keys: BackupKeys) -> None:
    sig = seal["signature"]
    key = keys.find(str(sig.get("key"))) if sig.get("alg") == SEAL_ALG else None
    if key is None:
        held = ", ".join(key_id(k) for k in keys.checking()) or "none"
        raise ArchiveError(f"{path}: its seal is not signed with a backup key of this group (key {sig.get('key')!r}; "
                           f"this process holds {held}, from {keys.source or 'no secrets directory'}): "
                           f"{_ARCHIVE_AGAIN}")
    if not hmac.compare_digest(str(sig.get("mac")), seal_mac(seal, key)):
        raise ArchiveError(f"{path}: its seal's signature does not match (the seal was altered): {_ARCHIVE_AGAIN}")


def seal_mac(seal: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256, with the group's backup key, of the canonical JSON of every field of the seal but `signature`."""
    body = {k: v for k, v in seal.items() if k != "signature"}
    return hmac.new(key, _SEAL_CONTEXT + canonical_json(body), hashlib.sha256).hexdigest()


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def segment_table(path: Path, segment: int, member: str, expected: SegmentInfo | None = None) -> pa.Table:
    """One closed segment as an Arrow table (decoded by sqm.log's SegmentScan: a damaged frame raises, and so does
    a segment that reads as less than its manifest entry, `expected`)."""
    cols: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    pack = msgpack.Packer(use_bin_type=True).pack
    for pos, rec in SegmentScan(path, segment, member, is_last=False, expected=expected):
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


def archive_logs(log_root: str | Path, out_dir: str | Path, progress: Progress = no_progress,
                 backup_keys: BackupKeys | None = None) -> ArchiveResult:
    """Archive every closed segment of every log under log_root into out_dir (idempotent), each file sealed with
    the group's backup key (backup_keys: default, those this process's settings find; without one nothing is
    written). A segment whose archived file does not pass verified_segment (no seal, an archive from before
    seals, another log's) is archived anew. progress(ARCHIVE, done, total) counts closed segments."""
    out = Path(out_dir)
    key = signing_key(backup_keys, "sign the archive with")
    refuse_unsafe_archive(out)
    log_dirs = find_log_dirs(log_root)
    if not log_dirs:
        raise FileNotFoundError(f"{log_root}: no record logs here (expected one directory per member)")
    work = [(LogReader(d).member, segno, path, trusted_segments(d, read_manifest(d)).get(segno))
            for d in log_dirs for segno, path in closed_segments(d)]
    result = ArchiveResult([], 0, 0)
    for done, (member, segno, path, live) in enumerate(work, 1):
        if _already_archived(out, member, segno, live, backup_keys):
            result.skipped += 1
        else:
            table = segment_table(path, segno, member, live)
            result.archived.append(_write_atomically(table, out, member, segno, key))
            result.records += table.num_rows
        progress(ARCHIVE, done, len(work))
    return result


def _already_archived(out: Path, member: str, segment: int, live: SegmentInfo | None,
                      backup_keys: BackupKeys | None) -> bool:
    try:
        return verified_segment(out, member, segment, live, backup_keys) is not None
    except ArchiveError:
        return False  # written anew, over the file that does not verify


def _write_atomically(table: pa.Table, archive_dir: Path, member: str, segment: int, key: bytes) -> Path:
    """The segment's Parquet file (0600) and then its seal, each written to a temporary name, fsynced and renamed:
    a crash between the two leaves a file without a seal, which no reader takes and the next archive rewrites."""
    directory = private_dir(archive_dir / member)  # holds message bodies: 0700, refused when others can write it
    final = parquet_path(archive_dir, member, segment)
    tmp = final.with_suffix(".parquet.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a crashed run's: created anew, 0600
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        pq.write_table(table, f, row_group_size=ROW_GROUP_ROWS, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    size, digest = _digest(tmp)
    lrsns = table.column("lrsn")
    seal: dict[str, Any] = {
        "format": SEAL_FORMAT, "member": member, "segment": segment, "file": final.name, "size": size,
        "sha256": digest, "records": table.num_rows,
        "min_lrsn": pc.min(lrsns).as_py() if table.num_rows else None,
        "max_lrsn": pc.max(lrsns).as_py() if table.num_rows else None,
    }
    seal["signature"] = {"alg": SEAL_ALG, "key": key_id(key), "mac": seal_mac(seal, key)}
    os.replace(tmp, final)
    write_private(seal_path(final), json.dumps(seal, sort_keys=True, indent=1).encode())
    fsync_directory(directory)
    return final


def archive_files(archive_dir: str | Path) -> list[Path]:
    """Every archived segment file (unchecked)."""
    return sorted(Path(archive_dir).glob("*/seg-*.parquet"))


def verified_files(archive_dir: str | Path, backup_keys: BackupKeys | None = None) -> list[Path]:
    """Every archived segment file, each checked against its seal (verified_segment; ArchiveError on the first
    that does not pass)."""
    archive = Path(archive_dir)
    refuse_unsafe_archive(archive)
    out = []
    for f in archive_files(archive):
        segment = int(f.stem.removeprefix("seg-"))
        checked = verified_segment(archive, f.parent.name, segment, backup_keys=backup_keys)
        if checked is not None:
            out.append(checked)
    return out


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


def audit_message(archive_dir: str | Path, entry_id: str, backup_keys: BackupKeys | None = None) -> list[Record]:
    """Where did message `entry_id` go? Every archived record that names it (its put, its gets, expiry, a
    backout carrying its data) and the outcome records (COMMIT, BACKOUT, PREPARE, RECOVERY, END) of the UOWs
    those name, in merged-log order (LRSN, member, segment, offset). Each record carries its member in "m".
    Only files whose seals verify are read (verified_files: ArchiveError otherwise)."""
    files = verified_files(archive_dir, backup_keys)
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
