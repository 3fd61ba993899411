"""A completed backup's log position, noted in the member's own log (seeds 000 and 002: the log says where
recovery of a structure starts; docs/log-management.md, "A backup's position in the log").

A backup (the backup floor, which the members never import) records each good backup in the CF's catalog
(cfemu.admin.Admin.record_backup). Each member looks at the catalog in its housekeeping and at restart; for every
structure whose newest good backup its log does not note yet, it appends a BACKUP record (sqm.core.records): the
backup's id, generation, replay start, floor and end. Restart says the newest one of each structure, `sqm log print`
shows them. The record is forced (an fsync per backup: `sqm log print` and a restart read it as soon as it is noted). The
member knows what its log notes from its last checkpoint (`bk`, carried forward) and the BACKUP records after it,
so each backup is noted once in each member's log."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from cfemu.admin import Admin
from sqm.core import records
from sqm.core.clock import LrsnClock
from sqm.core.records import Record
from sqm.log import RecordLog

#: How often housekeeping looks at the catalog for a backup completed since (seconds).
CHECK_EVERY_S = 1.0


class NotingMember(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def admin(self) -> Admin: ...
    @property
    def clock(self) -> LrsnClock: ...

    backups_noted: dict[str, dict[str, Any]]  # {structure: {b, l, rf}}: what the log notes (BackupsNoted)
    backups_checked_at: float

    @property
    def log(self) -> RecordLog | None: ...
    @property
    def log_reserve(self) -> int: ...

    def append(self, record: Record) -> None: ...


def noted(rec: Record) -> dict[str, Any]:
    """What the checkpoint carries of a BACKUP record."""
    return {"b": rec["b"], "l": rec["l"], "rf": rec["rf"]}


def note_from_log(noted_so_far: dict[str, dict[str, Any]], checkpoint: Record | None) -> Callable[[Record], None]:
    """Restart: seed noted_so_far from the checkpoint's `bk`; the returned function takes each later record."""
    noted_so_far.update((checkpoint or {}).get("bk", {}))

    def see(rec: Record) -> None:
        if rec.get("k") == "BACKUP":
            noted_so_far[rec["s"]] = noted(rec)
    return see


def note_new_backups(qm: NotingMember, *, force: bool = False) -> list[Record]:
    """Append a BACKUP record for each structure whose newest good backup the log does not note yet (at most every
    CHECK_EVERY_S unless force). Returns the records written."""
    now = time.monotonic()
    if not force and now - qm.backups_checked_at < CHECK_EVERY_S:
        return []
    room = qm.log.room() if qm.log is not None else 0
    if qm.log is None or 0 <= room <= qm.log_reserve:
        return []  # a circular log's reserve is for checkpoints and work begun: the note waits for room
    qm.backups_checked_at = now
    written = []
    for sdef in qm.admin.structures():
        catalog = qm.admin.backups(sdef.name)
        if not catalog:
            continue
        newest = max(catalog, key=lambda b: int(b.get("start_lrsn") or 0))
        if qm.backups_noted.get(sdef.name, {}).get("b") == newest["id"]:
            continue
        rec = records.backup(qm.clock.now(), structure=sdef.name, backup_id=str(newest["id"]),
                             gen=int(newest.get("gen") or 0), replay_from=int(newest.get("replay_from") or 0),
                             floor=int(newest.get("floor_lrsn") or 0), end=int(newest.get("end_lrsn") or 0))
        qm.append(rec)
        qm.backups_noted[sdef.name] = noted(rec)
        written.append(rec)
    return written


__all__ = ["CHECK_EVERY_S", "NotingMember", "note_from_log", "note_new_backups", "noted"]
