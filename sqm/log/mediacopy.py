"""Archived copies of a log's sealed segments, and media recovery of a damaged active segment from its copy
(linear logging; docs/log-management.md, "Media recovery").

A sealed segment is copied to the archive directory at the checkpoint after it was sealed, while it is still in
the active log (as MQ offloads a full active log to an archive log): the copy is written privately, fsynced,
read back (the same bytes, every frame valid, the record count and LRSN range of the segment) and renamed into
place, and the manifest lists it under "copies" with its sha256. When the segment later becomes inactive, archiving
it checks the copy against its sha256 before it removes the active file (then the only other copy): a good copy is
moved to "archived", a damaged or missing one is made again from the active file (archive_copy).

When the log is opened (the member's restart), a sealed segment the manifest lists whose file is gone is restored
from its copy, and every sealed active segment that has a copy is checked against the copy's digest; one that
differs (a bad sector, a stray write, a truncation) is replaced by its copy, whose own digest is checked first.
Nothing is decided from a damaged segment: it is either repaired from a good copy or the open fails naming both.
A reader (LogReader: restore, peer recovery, the printer) never changes the log: it reads a missing or truncated
sealed segment from its copy (format.checked_segments), and reads on from the verified copy where it finds a
damaged frame (good_copy).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfemu.durable import fsync_directory
from cfemu.private_files import open_private
from sqm.log.format import LogCorruptError, LogFormatError, SegmentInfo, SegmentScan, segment_name

log = logging.getLogger("sqm.log")


@dataclass(frozen=True)
class MediaRecovery:
    """One damaged active segment replaced by its archived copy."""

    segment: int
    path: Path
    copy: Path
    why: str


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def copy_verified(src: Path, dst: Path, segment: int, member: str, info: SegmentInfo) -> tuple[int, str]:
    """Copy one sealed segment to dst (0600, fsynced, renamed into place, directory fsynced) and check the copy:
    the same bytes, and every frame readable with the record count and LRSN range the manifest has. Returns the
    bytes and the sha256 (hex) of the copy."""
    tmp = dst.with_name(dst.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as out, open(src, "rb") as f:
        while chunk := f.read(1 << 20):
            out.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    if file_digest(tmp) != digest.hexdigest():
        tmp.unlink()
        raise LogFormatError(f"{dst}: the archived copy of segment {segment} does not read back as the bytes of "
                             f"{src}: not archived")
    try:
        SegmentScan(tmp, segment, member, is_last=False, expected=info).run()
    except LogCorruptError as e:
        # The copy holds the segment's own bytes (checked above): the damage is in the segment (a damaged frame, or
        # fewer records than its manifest entry), and the error names it, not the temporary copy removed here.
        tmp.unlink()
        raise LogCorruptError(src, e.offset, e.what) from None
    os.replace(tmp, dst)
    fsync_directory(dst.parent)
    return size, digest.hexdigest()


def _damage(path: Path, digest: str, other: str = "the archived copy's") -> str:
    """Why the segment file at path does not hold the bytes of `digest`, those of `other` ("" when it does)."""
    try:
        return "" if file_digest(path) == digest else f"its bytes differ from {other}"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"


def repair_damaged(directory: Path, member: str, sealed: list[tuple[int, Path]],
                   copies: list[dict[str, Any]]) -> list[MediaRecovery]:
    """Media recovery at open: each sealed active segment with an archived copy whose bytes differ from the copy's
    digest is replaced by the copy (checked first). A damaged segment whose copy is missing or damaged too fails
    the open (LogCorruptError), naming both: restart must not read a log with a hole."""
    by_segment = {int(c["segment"]): c for c in copies}
    done = []
    for segno, path in sealed:
        entry = by_segment.get(segno)
        if entry is None:
            continue
        why = _damage(path, str(entry["sha256"]))
        if why:
            done.append(_restore_from_copy(directory, member, segno, path, entry, why))
    return done


def restore_missing(directory: Path, member: str, manifest: dict[str, Any] | None) -> list[MediaRecovery]:
    """Media recovery at open, before the segments are listed: a sealed segment the manifest lists whose file is
    gone (deleted by mistake, lost with its sector) is restored from its archived copy, checked first. One with no
    copy is left to the listing, which fails the open naming it."""
    listed = {e.get("segment") for e in (manifest or {}).get("segments", []) if isinstance(e, dict)}
    done = []
    for entry in (manifest or {}).get("copies", []):
        segno = int(entry["segment"])
        path = directory / segment_name(segno)
        if segno in listed and not path.exists():
            done.append(_restore_from_copy(directory, member, segno, path, entry, "it is missing"))
    return done


def _restore_from_copy(directory: Path, member: str, segno: int, path: Path, entry: dict[str, Any],
                       why: str) -> MediaRecovery:
    copy = Path(entry["path"])
    bad_copy = _damage(copy, str(entry["sha256"])) if copy.is_file() else "it is missing"
    if bad_copy:
        raise LogCorruptError(path, 0, f"segment {segno} of {member} is damaged ({why}) and its archived copy "
                                       f"{copy} cannot replace it ({bad_copy})")
    tmp = path.with_name(path.name + ".media")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as out, open(copy, "rb") as f:
        while chunk := f.read(1 << 20):
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if file_digest(tmp) != entry["sha256"]:
        tmp.unlink()
        raise LogCorruptError(path, 0, f"segment {segno} of {member} is damaged ({why}) and restoring it from "
                                       f"{copy} did not read back")
    os.replace(tmp, path)
    fsync_directory(directory)
    log.warning("%s: media recovery: log segment %d (%s) was damaged (%s); restored from its archived copy %s",
                member, segno, path, why, copy)
    return MediaRecovery(segno, path, copy, why)


def good_copy(manifest: dict[str, Any] | None, segment: int) -> Path | None:
    """The archived copy of a sealed active segment, when its bytes are the ones the manifest's digest names (a
    reader falls back on it where the active file is damaged; it never changes the log)."""
    for entry in (manifest or {}).get("copies", []):
        if int(entry["segment"]) == segment:
            copy = Path(entry["path"])
            return copy if copy.is_file() and not _damage(copy, str(entry["sha256"])) else None
    return None


def copy_holds(active: Path, copy: Path, segment: int, member: str) -> bool:
    """Whether the archived copy of a segment holds the active file's bytes, so that the active file may go: what
    an archive interrupted after its manifest listed the copy, and before it removed the active file, needs before
    the open finishes it. The copy's volume may be missing at that open (not mounted yet), or the copy damaged: the
    active file is then the only good copy, and stays (readers read it: log_segments) until an open finds the copy
    good. Never copied again here: a missing volume's empty mount point would take the copy in its place."""
    why = "it is missing" if not copy.is_file() else _damage(copy, file_digest(active), "the active file's")
    if why:
        log.warning("%s: log segment %d was archived to %s, but %s: its active file %s is kept, and read, until the "
                    "copy is good", member, segment, copy, why, active)
    return not why


