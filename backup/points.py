"""Restore points: what a restore or a purge left in a structure, written as a backup that later restores start from.

A restore and a purge are points in a structure's history that no later restore may cross with an older view: a
restore loads what the logs it could read said, a purge discards everything, and the group goes on working from there
in a new generation. A later CF loss restored from a backup taken before that point would replay the old
incarnation's logs again: records that reached the disk only after the first restore (a GET appended but not forced
when the CF was lost) would be folded in as if they had happened, and purged messages would come back
(docs/architecture.md, "The group's durable history"). So each writes its result into the catalog as a backup of its
own kind:

  kind "restore"  every entry the restore loaded, with its final descriptor (entries held by in-doubt UOWs
                  included, with their UOW), and the tombstones it loaded;
  kind "purge"    no entries.

Its generation is the structure's new one; start, floor and end are the restore's LRSN (the purge's new
generation); replay_from is that LRSN, or lower when an in-doubt UOW holds entries (from the first LRSN of those
entries, so that a later restore reads the UOW's PREPARE and keeps it in doubt). The manifest is a version-1
backup manifest (docs/backup-format.md) with `kind`, `tombstones` and `restored_from`; frames are copies of step
0 (no copy step of the patent's wrote them). Everything else (verification, catalog, pruning) treats it as any
good backup: the newest good backup of a structure is where its next restore starts.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backup.files import MANIFEST_NAME, BackupWriter, new_backup_id
from cfemu.admin import QueueDef, StructureDef
from cfemu.credentials import BackupKeys
from cfemu.private_files import open_private, refuse_others_writing
from sqm.log import writer_is_open

# A backup manifest's kind (a manifest without one is a fuzzy backup: written before kinds existed).
FUZZY, RESTORE, PURGE, DEFINITION = "fuzzy", "restore", "purge", "definition"
POINT_STEP = 0  # the step number of a restore point's frames
UNFINISHED_MARK = ".unfinished-restore-point"  # in a restore point's directory until its manifest is written
# Restore's own log, beside the members' logs under the log root: a running restore holds its writer lock from
# before it begins its restore point until the point is finished (restore.run), so an unfinished point whose
# restore still runs is told from one a killed restore left.
RESTORE_LOG = "_restore"


def kind_of(manifest: Mapping[str, Any]) -> str:
    return str(manifest.get("kind", FUZZY))


def point_id(structure: str) -> str:
    """A new backup id for a restore point (the same form as any backup's). The catalog orders it among them by its
    manifest's start_lrsn (the restore's LRSN), not by the time in the id (backup.catalog.order_lrsn)."""
    return new_backup_id(structure, datetime.now(UTC))


class RestorePointWriter:
    """A restore point written as its restore loads: entries as each batch goes into the CF (add_copies, add), the
    manifest at the end (finish), once the load is verified and before the structure is ACTIVE; abort() leaves
    nothing of an unfinished point. A restore killed in between leaves the point unfinished (no manifest), which
    the catalog shows as incomplete and no restore takes as a base. A finished point stays whatever happens next:
    the switch to ACTIVE after it may have gone through though its caller saw it fail (a reply lost with the
    connection, an interrupt while it was read), and the structure's header then names the point; removed, the
    next restore would start from the older base and cross this restore. A point whose
    structure stayed RECOVERING holds what its load verified, which a restore from it loads again."""

    def __init__(self, backup_root: Path, backup_id: str, structure: str,
                 backup_keys: BackupKeys | None = None) -> None:
        self.backup_id = backup_id
        self.t0 = time.monotonic()
        self.started = datetime.now(UTC)
        self.directory = Path(backup_root) / structure / backup_id
        refuse_others_writing(Path(backup_root))  # the structure's own directory: BackupWriter
        self.writer = BackupWriter(self.directory, backup_keys=backup_keys)
        # Marks the directory as a restore point being written, for remove_unfinished_points: a restore killed
        # during its load leaves one holding every message loaded so far.
        os.close(open_private(self.directory / UNFINISHED_MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        self.entries = self.bytes = 0
        self.finished = False

    def add_copies(self, copies: Sequence[tuple[bytes, bytes]]) -> None:
        """Entries as the CF holds them: (descriptor, the CF's msgpack bytes; data)."""
        self.writer.add_raw(POINT_STEP, copies)
        self.entries += len(copies)
        self.bytes += sum(len(data) for _, data in copies)

    def add(self, descriptor: dict[str, Any], data: bytes) -> None:
        """An entry in wire form."""
        self.writer.add(POINT_STEP, descriptor, data)
        self.entries += 1
        self.bytes += len(data)

    def finish(self, *, kind: str, group: str, sdef: StructureDef, queues: Iterable[QueueDef],
               members: Iterable[str], gen: int, lrsn: int, replay_from: int, tombstones: Mapping[str, str],
               restored_from: str = "", uows: Mapping[str, int] | None = None) -> tuple[dict[str, Any], Path]:
        """Write the manifest (signed, atomically, after the entry files are fsynced); returns it and the
        directory."""
        if kind not in (RESTORE, PURGE):
            raise ValueError(f"a restore point is of kind {RESTORE} or {PURGE}, not {kind!r}")
        manifest = self.writer.finish({
            "id": self.backup_id, "kind": kind, "group": group, "structure": sdef.name,
            "structure_def": asdict(sdef), "queues": [asdict(q) for q in sorted(queues, key=lambda q: q.name)],
            "members": sorted(set(members)), "gen": gen, "start_lrsn": lrsn, "floor_lrsn": lrsn,
            "replay_from": min(replay_from, lrsn), "end_lrsn": lrsn,
            "started_at": self.started.isoformat(timespec="microseconds"),
            "ended_at": datetime.now(UTC).isoformat(timespec="microseconds"),
            "elapsed_s": round(time.monotonic() - self.t0, 3), "exclint_s": 0, "steps": [], "entries": self.entries,
            "bytes": self.bytes, "nonpersistent_skipped": 0, "excluded": 0, "exception_records": 0,
            "tombstones": dict(sorted(tombstones.items())), "restored_from": restored_from,
            "uows": dict(sorted((uows or {}).items())),
        })
        self.finished = True
        (self.directory / UNFINISHED_MARK).unlink(missing_ok=True)  # after the manifest: a mark left beside one
        return manifest, self.directory  # by a crash is ignored (remove_unfinished_points needs both)

    def abort(self) -> None:
        """Remove the point unless it is finished (see the class doc)."""
        if not self.finished:
            self.writer.abort()


def point_being_written(path: Path, log_root: Path | None) -> bool:
    """Whether the backup directory at `path` is a restore point its restore is still writing: unfinished (the mark,
    no manifest) while a restore holds restore's own log open under `log_root`. Removed now, the restore would fail
    at the end of its load, its work lost; one a killed restore left goes (remove_unfinished_points, cfbackup
    prune). Without a log root, every unfinished point counts as being written."""
    if not (path / UNFINISHED_MARK).exists() or (path / MANIFEST_NAME).exists():
        return False
    return log_root is None or writer_is_open(Path(log_root) / RESTORE_LOG)


def remove_unfinished_points(backup_root: Path, structure: str) -> list[str]:
    """Remove the restore points of `structure` that earlier restores began and never finished (killed during
    their load: a directory with the mark and no manifest); returns their ids. Called by a restore that owns the
    structure (claimed: no other restore of it still writes), before it writes a point of its own. A fuzzy backup
    interrupted, or a point's directory without the mark, is left for cfbackup prune: nothing says it is one."""
    removed = []
    root = Path(backup_root) / structure
    for mark in sorted(root.glob(f"*/{UNFINISHED_MARK}")) if root.is_dir() else []:
        directory = mark.parent
        if not (directory / MANIFEST_NAME).exists():
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory.name)
    return removed


