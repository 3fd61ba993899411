"""The readers of the columnar restore engine: log slices and backup files as Arrow tables, decoded in C.

restore._columns (restore/_columns.c, built by the package's build) walks a file's frames, checks each CRC32C and
decodes each msgpack body straight into column buffers: no Python object is made per record. A file is read a
chunk at a time (CHUNK); a descriptor's own bytes and an entry's data are not copied either: their places in the
file are columns, read back for the entries that survive (Sources). Four tables come out, the same for logs and
backups:

  recs   a log record a row: rid (its id in the plan), l, off, k, u, s, g, at, o, by, eu (the UOW a copy's
         descriptor names; "" for none), and seg, m, f (segment, member, source) added here;
  ss     a record's {structure: generation} a row each: rid, s, g;
  ev     each entry id a record names, with where it names it: rid, src (SRC_E its descriptor "e", SRC_I "i",
         SRC_IDS "ids", SRC_DD a copy in "dd"), eid (as bytes: entry_id reads it), dds (the structure of a "dd"
         copy);
  descs  each descriptor a record carries or the backup holds: rid, src (SRC_E, SRC_DD, SRC_BACKUP), pos (its
         place in "dd"), eid, s, q, p, exp, st, u, l, o1, o2, bc, and where its bytes and its data are: boff,
         blen, doff, dlen, in source f.

Where the C reader stops (a torn end, a damaged frame, a body it does not take), the house's own reader
(sqm.log.format.SegmentScan, backup.files) reads on from there: it raises the error that frame deserves, or ends
where a live log ends; a record it decodes that the C reader did not take is packed again and read from memory.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.compute as pc

from backup.digest import file_digest, new_hasher
from backup.files import (
    FILE_HEADER,
    ChecksumMismatchError,
    CorruptFrameError,
    TruncatedBackupError,
    entry_path,
)
from sqm.log import LogCorruptError, LogFormatError
from sqm.log.format import (
    SegmentScan,
    archived_segments,
    check_header,
    check_sealed,
    log_segments,
    read_header,
    read_manifest,
    trusted_segments,
)

_columns: Any
try:
    from restore import _columns  # type: ignore[attr-defined,no-redef]
except ImportError:  # installed where no C compiler was (the extension is optional): require_readers() says so
    _columns = None

SRC_E, SRC_I, SRC_IDS, SRC_DD, SRC_BACKUP = 0, 1, 2, 3, 4
STOP_END, STOP_FRAME, STOP_BODY = 0, 1, 2

# Strings as the C reader makes them (64-bit offsets): DuckDB reads them as they are, no copy into 32-bit ones.
_I64, _STR, _BIN = pa.int64(), pa.large_string(), pa.large_binary()
RECS = pa.schema([("rid", _I64), ("l", _I64), ("off", _I64), ("k", _STR), ("u", _STR), ("s", _STR), ("g", _I64),
                  ("at", _I64), ("o", _STR), ("by", _STR), ("eu", _STR), ("seg", _I64), ("m", _STR), ("f", _I64)])
SS = pa.schema([("rid", _I64), ("s", _STR), ("g", _I64)])
EV = pa.schema([("rid", _I64), ("src", _I64), ("eid", _BIN), ("dds", _STR)])
DESCS = pa.schema([("rid", _I64), ("src", _I64), ("pos", _I64), ("eid", _BIN), ("s", _STR), ("q", _STR),
                   ("p", _I64), ("exp", _I64), ("st", _STR), ("u", _STR), ("l", _I64), ("o1", _I64), ("o2", _I64),
                   ("bc", _I64), ("boff", _I64), ("blen", _I64), ("doff", _I64), ("dlen", _I64), ("f", _I64)])
TABLES = {"recs": RECS, "ss": SS, "ev": EV, "descs": DESCS}
_C_COLUMNS = {"recs": 11, "ss": 3, "ev": 4, "descs": 18}  # the columns the C reader makes, in schema order


def entry_id(held: bytes) -> str:
    """An entry id as the readers hold it (`eid` of ev and descs), as text again: the 12 bytes of an id of 24
    lowercase hex digits (the ids members make: DuckDB keeps 12 bytes inline, a longer string apart), any other id
    its UTF-8 after "~", or "!~" for one of 11 bytes, so that none is 12 bytes long (restore/_columns.c, col_eid).
    ENTRY_ID_SQL is the same in the plan's SQL."""
    if len(held) == 12:
        return held.hex()
    return held[2 if held[:1] == b"!" else 1:].decode()


