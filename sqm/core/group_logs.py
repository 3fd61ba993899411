"""The logs under a log root that are the group's: those of the members the group knows.

A log directory of a member the group does not know (another group's, copied or restored onto this volume, or two
groups sharing one log root) must not be read as one of ours: its records would be replayed into our structures,
and its relog passes taken for ours (sqm.core.relog.newest_pass), so that restore would start from its window and
log retention would release our records by it. Restore refuses such a directory (restore.run.member_log_dirs);
log retention leaves it out.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from cfemu.admin import Admin
from cfemu.repository import GroupRepository
from sqm.log import find_log_dirs


def split_log_dirs(log_root: str | Path, known: Iterable[str]) -> tuple[list[Path], list[Path]]:
    """The log directories under log_root (find_log_dirs), as (those of a member in `known`, the others)."""
    names = set(known)
    ours: list[Path] = []
    others: list[Path] = []
    for d in find_log_dirs(log_root):
        (ours if d.name in names else others).append(d)
    return ours, others


def known_member_logs(admin: Admin, log_root: str | Path) -> list[Path]:
    """The logs under log_root of the members the group knows: those its repository recorded at their join and
    those the admin structure lists."""
    known = set(GroupRepository(log_root).members()) | set(admin.members())
    return split_log_dirs(log_root, known)[0]


__all__ = ["known_member_logs", "split_log_dirs"]