def write_restore_point(backup_root: Path, backup_id: str, *, kind: str, group: str, sdef: StructureDef,
                        queues: Iterable[QueueDef], members: Iterable[str], gen: int, lrsn: int, replay_from: int,
                        entries: Iterable[tuple[dict[str, Any], bytes]], tombstones: Mapping[str, str],
                        restored_from: str = "", uows: Mapping[str, int] | None = None,
                        backup_keys: BackupKeys | None = None) -> tuple[dict[str, Any], Path]:
    """Write a restore point (see the module doc) as backup `backup_id` of sdef.name, signed with the group's
    backup key (backup_keys, default: those this process's settings find), from `entries` in wire form; returns
    its manifest and directory. The manifest is written last, atomically: a restore point without one is an
    unfinished one."""
    if kind not in (RESTORE, PURGE):
        raise ValueError(f"a restore point is of kind {RESTORE} or {PURGE}, not {kind!r}")
    point = RestorePointWriter(backup_root, backup_id, sdef.name, backup_keys=backup_keys)
    try:
        for descriptor, data in entries:
            point.add(descriptor, data)
        return point.finish(kind=kind, group=group, sdef=sdef, queues=queues, members=members, gen=gen, lrsn=lrsn,
                            replay_from=replay_from, tombstones=tombstones, restored_from=restored_from, uows=uows)
    except BaseException:
        point.abort()
        raise
