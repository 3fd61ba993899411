"""The on-disk backup format (docs/backup-format.md): entry files of CRC32C frames and a signed manifest.

BackupWriter streams frames into entry files as the backup copies entries and writes the manifest last,
atomically, so that a backup without a manifest is always an unfinished one. The manifest carries every entry
file's size, digest (backup.digest) and frame count, and is signed with the group's backup key (HMAC-SHA256 over its canonical
JSON: cfemu.credentials.BackupKeys, found by cfemu.settings), so that the manifest and, through its digests, the
entry files are the group's: nobody without the key can alter a backup (its replay start, a body, its members)
and have it accepted. read_backup() opens a backup and refuses anything that is not exactly what the manifest
describes, with one line naming the file (and the byte offset of a bad frame): an unsigned manifest (a backup
taken before backups were signed: accepted only with the operator's override, ``accept_unsigned``), a signature
that does not match or was made with a key the group does not hold, an entry file name that is not one of the
backup's own (entries-NNNN.bin in its directory; never a path, never a symbolic link), a file whose digest does
not match. Messages name files and key ids, never a key.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from itertools import repeat
from operator import add, concat
from pathlib import Path
from typing import Any, BinaryIO, cast

import crc32c
import msgpack

from backup.bounded_json import JSONFileError, load_json_bounded
from backup.digest import (
    WRITTEN,
    WRITTEN_FORMAT,
    Gathered,
    digest_of_format,
    file_digest,
    new_hasher,
    signed_format,
)
from cfemu import settings
from cfemu.bulk import Bulks
from cfemu.credentials import BackupKeys, key_id
from cfemu.durable import fsync_directory, replace_file
from cfemu.private_files import open_private, private_dir

log = logging.getLogger("backup.files")

_frames: Any
try:
    from backup import _frames  # type: ignore[attr-defined,no-redef]
except ImportError:  # installed where no C compiler was (the extension is optional): add_raw frames in Python
    _frames = None

# A signed manifest is format 2 (its files' digest SHA-256) or 3 (BLAKE3, what is written): backup.digest.
SIGNED_FORMATS = (2, WRITTEN_FORMAT)
UNSIGNED_FORMAT = 1  # a manifest from before signing: an unkeyed checksum only (read with accept_unsigned)
ENTRY_FILE_VERSION = 1
MAGIC = b"CFBKP1\n"
FILE_HEADER = MAGIC + struct.pack("<H", ENTRY_FILE_VERSION)
SIGNATURE_ALG = "hmac-sha256"
_MAC_CONTEXT = b"cfemu backup manifest v2\n"  # what the MAC is of: only a manifest, never another message
ENTRY_NAME_RE = re.compile(r"entries-[0-9]{4,6}\.bin")  # what the writer names entry files (fullmatch)
FRAME_HEAD = struct.Struct("<II")  # length, CRC32C of the body
MANIFEST_NAME = "manifest.json"
ROLL_BYTES = 256 * 2**20
_ID_RE = re.compile(r"^(?P<structure>[A-Za-z0-9_.\-]{1,48})-(?P<ts>\d{8}T\d{6}Z)-(?P<rand>[0-9a-f]{6})$")
_READ_BUFFER = 4 * 2**20
# The largest manifest read (a bigger one is refused as damaged, nothing read): a manifest grows with its entry
# files (about 150 bytes each, one per ROLL_BYTES of entries), queues, members, tombstones and registered UOWs. A
# 1M-message backup's (1 KiB bodies, 5 entry files) measured 3,154 bytes (2026-11-30); 8 MiB is over 2,600 times
# that, room for the entry files of several TiB beside tens of thousands of queues and UOWs, and bounds what a
# planted file costs every reader of the catalog (the console polls it every few seconds).
MANIFEST_MAX_BYTES = 8 * 2**20
_WRITE_CHUNK = 2**20  # frames handed to the writing thread at a time


class BackupError(Exception):
    """A backup that cannot be used; the message is one line naming the backup, file and problem."""


class BackupNotFoundError(BackupError):
    pass


class IncompleteBackupError(BackupError):
    """No manifest: the backup never finished (or its manifest was removed)."""


class TruncatedBackupError(BackupError):
    pass


class CorruptFrameError(BackupError):
    """A frame whose CRC32C does not match its body (or whose length runs past the end of the file)."""


class ChecksumMismatchError(BackupError):
    """The manifest's checksum, or a file's digest, size or frame count, does not match."""


class ForeignBackupError(BackupError):
    """The backup belongs to another structure or another queue-sharing group."""


class UnsignedBackupError(BackupError):
    """The manifest carries no signature: a backup taken before backups were signed, or one whose signature was
    removed. Used only with the operator's override (BackupKeys.accept_unsigned, ``--accept-unsigned``)."""


