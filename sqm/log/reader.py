"""Read-only access to record logs: one member's log, and the merged log of several members."""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from pathlib import Path
from typing import Any

from sqm.log.format import (
    MANIFEST_NAME,
    SEGMENT_RE,
    LogCorruptError,
    LogFormatError,
    LogPosition,
    SegmentInfo,
    SegmentScan,
    archived_segments,
    list_segments,
    log_segments,
    manifest_checkpoints,
    read_header,
    read_manifest,
    read_record_at,
    segment_name,
    trusted_segments,
)
from sqm.log.mediacopy import good_copy


class LogReader:
    """Read-only view of a log directory.

    Another process may be appending: the reader never modifies anything and never takes the writer lock.
    Each call looks at the directory afresh (segment list, manifest) and reads the last segment to its real
    end (a torn or still-being-written final frame is the end). ``segments_opened`` counts segment files
    opened for scanning (so callers/tests can see that ``min_lrsn`` skipped old segments).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise LogFormatError(f"{self.directory}: no such log directory")
        self.segments_opened = 0
        manifest = read_manifest(self.directory)
        if manifest is not None:
            self.member: str = str(manifest["member"])
        else:
            segs = list_segments(self.directory)
            if not segs:
                raise LogFormatError(f"{self.directory}: not a record log directory (no manifest, no segments)")
            segno, path = segs[0]
            with open(path, "rb") as f:
                header = read_header(f, path, allow_partial=len(segs) == 1)
            # A member killed while it made its log's first segment (no manifest yet, the header not all written)
            # logged nothing: its log is empty, and named by its directory, as the product lays logs out
            # (<log root>/<member>), until the member's restart writes the header. Peer recovery and restore read
            # it as empty rather than fail on it while the member is down.
            self.member = header.member if header is not None else self.directory.name

    def _scan(self, segno: int, path: Path, *, is_last: bool, start_offset: int = 0,
              expected: SegmentInfo | None = None) -> SegmentScan:
        self.segments_opened += 1
        if not path.exists():
            # Archived by its running writer since this reader listed the segments: the archive lists the copy
            # before the active file goes (RecordLog.archive), so the manifest read now names it.
            manifest = read_manifest(self.directory)
            moved = {i.segment: i.path for i in archived_segments(manifest)}.get(segno)
            if moved is None and segno < int((manifest or {}).get("pruned", 0)):
                # Released and reused (a circular log's ring) or pruned since this reader listed the segments.
                raise LogFormatError(f"{path}: segment {segno} of {self.member} was released by its running writer "
                                     "while this read its log (a circular log's ring reused it, or a prune): its "
                                     "records are no longer in the log; read again from its oldest segment")
            path = moved or path
        return SegmentScan(path, segno, self.member, is_last=is_last, start_offset=start_offset, expected=expected)

    def records(
        self, start: LogPosition | None = None, min_lrsn: int | None = None,
        segments: Container[int] | None = None,
    ) -> Iterator[tuple[LogPosition, dict[str, Any]]]:
        """Records in append order from ``start`` (a frame position; default: the beginning).

        ``min_lrsn``: skip whole sealed segments whose maximum LRSN (per the manifest) is below it, and drop
        records with ``l < min_lrsn``. Records are only approximately LRSN-ordered within one log, so this
        never stops early on LRSN. ``segments``: read only the segment numbers it contains (a restore's log scan
        shares one log's segments among processes; only ``in`` is asked of it, as each segment is reached)."""
        manifest = read_manifest(self.directory)
        segs = log_segments(self.directory, manifest)
        if not segs:
            return
        trusted = trusted_segments(self.directory, manifest)
        last = segs[-1][0]
        for segno, path in segs:
            if (start is not None and segno < start.segment) or (segments is not None and segno not in segments):
                continue
            if min_lrsn is not None and segno != last:
                info = trusted.get(segno)
                if info is not None and (info.max_lrsn is None or info.max_lrsn < min_lrsn):
                    continue
            off = start.offset if start is not None and segno == start.segment else 0
            frames = self._frames(manifest, segno, path, is_last=segno == last, start_offset=off,
                                  expected=trusted.get(segno))
            if min_lrsn is None:
                yield from frames
            else:
                for pos, rec in frames:
                    if rec["l"] >= min_lrsn:
                        yield pos, rec

    def _frames(self, manifest: dict[str, Any] | None, segno: int, path: Path, *, is_last: bool,
                start_offset: int, expected: SegmentInfo | None = None
                ) -> Iterator[tuple[LogPosition, dict[str, Any]]]:
        """The segment's records; a sealed segment found damaged on the way is read on from its verified archived
        copy (the same bytes: media recovery, sqm.log.mediacopy), from the first frame not read yet. Restore and
        peer recovery read a member's log here, before the member's own restart would repair the segment."""
        scan = self._scan(segno, path, is_last=is_last, start_offset=start_offset, expected=expected)
        try:
            yield from scan
        except (LogCorruptError, LogFormatError):
            copy = None if is_last else good_copy(manifest, segno)
            if copy is None or copy == path:
                raise
            yield from SegmentScan(copy, segno, self.member, is_last=False,
                                   start_offset=scan.end_offset or start_offset, expected=expected)

    def segments(self, manifest: dict[str, Any] | None = None) -> list[SegmentInfo]:
        """Per-segment information: from the manifest for sealed segments, by scanning for the others
        (always for the last one). ``manifest``: the one the caller has just read, so that what it decided from
        the manifest and these segments are of one look at the log (default: read now)."""
        if manifest is None:
            manifest = read_manifest(self.directory)
        segs = log_segments(self.directory, manifest)
        trusted = trusted_segments(self.directory, manifest)
        out: list[SegmentInfo] = []
        last = segs[-1][0] if segs else -1
        for segno, path in segs:
            info = trusted.get(segno)
            if info is None or segno == last:
                info = self._scan(segno, path, is_last=segno == last).run().info()
            out.append(info)
        return out

    def last_checkpoint(self) -> tuple[LogPosition, dict[str, Any]] | None:
        """The latest checkpoint recorded in the manifest, with its record read from the log."""
        manifest = read_manifest(self.directory)
        cps = manifest_checkpoints(manifest)
        if not cps:
            return None
        pos = cps[-1][0]
        segs = log_segments(self.directory, manifest)
        path = dict(segs).get(pos.segment, self.directory / segment_name(pos.segment))
        try:
            return pos, read_record_at(path, pos.segment, self.member, pos.offset)
        except (LogCorruptError, LogFormatError):
            # A sealed segment damaged in place is read from its verified archived copy, as records() reads it
            # (peer recovery reads the dead member's checkpoint here, before its restart would repair the segment).
            copy = None if segs and pos.segment == segs[-1][0] else good_copy(manifest, pos.segment)
            if copy is None or copy == path:
                raise
            return pos, read_record_at(copy, pos.segment, self.member, pos.offset)

    def checkpoints(self) -> list[tuple[LogPosition, int]]:
        """(position, lrsn) of the checkpoints remembered in the manifest, oldest first."""
        return manifest_checkpoints(read_manifest(self.directory))

    def end_position(self) -> LogPosition:
        """Position just after the last complete frame of the last segment (what a writer would append at)."""
        segs = log_segments(self.directory, read_manifest(self.directory))
        if not segs:
            return LogPosition(0, 0)
        segno, path = segs[-1]
        scan = self._scan(segno, path, is_last=True).run()
        return LogPosition(segno, scan.end_offset)

    def __repr__(self) -> str:
        return f"LogReader({str(self.directory)!r}, member={self.member!r})"


def one_log_per_member(directories: Iterable[str | Path]) -> dict[str, Path]:
    """Each member's log directory, member -> directory; LogFormatError when one member's log is in two
    directories (its records twice, or two histories of one member: which one is its log is the operator's to
    say). Every reader of several logs checks so before it reads a record (restore's engines, merged_records)."""
    dirs: dict[str, Path] = {}
    for d in directories:
        member = LogReader(d).member
        if member in dirs:
            raise LogFormatError(f"member {member!r} appears twice: {dirs[member]} and {d}")
        dirs[member] = Path(d)
    return dirs


def merged_records(
    directories: Iterable[str | Path], min_lrsn: int | None = None, max_lrsn: int | None = None
) -> list[dict[str, Any]]:
    """The merged log of several SQMs.

    Every record of each log with ``min_lrsn <= l <= max_lrsn`` (bounds optional), copied and annotated
    with ``"m"``: the member name, sorted by ``(l, m, position)``. This is an in-memory sort: records are
    only approximately in LRSN order within one log (concurrent threads append out of order), so a
    streaming k-way merge would be wrong."""
    keyed: list[tuple[int, str, int, int, dict[str, Any]]] = []
    directories = list(directories)
    one_log_per_member(directories)
    for d in directories:
        reader = LogReader(d)
        m = reader.member
        for pos, rec in reader.records(min_lrsn=min_lrsn):
            lrsn = rec["l"]
            if max_lrsn is not None and lrsn > max_lrsn:
                continue
            out = dict(rec)
            out["m"] = m
            keyed.append((lrsn, m, pos.segment, pos.offset, out))
    keyed.sort(key=lambda t: t[:4])
    return [t[4] for t in keyed]


def find_log_dirs(root: str | Path) -> list[Path]:
    """Subdirectories of ``root`` (one level) that hold a record log (a manifest or segment files), sorted."""
    rootp = Path(root)
    if not rootp.is_dir():
        return []
    return [p for p in sorted(rootp.iterdir()) if holds_log(p)]  # a file is not a directory: it holds no log


def holds_log(directory: str | Path) -> bool:
    """Whether ``directory`` holds a record log (a manifest or segment files); False when it does not exist."""
    d = Path(directory)
    try:
        return (d / MANIFEST_NAME).is_file() or any(SEGMENT_RE.match(c.name) for c in d.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return False
