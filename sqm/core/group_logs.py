"""The logs under a log root that are the group's: those of the members the group knows, not stamped as another
group's.

A log directory of another group's member (copied or restored onto this volume, or two groups sharing one log
root) must not be read as one of ours: its records would be replayed into our structures, and its relog passes
taken for ours (sqm.core.relog.newest_pass), so that restore would start from its window and log retention would
release our records by it. A log is another group's when its member is not one the group knows, or when its
manifest is stamped with another group repository's id (RecordLog.stamp_group: each member stamps its log when it
starts; a log with no stamp, written before, is taken for ours). Restore refuses such a log
(restore.run.member_log_dirs); log retention leaves it out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cfemu.admin import Admin
from cfemu.repository import GroupRepository
from sqm.log import find_log_dirs
from sqm.log.format import manifest_group, read_manifest


@dataclass(frozen=True)
class ForeignLog:
    """A log under the log root that is not the group's, and why."""

    directory: Path
    why: str


def split_log_dirs(log_root: str | Path, known: Iterable[str], group: str | None
                   ) -> tuple[list[Path], list[ForeignLog]]:
    """The log directories under log_root (find_log_dirs), as (the group's, the others): a log is the group's when
    its member is in `known` and its manifest is not stamped with a group other than `group` (the id of the group
    repository; None: not known, no stamp is compared)."""
    names = set(known)
    ours: list[Path] = []
    others: list[ForeignLog] = []
    for d in find_log_dirs(log_root):
        stamp = manifest_group(read_manifest(d))
        if d.name not in names:
            others.append(ForeignLog(d, f"it is of member {d.name}, which the group does not know"))
        elif group is not None and stamp is not None and stamp != group:
            others.append(ForeignLog(d, f"its manifest names group repository {stamp}, and this group's is "
                                        f"{group}"))
        else:
            ours.append(d)
    return ours, others


def known_member_logs(admin: Admin, log_root: str | Path) -> list[Path]:
    """The group's logs under log_root (split_log_dirs): of the members its repository recorded at their join or
    the admin structure lists, stamped with its repository's id or not at all."""
    repo = GroupRepository(log_root)
    known = set(repo.members()) | set(admin.members())
    return split_log_dirs(log_root, known, repo.id)[0]


__all__ = ["ForeignLog", "known_member_logs", "split_log_dirs"]