# entry_id as a DuckDB macro: entry_id(eid) in the plan's statements.
ENTRY_ID_SQL = """CREATE MACRO entry_id(x) AS
CASE WHEN octet_length(x) = 12 THEN lower(hex(x))
     WHEN starts_with(decode(x), '!') THEN substr(decode(x), 3) ELSE substr(decode(x), 2) END"""


def require_readers() -> None:
    """Raise, in one line, when the C readers were not built with the package."""
    if _columns is None:
        raise RuntimeError("the columnar restore engine needs its C readers (restore._columns), which were not "
                           "built: install the package where a C compiler is (pip install builds them), or use "
                           "--engine local")


@dataclass
class Scanned:
    """What one scan made: its tables, the records kept, the highest LRSN among them (-1: none)."""

    tables: dict[str, pa.Table]
    records: int
    max_lrsn: int


def _arrays(cols: Sequence[tuple[bytes, bytes | None, bytes | None, int]], schema: pa.Schema,
            n: int) -> list[pa.Array]:
    out = []
    for (values, data, bitmap, nulls), field in zip(cols, schema, strict=False):
        validity = None if bitmap is None else pa.py_buffer(bitmap)
        if field.type in (_STR, _BIN):
            arr = pa.Array.from_buffers(field.type, n, [validity, pa.py_buffer(values), pa.py_buffer(data)], nulls)
        else:
            arr = pa.Array.from_buffers(_I64, n, [validity, pa.py_buffer(values)], nulls)
        out.append(arr)
    return out


def scan_buffer(buf: Any, start: int, end: int, *, capacity: int, first_frame: int, min_lrsn: int, backup: bool,
                first_rid: int, check_crc: bool = True, const: dict[str, Any] | None = None,
                shift: int = 0) -> tuple[Scanned, int, int]:
    """The frames of buf[start:end] as tables (see the module doc); with where the reader stopped (an offset in
    the file) and why (STOP_END: at `end`). const: columns every row of recs and descs has (seg, m, f); shift: the
    buffer's offset in its file."""
    off, stop, records, max_lrsn, parts = _columns.scan(buf, start, end, capacity, first_frame, min_lrsn,
                                                        1 if backup else 0, first_rid, check_crc, shift)
    tables: dict[str, pa.Table] = {}
    for (name, schema), (n, cols) in zip(TABLES.items(), parts, strict=True):
        arrays = _arrays(cols, schema, n)
        for field in list(schema)[_C_COLUMNS[name]:]:
            value = (const or {}).get(field.name)
            arrays.append(pa.nulls(n, field.type) if value is None else _repeat(value, field.type, n))
        tables[name] = pa.Table.from_arrays(arrays, schema=schema)
    return Scanned(tables, records, max_lrsn), off, stop


def _repeat(value: Any, typ: pa.DataType, n: int) -> pa.Array:
    return pa.repeat(pa.scalar(value, typ), n)


def _frames(bodies: Sequence[bytes]) -> bytes:
    """Bodies as frames (length, CRC unchecked: 0), for the C reader to read from memory."""
    out = bytearray()
    for b in bodies:
        out += len(b).to_bytes(4, "little") + b"\0\0\0\0" + b
    return bytes(out)


@dataclass(frozen=True)
class Source:
    """Where a source's bytes are: a log segment (re-found in its log's archive if archived since), a backup file,
    or a spill file of records packed again."""

    path: str
    log_dir: str = ""
    segment: int = -1

    def open(self) -> int:
        # A backup's file never through a symbolic link (backup.files refuses them); a segment as the log's reader
        # opens it.
        flags = os.O_RDONLY if self.log_dir else os.O_RDONLY | os.O_NOFOLLOW
        try:
            return os.open(self.path, flags)
        except FileNotFoundError:
            if not self.log_dir:
                raise
        moved = {i.segment: i.path for i in archived_segments(read_manifest(Path(self.log_dir)))}.get(self.segment)
        if moved is None:
            raise LogFormatError(f"{self.path}: a log segment restore read is gone (neither in its log nor in its "
                                 f"archive): the plan cannot read its entries back")
        return os.open(moved, flags)


Emit = Callable[[Scanned], None]


