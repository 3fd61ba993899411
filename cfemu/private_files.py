"""Files that hold messages or secrets are their owner's only: 0600 files in 0700 directories.

Record logs, backups, restore reports, the CF's own files and the group's secrets all hold message bodies or
credentials. Every floor creates them through these helpers, so the mode is set by the code and not left to the
caller's umask; and a directory that others can write is refused at start, with a one-line error, because anyone
who can write it can replace or remove what the group relies on.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cfemu.durable import replace_file

FILE_MODE = 0o600
DIR_MODE = 0o700


class UnsafeDirectoryError(PermissionError):
    """A directory for private files that other users can write."""


def private_dir(directory: Path) -> Path:
    """Create DIRECTORY (and missing parents) 0700, or check an existing one: refused when group or others can
    write it; narrowed to 0700 when they can only read it."""
    directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    mode = refuse_others_writing(directory)
    if mode & 0o077:
        directory.chmod(DIR_MODE)
    return directory


def refuse_others_writing(directory: Path) -> int:
    """Refuse an existing DIRECTORY that group or others can write (UnsafeDirectoryError, naming it and its
    mode): whoever can write it can replace or remove what is kept below it. Returns its mode (0 when it does not
    exist yet: its maker creates it private)."""
    try:
        mode = stat.S_IMODE(directory.stat().st_mode)
    except FileNotFoundError:
        return 0
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectoryError(f"{directory} is writable by other users (mode {mode:o}): refusing to keep "
                                   "messages or secrets there; chmod 700 it")
    return mode


def open_private(path: Path, flags: int) -> int:
    """os.open with mode 0600 (the mode applies when the file is created)."""
    return os.open(path, flags, FILE_MODE)


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner only, atomically (temp file, fsync, rename, directory fsync)."""
    replace_file(path, data, mode=FILE_MODE)