def archive_copy(src: Path, dst: Path, info: SegmentInfo, member: str, copied: dict[str, Any] | None) -> int:
    """The archived copy of a sealed segment about to leave the active log, checked before the active file (then
    the only other copy) is removed: a copy made while the segment was active (copied) is kept when its bytes
    still match its digest, and made again from the active file when not (damaged, or gone); the active file must
    then read as the digest said (else it changed since it was copied: LogCorruptError, nothing is removed).
    Returns the copy's size in bytes."""
    if copied is not None:
        why = _damage(dst, str(copied["sha256"])) if dst.is_file() else "it is missing"
        if not why:
            return int(copied["bytes"])
        log.warning("%s: the archived copy %s of log segment %d is damaged (%s): copied again from %s", member,
                    dst, info.segment, why, src)
    size, digest = copy_verified(src, dst, info.segment, member, info)
    if copied is not None and digest != copied["sha256"]:
        raise LogCorruptError(src, 0, f"segment {info.segment} of {member} no longer reads as when it was copied "
                                      f"(its sha256 differs) and its archived copy {dst} is damaged: not archived")
    return size


__all__ = ["MediaRecovery", "archive_copy", "copy_holds", "copy_verified", "file_digest", "good_copy", "repair_damaged",
           "restore_missing"]