def _scan_file(fd: int, start: int, size: int, *, capacity: int, first_frame: int, min_lrsn: int, backup: bool,
               first_rid: int, const: dict[str, Any], emit: Emit, hashed: Any = None) -> tuple[int, int, int]:
    """The frames of the open file `fd` from `start` to `size`, read CHUNK bytes at a time (a frame that runs past
    a chunk is read again whole with the next one), each chunk's tables handed to `emit`, so that what a reader
    holds stays bounded whatever the file's size. Returns the records taken, where the reader stopped and why.
    hashed: a hash every byte read from `start` on goes through once."""
    off, rid, upto = start, first_rid, start
    # One buffer a file, each chunk read into it: a buffer made afresh for each chunk was memory the kernel mapped,
    # faulted in, zeroed and unmapped again every CHUNK bytes, which cost the readers more CPU than the copy itself.
    buf = bytearray(min(CHUNK, max(0, size - off)))
    while off < size:
        want = min(size - off, max(CHUNK, _frame_bytes(fd, off, size)))
        if want > len(buf):
            buf = bytearray(want)
        got = _read_into(fd, memoryview(buf)[:want], off)
        if not got:
            break
        if hashed is not None and off + got > upto:
            hashed.update(memoryview(buf)[upto - off:got])
            upto = off + got
        sc, stop_at, stop = scan_buffer(buf, 0, got, capacity=capacity, first_frame=first_frame,
                                        min_lrsn=min_lrsn, backup=backup, first_rid=rid, const=const, shift=off)
        emit(sc)
        rid += sc.records
        if stop == STOP_END:
            off = stop_at
            continue
        if stop == STOP_FRAME and off + got < size and stop_at > off:
            off = stop_at  # a frame that runs past this chunk: read again from its start
            continue
        return rid - first_rid, stop_at, stop
    return rid - first_rid, off, STOP_END


CHUNK = 8 << 20  # bytes of a file a reader holds at a time


