"""Reading a JSON file that someone else may have planted (a backup's manifest, a restore's report) within bounds.

The file's size is checked (fstat) before anything is read, and at most `max_bytes` + 1 bytes are read, so that a
huge or sparse file costs no memory; the file is opened without following a symbolic link and must be a regular
file (a FIFO would block the reader); and any failure to parse, a nesting deep enough to exhaust the parser's
recursion included, is one JSONFileError naming the file, never another exception that would stop a listing.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO


class JSONFileError(ValueError):
    """A JSON file that is too big, not a regular file, or not JSON; the message names the file."""


class SymlinkJSONFileError(JSONFileError):
    """The JSON file is a symbolic link (which may lead anywhere): refused, nothing read."""


def load_json_bounded(f: BinaryIO, path: Path, max_bytes: int, what: str = "the file") -> Any:
    """The JSON document in the open file `f` (named `path`, and `what` it is, in messages), refused above
    `max_bytes`."""
    size = os.fstat(f.fileno()).st_size
    if size > max_bytes:
        raise JSONFileError(f"{path}: {what} is {size} bytes, more than the {max_bytes} it can be: refused, "
                            f"nothing read")
    raw = f.read(max_bytes + 1)  # the file may grow after fstat: never more than the bound
    if len(raw) > max_bytes:
        raise JSONFileError(f"{path}: {what} is more than the {max_bytes} bytes it can be: refused")
    try:
        return json.loads(raw)
    except RecursionError:
        raise JSONFileError(f"{path}: {what} is not valid JSON (nested too deeply to parse)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise JSONFileError(f"{path}: {what} is not valid JSON ({e})") from None


def read_json_file(path: Path, max_bytes: int, what: str = "the file") -> Any:
    """The JSON document in the regular file `path`, never read through a symbolic link, refused above
    `max_bytes`. OSError when it cannot be opened (FileNotFoundError when there is none)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if path.is_symlink():
            raise SymlinkJSONFileError(f"{path}: {what} is a symbolic link: refused, nothing read") from None
        raise e
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise JSONFileError(f"{path}: {what} is not a regular file: refused, nothing read")
        return load_json_bounded(f, path, max_bytes, what)