class UntrustedBackupError(BackupError):
    """Not the group's backup as it was written: the signature does not match (the manifest was altered), it was
    made with a key the group does not hold (another group's backup, or a key rotated out), or the manifest names
    an entry file outside the backup (a path, a symbolic link)."""


class RenamedBackupError(UntrustedBackupError):
    """A signed, intact backup under another name than its manifest's id (copied or moved): refused, but what it
    is a copy of is known (copy_of: the id its signed manifest names)."""

    def __init__(self, message: str, copy_of: str) -> None:
        super().__init__(message)
        self.copy_of = copy_of


class NoBackupKeyError(BackupError):
    """This process found no backup key to sign or check a backup with."""


def _no_key(doing: str, keys: BackupKeys) -> NoBackupKeyError:
    return NoBackupKeyError(
        f"no backup key to {doing} (looked in: {keys.source or 'nowhere'}): backups are signed with the group's "
        "key, backup.key in its secrets directory; make one with 'cfemu secrets init --dir DIR' (existing secrets "
        "are kept) and set CFEMU_SECRETS_DIR=DIR, or run in a cluster ('cfemu cluster up')")


def resolve_keys(backup_keys: BackupKeys | None) -> BackupKeys:
    """The keys given, or when none are, those this process's settings find (cfemu.settings.backup_keys)."""
    return backup_keys if backup_keys is not None else settings.backup_keys()


def signing_key(backup_keys: BackupKeys | None, doing: str = "sign the backup with") -> bytes:
    """The key new backups are signed with; NoBackupKeyError when this process has none. Writers ask before
    they start, so that a backup or restore without a key fails before it changes anything."""
    keys = resolve_keys(backup_keys)
    if keys.current is None:
        raise _no_key(doing, keys)
    return keys.current


