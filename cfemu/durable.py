"""Durable small files: the one fsync_directory, and an atomic, fsynced replace of a whole file.

Every durable file of the house that is rewritten as a whole (a log's manifest, a backup's manifest, the group
repository) is replaced the same way: a temporary file beside it, written and fsynced, renamed over the old one,
then the directory fsynced, so that a crash leaves either the old file or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable (the directory entry, not only the file's data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, payload: bytes, *, mode: int = 0o600) -> None:
    """Atomically replace `path` with `payload`: temp file (created with `mode`, by default readable by its owner
    only: these files name members, LRSNs and messages), fsync, rename, fsync dir."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(payload)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)  # an older temp file may have had another mode
    os.replace(tmp, path)
    fsync_directory(path.parent)


class DiskFullError(OSError):
    """A write found its disk full: said with the directory it wrote under and what that leaves (the system's
    "[Errno 28] No space left on device" names neither)."""

    def __str__(self) -> str:
        return str(self.strerror)


@contextlib.contextmanager
def disk_full_named(directory: Path, consequence: str) -> Iterator[None]:
    """Within it, a write that finds its disk full (ENOSPC, EDQUOT) is a DiskFullError naming ``directory`` and the
    ``consequence`` (what the failed operation kept or left)."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        what = f"{e.strerror}: {e.filename!r}" if e.filename else e.strerror
        raise DiskFullError(e.errno, f"no space left on the device of {directory} ({what}): {consequence}") from e
