"""On-disk format of the record log: segment headers, frames, the manifest, and the segment scanner.

See docs/log-format.md for the full description. Everything here is shared by the writer
(:class:`sqm.log.writer.RecordLog`) and the read-only view (:class:`sqm.log.reader.LogReader`).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import crc32c as _crc32c
import msgpack

from cfemu.durable import replace_file

MAGIC = b"CFLOG1\n"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LOCK_NAME = "writer.lock"
SEGMENT_RE = re.compile(r"^seg-(\d{8})\.log$")
#: Fixed part of the segment header: magic, u8 version, u32 segment, u32 capacity, u16 member length.
_HEADER_FIXED = struct.Struct("<7sBIIH")
_U32 = struct.Struct("<I")
#: Frame header: u32 body length, u32 crc32c(body).
FRAME = struct.Struct("<II")
FRAME_HEADER_BYTES = FRAME.size
#: Hard upper bound for one record body; a larger length field is always corruption.
MAX_RECORD_BYTES = 256 * 2**20
#: How far past a suspected torn frame the scanner looks for a valid frame (which would prove corruption).
RESYNC_SCAN_BYTES = 4 * 2**20
_READ_BUFFER = 1 << 20

crc32c = _crc32c.crc32c


class LogCorruptError(Exception):
    """A frame before the end of the log is damaged (never skipped silently)."""

    def __init__(self, path: str | Path, offset: int, what: str) -> None:
        self.path = str(path)
        self.offset = offset
        self.what = what
        super().__init__(f"corrupt record log {self.path} at byte offset {offset}: {what}")


class LogFormatError(Exception):
    """Not a log directory/segment of this format or member (wrong magic, version, member, layout)."""


class LogLockedError(Exception):
    """The log directory is already open for writing by another writer."""


@dataclass(frozen=True, order=True)
class LogPosition:
    """Where a frame starts: segment number and byte offset within that segment file."""

    segment: int
    offset: int

    def to_json(self) -> list[int]:
        return [self.segment, self.offset]

    @classmethod
    def from_json(cls, value: Any) -> LogPosition:
        seg, off = value
        return cls(int(seg), int(off))

    def __str__(self) -> str:
        return f"{self.segment:08d}:{self.offset}"


@dataclass(frozen=True)
class SegmentInfo:
    """What is known about one segment file (from the manifest for sealed segments, else from a scan)."""

    segment: int
    path: Path
    first: LogPosition | None
    last: LogPosition | None
    end: LogPosition
    min_lrsn: int | None
    max_lrsn: int | None
    records: int
    sealed: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "segment": self.segment,
            "file": self.path.name,
            "first": self.first.to_json() if self.first else None,
            "last": self.last.to_json() if self.last else None,
            "end": self.end.to_json(),
            "min_lrsn": self.min_lrsn,
            "max_lrsn": self.max_lrsn,
            "records": self.records,
            "sealed": self.sealed,
        }

    @classmethod
    def from_json(cls, directory: Path, value: dict[str, Any]) -> SegmentInfo:
        first = value.get("first")
        last = value.get("last")
        return cls(
            segment=int(value["segment"]),
            path=directory / segment_name(int(value["segment"])),
            first=LogPosition.from_json(first) if first else None,
            last=LogPosition.from_json(last) if last else None,
            end=LogPosition.from_json(value["end"]),
            min_lrsn=value.get("min_lrsn"),
            max_lrsn=value.get("max_lrsn"),
            records=int(value.get("records", 0)),
            sealed=bool(value.get("sealed", False)),
        )


@dataclass(frozen=True)
class SegmentHeader:
    version: int
    segment: int
    capacity: int
    member: str
    length: int


def segment_name(segment: int) -> str:
    return f"seg-{segment:08d}.log"


def list_segments(directory: Path, *, gaps: bool = False) -> list[tuple[int, Path]]:
    """Segment files in ``directory`` sorted by number; a gap in the numbering is a format error (``gaps``: the
    caller fills gaps from elsewhere and checks what it makes of them)."""
    found: list[tuple[int, Path]] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        m = SEGMENT_RE.match(name)
        if m:
            found.append((int(m.group(1)), directory / name))
    found.sort()
    if not gaps:
        _check_contiguous(directory, found)
    return found


def _check_contiguous(directory: Path, segs: list[tuple[int, Path]]) -> None:
    for (a, _), (b, pb) in zip(segs, segs[1:]):
        if b != a + 1:
            raise LogFormatError(f"{directory}: segment {a + 1} is missing (next present is {pb.name})")


def encode_header(segment: int, capacity: int, member: str) -> bytes:
    name = member.encode("utf-8")
    head = _HEADER_FIXED.pack(MAGIC, FORMAT_VERSION, segment, capacity, len(name)) + name
    return head + _U32.pack(crc32c(head))


def read_header(f: IO[bytes], path: Path, *, allow_partial: bool) -> SegmentHeader | None:
    """Parse the header at the start of ``f``. Returns None if the file holds only a prefix of a header
    and ``allow_partial`` (a segment being created, or a crash during creation); otherwise
    raises :class:`LogFormatError` for anything that is not a header of this format."""
    fixed = f.read(_HEADER_FIXED.size)
    if allow_partial and fixed.count(0) == len(fixed) and _zeros_to_end(f):
        # Nothing of its header reached the disk (an empty file, or zeros where a filesystem that zero-fills the
        # unwritten pages of a crash left them): the crash came while the segment was being created.
        return None
    if len(fixed) < _HEADER_FIXED.size:
        if allow_partial and MAGIC.startswith(fixed[: len(MAGIC)]):
            return None
        raise LogFormatError(f"{path}: not a record log segment (file too short for a segment header)")
    magic, version, segment, capacity, name_len = _HEADER_FIXED.unpack(fixed)
    if magic != MAGIC:
        raise LogFormatError(f"{path}: not a record log segment (bad magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise LogFormatError(f"{path}: unsupported log format version {version} (this code reads {FORMAT_VERSION})")
    rest = f.read(name_len + _U32.size)
    if len(rest) < name_len + _U32.size:
        if allow_partial:
            return None
        raise LogFormatError(f"{path}: truncated segment header")
    name = rest[:name_len]
    (stored,) = _U32.unpack_from(rest, name_len)
    if crc32c(fixed + name) != stored:
        raise LogFormatError(f"{path}: segment header checksum mismatch (garbled header)")
    try:
        member = name.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LogFormatError(f"{path}: garbled member name in segment header") from e
    return SegmentHeader(version, segment, capacity, member, _HEADER_FIXED.size + name_len + _U32.size)


def _zeros_to_end(f: IO[bytes]) -> bool:
    """Whether the rest of f holds zero bytes only (reads it to its end)."""
    while chunk := f.read(_READ_BUFFER):
        if chunk.count(0) != len(chunk):
            return False
    return True


def check_header(header: SegmentHeader, path: Path, segment: int, member: str | None) -> None:
    if header.segment != segment:
        raise LogFormatError(f"{path}: header says segment {header.segment}, file name says {segment}")
    if member is not None and header.member != member:
        raise LogFormatError(f"{path}: segment belongs to member {header.member!r}, not {member!r}")


def decode_body(body: bytes, path: Path, offset: int) -> dict[str, Any]:
    try:
        rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise LogCorruptError(path, offset, f"undecodable record body ({e})") from e
    if not isinstance(rec, dict) or "k" not in rec or "l" not in rec:
        raise LogCorruptError(path, offset, "record body is not a map with 'k' and 'l'")
    return rec


def check_sealed(expected: SegmentInfo | None, path: Path, *, end: int,
                 counted: tuple[int, int | None, int | None] | None = None) -> None:
    """A sealed segment read to its end must be the segment its manifest entry describes (``expected``; None: no
    entry, nothing to compare). Its frames are sealed with their CRCs, but whole frames lost at its end (a cut at a
    frame boundary: a bad copy, writes lost in a host crash) leave a file that reads cleanly: only the manifest's
    end offset, record count and LRSN range tell it lost committed records, and a reader that went on would
    restore or recover around them without a word. ``end``: where the read ended; ``counted``: (records, lowest,
    highest LRSN) it read, None where the read did not cover the whole segment. Raises :class:`LogCorruptError`."""
    if expected is None or not expected.sealed:
        return
    want = (expected.records, expected.min_lrsn, expected.max_lrsn)
    if end == expected.end.offset and (counted is None or counted == want):
        return
    read = "" if counted is None else f" with {counted[0]} records, LRSN {counted[1]}..{counted[2]}"
    raise LogCorruptError(
        path, end,
        f"sealed segment {expected.segment} ends at byte {end}{read}, but its manifest entry says it ends at byte "
        f"{expected.end.offset} with {want[0]} records, LRSN {want[1]}..{want[2]}: records at its end are lost",
    )


def _valid_frame_follows(data: bytes, start: int) -> int | None:
    """Offset (in ``data``) of the first plausible complete frame at or after ``start``, if any."""
    n = len(data)
    stop = min(n - FRAME_HEADER_BYTES, start + RESYNC_SCAN_BYTES)
    unpack = FRAME.unpack_from
    for q in range(start, stop):
        length, crc = unpack(data, q)
        end = q + FRAME_HEADER_BYTES + length
        if length > 0 and end <= n:
            body = data[q + FRAME_HEADER_BYTES : end]
            if crc32c(body) == crc:
                try:
                    rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
                except Exception:
                    continue
                if isinstance(rec, dict) and "k" in rec and "l" in rec:
                    return q
    return None


class SegmentScan:
    """Iterate over the frames of one segment file.

    ``is_last``: the segment is the last one of the log, so a torn final frame is the normal end of log
    (iteration stops silently, ``torn_bytes`` says how much was left over). Anything else that is wrong
    raises :class:`LogCorruptError` / :class:`LogFormatError`. ``expected``: the manifest's entry for a sealed
    segment; the scan that reaches the file's end checks it (check_sealed: whole frames lost at the end raise).

    After iteration: ``header`` (None if the file holds only a partial header), ``end_offset`` (offset just
    after the last valid frame), ``torn_bytes``, ``records``, ``first``, ``last``, ``min_lrsn``, ``max_lrsn``
    (the last five only over the frames actually visited).
    """

    def __init__(
        self,
        path: Path,
        segment: int,
        member: str | None,
        *,
        is_last: bool,
        start_offset: int = 0,
        expected: SegmentInfo | None = None,
    ) -> None:
        self.path = path
        self.expected = None if is_last else expected
        self.segment = segment
        self.member = member
        self.is_last = is_last
        self.start_offset = start_offset
        self.header: SegmentHeader | None = None
        self.end_offset = 0
        self.torn_bytes = 0
        self.records = 0
        self.first: LogPosition | None = None
        self.last: LogPosition | None = None
        self.min_lrsn: int | None = None
        self.max_lrsn: int | None = None

    def info(self) -> SegmentInfo:
        return SegmentInfo(
            self.segment, self.path, self.first, self.last, LogPosition(self.segment, self.end_offset),
            self.min_lrsn, self.max_lrsn, self.records, sealed=not self.is_last,
        )

    def _check_end(self, first_frame: int) -> None:
        whole = self.start_offset <= first_frame  # else the count and LRSNs cover only the frames read
        check_sealed(self.expected, self.path, end=self.end_offset,
                     counted=(self.records, self.min_lrsn, self.max_lrsn) if whole else None)

    def run(self) -> SegmentScan:
        """Scan the whole segment without keeping the records (validation, end of log, statistics)."""
        for _ in self:
            pass
        return self

    def __iter__(self) -> Iterator[tuple[LogPosition, dict[str, Any]]]:
        path = self.path
        with open(path, "rb", buffering=_READ_BUFFER) as f:
            header = read_header(f, path, allow_partial=self.is_last)
            if header is None:
                return
            check_header(header, path, self.segment, self.member)
            self.header = header
            first_frame = header.length
            off = max(self.start_offset, first_frame)
            if off != header.length:
                f.seek(off)
            self.end_offset = off
            cap = header.capacity
            is_last = self.is_last
            unpack = FRAME.unpack
            seg = self.segment
            while True:
                head = f.read(FRAME_HEADER_BYTES)
                if len(head) < FRAME_HEADER_BYTES:
                    if not head:
                        self._check_end(first_frame)
                        return
                    if is_last:
                        self.torn_bytes = len(head)
                        return
                    raise LogCorruptError(
                        path, off, f"truncated frame header ({len(head)} bytes before end of file)"
                    )
                length, crc = unpack(head)
                if length == 0 or length > MAX_RECORD_BYTES or (
                    off != first_frame and off + FRAME_HEADER_BYTES + length > cap
                ):
                    rest = head + f.read()
                    if is_last and rest.count(0) == len(rest):
                        self.torn_bytes = len(rest)  # zero-filled tail left by a crash
                        return
                    if length == 0:
                        raise LogCorruptError(path, off, "length 0 is impossible for a frame")
                    raise LogCorruptError(
                        path, off, f"length {length} exceeds segment (capacity {cap}, frame at {off})"
                    )
                body = f.read(length)
                if len(body) < length:
                    if not is_last:
                        raise LogCorruptError(
                            path, off,
                            f"truncated frame: length {length} but only {len(body)} bytes before end of file",
                        )
                    q = _valid_frame_follows(body, 0)
                    if q is not None:
                        raise LogCorruptError(
                            path, off,
                            f"length {length} runs past end of file but a valid frame follows at offset "
                            f"{off + FRAME_HEADER_BYTES + q}",
                        )
                    self.torn_bytes = FRAME_HEADER_BYTES + len(body)
                    return
                actual = crc32c(body)
                if actual != crc:
                    # The final frame of the last segment with a bad CRC is torn: at the end of the file, or
                    # followed by zero bytes only (a crash on a filesystem that leaves the unwritten pages of a
                    # write as zeros: this frame's end and whatever followed it were never written). Forced frames
                    # were written whole, so nothing forced is given up; anything else after it is corruption.
                    rest = f.read() if is_last else b""
                    if is_last and rest.count(0) == len(rest):
                        self.torn_bytes = FRAME_HEADER_BYTES + length + len(rest)
                        return
                    raise LogCorruptError(
                        path, off, f"CRC mismatch (stored {crc:#010x}, computed {actual:#010x}, length {length})"
                    )
                rec = decode_body(body, path, off)
                lrsn = rec["l"]
                pos = LogPosition(seg, off)
                if self.first is None:
                    self.first = pos
                    self.min_lrsn = self.max_lrsn = lrsn
                else:
                    if lrsn < self.min_lrsn:
                        self.min_lrsn = lrsn
                    if lrsn > self.max_lrsn:
                        self.max_lrsn = lrsn
                self.last = pos
                self.records += 1
                off += FRAME_HEADER_BYTES + length
                self.end_offset = off
                yield pos, rec


def read_record_at(path: Path, segment: int, member: str | None, offset: int) -> dict[str, Any]:
    """Read and verify the single frame at ``offset`` of one segment."""
    scan = SegmentScan(path, segment, member, is_last=False, start_offset=offset)
    for pos, rec in scan:
        if pos.offset != offset:
            break
        return rec
    raise LogCorruptError(path, offset, "no record at this position")


# ----------------------------------------------------------------------------------------------- manifest


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise LogFormatError(f"{path}: manifest is not valid JSON ({e})") from e
    if not isinstance(data, dict) or "member" not in data:
        raise LogFormatError(f"{path}: not a record log manifest")
    if data.get("version") != FORMAT_VERSION:
        raise LogFormatError(f"{path}: unsupported manifest version {data.get('version')!r}")
    _check_manifest(path, data)
    return data


def _is_position(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)


#: What each list of the manifest holds: every field its readers take for granted, with its test.
_MANIFEST_ENTRIES: dict[str, dict[str, Any]] = {
    "segments": {"segment": int, "end": _is_position},
    "archived": {"segment": int, "end": _is_position, "path": str},
    "copies": {"segment": int, "path": str, "bytes": int, "sha256": str},
    "checkpoints": {"position": _is_position, "lrsn": int},
}


def _check_manifest(path: Path, data: dict[str, Any]) -> None:
    """A manifest that parses but is not of this format's shape (edited by hand, or damaged into other valid JSON)
    is a LogFormatError naming the file and the field, before any reader or the writer trusts a field of it:
    otherwise a KeyError or a TypeError deep in a reader would be all the operator sees."""
    if not isinstance(data["member"], str) or not data["member"]:
        raise LogFormatError(f"{path}: malformed manifest: 'member' must be a member name")
    for key in ("segment_bytes", "pruned", "pruned_lrsn", "ring"):
        if data.get(key) is not None and type(data[key]) is not int:
            raise LogFormatError(f"{path}: malformed manifest: {key!r} must be a whole number, not {data[key]!r}")
    for key, fields in _MANIFEST_ENTRIES.items():
        entries = data.get(key, [])
        if not isinstance(entries, list):
            raise LogFormatError(f"{path}: malformed manifest: {key!r} must be a list")
        for entry in entries:
            bad = not isinstance(entry, dict) or [
                f for f, ok in fields.items()
                if f not in entry or not (type(entry[f]) is ok if isinstance(ok, type) else ok(entry[f]))]
            if bad:
                raise LogFormatError(f"{path}: malformed manifest: an entry of {key!r} ({entry!r}) lacks or garbles "
                                     f"{', '.join(bad) if isinstance(bad, list) else 'everything'}")


def write_manifest(directory: Path, data: dict[str, Any]) -> None:
    """Atomically replace the manifest: temp file, fsync, rename, fsync directory."""
    replace_file(directory / MANIFEST_NAME, json.dumps(data, indent=1, sort_keys=False).encode("utf-8") + b"\n")


def archived_segments(manifest: dict[str, Any] | None) -> list[SegmentInfo]:
    """The segments archived out of the active log (docs/log-management.md), oldest first: each manifest entry
    names the archived file by its absolute path. They are sealed, so their statistics may be trusted."""
    out = []
    for entry in (manifest or {}).get("archived", []):
        try:
            info = SegmentInfo.from_json(Path(entry["path"]).parent, entry)
        except (KeyError, TypeError, ValueError) as e:
            raise LogFormatError(f"manifest of {(manifest or {}).get('member')}: bad archived entry {entry!r}") from e
        out.append(info)
    return sorted(out, key=lambda i: i.segment)


def log_segments(directory: Path, manifest: dict[str, Any] | None) -> list[tuple[int, Path]]:
    """Every segment of the log, oldest first: the archived ones (read where the archive keeps them) and then the
    active ones (checked_segments). A segment both archived and still in the active log (an archive interrupted
    before it removed the active file) is read from the active log. Segments below the manifest's "pruned" mark
    were removed on purpose (sqm log prune: no recovery needed them); any other gap is a format error. A file still
    there below that mark is one whose removal was interrupted (a prune killed after its manifest, or a circular
    ring's reuse killed before its rename: a file emptied, or holding the next segment's header under its old
    name): it is not part of the log, and its writer removes it when it next opens the log. A reader that read it
    would fail on it (a peer recovering the dead member, a restore, the printer) or read records the log gave up."""
    pruned = int((manifest or {}).get("pruned", 0))
    active = [(n, p) for n, p in checked_segments(directory, manifest, use_copies=True) if n >= pruned]
    have = {segno for segno, _ in active}
    out: list[tuple[int, Path]] = []
    for info in archived_segments(manifest):
        if info.segment in have:
            continue
        if not info.path.is_file():
            raise LogFormatError(f"{info.path}: archived segment {info.segment} of {directory} is listed in "
                                 f"{MANIFEST_NAME} but missing from the archive: its records are lost")
        out.append((info.segment, info.path))
    out += active
    for (a, _), (b, pb) in zip(out, out[1:]):
        if b != a + 1:
            raise LogFormatError(f"{directory}: segment {a + 1} is missing (next present is {pb})")
    return out


def trusted_segments(directory: Path, manifest: dict[str, Any] | None) -> dict[int, SegmentInfo]:
    """Sealed segment entries of the manifest (the only ones whose statistics may be trusted), archived ones
    included."""
    out: dict[int, SegmentInfo] = {}
    if not manifest:
        return out
    for info in archived_segments(manifest):
        out[info.segment] = info
    for entry in manifest.get("segments", []):
        try:
            info = SegmentInfo.from_json(directory, entry)
        except (KeyError, TypeError, ValueError) as e:
            raise LogFormatError(f"{directory / MANIFEST_NAME}: bad segment entry {entry!r}") from e
        if info.sealed:
            out[info.segment] = info
    return out


def checked_segments(directory: Path, manifest: dict[str, Any] | None, *,
                     use_copies: bool = False) -> list[tuple[int, Path]]:
    """The segment files (list_segments), checked against the manifest: a segment the manifest lists that is
    not on disk is corruption, reported by file name. Without this check a deleted last segment (or a deleted
    first one) would leave a log with no gap in its numbering, and its records would be lost without a word.
    use_copies (a reader): a sealed segment with an archived copy (the manifest's "copies", sqm.log.mediacopy)
    whose active file is missing, or not of the copy's size (truncated), is read from the copy; its writer
    restores the active file from the copy when it next opens the log."""
    copies = {int(c["segment"]): c for c in (manifest or {}).get("copies", [])
              if Path(c["path"]).is_file()} if use_copies else {}
    # With copies, a missing sealed segment between two present ones is a gap its copy fills: the numbering is
    # checked once the copies are in (a reader of a dead member's log must not fail on what its restart repairs).
    found = list_segments(directory, gaps=bool(copies))
    have = {segno for segno, _ in found}
    for entry in (manifest or {}).get("segments", []):
        segno = entry.get("segment") if isinstance(entry, dict) else None
        if isinstance(segno, int) and segno not in have and segno not in copies:
            raise LogFormatError(f"{directory / segment_name(segno)}: segment {segno} is listed in "
                                 f"{MANIFEST_NAME} but missing from the log directory: its records are lost")
    if not copies:
        return found
    out = dict(found)
    listed = {e.get("segment") for e in (manifest or {}).get("segments", []) if isinstance(e, dict)}
    for segno, c in copies.items():
        if segno not in listed:
            continue
        path = out.get(segno)
        if path is None or _size(path) != int(c["bytes"]):
            out[segno] = Path(c["path"])
    merged = sorted(out.items())
    _check_contiguous(directory, merged)
    return merged


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def manifest_group(manifest: dict[str, Any] | None) -> str | None:
    """The id of the group repository the log's member wrote it for (RecordLog.stamp_group); None for a log not
    stamped (written before logs were)."""
    group = (manifest or {}).get("group")
    return str(group) if group is not None else None


def manifest_checkpoints(manifest: dict[str, Any] | None) -> list[tuple[LogPosition, int]]:
    if not manifest:
        return []
    return [(LogPosition.from_json(c["position"]), int(c["lrsn"])) for c in manifest.get("checkpoints", [])]