def _read_into(fd: int, view: memoryview, off: int) -> int:
    """The bytes read into `view` from `off` on: as many as it holds, fewer only at the file's end. A read may return
    fewer bytes than asked before the end (some file systems do): taken as the end of the chunk, it would cut the
    first frame short and read as a damaged one."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], off + got)
        if not n:
            break
        got += n
    return got


def _frame_bytes(fd: int, off: int, size: int) -> int:
    """The bytes of the frame at `off` (header and body) as its length says, 0 when that is past the file."""
    head = os.pread(fd, 4, off)
    if len(head) < 4:
        return 0
    n = 8 + int.from_bytes(head, "little")
    return n if off + n <= size else 0


def log_segments_read(directory: Path, min_lrsn: int, only: Any = None) -> Iterator[tuple[int, Path, bool]]:
    """(segment, path, is last) of the segments sqm.log.LogReader.records reads for a slice (same skipping rule:
    a sealed segment the manifest says lies wholly below `min_lrsn` is not read)."""
    manifest = read_manifest(directory)
    segs = log_segments(directory, manifest)
    if not segs:
        return
    trusted = trusted_segments(directory, manifest)
    last = segs[-1][0]
    for segno, path in segs:
        if only is not None and segno not in only:
            continue
        if segno != last:
            info = trusted.get(segno)
            if info is not None and (info.max_lrsn is None or info.max_lrsn < min_lrsn):
                continue
        if not path.exists():  # archived by its running writer since the list was made (LogReader._scan)
            moved = {i.segment: i.path for i in archived_segments(read_manifest(directory))}.get(segno)
            path = moved or path
        yield segno, path, segno == last


def scan_segment(directory: Path, segno: int, path: Path, member: str, *, is_last: bool, min_lrsn: int,
                 first_rid: int, source: int, spill: Path, emit: Emit) -> list[Source]:
    """One log segment's records from `min_lrsn` on, as tables handed to `emit` a chunk at a time; returns the
    sources their bytes are in (the segment, and a spill file of records the C reader did not take, if any). A
    sealed segment is checked against its manifest entry as every reader of the log checks it (check_sealed)."""
    expected = None if is_last else trusted_segments(directory, read_manifest(directory)).get(segno)
    with open(path, "rb") as f:
        header = read_header(f, path, allow_partial=is_last)
        if header is None:
            return []
        check_header(header, path, segno, member)
    const = {"seg": segno, "m": member, "f": source}
    fd = os.open(path, os.O_RDONLY)
    try:
        taken, off, stop = _scan_file(fd, header.length, os.fstat(fd).st_size, capacity=header.capacity,
                                      first_frame=header.length, min_lrsn=min_lrsn, backup=False,
                                      first_rid=first_rid, const=const, emit=emit)
    finally:
        os.close(fd)
    sources = [Source(str(path), str(directory), segno)]
    if stop == STOP_END:
        # read to its end (the C reader keeps only records from min_lrsn on: the end is what it can tell)
        check_sealed(expected, path, end=off)
        return sources
    # The house's reader from there: it raises for a damaged frame, ends at a torn end, decodes what it can.
    rest = [(pos.offset, rec) for pos, rec in SegmentScan(path, segno, member, is_last=is_last, start_offset=off,
                                                       expected=expected)
            if rec["l"] >= min_lrsn]
    if not rest:
        return sources
    spilled = spill / f"repacked-{source + 1}"
    bodies = [msgpack.packb(rec, use_bin_type=True) for _, rec in rest]
    data = _frames(bodies)
    more, end, stop = scan_buffer(data, 0, len(data), capacity=len(data), first_frame=0, min_lrsn=min_lrsn,
                                  backup=False, first_rid=first_rid + taken, check_crc=False,
                                  const={"seg": segno, "m": member, "f": source + 1})
    if stop != STOP_END:
        bad = rest[len(more.tables["recs"])][0] if len(more.tables["recs"]) < len(rest) else end
        raise LogCorruptError(path, bad, "a record restore's columnar reader cannot take (a field of an "
                                         "unexpected type)")
    # its offsets: the record's own in the segment, as the merged log orders by them
    offsets = pa.array([o for o, _ in rest], _I64)
    recs = more.tables["recs"]
    more.tables["recs"] = recs.set_column(recs.schema.get_field_index("off"), "off", offsets)
    with open(spilled, "wb") as f:
        f.write(data)
    emit(more)
    return [*sources, Source(str(spilled))]


def scan_backup_file(backup_dir: Path, info: dict[str, Any], *, first_rid: int, source: int, structure: str,
                     emit: Emit) -> int:
    """One backup entry file's copies as a descs table (src SRC_BACKUP, rid their place in the backup), handed to
    `emit` a chunk at a time; the file checked as backup.files reads it (its header, every frame's CRC, its digest
    and frame count: a file that fails raises once all of it is read). A frame the C reader does not take raises
    CorruptFrameError, or for an entry id that is not text, cfemu.bulk.unloadable's error. Returns the copies."""

    def with_structure(sc: Scanned) -> None:
        descs = sc.tables["descs"]
        sc.tables["descs"] = descs.set_column(descs.schema.get_field_index("s"), "s",
                                              _repeat(structure, _STR, len(descs)))
        emit(sc)

    path = entry_path(backup_dir, info["name"])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise TruncatedBackupError(f"{path}: entry file is missing") from None
    try:
        size = os.fstat(fd).st_size
        header = os.pread(fd, len(FILE_HEADER), 0)
        if header != FILE_HEADER:
            raise ChecksumMismatchError(f"{path}: not a backup entry file of this version (bad header)")
        digest, expected = file_digest(info)
        sha = new_hasher(digest)
        sha.update(header)
        records, off, stop = _scan_file(fd, len(FILE_HEADER), size, capacity=size, first_frame=len(FILE_HEADER),
                                        min_lrsn=0, backup=True, first_rid=first_rid, const={"f": source},
                                        emit=with_structure, hashed=sha)
        if stop == STOP_FRAME:  # as backup.files says it
            if size - off < 8:
                raise TruncatedBackupError(f"{path}: truncated frame header at byte {off}")
            length = int.from_bytes(os.pread(fd, 4, off), "little")
            if off + 8 + length > size:
                raise CorruptFrameError(f"{path}: the frame at byte {off} runs past the end of the file "
                                        f"(length {length}, {size - off - 8} bytes left)")
            raise CorruptFrameError(f"{path}: bad CRC in the frame at byte {off}")
        if stop == STOP_BODY:
            raise _unreadable_copy(path, os.pread(fd, _frame_bytes(fd, off, size) or 8, off), off)
    finally:
        os.close(fd)
    if sha.hexdigest() != expected:
        raise ChecksumMismatchError(f"{path}: {digest} does not match the manifest")
    if records != info["frames"]:
        raise ChecksumMismatchError(f"{path}: {records} frames, the manifest says {info['frames']}")
    return records


