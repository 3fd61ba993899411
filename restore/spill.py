"""Spill files: where a restore keeps what does not fit in its memory limit (docs/architecture.md, "Restore in
bounded memory").

A SpillDir is a private temporary directory (0700, files 0600: they hold message bodies) under the restore's
work directory, removed when the restore ends, whatever way it ends. A Partitioned set of files is N append-only
files of msgpack frames, one per partition, written through in-memory buffers that hold at most `buffer_bytes`
in all, and read back one partition at a time. Plain files and msgpack serve better here than an embedded
database: every access is a sequential append or a sequential read of one whole partition, never a lookup.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from cfemu.private_files import open_private, private_dir

READ_SIZE = 1 << 20


class SpillDir:
    """A private temporary directory under `parent` (a private directory: created 0700, refused when others can
    write it; None: the system's temporary directory), removed by close() (or at the end of a `with`)."""

    def __init__(self, parent: Path | None = None) -> None:
        if parent is not None:
            private_dir(Path(parent))
        self.path = Path(tempfile.mkdtemp(prefix=".restore-spill-", dir=parent))  # mkdtemp: mode 0700
        self.bytes_written = 0

    @classmethod
    def at(cls, path: Path) -> SpillDir:
        """The spill directory `path` made by another process's SpillDir (a worker's view of it: only its
        maker removes it)."""
        spill = cls.__new__(cls)
        spill.path, spill.bytes_written = Path(path), 0
        return spill

    def file(self, name: str) -> Path:
        return self.path / name

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> SpillDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
