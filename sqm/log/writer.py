"""The writer side of one SQM's record log: append, group-commit force, segment roll, checkpoints."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from cfemu import thread_packer
from cfemu.durable import fsync_directory
from cfemu.latency import Latency
from cfemu.private_files import open_private, private_dir
from sqm.log.format import (
    FORMAT_VERSION,
    FRAME,
    FRAME_HEADER_BYTES,
    LOCK_NAME,
    MAX_RECORD_BYTES,
    LogCorruptError,
    LogFormatError,
    LogLockedError,
    LogPosition,
    SegmentInfo,
    SegmentScan,
    archived_segments,
    check_sealed,
    checked_segments,
    crc32c,
    encode_header,
    manifest_checkpoints,
    manifest_group,
    read_header,
    read_manifest,
    read_record_at,
    segment_name,
    trusted_segments,
    write_manifest,
)
from sqm.log.mediacopy import (
    MediaRecovery,
    archive_copy,
    copy_holds,
    copy_verified,
    repair_damaged,
    restore_missing,
)
from sqm.request_slots import before_wait

#: Checkpoints remembered in the manifest.
CHECKPOINTS_KEPT = 16
#: Buffered frames are written to the segment (without fsync) once this many bytes are pending.
WRITE_THRESHOLD = 256 * 1024

_fdatasync = getattr(os, "fdatasync", os.fsync)
_pack = thread_packer.pack  # each thread its own Packer, not kept past a record of a large message


@dataclass
class LogStats:
    """Counters of one :class:`RecordLog` instance (since it was opened)."""

    records: int = 0  # records appended
    bytes: int = 0  # frame bytes appended (headers included)
    fsyncs: int = 0  # fsync/fdatasync calls on segment files
    forces: int = 0  # calls to force() (append_forced and checkpoint included)
    segments: int = 0  # segment files in the log (current count)
    torn_bytes_truncated: int = 0  # bytes of torn tail removed when the log was opened
    fsync_seconds: Latency = field(default_factory=Latency)  # how long each fsync of a segment took


def writer_is_open(directory: Path) -> bool:
    """Whether a writer holds the log at `directory` open now (its writer lock, RecordLog, is taken: by this process
    or another). A process that died released it. False when the directory has no lock file."""
    try:
        fd = os.open(Path(directory) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the descriptor releases the shared lock taken to test
    return False


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class RecordRefusedError(OSError):
    """The log refused a record before any byte of it was buffered or written (the log failed earlier, or sealing
    the full segment failed): the record cannot be on disk. Any other OSError of an append or a force leaves the
    record possibly on disk (a write or an fsync that fails part way)."""


class LogFullError(RecordRefusedError):
    """A circular log's ring has no segment it may reuse: every one holds a record recovery still needs. Raised
    before the record is buffered: refused, never on disk."""


@dataclass(frozen=True)
class ArchiveOutcome:
    segment: int
    path: Path  # the archived copy
    records: int
    bytes: int


class _BadPosition(ValueError):
    """force() was given a position past the last record appended: the caller's error, not the log's."""


class RecordLog:
    """One SQM's log, opened for writing.

    A single process owns it: an exclusive ``fcntl.flock`` on ``writer.lock`` in the directory refuses a
    second writer (also a second instance in the same process) with :class:`LogLockedError`.

    ``append`` is cheap (encode, checksum, copy into a buffer) and not durable; ``force`` makes everything
    appended up to a position durable, sharing fsyncs between concurrent callers (group commit).
    """

    def __init__(
        self,
        directory: str | Path,
        member: str,
        *,
        segment_bytes: int = 64 * 2**20,
        create: bool = True,
        ring: int = 0,
    ) -> None:
        if not member:
            raise ValueError("member name must not be empty")
        if segment_bytes < 256:
            raise ValueError("segment_bytes is too small")
        self.directory = Path(directory)
        self.member = member
        self.segment_bytes = segment_bytes
        if ring and ring < 3:
            raise ValueError("a circular log needs a ring of at least 3 segments")
        # Circular logging (ring > 0): at most `ring` segment files; a roll reuses the oldest once the member has
        # said it is inactive (release_below), and refuses (LogFullError) rather than overwrite a needed record.
        self.ring = ring
        self._reusable_below = 0
        self._archived: list[dict[str, Any]] = []  # manifest entries of segments archived out of the active log
        # Manifest entries of the archived copies of sealed segments still in the active log (sqm.log.mediacopy).
        self._copies: list[dict[str, Any]] = []
        self.media_recovered: list[MediaRecovery] = []  # damaged segments restored from their copies at open
        self._pruned = 0  # segments below this were removed on purpose (no recovery needed them)
        self._group: str | None = None  # the id of the group repository whose member writes it (stamp_group)
        # The highest LRSN of the segments removed on purpose (None: none removed, or removed before the manifest
        # said): restore checks that a member's log still holds every record from its base's replay start on.
        self._pruned_lrsn: int | None = None
        self.stats = LogStats()
        self._lock = threading.Lock()  # buffer, current segment, counters of appends
        self._fcond = threading.Condition(threading.Lock())  # group commit state (never take _lock inside)
        self._flushing = False
        self._in_force = 0
        self._failed: BaseException | None = None
        # Called by the leader of a flush that other committers wait on, before it writes their records (the
        # owner's crash point for a kill inside a shared fsync: sqm.core.failpoints "group-force").
        self.before_shared_flush: Callable[[], None] | None = None
        self._closed = True
        self._buf = bytearray()
        self._retired: list[int] = []
        self._lock_fd = -1
        self._fd = -1
        self._checkpoints: list[tuple[LogPosition, int]] = []
        self._sealed: list[SegmentInfo] = []
        if not self.directory.is_dir() and not create:
            raise LogFormatError(f"{self.directory}: no such log directory")
        private_dir(self.directory)  # segments hold message bodies: 0700, refused when others can write it
        self._acquire_lock()
        try:
            self._open()
        except BaseException:
            self._release_lock()
            raise
        self._closed = False

    # ------------------------------------------------------------------------------------------ opening

    def _acquire_lock(self) -> None:
        path = self.directory / LOCK_NAME
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 100, 0).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
            raise LogLockedError(
                f"{self.directory}: record log is already open for writing by another writer "
                f"(lock file {path} held by {holder or 'unknown'})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode("ascii"), 0)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def _open(self) -> None:
        d = self.directory
        manifest = read_manifest(d)
        if manifest is not None and manifest["member"] != self.member:
            raise LogFormatError(
                f"{d}: log directory belongs to member {manifest['member']!r}, not {self.member!r}"
            )
        self._checkpoints = manifest_checkpoints(manifest)
        self._archived = list((manifest or {}).get("archived", []))
        self._kept_active: set[int] = set()  # archived segments whose active file stays: their copy is not good
        self._copies = list((manifest or {}).get("copies", []))
        self._pruned = int((manifest or {}).get("pruned", 0))
        self._group = manifest_group(manifest)
        pruned_lrsn = (manifest or {}).get("pruned_lrsn")
        self._pruned_lrsn = int(pruned_lrsn) if pruned_lrsn is not None else None
        archived = {i.segment: i.path for i in archived_segments(manifest)}  # segment -> its archived copy
        trusted = trusted_segments(d, manifest)
        restored = restore_missing(d, self.member, manifest)
        segs = checked_segments(d, manifest)
        if segs and archived.keys() & {n for n, _ in segs[:-1]}:
            # An archive interrupted after the manifest listed the copy and before the active file was removed: the
            # active file goes once its copy holds its bytes, else it stays for readers (copy_holds).
            for segno, path in segs[:-1]:
                if segno not in archived:
                    continue
                if copy_holds(path, archived[segno], segno, self.member):
                    path.unlink()
                else:
                    self._kept_active.add(segno)
            fsync_directory(d)
            segs = [(n, p) for n, p in segs if n not in archived or n == segs[-1][0]]
        if segs and segs[0][0] < self._pruned <= segs[-1][0]:
            # A prune interrupted after the manifest dropped the segments and before their files were removed.
            for segno, path in segs:
                if segno < self._pruned:
                    path.unlink()
            fsync_directory(d)
            segs = [(n, p) for n, p in segs if n >= self._pruned]
        self.media_recovered = restored + repair_damaged(d, self.member, segs[:-1], self._copies)
        if not segs:
            start = max(trusted, default=0) + 1
            os.close(self._create_segment(start))
            segs = [(start, d / segment_name(start))]
        self._sealed = []
        for segno, path in segs[:-1]:
            info = trusted.get(segno)
            if info is not None and not info.sealed:
                info = None
            if info is not None:
                with open(path, "rb") as f:
                    header = read_header(f, path, allow_partial=False)
                    # Not scanned (its manifest entry is trusted): a file shorter than that entry lost whole
                    # frames at its end, and a member must not start on a log that lost records.
                    check_sealed(info, path, end=os.fstat(f.fileno()).st_size)
                assert header is not None
                if header.segment != segno or header.member != self.member:
                    raise LogFormatError(
                        f"{path}: segment belongs to member {header.member!r} (segment {header.segment}), "
                        f"not {self.member!r}"
                    )
            else:
                info = SegmentScan(path, segno, self.member, is_last=False).run().info()
            self._sealed.append(info)
        segno, path = segs[-1]
        scan = SegmentScan(path, segno, self.member, is_last=True).run()
        self._refuse_forced_tail(path, segno, scan.end_offset)
        if scan.header is None:
            # Crash while the segment was being created: rewrite its header.
            self.stats.torn_bytes_truncated += path.stat().st_size
            path.unlink()
            os.close(self._create_segment(segno))
            scan = SegmentScan(path, segno, self.member, is_last=True).run()
            assert scan.header is not None
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            if size > scan.end_offset:
                os.ftruncate(fd, scan.end_offset)
                os.fsync(fd)
                self.stats.torn_bytes_truncated += size - scan.end_offset
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._seg = segno
        self._capacity = scan.header.capacity  # keep the capacity the segment was created with
        self._first_frame = scan.header.length
        self._off = scan.end_offset
        self._cur_first = scan.first
        self._cur_last = scan.last
        self._cur_min = scan.min_lrsn
        self._cur_max = scan.max_lrsn
        self._cur_count = scan.records
        self._last: LogPosition | None = scan.last
        if self._last is None and self._sealed:
            for info in reversed(self._sealed):
                if info.last is not None:
                    self._last = info.last
                    break
        self._durable = LogPosition(segno, self._off)
        self.stats.segments = len(segs)
        with self._lock:
            self._write_manifest_locked()

    def _refuse_forced_tail(self, path: Path, segno: int, end: int) -> None:
        """What the scan of the last segment took for a torn tail (from `end` on) must hold nothing that was forced:
        a checkpoint the manifest lists there was forced before the manifest named it, so damage there (a bit flipped
        in its length, its bytes zeroed) is corruption of forced records, not a crash's torn write. LogCorruptError,
        and nothing is truncated: truncating would destroy the damaged records, and the restart would then fail
        reading the checkpoint without saying why."""
        forced = [p.offset for p, _ in self._checkpoints if p.segment == segno and p.offset >= end]
        if forced:
            raise LogCorruptError(path, end, f"the frames end here, but the manifest lists a checkpoint record "
                                             f"forced at byte offset {max(forced)}: records that were forced are "
                                             "damaged, not torn (nothing truncated)")

    def _create_segment(self, segno: int) -> int:
        path = self.directory / segment_name(segno)
        fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND)
        try:
            _write_all(fd, encode_header(segno, self.segment_bytes, self.member))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        fsync_directory(self.directory)
        return fd

    def _reuse_segment(self, old: Path, segno: int) -> int:
        """A circular log's released segment file, emptied to segment `segno`'s header and then renamed to it (the
        file, and so its disk blocks, stay in the ring). A crash before the rename leaves a file numbered below the
        manifest's "pruned" mark, which the next open removes; after it, a valid empty segment."""
        path = self.directory / segment_name(segno)
        fd = os.open(old, os.O_WRONLY | os.O_APPEND)
        try:
            os.ftruncate(fd, 0)
            _write_all(fd, encode_header(segno, self.segment_bytes, self.member))
            os.fsync(fd)
            os.replace(old, path)
        except BaseException:
            os.close(fd)
            raise
        fsync_directory(self.directory)
        return fd

    # ------------------------------------------------------------------- log management (docs/log-management.md)

    def release_below(self, segment: int) -> None:
        """Circular logging: segments numbered below `segment` hold nothing recovery needs; a roll may reuse them."""
        with self._lock:
            self._reusable_below = max(self._reusable_below, segment)

    def ring_free(self) -> int:
        """Circular logging: how many more rolls can happen before one finds no reusable segment (linear: -1)."""
        with self._lock:
            if not self.ring:
                return -1
            unused = self.ring - len(self._sealed) - 1
            return unused + sum(1 for i in self._sealed if i.segment < self._reusable_below)

    def room(self) -> int:
        """Circular logging: about how many bytes can still be appended before a roll would find no reusable
        segment (the rest of the current segment and the free ones; linear: -1)."""
        free = self.ring_free()
        if free < 0:
            return -1
        with self._lock:
            return max(0, self._capacity - self._off) + free * self.segment_bytes

    def archive(self, below: int, archive_dir: Path) -> list[ArchiveOutcome]:
        """Linear logging: move the sealed segments numbered below `below` (inactive: the caller computed it) to
        archive_dir (0700): each copied, fsynced and verified, then listed in the manifest as archived, then
        removed from the active log. Readers (LogReader, restore, the printer) read them there transparently."""
        archive_dir = Path(archive_dir)
        with self._lock:
            todo = [i for i in self._sealed if i.segment < below]
        if not todo:
            return []
        self._refuse_own_directory(archive_dir)
        private_dir(archive_dir)  # segments hold message bodies: 0700 (each file 0600)
        done = []
        for info in todo:
            copied = self._copy_of(info.segment)  # copied while it was active (copy_sealed): kept if still good
            dst = Path(copied["path"]) if copied is not None else archive_dir / segment_name(info.segment)
            size = archive_copy(info.path, dst, info, self.member, copied)
            with self._lock:
                self._sealed.remove(info)
                self._copies = [c for c in self._copies if int(c["segment"]) != info.segment]
                self._archived.append({**info.to_json(), "path": str(dst.absolute()), "bytes": size})
                self._write_manifest_locked()
                self.stats.segments -= 1
            info.path.unlink()
            fsync_directory(self.directory)
            done.append(ArchiveOutcome(info.segment, dst, info.records, size))
        return done

    def _copy_of(self, segment: int) -> dict[str, Any] | None:
        with self._lock:
            return next((c for c in self._copies if int(c["segment"]) == segment), None)

    def copy_sealed(self, archive_dir: Path) -> list[int]:
        """Linear logging: copy each sealed active segment that has no archived copy yet to archive_dir (verified:
        sqm.log.mediacopy), and list it in the manifest's "copies": media recovery restores a damaged active
        segment from it, and archiving the segment later only moves it. Returns the segments copied."""
        archive_dir = Path(archive_dir)
        with self._lock:
            have = {int(c["segment"]) for c in self._copies}
            todo = [i for i in self._sealed if i.segment not in have]
        if not todo:
            return []
        self._refuse_own_directory(archive_dir)
        private_dir(archive_dir)
        done = []
        for info in todo:
            dst = archive_dir / segment_name(info.segment)
            size, digest = copy_verified(info.path, dst, info.segment, self.member, info)
            with self._lock:
                if info not in self._sealed:  # archived or pruned meanwhile
                    continue
                self._copies.append({"segment": info.segment, "path": str(dst.absolute()), "bytes": size,
                                     "sha256": digest})
                self._write_manifest_locked()
            done.append(info.segment)
        return done

    def _refuse_own_directory(self, archive_dir: Path) -> None:
        """An archive directory must not be the log directory itself (an archive root set to the log root makes
        ROOT/<member> the member's own log): each segment's "copy" would be its active file, and archiving would then
        remove the only file the manifest lists it in, leaving a log that every reader refuses (its archived segment
        missing). LogFormatError, before anything is copied or removed."""
        try:
            same = archive_dir.exists() and os.path.samefile(archive_dir, self.directory)
        except OSError:
            same = False
        if same or archive_dir.resolve() == self.directory.resolve():
            raise LogFormatError(f"{archive_dir}: the archive directory of {self.member}'s log is the log directory "
                                 "itself: archive to another directory (--log-archive-dir is a root: ROOT/<member>)")

    def prune(self, below: int) -> list[int]:
        """Remove every segment numbered below `below` for good, active or archived (the caller checked that no
        recovery needs them): the manifest first, then the files."""
        with self._lock:
            below = min(below, self._seg)  # never the current segment
            gone_active = [i for i in self._sealed if i.segment < below]
            gone_archived = [a for a in self._archived if int(a["segment"]) < below]
            if not gone_active and not gone_archived:
                return []
            self._sealed = [i for i in self._sealed if i.segment >= below]
            self._archived = [a for a in self._archived if int(a["segment"]) >= below]
            gone_copies = [c for c in self._copies if int(c["segment"]) < below]
            self._copies = [c for c in self._copies if int(c["segment"]) >= below]
            self._pruned = max(self._pruned, below)
            self._note_pruned([i.max_lrsn for i in gone_active] + [a.get("max_lrsn") for a in gone_archived])
            self._write_manifest_locked()
            self.stats.segments -= len(gone_active)
        for info in gone_active:
            info.path.unlink(missing_ok=True)
        for a in gone_archived + gone_copies:
            Path(a["path"]).unlink(missing_ok=True)
        fsync_directory(self.directory)
        return sorted([i.segment for i in gone_active] + [int(a["segment"]) for a in gone_archived])

    def _note_pruned(self, max_lrsns: list[int | None]) -> None:
        """Raise the manifest's pruned_lrsn to the highest LRSN of segments being removed on purpose."""
        known = [int(x) for x in max_lrsns if x is not None]
        if known:
            self._pruned_lrsn = max([*known, *([self._pruned_lrsn] if self._pruned_lrsn is not None else [])])

    def archived(self) -> list[SegmentInfo]:
        with self._lock:
            return archived_segments({"archived": self._archived})

    # ------------------------------------------------------------------------------------- manifest

    def _current_info(self) -> SegmentInfo:
        return SegmentInfo(
            self._seg, self.directory / segment_name(self._seg), self._cur_first, self._cur_last,
            LogPosition(self._seg, self._off), self._cur_min, self._cur_max, self._cur_count, sealed=False,
        )

    def _write_manifest_locked(self) -> None:
        data = {
            "format": "cfemu-record-log",
            "version": FORMAT_VERSION,
            "member": self.member,
            "segment_bytes": self.segment_bytes,
            "segments": [i.to_json() for i in self._sealed] + [self._current_info().to_json()],
            "archived": self._archived,
            "copies": self._copies,
            "pruned": self._pruned,
            **({"pruned_lrsn": self._pruned_lrsn} if self._pruned_lrsn is not None else {}),
            "ring": self.ring,
            "checkpoints": [{"position": p.to_json(), "lrsn": lrsn} for p, lrsn in self._checkpoints],
        }
        if self._group is not None:
            data["group"] = self._group
        write_manifest(self.directory, data)

    def stamp_group(self, group: str) -> None:
        """Say in the manifest which group the log is of (the id of its group repository, cfemu.repository), so
        that a copy of it under another group's log root is known for another group's and never read as one of
        that group's logs (sqm.core.group_logs). LogFormatError when it is stamped with another group already:
        its records are another group's history, and this member must not write on them."""
        with self._lock:
            if self._closed:
                self._raise_unusable()
            if self._group == group:
                return
            if self._group is not None:
                raise LogFormatError(f"{self.directory}: the log is of another group (its manifest names group "
                                     f"repository {self._group}, this member's group is {group}): move it away")
            self._group = group
            self._write_manifest_locked()

    # --------------------------------------------------------------------------------------- append

    def append(self, record: dict[str, Any]) -> LogPosition:
        """Buffer one record (a dict with at least ``"k"`` and an int ``"l"``); not yet durable."""
        lrsn = record["l"]
        if type(lrsn) is not int:
            raise TypeError(f"record 'l' (LRSN) must be an int, got {type(lrsn).__name__}")
        if "k" not in record:
            raise KeyError("record has no 'k' (kind)")
        body = _pack(record)
        n = len(body)
        if n > MAX_RECORD_BYTES:
            raise ValueError(f"record of {n} bytes exceeds the maximum of {MAX_RECORD_BYTES}")
        head = FRAME.pack(n, crc32c(body))
        size = FRAME_HEADER_BYTES + n
        with self._lock:
            try:
                if self._closed or self._failed is not None:
                    self._raise_unusable()
                if self._off + size > self._capacity and self._off > self._first_frame:
                    self._roll_locked()
            except LogFullError:
                raise
            except OSError as e:
                raise RecordRefusedError(*e.args) from e
            pos = LogPosition(self._seg, self._off)
            buf = self._buf
            buf += head
            buf += body
            self._off += size
            self._last = self._cur_last = pos
            if self._cur_count == 0:
                self._cur_first = pos
                self._cur_min = self._cur_max = lrsn
            elif lrsn < self._cur_min:  # type: ignore[operator]
                self._cur_min = lrsn
            elif lrsn > self._cur_max:  # type: ignore[operator]
                self._cur_max = lrsn
            self._cur_count += 1
            st = self.stats
            st.records += 1
            st.bytes += size
            if len(buf) >= WRITE_THRESHOLD:
                self._write_locked()
        return pos

    def _raise_unusable(self) -> None:
        if self._failed is not None:
            raise OSError(f"{self.directory}: record log unusable after an I/O error: {self._failed}")
        raise ValueError(f"{self.directory}: record log is closed")

    def _write_locked(self) -> None:
        if self._buf:
            try:
                _write_all(self._fd, self._buf)
            except OSError as e:
                self._failed = e
                raise
            self._buf.clear()

    def _roll_locked(self) -> None:
        """Seal the current segment (write, fsync, keep fd until no flush can use it) and start the next. A full
        circular ring reuses its oldest segment, only once it is released (release_below); else LogFullError, and
        nothing is appended or overwritten."""
        reuse = None
        shed: list[SegmentInfo] = []
        if self.ring and len(self._sealed) + 1 >= self.ring:
            oldest = self._sealed[0]
            if oldest.segment >= self._reusable_below:
                raise LogFullError(f"{self.directory}: circular log full: all {self.ring} segments hold records "
                                   f"recovery still needs (oldest, segment {oldest.segment}, is not released)")
            reuse = oldest
            # A ring lowered since its files were made (--log-ring at a restart): the released segments after the
            # one reused, beyond the ring, are removed, so that its files come down to the ring as they are released.
            excess = len(self._sealed) + 1 - self.ring  # files beyond the ring once this roll has reused one
            for info in self._sealed[1:1 + excess]:
                if info.segment >= self._reusable_below:
                    break
                shed.append(info)
        self._write_locked()
        try:
            with self.stats.fsync_seconds.time():
                _fdatasync(self._fd)
        except OSError as e:
            self._failed = e
            raise
        old_end = LogPosition(self._seg, self._off)
        info = self._current_info()
        self._sealed.append(SegmentInfo(
            info.segment, info.path, info.first, info.last, info.end, info.min_lrsn, info.max_lrsn,
            info.records, sealed=True,
        ))
        with self._fcond:
            self.stats.fsyncs += 1
            if old_end > self._durable:
                self._durable = old_end
            if self._flushing:  # a leader may be fsyncing this fd right now: close it after that flush
                self._retired.append(self._fd)
            else:
                os.close(self._fd)
        segno = self._seg + 1
        # The sealed segment's descriptor is closed (or retired) above: never used again. Should the next segment
        # not be made, the log is failed for good, with no descriptor of its own: a later flush or close would
        # otherwise write to, or close, whatever file has been given that number since.
        self._fd = -1
        try:
            if reuse is not None:
                for info in (reuse, *shed):
                    self._sealed.remove(info)
                self._pruned = (shed[-1] if shed else reuse).segment + 1
                self._note_pruned([i.max_lrsn for i in (reuse, *shed)])
                self._write_manifest_locked()  # first: a crash before the rename leaves an unlisted, readable segment
                for info in shed:  # below the pruned mark: a crash before its removal leaves it to the next open
                    info.path.unlink()
                self._fd = self._reuse_segment(reuse.path, segno)
                self.stats.segments -= 1 + len(shed)
            else:
                self._fd = self._create_segment(segno)
        except OSError as e:
            self._failed = e
            raise
        self._seg = segno
        self._capacity = self.segment_bytes
        self._first_frame = self._off = len(encode_header(segno, self.segment_bytes, self.member))
        self._cur_first = self._cur_last = None
        self._cur_min = self._cur_max = None
        self._cur_count = 0
        self.stats.segments += 1
        self._write_manifest_locked()

    # ---------------------------------------------------------------------------------------- force

    def force(self, upto: LogPosition | None = None) -> None:
        """Block until every record appended up to ``upto`` (default: everything appended so far, by any
        thread) is written and fsynced. Group commit: one caller (the leader) writes and fsyncs everything
        appended before its flush started; callers arriving meanwhile wait, then either find their position
        durable or lead the next flush.

        A force that fails raises OSError, whatever failed (an I/O error, or anything else in the flush): what
        reached the disk is then not known, so the log is not trusted again (every later append and force is
        refused, and close forces nothing more), as after a failed fsync. A caller's bad position is its own
        ValueError, and a log closed after every record up to ``upto`` was forced answers that it is durable."""
        try:
            self._force(upto)
        except (OSError, _BadPosition):
            raise
        except Exception as e:
            with self._lock:
                if self._failed is None:
                    self._failed = OSError(f"a force failed: {type(e).__name__}: {e}")
            raise OSError(f"{self.directory}: record log unusable: a force failed ({type(e).__name__}: {e})") from e

    def _force(self, upto: LogPosition | None) -> None:
        with self._lock:
            if self._failed is not None:
                self._raise_unusable()
            last = self._last
            if upto is not None and last is not None and upto > last:
                raise _BadPosition(f"force({upto}): position beyond the last appended record {last}")
            target = upto if upto is not None else last
            if self._closed:
                if target is None or self._durable > target:
                    return  # close forced it before it closed
                self._raise_unusable()
        before_wait()  # a service request's slot goes to another request while this one waits (group commit)
        with self._fcond:
            self.stats.forces += 1
            if target is None:
                return
            self._in_force += 1
            try:
                while True:
                    if self._durable > target:
                        return
                    if self._failed is not None or self._closed:
                        self._raise_unusable()
                    if not self._flushing:
                        self._flushing = True
                        siblings = self._in_force - 1
                        break
                    self._fcond.wait()
            finally:
                self._in_force -= 1
        if siblings:
            # Other committers are inside force() (typically the followers the previous flush just
            # released): give up the GIL once so they can append their next records before this flush
            # captures the buffer. Costs nothing for a lone committer; halves fsyncs with 8 threads.
            time.sleep(0)
        self._lead_flush()

    def _lead_flush(self) -> None:
        """Write and fsync everything buffered (caller holds the flushing token, which this releases)."""
        end: LogPosition | None = None
        try:
            if self._in_force and self.before_shared_flush is not None:
                self.before_shared_flush()
            with self._lock:
                for fd in self._retired:  # no other flush can be using them: we hold the token
                    os.close(fd)
                self._retired.clear()
                self._write_locked()
                fd = self._fd
                end = LogPosition(self._seg, self._off)
            try:
                with self.stats.fsync_seconds.time():
                    _fdatasync(fd)
            except OSError as e:
                self._failed = e
                end = None
                raise
        finally:
            with self._fcond:
                if end is not None:
                    self.stats.fsyncs += 1
                    if end > self._durable:
                        self._durable = end
                self._flushing = False
                self._fcond.notify_all()

    def append_forced(self, record: dict[str, Any]) -> LogPosition:
        pos = self.append(record)
        self.force(pos)
        return pos

    # ------------------------------------------------------------------------------------ checkpoints

    def checkpoint(self, record: dict[str, Any]) -> LogPosition:
        """Append and force a checkpoint record, then record its position in the manifest (atomically)."""
        pos = self.append_forced(record)
        with self._lock:
            self._checkpoints.append((pos, int(record["l"])))
            self._checkpoints.sort()
            del self._checkpoints[:-CHECKPOINTS_KEPT]
            self._write_manifest_locked()
        return pos

    def last_checkpoint(self) -> tuple[LogPosition, dict[str, Any]] | None:
        with self._lock:
            if not self._checkpoints:
                return None
            pos = self._checkpoints[-1][0]
            self._write_locked()
        return pos, read_record_at(self.directory / segment_name(pos.segment), pos.segment, self.member,
                                   pos.offset)

    def checkpoints(self) -> list[tuple[LogPosition, int]]:
        """(position, lrsn) of the remembered checkpoints, oldest first."""
        with self._lock:
            return list(self._checkpoints)

    # -------------------------------------------------------------------------------------- reading

    def records(self, start: LogPosition | None = None) -> Iterator[tuple[LogPosition, dict[str, Any]]]:
        """Everything appended so far (buffered frames are written out first, not fsynced), in append order,
        read back from the segment files."""
        with self._lock:
            if self._closed:
                self._raise_unusable()
            self._write_locked()
            segs: list[tuple[int, Path, SegmentInfo | None]] = [
                (i.segment, self.directory / segment_name(i.segment) if i.segment in self._kept_active else i.path, i)
                for i in archived_segments({"archived": self._archived})
                if i.segment < (self._sealed[0].segment if self._sealed else self._seg)]
            segs += [(i.segment, i.path, i) for i in self._sealed] + [
                (self._seg, self.directory / segment_name(self._seg), None)
            ]
        return self._iter(segs, start)

    def _iter(
        self, segs: list[tuple[int, Path, SegmentInfo | None]], start: LogPosition | None
    ) -> Iterator[tuple[LogPosition, dict[str, Any]]]:
        last = segs[-1][0]
        for segno, path, info in segs:
            if start is not None and segno < start.segment:
                continue
            off = start.offset if start is not None and segno == start.segment else 0
            yield from SegmentScan(path, segno, self.member, is_last=segno == last, start_offset=off, expected=info)

    def end_position(self) -> LogPosition:
        """Where the next record will go (in the current segment, unless it rolls)."""
        with self._lock:
            return LogPosition(self._seg, self._off)

    def segments(self) -> list[SegmentInfo]:
        with self._lock:
            return [*self._sealed, self._current_info()]

    # -------------------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Force everything, update the manifest, close files and release the writer lock."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self.force()
        finally:
            with self._fcond:
                while self._flushing:
                    self._fcond.wait()
                self._flushing = True  # keep any late force() out for good
            with self._lock:
                try:
                    if self._failed is None:
                        self._write_manifest_locked()
                finally:
                    self._closed = True
                    for fd in [*self._retired, self._fd]:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                    self._retired.clear()
                    self._fd = -1
                    self._release_lock()
            with self._fcond:
                self._flushing = False
                self._fcond.notify_all()

    def __enter__(self) -> RecordLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RecordLog({str(self.directory)!r}, member={self.member!r})"
