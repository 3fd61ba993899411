"""Spill files: where a restore keeps what does not fit in its memory limit (docs/architecture.md, "Restore in
bounded memory").

A SpillDir is a private temporary directory (0700, files 0600: they hold message bodies) under the restore's
work directory, removed when the restore ends, whatever way it ends. A Partitioned set of files is N append-only
files of msgpack frames, one per partition, written through in-memory buffers that hold at most `buffer_bytes`
in all, and read back one partition at a time. Plain files and msgpack serve better here than an embedded
database: every access is a sequential append or a sequential read of one whole partition, never a lookup.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from cfemu.private_files import open_private, private_dir

READ_SIZE = 1 << 20


PREFIX = ".restore-spill-"
#: A spill directory is made under this prefix and renamed to PREFIX once its lock is held, so that no directory
#: named PREFIX... is ever seen without its lock: a restore killed between the two steps leaves a MAKING one, which
#: a later restore removes once it is older than UNLOCKED_GRACE_S (never by its lock: between the lock file's creation
#: and its flock, another restore would take the lock and remove the directory under its maker).
MAKING = ".restore-making-"
#: A spill directory's lock file: its maker holds an exclusive flock on it while the directory is in use. The
#: kernel lets go of it when the maker dies, however it dies (SIGKILL, the OOM killer), so a directory whose lock can
#: be taken is one nobody will read again.
OWNER = ".owner"
#: A spill directory with no lock file is taken for left behind only once older than this: its maker makes the lock
#: file right after the directory, and a directory from a version before lock files has none.
UNLOCKED_GRACE_S = 600


class SpillDir:
    """A private temporary directory under `parent` (a private directory: created 0700, refused when others can
    write it; None: the system's temporary directory), removed by close() (or at the end of a `with`). Made, it
    removes the spill directories beside it that their makers left behind (remove_left_behind): a restore killed
    (SIGKILL, the OOM killer) never closes its own, and RECAUTO's retries would otherwise fill the disk with them."""

    def __init__(self, parent: Path | None = None) -> None:
        if parent is not None:
            private_dir(Path(parent))
        making = Path(tempfile.mkdtemp(prefix=MAKING, dir=parent))  # mkdtemp: mode 0700
        try:
            self._owner = _hold(making / OWNER)
        except BaseException:
            shutil.rmtree(making, ignore_errors=True)
            raise
        self.path = making.with_name(PREFIX + making.name[len(MAKING):])
        try:
            os.rename(making, self.path)
        except BaseException:
            os.close(self._owner)
            shutil.rmtree(making, ignore_errors=True)
            raise
        self.bytes_written = 0
        self.removed = remove_left_behind(self.path.parent, keep=self.path)

    @classmethod
    def at(cls, path: Path) -> SpillDir:
        """The spill directory `path` made by another process's SpillDir (a worker's view of it: only its
        maker removes it)."""
        spill = cls.__new__(cls)
        spill.path, spill.bytes_written, spill._owner, spill.removed = Path(path), 0, -1, []
        return spill

    def file(self, name: str) -> Path:
        return self.path / name

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._owner >= 0:  # after the removal: until then the directory is in use
            os.close(self._owner)
            self._owner = -1

    def __enter__(self) -> SpillDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hold(path: Path) -> int:
    """Create the lock file at path and hold an exclusive flock on it (the descriptor is not inherited by programs
    this process runs)."""
    fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def remove_left_behind(parent: Path, keep: Path) -> list[Path]:
    """Remove the spill directories in parent other than `keep` whose maker is gone (their lock file's flock can
    be taken; one with no lock file: once older than UNLOCKED_GRACE_S). One in use by a live restore is left
    alone. Returns those removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        if not entry.name.startswith((PREFIX, MAKING)) or path == keep or not entry.is_dir(follow_symlinks=False):
            continue
        making = entry.name.startswith(MAKING)  # its lock may not be taken yet: judged by its age alone
        try:
            fd = -1 if making else os.open(path / OWNER, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = -1
        except OSError:  # another user's, or not ours to read: left alone
            continue
        if fd < 0:
            try:
                old = time.time() - entry.stat(follow_symlinks=False).st_mtime > UNLOCKED_GRACE_S
            except OSError:
                continue
            if old:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its maker is alive
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def _append(spill: SpillDir, path: Path, data: bytes | bytearray) -> None:
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    spill.bytes_written += len(data)


def read_frames(path: Path, read_size: int = READ_SIZE) -> Iterator[Any]:
    """The msgpack frames of one spill file, in the order they were written (none when it does not exist)."""
    if not path.exists():
        return
    with open(path, "rb", buffering=0) as f:
        yield from msgpack.Unpacker(f, raw=False, read_size=read_size, max_buffer_size=0, strict_map_key=False)


class Partitioned:
    """`n` spill files named `name`-<i>, appended to through buffers of at most `buffer_bytes` in all."""

    def __init__(self, spill: SpillDir, name: str, n: int, buffer_bytes: int) -> None:
        self.spill, self.name, self.n = spill, name, n
        self.per_partition = max(4096, buffer_bytes // max(1, n))
        self.buffers = [bytearray() for _ in range(n)]
        self.sizes = [0] * n
        self.pack = msgpack.Packer(use_bin_type=True).pack

    def path(self, i: int) -> Path:
        return self.spill.file(f"{self.name}-{i}")

    def add(self, i: int, frame: Any) -> None:
        buf = self.buffers[i]
        buf += self.pack(frame)
        if len(buf) >= self.per_partition:
            self._flush(i)

    def _flush(self, i: int) -> None:
        buf = self.buffers[i]
        if buf:
            _append(self.spill, self.path(i), buf)
            self.sizes[i] += len(buf)
            self.buffers[i] = bytearray()

    def close(self) -> None:
        """Write every buffer out (before the partitions are read)."""
        for i in range(self.n):
            self._flush(i)

    def read(self, i: int, read_size: int = READ_SIZE) -> Iterator[Any]:
        return read_frames(self.path(i), read_size)

    def remove(self, i: int) -> None:
        self.path(i).unlink(missing_ok=True)


class SpillWriter:
    """One spill file written in order through a bounded buffer (a sorted run)."""

    def __init__(self, spill: SpillDir, name: str, buffer_bytes: int = READ_SIZE) -> None:
        self.spill, self.path = spill, spill.file(name)
        self.buffer = bytearray()
        self.limit = buffer_bytes
        self.pack = msgpack.Packer(use_bin_type=True).pack

    def add(self, frame: Any) -> None:
        self.buffer += self.pack(frame)
        if len(self.buffer) >= self.limit:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            _append(self.spill, self.path, self.buffer)
            self.buffer = bytearray()


#: The file of a spill directory that holds its sharing token (share, TaskFiles.open).
SHARED = ".shared"


def share(spill: SpillDir) -> str:
    """A random token written into the spill directory for processes that may see it or not (a Spark executor on
    this machine, or on another): one that reads the same token there shares the directory and may write its own
    files into it (TaskFiles); one that does not (another machine, another user) must hand its frames back."""
    token = secrets.token_hex(16)
    fd = open_private(spill.file(SHARED), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return token


class TaskFiles:
    """The spill files one task of another process writes into a spill directory it shares (share): `name`-<index>
    for each name it adds to, each a SpillWriter under a name of its own, renamed whole when the task is done
    (commit, or the end of a `with` block that raised nothing), so that a task run twice (a retry, a speculative
    copy: the same frames) leaves one whole file, never two interleaved. A task that fails removes its part files
    (abort, or a `with` block that raised); any left behind go with the directory, removed by its maker."""

    def __init__(self, path: Path, index: int, buffer_bytes: int = READ_SIZE) -> None:
        self.spill, self.index, self.limit = SpillDir.at(path), index, buffer_bytes
        self.attempt = uuid.uuid4().hex
        self.writers: dict[str, SpillWriter] = {}
        self.sizes: dict[str, int] = {}  # the bytes of each file, once committed

    @classmethod
    def open(cls, path: Path, token: str, index: int) -> TaskFiles | None:
        """The task files of task `index` in the spill directory at `path`, or None when this process does not
        share it (no such directory here, not readable, or another token: another restore's, or another
        machine's directory of the same name)."""
        try:
            with open(path / SHARED, "rb") as f:
                if f.read() != token.encode():
                    return None
        except OSError:
            return None
        return cls(path, index)

    def add(self, name: str, frame: Any) -> None:
        writer = self.writers.get(name)
        if writer is None:
            writer = self.writers[name] = SpillWriter(self.spill, f"{name}-{self.index}.{self.attempt}.part",
                                                      self.limit)
        writer.add(frame)

    def commit(self) -> dict[str, int]:
        """Every file written out and renamed to `name`-<index>: the bytes of each."""
        for name, writer in self.writers.items():
            writer.flush()
            self.sizes[name] = writer.path.stat().st_size
            os.replace(writer.path, self.spill.file(f"{name}-{self.index}"))
        return dict(self.sizes)

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.path.unlink(missing_ok=True)

    def __enter__(self) -> TaskFiles:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def remove_files(spill: SpillDir, name: str) -> None:
    """Remove the files `name`-<i> of a Partitioned set (before it is written again another way)."""
    for path in spill.path.glob(f"{name}-*"):
        path.unlink(missing_ok=True)