def new_backup_id(structure: str, when: datetime) -> str:
    """<STRUCTURE>-<YYYYmmddTHHMMSSZ>-<6 hex>: ids of one structure sort by start time (to the second)."""
    return f"{structure}-{when.astimezone(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def parse_backup_id(backup_id: str) -> tuple[str, datetime]:
    """(structure, start time to the second) of a backup id; ValueError when it is not one."""
    m = _ID_RE.match(backup_id)
    if not m:
        raise ValueError(f"{backup_id!r} is not a backup id (<STRUCTURE>-<YYYYmmddTHHMMSSZ>-<6 hex>)")
    try:
        return m["structure"], datetime.strptime(m["ts"], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    except ValueError as e:  # the digits are there, the date or time is not one (month 13, 25 h, 30 February)
        raise ValueError(f"{backup_id!r} is not a backup id: {m['ts']} is not a date and time "
                         f"(YYYYmmddTHHMMSSZ, UTC): {e}") from None


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of every field but `checksum`: the unkeyed check of an unsigned (format 1)
    manifest. Anyone can recompute it: it shows damage, not tampering."""
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != "checksum"})).hexdigest()


def manifest_mac(manifest: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256, with the group's backup key, of the canonical JSON of every field but `signature`."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return hmac.new(key, _MAC_CONTEXT + canonical_json(body), hashlib.sha256).hexdigest()


def sign_manifest(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """The manifest signed with key: {"alg", "key" (its id), "mac"} in `signature`; its format the one of its
    files' digest (backup.digest.signed_format)."""
    out = {k: v for k, v in manifest.items() if k not in ("signature", "checksum")}
    out["format"] = signed_format(out.get("files") or [])
    out["signature"] = {"alg": SIGNATURE_ALG, "key": key_id(key), "mac": manifest_mac(out, key)}
    return out


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    replace_file(directory / MANIFEST_NAME, json.dumps(manifest, sort_keys=True, indent=1,
                                                       ensure_ascii=False).encode())


def _packer() -> msgpack.Packer:
    # surrogateescape: descriptors are read from the CF the same way (cfemu.entry.Entry.unpack)
    return msgpack.Packer(use_bin_type=True, unicode_errors="surrogateescape")


def _bin_head(n: int) -> bytes:
    """The msgpack bin header of n bytes of data (what a Packer with use_bin_type writes before them)."""
    if n < 0x100:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


class _BinHeads(dict[int, bytes]):
    """_bin_head by size, looked up in C: the sizes met most (a backup's messages are often of a few sizes) kept,
    up to a bound."""

    def __missing__(self, n: int) -> bytes:
        made = _bin_head(n)
        if len(self) < 4096:
            self[n] = made
        return made


_BIN_HEADS = _BinHeads()
_WHOLE_BATCH_BYTES = 4 * 2**20  # the most frames add_raw joins at once (a batch of large messages: frame by frame)


_FRAME_HEAD_SIZE = FRAME_HEAD.size
_FADVISE = hasattr(os, "posix_fadvise")  # not on every system (macOS): there the fsync does all the work
_STEP_HEAD = [msgpack.packb(n) for n in range(6)]  # positive fixints: the steps 0-5
_MAX_PENDING_WRITES = 3  # chunks handed to the writing thread and not yet written (bounds the memory: ~1 MiB each)


_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux: an entry file's bytes go to the disk past the page cache
_DIRECT_ALIGN = 4096  # what O_DIRECT asks of a write's memory, length and file offset (a page: any block size)
_STAGE_BYTES = 4 * 2**20  # the aligned buffer a chunk is copied into for O_DIRECT (a chunk is ~1 MiB)


class _EntryFile:
    """One entry file being written by the writing thread: with O_DIRECT where the file system takes it, else
    through the page cache. Through the page cache the kernel copies each chunk into pages it makes and lets go
    (posix_fadvise DONTNEED starts their write-back early), a cost in the backup's process of the order of all its
    selection and framing; O_DIRECT hands the pages to the disk as they are (the figures: BENCHMARKS.md, backup,
    third pass). O_DIRECT writes whole aligned blocks from aligned memory, so a
    chunk is copied into an aligned buffer and written up to its last whole block; the rest waits for the next
    chunk, and the file's last bytes are written through the page cache at finish(), before the fsync: the file is
    as durable either way."""

    def __init__(self, path: Path) -> None:
        # Made through the page cache, then O_DIRECT asked of the open file: an open with O_CREAT and O_DIRECT on
        # a file system without it (tmpfs before Linux 6.6) creates the file and then fails with EINVAL, so that
        # no second open could make it (O_EXCL); fcntl refuses the flag and changes nothing.
        self.fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        self.direct = False
        self._stage: mmap.mmap | None = None
        if _DIRECT:
            try:
                self._stage = mmap.mmap(-1, _STAGE_BYTES)  # page-aligned memory
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | _DIRECT)
                self.direct = True
            except OSError:  # EINVAL: the file system has no O_DIRECT; the page cache then
                if self._stage is not None:
                    self._stage.close()
                    self._stage = None
        self._held = 0  # bytes at the start of the stage, not yet written (less than a block)
        self._offset = 0  # bytes written to the file

    def write(self, chunk: bytearray) -> None:
        """Write the chunk (the writing thread): O_DIRECT up to the last whole block, or all of it through the page
        cache. A file system that refuses an O_DIRECT write (EINVAL) has the rest through the page cache."""
        if self._stage is None:
            self._write_all(memoryview(chunk))
            if _FADVISE:  # start the write-back now, so that the fsync at the close finds little left to do
                os.posix_fadvise(self.fd, self._offset - len(chunk), len(chunk), os.POSIX_FADV_DONTNEED)
            return
        view = memoryview(chunk)
        while view:
            room = _STAGE_BYTES - self._held
            piece, view = view[:room], view[room:]
            self._stage[self._held:self._held + len(piece)] = piece
            self._held += len(piece)
            whole = self._held - self._held % _DIRECT_ALIGN
            if whole:
                self._write_stage(whole)

    def _write_stage(self, n: int) -> None:
        """Write the stage's first n bytes (whole blocks) and keep the rest at its start."""
        assert self._stage is not None
        stage = memoryview(self._stage)
        start = self._offset
        try:
            self._write_all(stage[:n])
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._buffered()  # O_DIRECT taken at the open and refused at the write: the page cache then
            self._write_all(stage[self._offset - start:n])  # from where the refused write left off
        rest = self._held - n
        if rest:
            self._stage.move(0, n, rest)
        self._held = rest

    def _write_all(self, view: memoryview) -> None:
        while view:  # a write may write less than asked
            written = os.write(self.fd, view)
            self._offset += written
            view = view[written:]

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_DIRECT)
        self.direct = False

    def finish(self) -> None:
        """Write what is held (through the page cache: it is less than a block), then fsync."""
        if self._stage is not None and self._held:
            self._buffered()
            self._write_all(memoryview(self._stage)[:self._held])
            self._held = 0
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._stage is not None:
            stage, self._stage = self._stage, None
            # A failed write's traceback (the error the backup reports) may still hold a view of the stage: it is
            # then freed with the traceback, and the error is not replaced by a BufferError.
            with contextlib.suppress(BufferError):
                stage.close()


