"""What recovery still needs of a member's log: the active and the inactive log (docs/log-management.md).

A member's log must keep every record at or after the oldest of:

* its restart position: its last checkpoint (restart reads from there; so does a peer recovering it, and restore's
  check of commits its base holds);
* the first record of its oldest active or in-doubt unit of work;
* for each structure, the start CF recovery would use (restore.run.choose_start): the newest good backup's replay
  start, or the window of the newest complete relog pass when that is newer (the logs alone then rebuild it).

Segments wholly before it are inactive: linear logging archives them, circular logging reuses them, ``sqm log
prune`` may remove them. ``recovery_needs`` is the one function that decides; the gatherers below feed it from a
running member or from a log on disk, and the CF (the backup catalog and the structures' generations). When the CF
cannot be asked, nothing is inactive: not knowing the structures' starts, every record may be needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cfemu.admin import Admin
from sqm.core.group_logs import known_member_logs
from sqm.core.relog import newest_pass
from sqm.core.uow import UnitOfWork, rebuild_table
from sqm.log import LogPosition, LogReader, SegmentInfo

if TYPE_CHECKING:
    from sqm.core.member import LogUser

RESTART, UOW, STRUCTURE = "restart", "uow", "structure"


@dataclass(frozen=True)
class Need:
    """One reason to keep a log: records at LRSN >= lrsn, and (restart) every segment numbered >= segment."""

    kind: str  # restart | uow | structure
    lrsn: int
    why: str
    segment: int = 0  # restart: the checkpoint's segment (restart reads by position from there)


@dataclass
class Retention:
    """What recovery needs of one member's log (recovery_needs)."""

    member: str
    needs: list[Need] = field(default_factory=list)
    unknown: str = ""  # why the needs could not be computed (then every segment is kept)

    @property
    def lrsn(self) -> int:
        """The oldest LRSN any recovery needs (0 when unknown: everything)."""
        if self.unknown or not self.needs:
            return 0
        return min(n.lrsn for n in self.needs)

    @property
    def restart_segment(self) -> int:
        return max((n.segment for n in self.needs if n.kind == RESTART), default=0)

    def kept_for(self, info: SegmentInfo) -> list[str]:
        """Why a segment is still needed (empty: it is inactive)."""
        if self.unknown:
            return [f"unknown: {self.unknown}"]
        if not info.sealed:
            return ["the segment being written"]
        out = []
        for n in self.needs:
            if n.kind == RESTART:
                if info.segment >= n.segment:
                    out.append(n.why)
            elif info.max_lrsn is not None and info.max_lrsn >= n.lrsn:
                out.append(n.why)
        if not any(n.kind == RESTART for n in self.needs):
            out.append("no checkpoint yet: restart reads the whole log")
        return out

    def inactive_below(self, segments: Iterable[SegmentInfo]) -> int:
        """The number of the first segment still needed: every segment below it is inactive. Only a prefix of
        the log is ever inactive (a log has no holes), so a needed segment keeps every later one."""
        bound = 0
        for info in sorted(segments, key=lambda i: i.segment):
            if self.kept_for(info):
                return info.segment
            bound = info.segment + 1
        return bound


def recovery_needs(member: str, checkpoint: tuple[LogPosition, int] | None, uows: Iterable[UnitOfWork],
                   starts: Mapping[str, Need] | None) -> Retention:
    """What recovery still needs of `member`'s log: its last checkpoint (position, LRSN) for restart and peer
    recovery, the first record of each of its active or in-doubt UOWs, and each structure's CF recovery start
    (structure_starts; None when the CF could not say: then everything is needed)."""
    ret = Retention(member)
    if starts is None:
        ret.unknown = "the structures' recovery starts are not known (the CF cannot be asked)"
        return ret
    if checkpoint is not None:
        pos, lrsn = checkpoint
        ret.needs.append(Need(RESTART, lrsn, f"restart and peer recovery: checkpoint at LRSN {lrsn} (segment "
                                             f"{pos.segment})", pos.segment))
    for u in uows:
        if not u.persistent:
            continue  # never logged: nothing of it is in the log
        ret.needs.append(Need(UOW, u.first_lrsn, f"{u.state} unit of work {u.id} (first record at LRSN "
                                                 f"{u.first_lrsn or 'unknown: kept from the start'})"))
    ret.needs.extend(starts.values())
    return ret