def _unreadable_copy(path: Path, frame: bytes, off: int) -> Exception:
    """The error for a backup frame the C reader stopped at: backup.files' own when it is one it refuses; else the
    entry's id, which is not text the plan can hold (cfemu.bulk.unloadable)."""
    from cfemu.bulk import unloadable

    body = bytes(frame[8:8 + int.from_bytes(frame[:4], "little")])
    try:
        _, desc, _ = msgpack.unpackb(body, raw=False, unicode_errors="surrogateescape")
        eid = str(desc["id"])
        eid.encode()
    except UnicodeEncodeError as x:
        return unloadable(eid, x)
    except (ValueError, TypeError, KeyError, msgpack.ExtraData) as e:
        return CorruptFrameError(f"{path}: undecodable frame at byte {off}: {e}")
    return CorruptFrameError(f"{path}: the frame at byte {off} holds a descriptor restore cannot read "
                             f"(a field of an unexpected type)")


def copies_as_frames(copies: Any, first_rid: int, source: int,
                     spill: Path) -> tuple[Scanned, Source]:
    """Copies from any backup source ((structure, descriptor, data) each) as a descs table: packed as backup
    frames into a spill file, then read by the C reader (the source their bytes are read back from)."""
    data = bytearray()
    structures: list[str] = []
    for s, desc, blob in copies:
        body = msgpack.packb([0, desc, blob], use_bin_type=True, unicode_errors="surrogateescape")
        data += len(body).to_bytes(4, "little") + b"\0\0\0\0" + body
        structures.append(s)
    path = spill / f"copies-{source}"
    with open(path, "wb") as f:
        f.write(data)
    scanned, off, stop = scan_buffer(bytes(data), 0, len(data), capacity=len(data), first_frame=0, min_lrsn=0,
                                     backup=True, first_rid=first_rid, check_crc=False, const={"f": source})
    if stop != STOP_END:
        raise _unreadable_copy(path, bytes(data[off:]), off)
    descs = scanned.tables["descs"]
    scanned.tables["descs"] = descs.set_column(descs.schema.get_field_index("s"), "s", pa.array(structures, _STR))
    return scanned, Source(str(path))


def read_back(sources: Sequence[Source], pieces: Sequence[tuple[int, int, int, int, int]]) -> list[tuple[bytes, bytes]]:
    """(descriptor bytes, data) of each piece (source, boff, blen, doff, dlen), in order; each source opened once."""
    fds: dict[int, int] = {}
    out = []
    try:
        for f, boff, blen, doff, dlen in pieces:
            fd = fds.get(f)
            if fd is None:
                fd = fds[f] = sources[f].open()
            if dlen and doff >= boff + blen and doff - (boff + blen) < 16:  # adjacent: one read
                whole = _pread_exactly(fd, doff + dlen - boff, boff)
                out.append((whole[:blen], whole[doff - boff:]))
            else:
                out.append((_pread_exactly(fd, blen, boff), _pread_exactly(fd, dlen, doff) if dlen else b""))
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _pread_exactly(fd: int, n: int, off: int) -> bytes:
    """The `n` bytes at `off`, read on where a read returns fewer (as read_pieces does in C); OSError (EIO) when
    the file ends before them: a source cut short since it was read, never a piece restored short."""
    out = bytearray(n)
    got = _read_into(fd, memoryview(out), off)
    if got < n:
        raise OSError(errno.EIO, f"a restore's source ends at byte {off + got}, inside a piece it read "
                                 f"there ({n} bytes at {off})")
    return bytes(out)


class Pieces:
    """Descriptors and their data read back by their places (columns of a query's result: f, boff, blen, doff,
    dlen, Arrow int64 arrays without nulls), a batch of rows at a time, in C (restore._columns.read_pieces): no
    Python per row. Each source is opened once, when a row first names it; close() closes them."""

    def __init__(self, sources: Sequence[Source]) -> None:
        self.sources = sources
        self.fds = [-1] * len(sources)

    def read(self, f: pa.Array, boff: pa.Array, blen: pa.Array, doff: pa.Array,
             dlen: pa.Array) -> tuple[list[bytes], list[bytes]]:
        values = [_int64_values(a) for a in (f, boff, blen, doff, dlen)]
        for k in pc.unique(f).to_pylist():
            if self.fds[k] < 0:
                self.fds[k] = self.sources[k].open()
        return _columns.read_pieces(self.fds, *values)

    def close(self) -> None:
        for k, fd in enumerate(self.fds):
            if fd >= 0:
                os.close(fd)
                self.fds[k] = -1


def _int64_values(a: pa.Array) -> memoryview:
    """The values of an int64 array without nulls, as bytes (its own slice of its buffer)."""
    if a.null_count:
        raise ValueError("a piece's place is missing")
    return memoryview(a.buffers()[1])[a.offset * 8:(a.offset + len(a)) * 8]