def _native_datas(datas: Sequence[bytes | None]) -> Any:
    """A fetched part's data as backup._frames.select_append takes them: a list, or a Bulks' (blob, spans)."""
    if type(datas) is Bulks:
        return datas.blob, datas.spans
    return datas if type(datas) is list else list(datas)


class BackupWriter:
    """Writes one backup directory: frames into entry files (rolled at roll_bytes), then the manifest.

    Frames are gathered in memory and handed, ~1 MiB at a time, to one writing thread that writes them and
    updates the file's digest (both let go of the GIL), so that the copy loop goes on meanwhile; the files are
    fsynced, in order, before the manifest is written (finish)."""

    def __init__(self, directory: Path, *, roll_bytes: int = ROLL_BYTES,
                 backup_keys: BackupKeys | None = None) -> None:
        self._key = signing_key(backup_keys)  # before anything is written: no key, no backup
        self.directory = Path(directory)
        self.roll_bytes = roll_bytes
        private_dir(self.directory.parent)  # the structure's backups hold every message: 0700
        self.directory.mkdir(exist_ok=False, mode=0o700)
        self.files: list[dict[str, Any]] = []
        self._packer = _packer()
        self._file: _EntryFile | None = None
        self._sha = new_hasher()
        self._size = 0  # bytes of the current file, buffered ones included
        self._frames = 0
        self._buf = bytearray()  # frames not yet handed to the writing thread
        self._pool: ThreadPoolExecutor | None = None  # the writing thread, started with the first chunk
        self._pending: deque[Future[None]] = deque()
        self._closed = False  # the entry files are written and fsynced: no more frames (close_files)

    def _open_next(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.directory}: the entry files are closed: no more frames")
        self._close_current()
        name = f"entries-{len(self.files) + 1:04d}.bin"
        self._file = _EntryFile(self.directory / name)
        self.files.append({"name": name})
        self._sha = new_hasher()
        self._size = self._frames = 0
        self._buf += FILE_HEADER
        self._size += len(FILE_HEADER)

    @staticmethod
    def _write_chunk(file: _EntryFile, sha: Any, chunk: bytearray) -> None:
        file.write(chunk)
        sha.update(chunk)

    def _flush_buffer(self) -> None:
        """Hand the gathered frames to the writing thread (a write error shows at the next hand-over or at the
        file's close); at most _MAX_PENDING_WRITES chunks wait."""
        assert self._file is not None
        if not self._buf:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backup-write")
        self._pending.append(self._pool.submit(self._write_chunk, self._file, self._sha, self._buf))
        self._buf = bytearray()
        while len(self._pending) > _MAX_PENDING_WRITES or (self._pending and self._pending[0].done()):
            self._pending.popleft().result()

    def _drain(self) -> None:
        """Wait until every chunk handed over is written (raising the first write error)."""
        while self._pending:
            self._pending.popleft().result()

    def _close_current(self) -> None:
        if self._file is None:
            return
        self._flush_buffer()
        self._drain()
        self._file.finish()
        self._file.close()
        self._file = None
        self.files[-1].update({"size": self._size, "frames": self._frames, WRITTEN: self._sha.hexdigest()})

    def add(self, step: int, descriptor: dict[str, Any], data: bytes) -> None:
        """One copied entry: a frame [step, descriptor (wire form), data]."""
        self._add_frame(self._packer.pack([step, descriptor, data]), b"")

    def add_raw(self, step: int, copies: Iterable[tuple[bytes, bytes]]) -> None:
        """Copied entries whose descriptors are the CF's msgpack bytes (a wire-form map, docs/backup-format.md):
        each a frame [step, descriptor, data], the descriptor's bytes written as they are (no decode, no
        re-pack). The same frames as add. A batch that fits in the current file and in a few write chunks is
        framed as a whole: by backup._frames (C, no Python object an entry) where it was built, else each step
        one map over the batch in C (a loop of Python a frame had cost a backup, and a restore's point, about a
        third more); any other, frame by frame."""
        batch = copies if isinstance(copies, list) else list(copies)
        if not batch:
            return
        head = b"\x93" + _STEP_HEAD[step]
        if _frames is not None and self._file is not None:
            # The same frames, framed in C (backup/_frames.c); -1: the batch does not fit, framed one by one below.
            added = _frames.append(self._buf, head, batch, min(self.roll_bytes - self._size, _WHOLE_BATCH_BYTES))
            if added >= 0:
                self._added_whole(added, len(batch))
                return
        descs, datas = zip(*batch)
        sizes = list(map(len, datas))
        prefixes: list[bytes] = cast(list[bytes], list(
            map(concat, map(concat, repeat(head), descs), map(_BIN_HEADS.__getitem__, sizes))))
        lengths = list(map(add, map(len, prefixes), sizes))
        total = sum(lengths) + _FRAME_HEAD_SIZE * len(lengths)
        if self._file is None or self._size + total > self.roll_bytes or total > _WHOLE_BATCH_BYTES:
            for prefix, data in zip(prefixes, datas, strict=True):
                self._add_frame(prefix, data)
            return
        crc = crc32c.crc32c
        frames: list[bytes] = [b""] * (3 * len(lengths))
        frames[0::3] = map(FRAME_HEAD.pack, lengths, map(crc, datas, map(crc, prefixes)))
        frames[1::3] = prefixes
        frames[2::3] = datas
        self._buf += b"".join(frames)
        self._added_whole(total, len(lengths))

    @property
    def selects_natively(self) -> bool:
        """Whether add_selected can run: backup._frames (C) was built."""
        return _frames is not None

    def add_selected(self, step: int, descs: list[bytes | None], datas: Sequence[bytes | None],
                     decide: Callable[[bytes], bool], *, at_sight: bool = True) -> tuple[int, int, int]:
        """A fetched part's copies as frames [step, descriptor, data], selected and framed in one pass in C
        (backup/_frames.c, select_append): a pair with a None (an entry gone) is left out; a descriptor persistent
        at sight (at_sight; backup.protocol._persistent_at_sight's rule) is copied; any other is copied when
        decide(descriptor) says so. The same frames as add_raw of the pairs kept, in their order; data read as
        cfemu.bulk.Bulks are framed from the reply's bytes. Returns (copied, data bytes copied, gone). Only where
        selects_natively."""
        if _frames is None:
            raise RuntimeError("backup._frames was not built: select with backup.protocol.select_raw, then add_raw")
        if self._file is None:
            self._open_next()  # the file the first frame opens in add_raw, opened first: the same bytes
        added, copied, nbytes, vanished, overflow = _frames.select_append(
            self._buf, b"\x93" + _STEP_HEAD[step], descs if type(descs) is list else list(descs),
            _native_datas(datas), min(self.roll_bytes - self._size, _WHOLE_BATCH_BYTES),
            at_sight, decide)
        if added >= 0:
            self._added_whole(added, copied)
        else:  # more than fits in the file or in a few write chunks: the copies kept, frame by frame
            self.add_raw(step, overflow)
        return copied, nbytes, vanished

    def _added_whole(self, size: int, frames: int) -> None:
        """A whole batch's frames are in the buffer: count them, and hand the buffer over when it is a chunk."""
        self._size += size
        self._frames += frames
        if len(self._buf) >= _WRITE_CHUNK:
            self._flush_buffer()

    def _add_frame(self, prefix: bytes, data: bytes) -> None:
        """One frame whose body is prefix followed by data: its CRC chained over both, so that a message's data
        is never copied into a body of its own; the file rolls first when the frame would pass roll_bytes."""
        length = len(prefix) + len(data)
        if self._file is None or (self._size + _FRAME_HEAD_SIZE + length > self.roll_bytes and self._frames):
            self._open_next()
        buf = self._buf
        buf += FRAME_HEAD.pack(length, crc32c.crc32c(data, crc32c.crc32c(prefix)))
        buf += prefix
        buf += data
        self._size += _FRAME_HEAD_SIZE + length
        self._frames += 1
        if len(buf) >= _WRITE_CHUNK:
            self._flush_buffer()

    def close_files(self) -> None:
        """Write, fsync and close the entry files (and the directory that names them): every write or fsync error
        shows here. A backup closes them before it ends well in the CF, so that a disk that fails under the files
        fails the backup while it can still end as failed (finish writes the manifest alone then)."""
        if self._closed:
            return
        if self._file is None and not self.files:
            self._open_next()  # an empty structure still has one (empty) entry file: the format stays uniform
        self._close_current()
        self._stop_writing()
        fsync_directory(self.directory)
        self._closed = True

    def finish(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Close the entry files (close_files, when not done yet), then write the manifest, signed, atomically;
        returns it."""
        self.close_files()
        out = sign_manifest(dict(manifest, files=self.files), self._key)
        _write_manifest(self.directory, out)
        return out

    def _stop_writing(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def abort(self) -> None:
        """A failed backup leaves nothing behind (never a directory that could pass for a backup)."""
        for f in self._pending:  # the writing thread is done with the file before it is closed
            with contextlib.suppress(Exception):
                f.result()
        self._pending.clear()
        self._stop_writing()
        if self._file is not None:
            with contextlib.suppress(Exception):  # the backup's own failure is what its caller reports
                self._file.close()
            self._file = None
        shutil.rmtree(self.directory, ignore_errors=True)


class Backup:
    """An opened backup whose manifest has been checked; copies() verifies the entry files as it reads them."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest

    @property
    def id(self) -> str:
        return str(self.manifest["id"])

    def frames(self) -> Iterator[tuple[int, dict[str, Any], bytes]]:
        """(step, descriptor, data) of every frame, in file order, each checked; raises BackupError."""
        for info in self.manifest["files"]:
            yield from _read_entry_file(entry_path(self.path, info["name"]), info)

    def copies(self) -> Iterator[tuple[str, dict[str, Any], bytes]]:
        """(structure, descriptor wire form, data) of every copy in the backup (an entry may appear twice)."""
        structure = self.manifest["structure"]
        for _, descriptor, data in self.frames():
            yield structure, descriptor, data


def entry_path(backup_dir: Path, name: Any) -> Path:
    """The path of an entry file the manifest names: only a name the writer gives (entries-NNNN.bin), so always
    in the backup's own directory; anything else (``../x``, an absolute path) is refused before it is opened."""
    if not isinstance(name, str) or not ENTRY_NAME_RE.fullmatch(name):
        raise UntrustedBackupError(f"{backup_dir / MANIFEST_NAME}: the entry file name {name!r} is not one of "
                                   f"this backup's (entries-NNNN.bin in {backup_dir}): refused, nothing read")
    return backup_dir / name


def _open_file(path: Path) -> BinaryIO:
    """Open a backup's file for reading, never through a symbolic link (which may lead outside the backup)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise TruncatedBackupError(f"{path}: entry file is missing") from None
    except OSError:
        if path.is_symlink():
            raise _symlink(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UntrustedBackupError(f"{path}: not a regular file: refused")
    return os.fdopen(fd, "rb", buffering=_READ_BUFFER)


def _symlink(path: Path) -> UntrustedBackupError:
    return UntrustedBackupError(f"{path}: a symbolic link, which no file of a backup is (it may lead outside the "
                                "backup): refused, nothing read")


def _read_entry_file(path: Path, info: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any], bytes]]:
    digest, expected = file_digest(info)
    sha = Gathered(digest)
    frames = 0
    with _open_file(path) as f:
        header = f.read(len(FILE_HEADER))
        sha.update(header)
        if header != FILE_HEADER:
            raise ChecksumMismatchError(f"{path}: not a version {ENTRY_FILE_VERSION} backup entry file (bad header)")
        offset = len(header)
        while head := f.read(FRAME_HEAD.size):
            if len(head) < FRAME_HEAD.size:
                raise TruncatedBackupError(f"{path}: truncated frame header at byte {offset}")
            length, crc = FRAME_HEAD.unpack(head)
            body = f.read(length)
            if len(body) < length:
                raise CorruptFrameError(f"{path}: the frame at byte {offset} runs past the end of the file "
                                        f"(length {length}, {len(body)} bytes left)")
            if crc32c.crc32c(body) != crc:
                raise CorruptFrameError(f"{path}: bad CRC in the frame at byte {offset}")
            sha.update(head)
            sha.update(body)
            try:
                step, descriptor, data = msgpack.unpackb(body, raw=False, unicode_errors="surrogateescape")
            except (ValueError, TypeError, msgpack.ExtraData) as e:
                raise CorruptFrameError(f"{path}: undecodable frame at byte {offset}: {e}") from None
            if isinstance(descriptor, dict) and not isinstance(descriptor.get("pr", {}), dict):
                descriptor["pr"] = {}  # the CF's own bytes (add_raw): Lua writes an empty property table so
            frames += 1
            offset += FRAME_HEAD.size + length
            yield int(step), descriptor, bytes(data)
    if sha.hexdigest() != expected:
        raise ChecksumMismatchError(f"{path}: {digest} does not match the manifest")
    if frames != info["frames"]:
        raise ChecksumMismatchError(f"{path}: {frames} frames, the manifest says {info['frames']}")


def read_manifest(path: Path, *, backup_keys: BackupKeys | None = None) -> dict[str, Any]:
    """The manifest of the backup at `path`, checked (entry files not read): its entry file names, then its
    signature with the group's backup keys (an unsigned one only with keys.accept_unsigned, and logged)."""
    path = Path(path)
    keys = resolve_keys(backup_keys)
    if path.is_symlink():
        raise UntrustedBackupError(f"{path}: a symbolic link, which no backup directory is (it may lead outside the "
                                   f"backup directory): refused, nothing read")
    if not path.is_dir():
        raise BackupNotFoundError(f"{path}: no such backup directory")
    mpath = path / MANIFEST_NAME
    if not mpath.exists() and not mpath.is_symlink():
        raise IncompleteBackupError(f"backup {path.name} has no manifest: it is unfinished (or its manifest "
                                    f"was removed) and cannot be used")
    with _open_file(mpath) as f:
        try:
            manifest = load_json_bounded(f, mpath, MANIFEST_MAX_BYTES, "the manifest")
        except JSONFileError as e:
            raise ChecksumMismatchError(str(e)) from None
    if not isinstance(manifest, dict):
        raise ChecksumMismatchError(f"{mpath}: the manifest is not a JSON object")
    _check_file_list(path, manifest)
    signature = manifest.get("signature")
    if signature is None:
        return _unsigned(path, manifest, keys)
    if (not isinstance(signature, dict) or signature.get("alg") != SIGNATURE_ALG
            or not isinstance(signature.get("key"), str) or not isinstance(signature.get("mac"), str)):
        raise UntrustedBackupError(f"{mpath}: the manifest's signature is not an {SIGNATURE_ALG} signature: refused")
    if not keys.checking():
        raise _no_key("check the backup's signature with", keys)
    key = keys.find(signature["key"])
    if key is None:
        held = ", ".join(key_id(k) for k in keys.checking())
        raise UntrustedBackupError(
            f"{mpath}: signed with a key this group does not hold (key id {signature['key']}; the group's: "
            f"{held}): a backup of another group, or signed with a key since rotated out: refused")
    if not hmac.compare_digest(manifest_mac(manifest, key), signature["mac"]):
        raise UntrustedBackupError(f"{mpath}: the signature does not match: the manifest was altered after it "
                                   f"was signed: refused")
    _check_format(mpath, manifest, SIGNED_FORMATS)
    return manifest


def _check_file_list(path: Path, manifest: dict[str, Any]) -> None:
    """Every entry file the manifest lists has a name the writer gives (in the backup's directory), once, and a
    size, digest and frame count of the right types: checked before anything else is read."""
    mpath = path / MANIFEST_NAME
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        raise ChecksumMismatchError(f"{mpath}: the manifest lists no entry files")
    seen: set[str] = set()
    for info in files:
        if not isinstance(info, dict):
            raise ChecksumMismatchError(f"{mpath}: bad entry file record {info!r}")
        name = entry_path(path, info.get("name")).name
        if name in seen:
            raise UntrustedBackupError(f"{mpath}: the entry file {name} is listed twice: refused")
        seen.add(name)
        try:
            file_digest(info)
        except ValueError:
            raise ChecksumMismatchError(f"{mpath}: bad digest for {name}") from None
        if not isinstance(info.get("size"), int) or not isinstance(info.get("frames"), int):
            raise ChecksumMismatchError(f"{mpath}: bad size or frame count for {name}")


def _check_format(mpath: Path, manifest: dict[str, Any], formats: tuple[int, ...]) -> None:
    """The manifest's format is one of `formats` (those read signed, or unsigned), and its files carry that
    format's digest: a manifest whose digests are not its format's is refused before any file is read."""
    fmt = manifest.get("format")
    digest = digest_of_format(fmt)
    if digest is None or fmt not in formats:
        raise ChecksumMismatchError(f"{mpath}: backup format {fmt!r} is not supported (this tool reads formats "
                                    f"{', '.join(map(str, SIGNED_FORMATS))}, and {UNSIGNED_FORMAT} unsigned)")
    for info in manifest["files"]:
        if file_digest(info)[0] != digest:
            raise ChecksumMismatchError(f"{mpath}: {info['name']} has a {file_digest(info)[0]} digest; a format "
                                        f"{fmt} manifest's files have {digest}: refused")


def _unsigned(path: Path, manifest: dict[str, Any], keys: BackupKeys) -> dict[str, Any]:
    """A manifest without a signature: refused, unless the operator accepts unsigned backups; then it must be
    an intact format 1 manifest (its unkeyed checksum matches), and its use is logged."""
    mpath = path / MANIFEST_NAME
    if not keys.accept_unsigned:
        raise UnsignedBackupError(
            f"{mpath}: the manifest is not signed (a backup taken before backups were signed, or its signature "
            f"was removed), so nothing shows it is the group's: refused; if you know where it came from, "
            f"--accept-unsigned uses it (docs/security.md)")
    if manifest.get("format") != UNSIGNED_FORMAT or "checksum" not in manifest:
        raise UnsignedBackupError(f"{mpath}: a format {manifest.get('format')!r} manifest without its signature "
                                  f"(removed): refused, even with --accept-unsigned")
    if manifest_checksum(manifest) != manifest["checksum"]:
        raise ChecksumMismatchError(f"{mpath}: manifest checksum mismatch (the manifest was altered or damaged)")
    _check_format(mpath, manifest, (UNSIGNED_FORMAT,))
    log.warning("backup %s is unsigned (taken before backups were signed): used because of --accept-unsigned",
                path.name)
    return manifest


def _check_files(path: Path, manifest: dict[str, Any]) -> None:
    for info in manifest["files"]:
        f = entry_path(path, info["name"])
        try:
            st = os.lstat(f)
        except FileNotFoundError:
            raise TruncatedBackupError(f"{f}: entry file is missing") from None
        if stat.S_ISLNK(st.st_mode):
            raise _symlink(f)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedBackupError(f"{f}: not a regular file: refused")
        size = st.st_size
        if size < info["size"]:
            raise TruncatedBackupError(f"{f}: truncated: {size} of {info['size']} bytes")
        if size > info["size"]:
            raise ChecksumMismatchError(f"{f}: {size} bytes, the manifest says {info['size']}")


def read_backup(path: str | Path, *, structure: str | None = None, group: str | None = None,
                backup_keys: BackupKeys | None = None) -> Backup:
    """Open the backup at `path` for reading: the manifest's signature and file names, owner and file sizes are
    checked now, frames (CRC32C), digests and frame counts as copies() reads them. Raises a BackupError subclass."""
    path = Path(path)
    manifest = read_manifest(path, backup_keys=backup_keys)
    if manifest.get("id") != path.name:  # an old backup copied under a newer id would pass for the latest
        raise RenamedBackupError(f"{path / MANIFEST_NAME}: the manifest is of backup {manifest.get('id')}, not "
                                 f"{path.name}: a backup copied or moved under another name: refused",
                                 str(manifest.get("id")))
    if structure is not None and manifest["structure"] != structure:
        raise ForeignBackupError(f"backup {manifest['id']} is of structure {manifest['structure']}, "
                                 f"not {structure}")
    if group is not None and manifest["group"] != group:
        raise ForeignBackupError(f"backup {manifest['id']} belongs to group {manifest['group']}, not {group}")
    _check_files(path, manifest)
    return Backup(path, manifest)


def verify(path: str | Path, *, structure: str | None = None, group: str | None = None,
           backup_keys: BackupKeys | None = None) -> dict[str, Any]:
    """Read the whole backup, checking everything; returns its manifest. Raises a BackupError subclass."""
    backup = read_backup(path, structure=structure, group=group, backup_keys=backup_keys)
    for _ in backup.frames():
        pass
    return backup.manifest


def sign_backup(path: str | Path, *, backup_keys: BackupKeys | None = None) -> dict[str, Any]:
    """Sign the backup at `path` again with the current key, after checking all of it with the keys given (a
    previous key's signature, or an unsigned backup with accept_unsigned): after a key rotation, or to adopt a
    backup taken before backups were signed. Returns the new manifest."""
    path = Path(path)
    keys = resolve_keys(backup_keys)
    key = signing_key(keys, "sign the backup with")
    manifest = verify(path, backup_keys=keys)
    signed = sign_manifest(manifest, key)
    _write_manifest(path, signed)
    return signed
