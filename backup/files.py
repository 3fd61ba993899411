"""The on-disk backup format (docs/backup-format.md): entry files of CRC32C frames and a checksummed manifest.

BackupWriter streams frames into entry files as the backup copies entries and writes the manifest last,
atomically, so that a backup without a manifest is always an unfinished one. read_backup() opens a backup and
refuses anything that is not exactly what the manifest describes, with one line naming the file (and the byte
offset of a bad frame).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import struct
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import crc32c
import msgpack

from cfemu.durable import fsync_directory, replace_file
from cfemu.private_files import open_private, private_dir

FORMAT_VERSION = 1
MAGIC = b"CFBKP1\n"
FILE_HEADER = MAGIC + struct.pack("<H", FORMAT_VERSION)
FRAME_HEAD = struct.Struct("<II")  # length, CRC32C of the body
MANIFEST_NAME = "manifest.json"
ROLL_BYTES = 256 * 2**20
_ID_RE = re.compile(r"^(?P<structure>[A-Za-z0-9_.\-]{1,48})-(?P<ts>\d{8}T\d{6}Z)-(?P<rand>[0-9a-f]{6})$")
_READ_BUFFER = 4 * 2**20
_WRITE_CHUNK = 2**20


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
    """The manifest's checksum, or a file's sha256, size or frame count, does not match."""


class ForeignBackupError(BackupError):
    """The backup belongs to another structure or another queue-sharing group."""


def new_backup_id(structure: str, when: datetime) -> str:
    """<STRUCTURE>-<YYYYmmddTHHMMSSZ>-<6 hex>: ids of one structure sort by start time (to the second)."""
    return f"{structure}-{when.astimezone(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def parse_backup_id(backup_id: str) -> tuple[str, datetime]:
    """(structure, start time to the second) of a backup id; ValueError when it is not one."""
    m = _ID_RE.match(backup_id)
    if not m:
        raise ValueError(f"{backup_id!r} is not a backup id (<STRUCTURE>-<YYYYmmddTHHMMSSZ>-<6 hex>)")
    return m["structure"], datetime.strptime(m["ts"], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of every field but `checksum`."""
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != "checksum"})).hexdigest()


def _packer() -> msgpack.Packer:
    # surrogateescape: descriptors are read from the CF the same way (cfemu.entry.Entry.unpack)
    return msgpack.Packer(use_bin_type=True, unicode_errors="surrogateescape")


