"""The one store an unload is loaded into (docs/migration.md, "Never both"): the first load of an unload records its
target (the CF's run id, the structure's name, the group) in the unload's directory, and a load into any other store
is refused. Loaded into two stores, the unload's messages would be served by both: applications would receive them
twice, as seed 004 warns of for the source and its target. The record is made with a hard link of a file already
written and synced, so that of two loads started at once exactly one records its target, and the other reads a
complete record."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

TARGET_FILE = "load-target.json"


def record_target(directory: Path, target: dict[str, str]) -> dict[str, str] | None:
    """Record ``target`` as the store the unload in ``directory`` is loaded into, unless a target is recorded
    already: then that one (None: ``target`` is recorded now). OSError when the directory cannot take the record."""
    path = directory / TARGET_FILE
    if path.exists():
        return read_target(path)
    draft = directory / f".{TARGET_FILE}.{os.getpid()}.{os.urandom(6).hex()}"  # one per load, threads too
    with open(draft, "w", encoding="utf-8") as f:
        json.dump(target, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(draft, path)  # exclusive: of two loads at once, one links
    except FileExistsError:
        return read_target(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(draft)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return None


def read_target(path: Path) -> dict[str, str]:
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


__all__ = ["TARGET_FILE", "record_target", "read_target"]