def structure_start(structure: str, backups: list[dict[str, Any]], relog: tuple[str, dict[str, Any]] | None) -> Need:
    """Where CF recovery of `structure` would start reading the logs, as restore.run.choose_start chooses: the
    newest good backup's replay start, or the newest complete relog pass's window when that is of a generation at
    least the backup's and starts later. backups: the admin catalog's entries (backup.run.catalog_entry)."""
    newest = max(backups, key=lambda b: int(b.get("start_lrsn") or 0)) if backups else None
    if relog is not None:
        member, p = relog
        w, gen = int(p["w"]), int(p["gen"])
        via_logs = Need(STRUCTURE, w, f"CF recovery of {structure}: the relog window from LRSN {w} (pass of {member} "
                                      f"ending at LRSN {p['e']})")
        if newest is None:
            return via_logs
        bfrom = int(newest.get("replay_from") or 0)
        bgen = newest.get("gen")
        via_backup = Need(STRUCTURE, bfrom, f"CF recovery of {structure}: backup {newest.get('id')} replays from "
                                            f"LRSN {bfrom}")
        if bgen is None:  # a catalog entry from before it said: either may be chosen
            return via_logs if w <= bfrom else via_backup
        return via_logs if gen >= int(bgen) and w > bfrom else via_backup
    if newest is not None:
        bfrom = int(newest.get("replay_from") or 0)
        return Need(STRUCTURE, bfrom, f"CF recovery of {structure}: backup {newest.get('id')} replays from LRSN "
                                      f"{bfrom}")
    return Need(STRUCTURE, 0, f"CF recovery of {structure}: no backup and no complete relog pass (it replays from "
                              "its definition)")


def structure_starts(admin: Admin, log_root: Path) -> dict[str, Need] | None:
    """Each structure's CF recovery start (structure_start), from the CF's backup catalog and the last checkpoints
    of the members' logs under log_root (only the group's members': a log of another group's member there is not
    ours, and its relog passes say nothing of our structures; sqm.core.group_logs). None when the CF cannot say
    (unreachable, or lost: its catalog and structures are gone until a restore brings them back), so that nothing
    is taken for inactive."""
    try:
        if admin.repository() is None:
            return None
        log_dirs = known_member_logs(admin, log_root)
        out = {}
        for sdef in admin.structures():
            out[sdef.name] = structure_start(sdef.name, admin.backups(sdef.name), newest_pass(log_dirs, sdef.name))
        return out
    except Exception:  # noqa: BLE001 - any failure to ask means: not known, keep everything
        return None


def member_retention(qm: LogUser) -> Retention:
    """What recovery needs of a running member's log, from its memory (its UOW table) and the CF."""
    assert qm.log is not None
    cps = qm.log.checkpoints()
    with qm.uow_lock:
        uows = [u for u in qm.uows.values() if u.persistent]
    starts = structure_starts(qm.admin, Path(qm.config.log_root))
    return recovery_needs(qm.name, cps[-1] if cps else None, uows, starts)


def log_retention(log_dir: Path, admin: Admin, log_root: Path | None = None) -> Retention:
    """What recovery needs of a log on disk (its member running or not), read as restart reads it."""
    reader = LogReader(log_dir)
    cps = reader.checkpoints()
    last = reader.last_checkpoint()
    start, ckpt = (last[0], last[1]) if last else (None, None)
    table = rebuild_table(reader.member, ckpt, (r for _, r in reader.records(start)))
    starts = structure_starts(admin, Path(log_root or log_dir.parent))
    return recovery_needs(reader.member, cps[-1] if cps else None, table.values(), starts)


__all__ = ["Need", "Retention", "log_retention", "member_retention", "recovery_needs", "structure_start",
           "structure_starts"]
