"""RECOVER CFSTRUCT: rebuild a lost (or failed) CF structure from its latest good backup plus every member's log.

run_restore() does it in this order, and changes nothing before step 5:
  1 observe the structure (cfemu.bulk.observe: the CF's identity, the header's restore token, state and
    generation) and check its state: FAILED (a structure missing from the CF counts as FAILED), RECOVERING (an
    earlier restore stopped midway: this one resumes it), or ACTIVE with mark_failed (the operator fails it);
  2 open the backup (the latest good one, or the one named) and check that it belongs to this structure and
    group;
  3 find the log of every member the backup names (and any other log under the log root, restore's own
    `_restore` log included);
  4 plan: the engine reads the backup and the logs and settles every message (restore.engine);
  5 claim the structure (cfemu.bulk.claim), only if nothing happened to it since step 1: the same CF, no other
    restore or purge claimed it, not restored again. The claim gives it a new restore token and state
    RECOVERING; the UOWs restore decides (in flight at the failure: backed out) are logged, forced, as RECOVERY
    records in restore's own log `<log root>/_restore`, so that any later restore or re-run sees the same
    decisions;
  6 the bulk load (restore.load), each batch a transaction that lands only while the structure is still this
    restore's, in the CF it claimed it on; it ends by switching the structure to ACTIVE.

So a restore owns its structure from its start to the end of its load: one that planned while another restored
the structure refuses at step 5, having written nothing; one that a later restore or a purge took over, or whose
CF was lost (or replaced) under it, stops at its next batch and writes nothing more (RestoreStoppedError).
A crash anywhere leaves the structure FAILED or RECOVERING; running the restore again gives the same structure
as a clean run (the RECOVERY records make the decisions stable, the load starts from a wipe).

Every restore ends by writing its result as a restore point (backup.points): a backup of kind "restore" at the
restore's LRSN and generation, written after the load is verified and before the structure is ACTIVE, so that a
later restore starts there instead of crossing it with an older view. Which records a plan
folds is decided by the generation rule (restore.plan.current_incarnation). The definitions come from the CF,
else the group repository (cfemu.repository: queues defined after the last backup too), else the backup; a
structure never backed up restores from its definition in the repository. Restore refuses while any member
the group knows (repository, backup, admin structure) has no log under the log root.

run_purge() is RECOVER CFSTRUCT TYPE(PURGE): an empty structure, definitions kept, usable again; it writes an
empty restore point (kind "purge") before the structure is usable again.

The rules, and why each is needed: docs/architecture.md, "The group's durable history".
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from backup.catalog import (
    CORRUPT,
    OK,
    UNSIGNED,
    UNTRUSTED,
    BackupInfo,
    find_backup,
    list_backups,
    order_lrsn,
    readable_kind,
)
from backup.files import Backup, parse_backup_id, read_backup, resolve_keys, signing_key
from backup.migrate_target import TARGET_FILE
from backup.points import (
    DEFINITION,
    FUZZY,
    PURGE,
    RESTORE,
    RESTORE_LOG,
    RestorePointWriter,
    kind_of,
    point_id,
    remove_unfinished_points,
    write_restore_point,
)
from backup.run import rebuild_catalog
from cfemu import bulk, keys
from cfemu.admin import Admin, AdminError, QueueDef, StructureDef
from cfemu.cf import CF
from cfemu.credentials import BackupKeys
from cfemu.private_files import refuse_others_writing
from cfemu.progress import Progress, no_progress
from cfemu.pstore import warm_generations
from cfemu.repository import GroupRepository, migrated_refusal
from cfemu.settings import restore_memory, restore_workers
from restore.engine import PHASES, PURGING, default_engine, get_engine
from restore.load import LoadResult, batch_bytes_for, load_plan, loaded_tombstones, restore_owned_uows
from restore.partitioned import DEFAULT_MEMORY
from restore.plan import EARLIER_GENERATIONS, Copy, RestorePlan, base_lrsn
from restore.result import PurgeResult, RestoreResult, write_report
from sqm.core import records
from sqm.core.group_logs import split_log_dirs
from sqm.core.records import INCOMMIT
from sqm.core.relog import newest_pass
from sqm.core.uow import rebuild_table
from sqm.log import LogFormatError, LogLockedError, LogReader, RecordLog, find_log_dirs, holds_log
from sqm.log.format import log_segments, read_manifest

log = logging.getLogger("restore.run")

RESTORE_MEMBER = RESTORE_LOG  # restore's own log, beside the members' logs
WORK_DIR = ".restore-work"  # under the backup root: the local engine's spill files, removed after each restore


class RestoreError(Exception):
    """A restore that cannot be done as asked; nothing was changed. The message names the problem."""


class RestoreStoppedError(RestoreError):
    """A restore stopped during its load: the CF was lost or replaced under it (cf_lost), or a later restore or a
    purge took the structure over. It wrote nothing more; the message says so, and what to do."""

    def __init__(self, message: str, *, cf_lost: bool) -> None:
        super().__init__(message)
        self.cf_lost = cf_lost


class PhaseTimer:
    """Wraps a progress callback and measures each phase from its first report to its last."""

    def __init__(self, inner: Progress) -> None:
        self.inner = inner
        self.spans: dict[str, list[float]] = {}

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        span = self.spans.setdefault(phase, [now, now])
        span[1] = now
        self.inner(phase, done, total)

    def seconds(self) -> dict[str, float]:
        return {p: round(self.spans[p][1] - self.spans[p][0], 6) for p in PHASES if p in self.spans}


class DefinitionBase:
    """The base of a structure that was never backed up: empty, at the LRSN of its definition in the group
    repository (the structure's CF clock started there, so every record of its work lies above it). Restore
    replays every log from there: log management (sqm.core.retention) keeps every log from the definition on while the
    structure has neither a backup nor a complete relog pass, so the logs reach back to it."""

    def __init__(self, manifest: dict[str, Any], path: Path) -> None:
        self.manifest = manifest
        self.path = path

    @property
    def id(self) -> str:
        return str(self.manifest["id"])

    def copies(self) -> Iterator[Copy]:
        return iter(())


LOGS = "logs"  # the kind of a base of the logs alone: the relog window of the newest complete relog pass


def logs_base(structure: str, member: str, relog: dict[str, Any], backup: Backup | DefinitionBase | None,
              repo: GroupRepository, group: str) -> DefinitionBase:
    """A base of the logs alone: empty, at the window start of a complete relog pass, in its generation. The merged
    logs from the window hold a copy (PUT or RELOG) of every entry that lived at the pass; the UOWs of older
    generations that held copied entries are carried (the generation rule keeps their records); tombstones,
    definitions and members come from the newest good backup (or the repository)."""
    m = dict(backup.manifest) if backup is not None else {}
    if not m:
        known = repo.structure(structure)
        sdef = known[0] if known is not None else StructureDef(structure)
        m = {"structure_def": asdict(sdef), "queues": [asdict(q) for q in repo.queues(structure)], "members": [],
             "group": group, "tombstones": {}}
    w, e = int(relog["w"]), int(relog["e"])
    return DefinitionBase({
        **m, "id": f"{structure}-relog-{e}", "kind": LOGS, "structure": structure, "gen": int(relog["gen"]),
        "start_lrsn": w, "floor_lrsn": w, "replay_from": w, "end_lrsn": e, "entries": 0, "bytes": 0,
        "nonpersistent_skipped": 0, "files": [], "carried": list(relog.get("held", ())), "relog_member": member,
        "relog_pass": dict(relog)}, Path(repo.path))


def choose_start(structure: str, backup: Backup | DefinitionBase | None, log_dirs: list[Path],
                 repo: GroupRepository, group: str, *, from_logs: bool = False) -> Backup | DefinitionBase | None:
    """Where a restore starts: the newest good backup, or the relog window of the newest complete relog pass when
    that is newer (its generation at least the backup's and its start above the backup's replay start: less log
    to read, and no backup needed), or when asked (from_logs). Never a pass made while the structure ran from a
    WARM start."""
    found = newest_pass(log_dirs, structure)
    if found is not None and int(found[1].get("gen", 0) or 0) in warm_generations(repo, structure):
        found = None  # a pass of a WARM generation copied none of the persistent content (cfemu.pstore)
    if found is None:
        if from_logs:
            raise RestoreError(f"no complete relog pass of structure {structure} in the logs under "
                               f"{log_dirs[0].parent if log_dirs else '?'}: restore it from a backup")
        return backup
    member, relog = found
    if backup is not None and not from_logs:
        gen, start = int(backup.manifest.get("gen", 0) or 0), int(backup.manifest["replay_from"])
        if int(relog["gen"]) < gen or int(relog["w"]) <= start:
            return backup
    return logs_base(structure, member, relog, backup, repo, group)


def _refuse_loaded_from_definition(repo: GroupRepository, structure: str, manifest: Mapping[str, Any]) -> None:
    """RestoreError when a store migration loaded the structure and the base holds none of what was loaded: what was
    loaded is in no log of this group, only in a backup or a complete relog pass taken since the load. Such a base
    is the structure's definition alone, a backup or restore point begun before the load, or the relog pass that
    was the newest when it loaded (the target group's own history of the structure, which a load does not cut as a
    purge's point does): restored from it, the structure would be served without what was loaded, and as it was
    before the load. Begun before the load: by its `started_at`, against the load's time (both UTC wall clocks:
    a backup's host whose clock is behind the load's refuses more, never less)."""
    loaded = repo.loaded(structure)
    if loaded is None:
        return
    unload = loaded.get("unload", "?")
    kind = kind_of(manifest)
    if kind == DEFINITION:
        why = "has had neither a backup nor a complete relog pass since"
    elif kind == LOGS:
        before = loaded.get("pass_before")
        relog = manifest.get("relog_pass") or {}
        if not isinstance(before, dict) or (before.get("member"), int(before.get("e", 0) or 0)) != (
                manifest.get("relog_member"), int(relog.get("e", 0) or 0)):
            return  # a pass made since the load (or a load recorded before passes were: as it was)
        why = (f"its base, the relog pass of {before.get('member')} ending at LRSN {before.get('e')}, was made "
               "before the load, and it has had neither a backup nor a complete relog pass since")
    else:
        loaded_at, began = _utc(loaded.get("loaded_at")), _utc(manifest.get("started_at"))
        if loaded_at is None or (began is not None and began >= loaded_at):
            return
        why = (f"its base {manifest.get('id', '?')} was begun before the load (at {manifest.get('started_at', '?')}, "
               f"the load at {loaded.get('loaded_at')}), and it has had no backup since")
    raise RestoreError(
        f"structure {structure} was loaded by migration {loaded.get('migration', '?')} (from {unload}) and {why}: "
        f"restored from it, it would be served without what was loaded, so nothing was restored; load the unload "
        f"again ('cfemu migrate load {unload} --report FILE', a new report, after removing "
        f"{Path(unload) / TARGET_FILE}: this CF is a new store; messages consumed since the load come back), or give "
        f"them up with 'cfrestore purge {structure}'")


def _definition_base(repo: GroupRepository, structure: str, group: str) -> DefinitionBase | None:
    known = repo.structure(structure)
    if known is None:
        return None
    sdef, lrsn = known
    # Generation 1: a structure defined and never backed up was never restored or purged either (both write a
    # restore point), so it is still in the incarnation its definition created.
    return DefinitionBase({
        "id": f"{structure}-definition", "kind": DEFINITION, "group": group, "structure": structure,
        "structure_def": asdict(sdef), "queues": [asdict(q) for q in repo.queues(structure)], "members": [],
        "gen": 1, "start_lrsn": lrsn, "floor_lrsn": lrsn, "replay_from": lrsn, "end_lrsn": lrsn, "entries": 0,
        "bytes": 0, "nonpersistent_skipped": 0, "tombstones": {}}, repo.path)


class _AsPlanned:
    """The base as the engines see it: its copies, and its manifest with the structure's earlier generations
    (plan.EARLIER_GENERATIONS) beside what the base records."""

    def __init__(self, base: Backup | DefinitionBase, earlier: int) -> None:
        self.base = base
        self.manifest = {**base.manifest, EARLIER_GENERATIONS: earlier}
        self.path = base.path

    def copies(self) -> Iterator[Copy]:
        return iter(self.base.copies())


def open_backup(backup_root: Path, structure: str, backup_id: str | None, group: str | None,
                repo: GroupRepository | None = None, backup_keys: BackupKeys | None = None) -> Backup | DefinitionBase:
    """The named backup, or the latest good one of the structure (restore and purge points included: a later
    restore never crosses one; never a backup taken while it ran from a WARM start, _taken_warm); checked to be
    this structure's (and group's), and signed with the group's backup key. Entry frames and digests are checked
    as the engine reads them. A structure with no backup at all restores from its definition in the group
    repository. A backup newer than the latest good one that is
    untrusted (altered, another key's) or unsigned is refused rather than passed over: someone may have
    tampered with the backups, and an older base may cross a restore point; the operator names the base then."""
    backup_keys = resolve_keys(backup_keys)
    if backup_id is not None:
        return read_backup(find_backup(backup_root, backup_id), structure=structure, group=group,
                           backup_keys=backup_keys)
    backups = list_backups(backup_root, structure, backup_keys=backup_keys)
    warm = warm_generations(repo, structure) if repo is not None else frozenset()
    good = next((b for b in backups if b.state == OK and not _taken_warm(b, warm)), None)
    _refuse_to_cross_damaged_points(backups, good)
    if good is None:
        defined = _definition_base(repo, structure, group or "QSG1") if repo is not None and not backups else None
        if defined is not None:
            return defined
        why = "; ".join(f"{b.id} is {b.state}: {b.problem}" for b in backups[:3])
        raise RestoreError(f"no good backup of structure {structure} under {backup_root / structure}"
                           + (f" ({why})" if why else "")
                           + ("" if backups or repo is None else f", and the group repository {repo.path} has no "
                                                                 f"definition of it"))
    return read_backup(good.path, structure=structure, group=group, backup_keys=backup_keys)


def _taken_warm(b: BackupInfo, warm: frozenset[int]) -> bool:
    """A fuzzy backup taken while the structure ran from a WARM start (cfemu.pstore.WARM_SECTION): it holds none of
    the persistent content, and its floor lies above what was committed before the CF loss. Never a base."""
    m = b.manifest or {}
    return kind_of(m) == FUZZY and int(m.get("gen", 0) or 0) in warm


def _refuse_to_cross_damaged_points(backups: list[BackupInfo], good: BackupInfo | None) -> None:
    """A restore or purge point cuts the structure's history: a base older than it brings back what it purged or
    consumed. A corrupt backup newer than the newest good one that is such a point (or whose kind cannot be read)
    is not skipped without a word, as restore once did; an incomplete one never made its structure ACTIVE (a
    restore writes its point before that), so an older base is right then. A newer backup that is untrusted
    (altered, another key's) or unsigned is refused whatever its kind: someone may have tampered with the backups,
    and what it claims to be cannot be believed."""
    for b in backups:
        if good is not None and (b is good or _stands_before(b, good)):
            continue
        if b.state == UNTRUSTED and _copy_of_an_older_backup(b, backups, good):
            log.warning("restore of %s passes over backup %s: a copy of backup %s under a newer name (its signed "
                        "manifest says so), and no newer than the base %s; %s", b.structure, b.id, b.copy_of,
                        good.id if good is not None else "-", b.problem)
            continue
        if b.state in (UNTRUSTED, UNSIGNED):
            raise RestoreError(
                f"backup {b.id} of {b.structure} is {b.state} and newer than any good backup: {b.problem}"
                + ("" if good is None else f"; to restore from an older one, having checked, name it "
                                           f"(--backup {good.id})"))
        if b.state != CORRUPT:
            continue
        kind = readable_kind(b.path)
        if kind == FUZZY:
            continue
        what = f"a {kind} point" if kind else "unreadable: it may be a restore or purge point"
        raise RestoreError(f"backup {b.id} of {b.structure} is corrupt ({b.problem}) and {what}: a restore from an "
                           f"older base would cross the restore or purge point (messages it consumed or purged "
                           f"would come back). Repair or restore it from a copy; or, having checked, name the base "
                           f"with --backup")


def _stands_before(b: BackupInfo, good: BackupInfo) -> bool:
    """Whether a backup that is not good certainly stands before the base in the structure's history, so that a
    restore from the base does not cross it. By the CF-ticked start_lrsn its manifest still says (unchecked:
    catalog.readable_start_lrsn), as the catalog orders good ones; ids are to the second and follow whoever's wall
    clock took them (a clock stepped back names a later point earlier). A damaged restore or purge point (or one
    whose kind cannot be read) whose LRSN cannot be read is newer, whatever its time: it is never crossed without a
    word. Any other (untrusted, unsigned, incomplete, a damaged fuzzy backup) is before the base only when every
    clue says so: its id's time, and its LRSN when it can be read (an altered manifest may claim an older one)."""
    lrsn, base = b.start_lrsn, order_lrsn(good)
    if b.state == CORRUPT and readable_kind(b.path) != FUZZY:
        return lrsn is not None and lrsn < base
    return b.started < good.started and (lrsn is None or lrsn < base)


def _copy_of_an_older_backup(b: BackupInfo, backups: list[BackupInfo], good: BackupInfo | None) -> bool:
    """A backup refused only for its name (a signed, intact copy of another backup of this structure) is passed
    over when what it copies is no newer than the base: the original good in the catalog (where it counts at its
    own time), or begun before the base. It brings nothing the base's restore would cross."""
    if not b.copy_of:
        return False
    try:
        structure, started = parse_backup_id(b.copy_of)
    except ValueError:
        return False
    if structure != b.structure:
        return False
    if any(o.id == b.copy_of and o.state == OK for o in backups):
        return True
    return good is not None and started < good.started


def _logs_reach_back(log_dirs: list[Path], structure: str, base: Mapping[str, Any]) -> None:
    """Every member's log must hold every record from the base's replay start on: a restore replays them all, and
    one that is gone is work lost without a word (a committed put not loaded, a consumed message back). Log
    management keeps them for the base restore would choose (sqm.core.retention), but a restore may start lower:
    the newest backup damaged after the logs were pruned to its replay start, a base named with --backup, a
    segment an operator removed. A log reaches back when it still holds its first segment; when the segments it
    lacks were all removed on purpose, when every one held only LRSNs below the replay start (its manifest's
    pruned_lrsn); else (removed before the manifest said, or by hand) when its first record, archived segments
    included, is at or below it."""
    replay_from = int(base["replay_from"])
    for d in log_dirs:
        gap = _log_gap(d, replay_from)
        if gap is None:
            continue
        what = (f"structure {structure} was never backed up (a restore from its definition replays every log from "
                f"the definition on): bring the segments back" if kind_of(base) == DEFINITION else
                "restore from the logs alone (--from-logs), or name a base the logs reach back to (--backup ID)")
        raise RestoreError(f"the log of member {d.name} ({d}) {gap}, and {describe_start(base)}: the records from "
                           f"LRSN {replay_from} on are not all there, and the restore would lose them; {what}")


def _log_gap(directory: Path, replay_from: int) -> str | None:
    """Why the log at `directory` lacks records from `replay_from` on (_logs_reach_back), naming its first LRSN;
    None when it holds them all."""
    manifest = read_manifest(directory) or {}
    segments = log_segments(directory, manifest)  # archived segments count: restore reads them there
    if not segments or segments[0][0] == 1:
        return None
    first_segment = segments[0][0]
    pruned_lrsn = manifest.get("pruned_lrsn")
    if pruned_lrsn is not None and first_segment <= int(manifest.get("pruned", 0)) and int(pruned_lrsn) < replay_from:
        return None
    first = next((s.min_lrsn for s in LogReader(directory).segments(manifest) if s.min_lrsn is not None), None)
    if pruned_lrsn is None and first is not None and first <= replay_from:
        return None
    return (f"begins at segment {first_segment}, first LRSN {first if first is not None else 'unknown (no record)'}"
            + (f", its removed segments holding LRSNs up to {pruned_lrsn}" if pruned_lrsn is not None else ""))


def known_members(repo: GroupRepository, manifest: dict[str, Any], admin: Admin) -> dict[str, str]:
    """Every member the group knows durably, with where it logs ("" when not recorded): those the group
    repository recorded at their join, those the base backup names, and the live ones the admin structure lists
    when the CF still has it. Restore must read every one's log."""
    known = {str(m): "" for m in manifest.get("members", [])}
    known.update(repo.members())
    for member, info in admin.members().items():
        known[member] = str(info.get("log") or known.get(member, ""))
    known.pop(RESTORE_MEMBER, None)
    return known


def member_log_dirs(log_root: Path, members: Mapping[str, str] | list[str], replay_from: int) -> list[Path]:
    """Every log under log_root; refuses when a member the group knows (members: name -> where it logs) has
    none there, naming each and where its log is or should be, and when a log there is of a member the group does
    not know (refuse_foreign_logs)."""
    where = members if isinstance(members, Mapping) else dict.fromkeys(members, "")
    found = {d.name: d for d in refuse_foreign_logs(log_root, where)}
    missing = sorted(m for m in where if m not in found)
    if missing:
        elsewhere = [f"{m} logs to {where[m]}" for m in missing
                     if where[m] and Path(where[m]).absolute() != (log_root / m).absolute()]
        raise RestoreError(f"no log for member{'s' if len(missing) > 1 else ''} {', '.join(missing)} under "
                           f"{log_root}: restore needs every member's log from LRSN {replay_from} on"
                           + (f" ({'; '.join(elsewhere)})" if elsewhere else "")
                           + f"; bring {'each' if len(missing) > 1 else 'it'} back to {log_root}/<member> (or "
                             "mount it there) and run again")
    return [found[name] for name in sorted(found)]


def without_lost_logs(members: Mapping[str, str], repo: GroupRepository, log_root: Path) -> dict[str, str]:
    """`members` less those whose log was declared lost (sqm log lost) and who have no log under log_root (they
    have not begun a new one, and the old one is not back): there is none of theirs to read, and none is missing:
    what the lost one held is gone (refuse_lost_logs), and they wrote nothing since."""
    lost = repo.lost_logs()
    return {m: where for m, where in members.items() if m not in lost or holds_log(Path(log_root) / m)}


def refuse_lost_logs(repo: GroupRepository, structure: str, base: Mapping[str, Any]) -> None:
    """A base begun before a member's log was declared lost may need that log's records: the member may have died
    after it began, with work in it that its lost log alone holds (a committed put not loaded, a consumed message
    back). A base begun after the declaration needs none of them: the member was dead by then, and what it applied
    on the CF is in the base, what peers decided for it in their logs. Begun after means both by the LRSN the
    declaration recorded and by the wall clock (LRSN clocks run ahead of the wall clock when a member's did: the
    declaration cannot see the lost log's highest LRSN). Refused, naming the member and what can be done."""
    begun = int(base.get("start_lrsn") or base["replay_from"])
    started_at = _utc(base.get("started_at"))
    for member, lost in sorted(repo.lost_logs().items()):
        declared_at = _utc(lost.get("declared_at"))
        after = begun > int(lost["lrsn"]) and (started_at is None or declared_at is None or started_at > declared_at)
        if not after:
            raise RestoreError(
                f"the log of member {member} was declared lost for good on {lost.get('declared_at', '?')} (sqm log "
                f"lost, LRSN {lost['lrsn']}), and {describe_start(base)}, begun before that: what the lost log held "
                f"after it began is gone, and the restore would lose it; start {structure} COLD ('cfemu pstore start "
                f"{structure} --mode COLD --confirm {structure}': its messages are lost), or restore from a backup "
                "begun after the declaration (--backup ID)")


def _utc(iso: Any) -> datetime | None:
    """An ISO 8601 time as an aware UTC datetime (one without a zone is UTC), or None."""
    if not iso:
        return None
    try:
        t = datetime.fromisoformat(str(iso))
    except ValueError:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def refuse_missing_member_logs(admin: Admin, structure: str, what: str, log_root: Path) -> None:
    """Every member the group knows must have its log under log_root before a structure starts empty (a purge, a
    COLD or WARM start): each unit of work whose COMMIT a member logged but had not applied gets a tombstone
    (committed_before_base), so that the member's retry finds its commit standing. Without a member's log its units
    of work would get none: its restart would hear "lost with the CF", log BACKOUT after its COMMIT and fail on the
    structures that kept the commit, at every restart. `what` names the operation in the refusal. A member whose
    log was declared lost is not waited for: its next start begins a new log and backs its units of work out."""
    repo = GroupRepository(log_root)
    try:
        member_log_dirs(log_root, without_lost_logs(known_members(repo, {}, admin), repo, log_root), 0)
    except RestoreError as e:
        raise RestoreError(f"{what} of {structure} reads every member's log (the commits they logged and had not "
                           f"applied keep their outcome): {e}") from None


def refuse_foreign_logs(log_root: Path, known: Mapping[str, str]) -> list[Path]:
    """The logs under log_root; RestoreError, naming the directory, when one is another group's (split_log_dirs: of
    a member the group does not know, restore's own log aside, or stamped with another group): its records would
    be replayed into our structures and its relog passes taken for ours (choose_start), so that ours would be lost.
    It is the operator's to move away."""
    ours, others = split_log_dirs(log_root, [*known, RESTORE_MEMBER], GroupRepository(log_root).id)
    if others:
        raise RestoreError(f"the log {others[0].directory} is another group's ({others[0].why}): restore does not "
                           f"read it; move it out of {log_root} and run again")
    return ours


def log_ranges(log_dirs: list[Path], replay_from: int, replay_to: int) -> dict[str, dict[str, Any]]:
    """Per member: its log directory and the LRSN range restore replays from it ("to" None: nothing to replay,
    the log ends before the replay range). The range ends at `replay_to`, the highest LRSN the plan read: a live
    member's log is read again here after the plan, and what it appended since was not replayed."""
    out: dict[str, dict[str, Any]] = {}
    for d in log_dirs:
        reader = LogReader(d)
        top = max((s.max_lrsn for s in reader.segments() if s.max_lrsn is not None), default=None)
        if top is not None:
            top = min(top, replay_to)
        out[reader.member] = {"dir": str(d), "from": replay_from,
                              "to": top if top is not None and top >= replay_from else None}
    return out


def committed_before_base(log_dirs: list[Path], structure: str, gen: int) -> set[str]:
    """Units of work whose owner may still retry a commit that the base already holds: the owner's log ends with
    the UOW committed (COMMIT, no END: the END was appended but lost with the member, or it is still in its
    buffer) and names `structure` in the base's generation `gen`. Read as restart reads a log: from its last
    checkpoint on.

    Such a UOW held no entries on the structure when the base's backup started (its recovery floor would then lie
    at or below the UOW's first LRSN, and the COMMIT would be replayed), so its work there had taken effect before
    the base: the base holds it. Restore leaves it a 'C' tombstone, as it does for the in-commit UOWs it replays,
    so that the owner's retry (its restart, a peer's recovery, its pending commit) learns that the commit stands
    here. Without one, the structure answers "lost with the CF" (a UOW of an older generation it does not know),
    the owner logs BACKOUT after its COMMIT and backs the UOW out on its other structures, and a later restore of
    one of those, reading COMMIT then BACKOUT, drops messages whose put was committed (the property model's
    test_a_member_restarts_after_a_structure_forgot_its_commit_and_the_next_restore_keeps_it)."""
    out: set[str] = set()
    for d in log_dirs:
        if d.name == RESTORE_MEMBER:
            continue  # restore decides only in-flight UOWs backed out: none it decided is in commit
        reader = LogReader(d)
        ckpt = reader.last_checkpoint()
        start, ckpt_rec = (ckpt[0], ckpt[1]) if ckpt else (None, None)
        table = rebuild_table(reader.member, ckpt_rec, (r for _, r in reader.records(start)))
        for uow in table.values():
            named = uow.structures.get(structure)
            if uow.state == INCOMMIT and named is not None and (gen <= 0 or int(named) == gen):
                out.add(uow.id)
    return out


def with_commits_before_base(plan: RestorePlan, log_dirs: list[Path], gen: int) -> RestorePlan:
    """The plan, its in-commit UOWs joined by those whose commit its base holds (committed_before_base) and that
    its replay did not decide otherwise. Every engine's plan goes through it, so that they stay equal."""
    plan.in_commit |= {u for u in committed_before_base(log_dirs, plan.structure, gen) if u not in plan.outcomes}
    return plan


def _admin_definition(admin: Admin, structure: str) -> StructureDef | None:
    """The structure's definition, or None when the admin structure was lost with the CF."""
    try:
        return admin.structure_def(structure)
    except AdminError:
        return None


def _definitions_without_backup(admin: Admin, repo: GroupRepository, structure: str,
                                hint: str = "") -> tuple[StructureDef, list[QueueDef], bool]:
    """The structure's definition and its queues for a start that reads no backup (a purge, a WARM start): the
    CF's, else the group repository's (definitions); and whether the CF lost them. A structure neither knows is a
    RestoreError (``hint``: what the error adds)."""
    admin_def = _admin_definition(admin, structure)
    known = repo.structure(structure)
    if admin_def is None and known is None:
        raise RestoreError(f"structure {structure} is not defined, in the CF or in the group repository "
                           f"{repo.path}{hint}")
    base_def = admin_def or (known[0] if known else StructureDef(structure))
    sdef, queues = definitions(admin_def, admin.queues(), repo,
                               {"structure": structure, "structure_def": asdict(base_def), "queues": []})
    return sdef, queues, admin_def is None


def definitions(admin_def: StructureDef | None, admin_queues: list[QueueDef], repo: GroupRepository,
                manifest: dict[str, Any]) -> tuple[StructureDef, list[QueueDef]]:
    """The structure's definition and every queue on it: the CF's where the admin structure still has them,
    else the group repository's (queues defined after the last backup included), else the base backup's."""
    structure = str(manifest["structure"])
    sd = manifest["structure_def"]
    known = repo.structure(structure)
    sdef = admin_def or (known[0] if known else None) or StructureDef.from_dict(sd)
    queues = {q["name"]: QueueDef.from_dict({**q, "structure": structure}) for q in manifest["queues"]}
    queues.update({q.name: q for q in repo.queues(structure)})
    queues.update({q.name: q for q in admin_queues if q.structure == structure})
    return sdef, [queues[name] for name in sorted(queues)]


def _redefine(admin: Admin, group: str, sdef: StructureDef, queues: list[QueueDef], *, lost: bool) -> None:
    """Define again what the CF lost: the group, the structure (lost: the admin structure went with the CF)
    and the queues it lacks. The caller owns the structure (its claim made it RECOVERING: no queue manager uses
    it), and leaves its header to the owner's guarded reset: written here, unguarded, it would land in a structure
    that another restore or a purge took over meanwhile and made ACTIVE, making it RECOVERING again under the
    other's token (every member refused, and no restore running to end it)."""
    known = {q.name for q in admin.queues()}
    if lost:
        admin.set_group_name(group)
        admin.define_structure(sdef.name, max_entries=sdef.max_entries, max_bytes=sdef.max_bytes, replace=True,
                               recauto=sdef.recauto, create=False)
    for q in queues:
        if lost or q.name not in known:
            admin.define_from(q, structure=sdef.name, replace=True)


def history_lrsn(backup_root: Path, structure: str, backup_keys: BackupKeys) -> int:
    """The highest LRSN and generation the structure's backups and restore points record (good or not, as far as
    they can be read). A purge's new generation, and its point's LRSN, go above it, as a restore's go above its
    base's (restore.plan.restore_lrsn_above): from the purging host's clock alone (the CF, lost, keeps no clock or
    generation to go above), behind the members' clocks, the point sorted before the last backup, which the next
    restore then started from, crossing the purge (the purged messages back)."""
    highest = 0
    for b in list_backups(backup_root, structure, backup_keys=backup_keys):
        highest = max(highest, order_lrsn(b))
        if b.manifest:
            highest = max(highest, base_lrsn(b.manifest), int(b.manifest.get("gen", 0) or 0))
    return highest


def purge_claimed(client: redis.Redis, sdef: StructureDef, queues: list[QueueDef], *, group: str, lost: bool,
                  log_root: Path, backup_root: Path, backup_keys: BackupKeys, seen: bulk.Seen | None,
                  progress: Progress = no_progress, **options: Any) -> bulk.Purged:
    """bulk.purge of the structure (a COLD start, a WARM one, `cfrestore purge`) as the caller saw it (``seen``):
    the UOWs committed before the new base tombstoned from every member's log, the structure defined again as the
    purge's first step once it owns it (bulk.purge's claimed), so that a purge refused because a restore took the
    structure over meanwhile changed nothing, and its generation above the structure's history (history_lrsn).
    Refused in one line (RestoreError) when it lost the claim; once it owned the structure (progress reports PURGING),
    a later loss of it is a RestoreStoppedError (cf_lost: the CF was lost or replaced). ``options``: bulk.purge's
    (before_activate, flags)."""
    structure = sdef.name
    owned = False

    def claimed(owner: bulk.Owner) -> None:
        nonlocal owned
        owned = True
        progress(PURGING, 0, None)
        _redefine(Admin(owner.admin), group, sdef, queues, lost=lost)

    try:
        return bulk.purge(client, sdef, [q.name for q in queues],
                          committed=lambda gen: committed_before_base(find_log_dirs(log_root), structure, gen),
                          seen=seen, claimed=claimed, above=history_lrsn(backup_root, structure, backup_keys),
                          **options)
    except bulk.NotOwnerError as e:
        if owned:
            raise RestoreStoppedError(str(_refused(structure, e)), cf_lost=isinstance(e, bulk.CFReplacedError)) from e
        raise _refused(structure, e) from e


def _log_decisions(log: RecordLog, plan: RestorePlan, gen: int) -> int:
    """Restore's decisions (in-flight UOWs backed out) as forced RECOVERY records, before anything is loaded.
    Appended to the log directly, not through a queue manager: one force covers them all. gen: the base's
    generation, the incarnation the decided UOWs ran in (a later restore from a newer base leaves them out)."""
    for uow, owner in sorted(plan.decisions.items()):
        log.append(records.recovery(uow, plan.restore_lrsn, {plan.structure: gen}, commit=False, of=owner,
                                    by="restore"))
    if plan.decisions:
        log.force()
    return len(plan.decisions)


def point_uows(plan: RestorePlan) -> dict[str, int]:
    """The UOWs the restored structure holds a record of (plan.in_doubt_uows), each with the first LRSN its record
    carries, as the load writes it: its first entry's, or its PREPARE's when none of its work here survived."""
    first = {u: plan.outcomes[u].lrsn for u in plan.in_doubt_uows() if u in plan.outcomes}
    for u, lrsn in plan.loaded_first_lrsn().items():
        first[u] = min(first.get(u, lrsn), lrsn)
    return first


def point_replay_from(plan: RestorePlan) -> int:
    """Where a restore from this restore's point starts reading the logs: its LRSN, or the first LRSN of a UOW it
    holds (the entries of an in-doubt UOW, or its PREPARE when it holds none: so that the PREPARE is read, and the
    UOW stays in doubt)."""
    return min([plan.restore_lrsn, *point_uows(plan).values()])


def _counts(plan: RestorePlan) -> dict[str, int]:
    counts = Counter({k: v for k, v in plan.counts.items()})
    # UOWs restore backed out: decided now, or by an earlier run of this restore (its RECOVERY records)
    counts["uows in flight backed out"] = sum(1 for v in restore_owned_uows(plan).values() if v == "B")
    return dict(counts)


def default_report_path(backup_root: Path, structure: str, when: datetime) -> Path:
    return backup_root / structure / f"restore-{when:%Y%m%dT%H%M%S%fZ}.json"


MIGRATION_STATES = ("MIGRATING", "MIGRATED")  # a store migration's source (backup.migrate): its header's states


def refuse_migrated(structure: str, state: str, log_root: Path, doing: str) -> None:
    """RestoreError when `structure` is a store migration's source: its header says so (MIGRATING, MIGRATED), or,
    once a CF loss took the header away, the group repository does. Restoring or starting it would make it serve
    beside its target; only 'cfemu migrate reopen' gives it back (backup.migrate)."""
    if state in MIGRATION_STATES:
        raise RestoreError(f"structure {structure} is {state}, a store migration's source: {doing} it would serve "
                           f"its messages beside its target's; only if the migration is abandoned: 'cfemu migrate "
                           f"reopen {structure} --confirm {structure}'")
    record = GroupRepository(log_root).migrated().get(structure)
    if record is not None:
        raise RestoreError(migrated_refusal(structure, record, doing))


def refuse_unsafe_inputs(log_root: Path, report_path: Path | None, archive_dir: Path | str | None) -> None:
    """Refused before anything is read or changed (UnsafeDirectoryError, naming the directory): a log root, an
    archive directory or the report's directory that other users can write. Whoever can write the logs or the
    archive could hand the restore records of their own (a consumed message back, with their body); whoever can
    write the report's directory could replace the report, or a link in its place would take the write."""
    refuse_others_writing(log_root)
    if archive_dir is not None:
        refuse_others_writing(Path(archive_dir))
    if report_path is not None:
        refuse_others_writing(Path(report_path).absolute().parent)


def run_restore(client: redis.Redis, structure: str, *, backup_root: Path, log_root: Path,
                backup_id: str | None = None, engine: str | None = None, dry_run: bool = False,
                mark_failed: bool = False, progress: Progress = no_progress, report_path: Path | None = None,
                now_ms: int | None = None, engine_options: dict[str, Any] | None = None,
                from_logs: bool = False, backup_keys: BackupKeys | None = None) -> RestoreResult:
    """Restore `structure` (see the module doc). from_logs: start from the logs alone (the newest complete relog
    pass's window) even when a backup is newer. backup_keys: the group's backup keys, which check the backup and
    sign the restore point (default: those this process's settings find; without one a restore is refused
    before it reads anything). Raises RestoreError, backup.files.BackupError,
    sqm.log.LogCorruptError / LogFormatError, cfemu.admin.AdminError; nothing is changed when it raises before
    the load starts. The report is written (as JSON) to report_path, default
    <backup_root>/<structure>/restore-<timestamp>.json (a dry run writes one only when report_path is given)."""
    started = datetime.now(UTC)
    try:
        keys.check_name("structure", structure)
    except ValueError as e:
        raise RestoreError(str(e)) from None
    backup_root, log_root = Path(backup_root), Path(log_root)
    backup_keys = resolve_keys(backup_keys)
    refuse_unsafe_inputs(log_root, report_path, (engine_options or {}).get("archive_dir"))
    if not dry_run:
        signing_key(backup_keys, "sign the restore point with")  # refused now, not after the load
        for directory in (backup_root, backup_root / structure):  # where its restore point goes: nor then
            refuse_others_writing(directory)
    admin = Admin(client)
    seen = bulk.observe(client, structure)  # what the claim compares against, after the plan
    points_seen = finished_points(backup_root, structure, backup_keys)  # before the base is chosen: likewise
    state = seen.state or "FAILED"  # a structure missing from the CF counts as FAILED (Admin.state)
    refuse_migrated(structure, state, log_root, "restoring")
    sdef = _admin_definition(admin, structure)
    if state == "ACTIVE" and not (mark_failed or dry_run):
        raise RestoreError(f"structure {structure} is ACTIVE: restore works on a FAILED structure; mark it "
                           f"failed first (--mark-failed) if you mean to replace its content")
    options = dict(engine_options or {})
    engine = engine or default_engine()
    if engine == "spark":
        options.setdefault("backup_keys", backup_keys)  # checks the seals of the archived segments it reads
    if engine in ("local", "columnar", "spark"):  # spill files: a private directory beside the backups (docs/runbook.md)
        # A read-only backup volume (the compose tools service mounts it so): the system's temporary directory.
        options.setdefault("work_dir", backup_root / WORK_DIR if os.access(backup_root, os.W_OK) else None)
        # RECAUTO and library callers: $CFEMU_RESTORE_MEMORY and $CFEMU_RESTORE_WORKERS, else the defaults
        try:
            if "memory" not in options:
                options["memory"] = restore_memory()
            if "workers" not in options and engine != "spark":  # Spark's parallelism is its master's
                options["workers"] = restore_workers()
        except ValueError as e:
            raise RestoreError(str(e)) from None
    chosen_engine = get_engine(engine, **options)
    memory_limit = int(getattr(chosen_engine, "memory", 0) or 0)  # 0: an engine without one
    repo = GroupRepository(log_root)  # read only until the load
    group = admin.group_name() if sdef is not None else None
    no_backup: RestoreError | None = None
    try:
        found: Backup | DefinitionBase | None = open_backup(backup_root, structure, backup_id, group=group,
                                                            repo=repo, backup_keys=backup_keys)
    except RestoreError as e:
        if backup_id is not None or not from_logs:
            raise  # a damaged newest backup is said, not passed over, unless the logs alone are asked for
        found, no_backup = None, e
    manifest = found.manifest if found is not None else {}
    members = without_lost_logs(known_members(repo, manifest, admin), repo, Path(log_root))
    log_dirs = member_log_dirs(log_root, members, int(manifest.get("replay_from", 0)))
    for log_dir in log_dirs:
        refuse_others_writing(log_dir)
    if backup_id is None:
        found = choose_start(structure, found, log_dirs, repo, group or str(manifest.get("group") or "QSG1"),
                             from_logs=from_logs)
    if found is None:
        assert no_backup is not None
        raise no_backup
    backup = found
    manifest = backup.manifest
    _refuse_loaded_from_definition(repo, structure, manifest)
    replay_from = int(manifest["replay_from"])
    _logs_reach_back(log_dirs, structure, manifest)
    refuse_lost_logs(repo, structure, manifest)
    decisions_seen = _decisions_logged(log_root)  # before the plan reads them: compared under the log's lock
    timer = PhaseTimer(progress)
    now = now_ms if now_ms is not None else time.time_ns() // 1_000_000

    # Above every generation the structure has had (the CF's own, when it still holds the structure; every restore
    # and purge writes one as a restore point, and a fuzzy backup records the one it was taken in) and every LRSN its
    # backups record (history_lrsn, which reads those generations too): the restore's LRSN (its generation, its
    # point's LRSN) above a backup newer than a base named with --backup, or its point sorts before that backup,
    # from which the next restore would start, crossing this one.
    as_planned = _AsPlanned(backup, max(seen.gen, history_lrsn(backup_root, structure, backup_keys)))

    plans: list[RestorePlan] = []  # closed at the end, whatever happens (a partitioned plan's spill files)

    def make_plan() -> RestorePlan:
        for earlier in plans:
            earlier.close()  # planned again: the earlier plan's spill files are not needed any more
        plans.append(chosen_engine.plan(structure, as_planned, log_dirs, replay_from, now, timer))
        return with_commits_before_base(plans[-1], log_dirs, int(manifest.get("gen", 0) or 0))

    result = RestoreResult(structure, backup.id, str(backup.path), chosen_engine.name, dry_run, state,
                           replay_from=replay_from, started_at=started.isoformat(timespec="seconds"),
                           base_kind=kind_of(manifest), start=describe_start(manifest))
    try:
        plan = make_plan()  # reads everything: a bad backup or log is refused here, before any change
        found_in_cf = 0
        if not dry_run:
            _refuse_if_changed(client, structure, seen)  # the common case, before restore's log is even opened
            with (_restore_log(log_root, structure, decisions_seen) as rlog,
                  _no_point_since(backup_root, structure, points_seen, backup_keys, "restore"),
                  _failed_if_live(client, structure, seen, "restore") as claimed_seen,
                  _owning(client, structure, claimed_seen) as owner):
                owned = Admin(owner.admin)  # the owner's own connection (a cluster's: its {ADMIN} slot, bulk.Owner)
                if state == "ACTIVE":
                    plan = make_plan()  # again: members may have logged more before the claim stopped them
                if seen.state:
                    found_in_cf = bulk.count_nonpersistent(owner.client, structure)
                lost = sdef is None
                sdef, queues = definitions(sdef, owned.queues(), repo, manifest)
                _redefine(owned, str(manifest["group"]), sdef, queues, lost=lost)
                # The group repository learns what it lacked (a group from before it existed), and the new CF
                # learns where it is, so that a member started with another log root is refused.
                repo.adopt([sdef], queues)
                owned.claim_repository(str(repo.id), str(repo.path), overwrite=True)
                result.decisions_logged = _log_decisions(rlog, plan, int(manifest.get("gen", 0) or 0))
                base_tombstones = dict(manifest.get("tombstones") or {})
                result.unfinished_points_removed = remove_unfinished_points(backup_root, structure)
                point = RestorePointWriter(backup_root, point_id(structure), structure, backup_keys=backup_keys)

                def write_point() -> None:  # after the load is verified, before the structure is ACTIVE
                    point.finish(
                        kind=RESTORE, group=str(manifest["group"]), sdef=sdef, queues=queues,
                        members=[*members.keys(), *(d.name for d in log_dirs if d.name != RESTORE_MEMBER)],
                        gen=plan.restore_lrsn, lrsn=plan.restore_lrsn, replay_from=point_replay_from(plan),
                        tombstones=loaded_tombstones(plan, base_tombstones), restored_from=backup.id,
                        uows=point_uows(plan))

                try:  # the point's entries are written as the load goes (they are what it loads)
                    loaded: LoadResult = load_plan(owner, plan, sdef, [q.name for q in queues], progress=timer,
                                                   batch_bytes=batch_bytes_for(memory_limit or DEFAULT_MEMORY),
                                                   restored_from=backup.id, base_tombstones=base_tombstones,
                                                   before_activate=write_point, last_backup=point.backup_id,
                                                   copies_to=point.add_copies)
                except BaseException:
                    point.abort()
                    raise
                result.keys_deleted, result.loaded_entries = loaded.keys_deleted, loaded.entries
                result.loaded_bytes = loaded.bytes
                result.restore_point = point.backup_id
                rebuild_catalog(admin, backup_root, structure, backup_keys=backup_keys)

        result.replay_to, result.restore_lrsn = plan.max_lrsn, plan.restore_lrsn
        result.log_ranges = log_ranges(log_dirs, replay_from, plan.max_lrsn)
        result.records_by_member = dict(plan.records_by_member)
        result.counts = _counts(plan)
        result.nonpersistent_lost = {"skipped by the backup": int(manifest.get("nonpersistent_skipped", 0)),
                                     "found in the CF": found_in_cf}
        result.in_doubt_uows = plan.in_doubt_uows()  # the same set the count of UOWs in doubt counts
        result.timings = timer.seconds()
        # With the worker processes' peaks added: they ran side by side with this process (each plan's workers
        # end with it, so the plans' own peaks do not add up).
        workers_peak = max((int(getattr(p, "worker_peak_bytes", 0) or 0) for p in plans), default=0)
        result.peak_rss_bytes = peak_rss_bytes() + workers_peak
        result.memory_limit = memory_limit
        result.partitions = int(getattr(plan, "partitions", 0) or 0)
        result.workers = min(int(getattr(chosen_engine, "workers", 0) or 0), result.partitions)
        if report_path is not None or not dry_run:
            path = report_path or default_report_path(backup_root, structure, started)
            result.report_path = str(path)
            write_report(result, path)
    finally:
        for p in plans:
            p.close()
    return result


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (getrusage: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def describe_start(manifest: Mapping[str, Any]) -> str:
    """Which start a restore used, in words (the report's `start`)."""
    if kind_of(manifest) == LOGS:
        p = manifest["relog_pass"]
        return (f"the logs alone, from LRSN {manifest['replay_from']}: the relog window of the newest complete relog "
                f"pass (by {manifest['relog_member']}, ended at LRSN {p['e']}, generation {p['gen']})")
    return f"{kind_of(manifest)} backup {manifest['id']}, replaying the logs from LRSN {manifest['replay_from']}"


def _refused(structure: str, e: bulk.NotOwnerError) -> RestoreError:
    if isinstance(e, bulk.CFReplacedError):
        return RestoreError(f"restore of {structure} refused: the CF was lost or replaced since this restore "
                            f"started ({e}); nothing was written: run the restore of {structure} again")
    return RestoreError(f"restore of {structure} refused: {e}; nothing was written")


def _refuse_if_changed(client: redis.Redis, structure: str, seen: bulk.Seen) -> None:
    """Refuse, writing nothing, when the structure is no longer as the restore saw it at its start."""
    why = bulk.changed_since(seen, bulk.observe(client, structure))
    if why is not None:
        raise _refused(structure, why)


@contextmanager
def _owning(client: redis.Redis, structure: str, seen: bulk.Seen) -> Iterator[bulk.Owner]:
    """The restore's claim on the structure (cfemu.bulk.claim) for the rest of the run, with what can end it in
    the operator's words: refused before anything was written, or stopped during the load."""
    try:
        owner = bulk.claim(client, structure, seen)
    except bulk.NotOwnerError as e:
        raise _refused(structure, e) from e
    try:
        yield owner
    except redis.exceptions.MaxConnectionsError:
        raise  # a bug in the use of the owner's one connection, not a lost CF
    except (bulk.CFReplacedError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        why = str(e) if isinstance(e, bulk.CFReplacedError) else "the connection to the CF broke"
        raise RestoreStoppedError(
            f"restore of {structure} stopped: the CF was lost or replaced during the restore ({why}); nothing "
            f"more was written: run the restore of {structure} again once the CF is back (a CF restarted empty "
            f"is restored from the start)", cf_lost=True) from e
    except bulk.NotOwnerError as e:
        raise RestoreStoppedError(f"restore of {structure} stopped: {e}; nothing more was written by this "
                                  f"restore", cf_lost=False) from e
    finally:
        owner.close()


def finished_points(backup_root: Path, structure: str, backup_keys: BackupKeys) -> set[str]:
    """The ids of the structure's restore and purge points that have their manifest (good or not): each one a
    restore or a purge that came to the end of its load."""
    return {b.id for b in list_backups(backup_root, structure, backup_keys=backup_keys)
            if (kind_of(b.manifest) if b.manifest else readable_kind(b.path)) in (RESTORE, PURGE)}


@contextmanager
def _failed_if_live(client: redis.Redis, structure: str, seen: bulk.Seen, what: str) -> Iterator[bulk.Seen]:
    """Entered just before the claim: a structure that was ACTIVE when the restore or purge started (--mark-failed)
    is failed first (fail.lua), if it is still the structure seen then; yields what the claim compares against. Its
    members write its header on every operation while it is ACTIVE, so the claim's guarded transaction, which
    watches the header, found it changed every time on a busy structure; once FAILED the members write nothing.
    Refused, writing nothing, when another restore or a purge took it over since."""
    if seen.state == "ACTIVE":
        why = CF(client).structure(structure).fail(token=seen.token, gen=seen.gen)
        if why is not None:
            raise RestoreError(f"{what} of {structure} refused: the structure changed since this {what} started "
                               f"({why}); nothing was written: run the {what} of {structure} again")
        seen = bulk.observe(client, structure)
    yield seen


@contextmanager
def _no_point_since(backup_root: Path, structure: str, seen: set[str], backup_keys: BackupKeys,
                    what: str) -> Iterator[None]:
    """Entered before the claim (a restore's under restore's own log's lock): refuse, writing nothing, when a
    restore or a purge finished its load since this `what` ("restore", "purge") started (`seen`: the finished
    points then). The claim cannot always tell: a CF lost again by a flush (the same server, its run id unchanged)
    holds nothing of the other's token, generation or state. A restore's plan starts before that point: loaded, it
    would bring back the structure as it was before the other (without the work committed on it since) in a
    generation below the other's. A purge would empty a structure restored since it chose to purge, where a restore
    completed since is refused, not emptied."""
    new = sorted(finished_points(backup_root, structure, backup_keys) - seen)
    if new:
        why = ("this one's plan does not start there" if what == "restore" else
               "this one would empty what that one made")
        raise RestoreError(f"{what} of {structure} refused: another restore or a purge wrote its restore point "
                           f"{new[-1]} since this one started, and {why}; nothing was written: run the {what} of "
                           f"{structure} again")
    yield


def _decisions_logged(log_root: Path) -> int:
    """How many records restore's own log holds (its RECOVERY decisions, of every restore so far)."""
    directory = log_root / RESTORE_MEMBER
    return sum(s.records for s in LogReader(directory).segments()) if directory.is_dir() else 0


class _restore_log:
    """Restore's own log, opened for writing: its writer lock also keeps a second restore out meanwhile. `seen`:
    how many records it held when this restore started, before it planned; if another restore has logged
    decisions since, this one's plan may not have read them, so it refuses."""

    def __init__(self, log_root: Path, structure: str, seen: int) -> None:
        self.directory = log_root / RESTORE_MEMBER
        self.log: RecordLog | None = None
        self.structure, self.seen, self.log_root = structure, seen, log_root

    def __enter__(self) -> RecordLog:
        try:
            self.log = RecordLog(self.directory, RESTORE_MEMBER)
        except LogLockedError as e:
            raise RestoreError(f"another restore is running ({e})") from None
        group = GroupRepository(self.log_root).id
        if group is not None:  # says whose decisions these are, as each member's log does (sqm.core.group_logs)
            try:
                self.log.stamp_group(group)
            except LogFormatError as e:
                self.log.close()
                raise RestoreError(f"restore of {self.structure} refused: {e}") from None
        now = _decisions_logged(self.log_root)
        if now != self.seen:
            self.log.close()
            raise RestoreError(f"restore of {self.structure} refused: another restore logged decisions in "
                               f"{self.directory} since this one started ({now - self.seen} records), which its "
                               f"plan may not have read; nothing was written: run the restore again")
        return self.log

    def __exit__(self, *exc: object) -> None:
        if self.log is not None:
            self.log.close()


def _group_of(admin: Admin, backup_root: Path, structure: str, lost: bool, backup_keys: BackupKeys) -> str:
    """The group's name for a restore point: the admin structure's, or when the CF lost it, the newest good
    backup's (a point of another group's name would be refused as foreign by the next restore)."""
    if not lost:
        return admin.group_name()
    newest = next((b for b in list_backups(backup_root, structure, backup_keys=backup_keys)
                   if b.state == OK and b.manifest), None)
    return str(newest.manifest["group"]) if newest is not None and newest.manifest else admin.group_name()


def run_purge(client: redis.Redis, structure: str, *, backup_root: Path, log_root: Path,
              mark_failed: bool = False, backup_keys: BackupKeys | None = None,
              seen: bulk.Seen | None = None, progress: Progress = no_progress) -> PurgeResult:
    """RECOVER CFSTRUCT TYPE(PURGE): discard every message, keep the definition and queues, a new generation
    (so every unit of work from before is backed out when it next touches the structure), state ACTIVE.
    The purge is a restore point (kind purge, empty) in the backup catalog, written before the structure is
    usable again: a later restore starts there and never brings the purged messages back.
    The definitions come from the CF, or from the group repository under log_root when the CF lost them.
    backup_keys sign the restore point (default: those this process's settings find; none: refused at once).
    seen: the structure as the caller saw it when it chose to purge (bulk.observe; default: as this call first
    sees it): a restore that completed since is refused, not emptied."""
    try:
        keys.check_name("structure", structure)
    except ValueError as e:
        raise RestoreError(str(e)) from None
    backup_root = Path(backup_root)
    backup_keys = resolve_keys(backup_keys)
    signing_key(backup_keys, "sign the purge's restore point with")  # before anything changes
    # Where its restore point goes, and the log root whose group repository holds the definitions a lost CF no
    # longer has: whoever else could write it could hand the purge definitions of their own.
    for directory in (backup_root, backup_root / structure, Path(log_root)):
        refuse_others_writing(directory)
    admin = Admin(client)
    repo = GroupRepository(log_root)
    # The finished points before the purge's own look at the structure (a caller's `seen`, a start mode's, is older:
    # a point written between the two is left to the claim's comparison)
    points_seen = finished_points(backup_root, structure, backup_keys)
    seen = seen if seen is not None else bulk.observe(client, structure)  # what the purge's claim compares against
    sdef, queues, lost = _definitions_without_backup(
        admin, repo, structure, " (a purge keeps a definition; restore it from a backup instead)")
    state = seen.state or "FAILED"  # a structure missing from the CF counts as FAILED (Admin.state)
    if state == "ACTIVE" and not mark_failed:
        raise RestoreError(f"structure {structure} is ACTIVE: purge it only once it has failed, or mark it "
                           f"failed first (--mark-failed)")
    refuse_missing_member_logs(admin, structure, "a purge", Path(log_root))
    group = _group_of(admin, backup_root, structure, lost, backup_keys)
    point = point_id(structure)

    def write_point(gen: int, tombstones: dict[str, str]) -> str:  # RECOVERING, before it is usable again
        write_restore_point(backup_root, point, kind=PURGE, group=group, sdef=sdef, queues=queues,
                            members=known_members(repo, {}, admin), gen=gen, lrsn=gen, replay_from=gen,
                            entries=(), tombstones=tombstones, backup_keys=backup_keys)
        return point

    with (_no_point_since(backup_root, structure, points_seen, backup_keys, "purge"),
          _failed_if_live(client, structure, seen, "purge") as claimed_seen):
        purged = purge_claimed(client, sdef, queues, group=group, lost=lost, log_root=Path(log_root),
                               backup_root=backup_root, backup_keys=backup_keys, seen=claimed_seen,
                               before_activate=write_point, progress=progress)
    rebuild_catalog(admin, backup_root, structure, backup_keys=backup_keys)
    return PurgeResult(structure, state, purged.discarded, purged.discarded_bytes, purged.gen, restore_point=point)