class BackupWriter:
    """Writes one backup directory: frames into entry files (rolled at roll_bytes), then the manifest."""

    def __init__(self, directory: Path, *, roll_bytes: int = ROLL_BYTES) -> None:
        self.directory = Path(directory)
        self.roll_bytes = roll_bytes
        private_dir(self.directory.parent)  # the structure's backups hold every message: 0700
        self.directory.mkdir(exist_ok=False, mode=0o700)
        self.files: list[dict[str, Any]] = []
        self._packer = _packer()
        self._file: BinaryIO | None = None
        self._sha = hashlib.sha256()
        self._size = 0  # bytes of the current file, buffered ones included
        self._frames = 0
        self._buf = bytearray()  # frames not yet written: one write and one hash update per ~1 MiB

    def _open_next(self) -> None:
        self._close_current()
        name = f"entries-{len(self.files) + 1:04d}.bin"
        self._file = os.fdopen(open_private(self.directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb")
        self.files.append({"name": name})
        self._sha = hashlib.sha256()
        self._size = self._frames = 0
        self._buf += FILE_HEADER
        self._size += len(FILE_HEADER)

    def _flush_buffer(self) -> None:
        assert self._file is not None
        self._file.write(self._buf)
        self._sha.update(self._buf)
        self._buf = bytearray()

    def _close_current(self) -> None:
        if self._file is None:
            return
        self._flush_buffer()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        self.files[-1].update(size=self._size, sha256=self._sha.hexdigest(), frames=self._frames)

    def add(self, step: int, descriptor: dict[str, Any], data: bytes) -> None:
        """One copied entry: a frame [step, descriptor (wire form), data]."""
        body = self._packer.pack([step, descriptor, data])
        if self._file is None or (self._size + FRAME_HEAD.size + len(body) > self.roll_bytes and self._frames):
            self._open_next()
        buf = self._buf
        buf += FRAME_HEAD.pack(len(body), crc32c.crc32c(body))
        buf += body
        self._size += FRAME_HEAD.size + len(body)
        self._frames += 1
        if len(buf) >= _WRITE_CHUNK:
            self._flush_buffer()

    def finish(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Close the entry files (fsynced), then write the manifest atomically; returns the manifest written."""
        if self._file is None and not self.files:
            self._open_next()  # an empty structure still has one (empty) entry file: the format stays uniform
        self._close_current()
        fsync_directory(self.directory)
        out = dict(manifest, format=FORMAT_VERSION, files=self.files)
        out["checksum"] = manifest_checksum(out)
        replace_file(self.directory / MANIFEST_NAME,
                     json.dumps(out, sort_keys=True, indent=1, ensure_ascii=False).encode())
        return out

    def abort(self) -> None:
        """A failed backup leaves nothing behind (never a directory that could pass for a backup)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
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
            yield from _read_entry_file(self.path / info["name"], info)

    def copies(self) -> Iterator[tuple[str, dict[str, Any], bytes]]:
        """(structure, descriptor wire form, data) of every copy in the backup (an entry may appear twice)."""
        structure = self.manifest["structure"]
        for _, descriptor, data in self.frames():
            yield structure, descriptor, data


def _read_entry_file(path: Path, info: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any], bytes]]:
    sha = hashlib.sha256()
    frames = 0
    with open(path, "rb", buffering=_READ_BUFFER) as f:
        header = f.read(len(FILE_HEADER))
        sha.update(header)
        if header != FILE_HEADER:
            raise ChecksumMismatchError(f"{path}: not a version {FORMAT_VERSION} backup entry file (bad header)")
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
            frames += 1
            offset += FRAME_HEAD.size + length
            yield int(step), descriptor, bytes(data)
    if sha.hexdigest() != info["sha256"]:
        raise ChecksumMismatchError(f"{path}: sha256 does not match the manifest")
    if frames != info["frames"]:
        raise ChecksumMismatchError(f"{path}: {frames} frames, the manifest says {info['frames']}")


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the backup at `path`, its checksum verified (entry files not read)."""
    path = Path(path)
    if not path.is_dir():
        raise BackupNotFoundError(f"{path}: no such backup directory")
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        raise IncompleteBackupError(f"backup {path.name} has no manifest: it is unfinished (or its manifest "
                                    f"was removed) and cannot be used")
    try:
        manifest = json.loads(mpath.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise ChecksumMismatchError(f"{mpath}: the manifest is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or "checksum" not in manifest:
        raise ChecksumMismatchError(f"{mpath}: the manifest has no checksum")
    if manifest_checksum(manifest) != manifest["checksum"]:
        raise ChecksumMismatchError(f"{mpath}: manifest checksum mismatch (the manifest was altered or damaged)")
    if manifest.get("format") != FORMAT_VERSION:
        raise ChecksumMismatchError(f"{mpath}: backup format {manifest.get('format')!r} is not supported "
                                    f"(this tool reads format {FORMAT_VERSION})")
    return manifest


def _check_files(path: Path, manifest: dict[str, Any]) -> None:
    for info in manifest["files"]:
        f = path / info["name"]
        if not f.is_file():
            raise TruncatedBackupError(f"{f}: entry file is missing")
        size = f.stat().st_size
        if size < info["size"]:
            raise TruncatedBackupError(f"{f}: truncated: {size} of {info['size']} bytes")
        if size > info["size"]:
            raise ChecksumMismatchError(f"{f}: {size} bytes, the manifest says {info['size']}")


def read_backup(path: str | Path, *, structure: str | None = None, group: str | None = None) -> Backup:
    """Open the backup at `path` for reading: manifest checksum, owner and file sizes are checked now, frames
    (CRC32C), sha256 and frame counts as copies() reads them. Raises a BackupError subclass."""
    path = Path(path)
    manifest = read_manifest(path)
    if structure is not None and manifest["structure"] != structure:
        raise ForeignBackupError(f"backup {manifest['id']} is of structure {manifest['structure']}, "
                                 f"not {structure}")
    if group is not None and manifest["group"] != group:
        raise ForeignBackupError(f"backup {manifest['id']} belongs to group {manifest['group']}, not {group}")
    _check_files(path, manifest)
    return Backup(path, manifest)


def verify(path: str | Path, *, structure: str | None = None, group: str | None = None) -> dict[str, Any]:
    """Read the whole backup, checking everything; returns its manifest. Raises a BackupError subclass."""
    backup = read_backup(path, structure=structure, group=group)
    for _ in backup.frames():
        pass
    return backup.manifest
