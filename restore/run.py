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

run_purge() is RECOVER CFSTRUCT TYPE(PURGE): an empty structure, definitions kept, usable again.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from backup.catalog import OK, find_backup, list_backups
from backup.files import Backup, read_backup
from cfemu import bulk, keys
from cfemu.admin import Admin, AdminError, StructureDef
from restore.engine import PHASES, Progress, get_engine, no_progress
from restore.load import LoadResult, load_plan, restore_owned_uows
from restore.plan import RestorePlan
from restore.result import PurgeResult, RestoreResult, write_report
from sqm import records
from sqm.log import LogLockedError, LogReader, RecordLog, find_log_dirs

RESTORE_MEMBER = "_restore"  # restore's own log, beside the members' logs


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


def open_backup(backup_root: Path, structure: str, backup_id: str | None, group: str | None) -> Backup:
    """The named backup, or the latest good one of the structure; checked to be this structure's (and group's).
    Entry frames are checked as the engine reads them."""
    if backup_id is not None:
        return read_backup(find_backup(backup_root, backup_id), structure=structure, group=group)
    backups = list_backups(backup_root, structure)
    good = next((b for b in backups if b.state == OK), None)
    if good is None:
        why = "; ".join(f"{b.id} is {b.state}: {b.problem}" for b in backups[:3])
        raise RestoreError(f"no good backup of structure {structure} under {backup_root / structure}"
                           + (f" ({why})" if why else ""))
    return read_backup(good.path, structure=structure, group=group)


def member_log_dirs(log_root: Path, members: list[str], replay_from: int) -> list[Path]:
    """Every log under log_root; refuses when a member the backup names has none."""
    found = {d.name: d for d in find_log_dirs(log_root)}
    missing = [m for m in members if m not in found]
    if missing:
        raise RestoreError(f"no log for member{'s' if len(missing) > 1 else ''} {', '.join(missing)} under "
                           f"{log_root}: restore needs every member's log from LRSN {replay_from} on")
    return [found[name] for name in sorted(found)]


def log_ranges(log_dirs: list[Path], replay_from: int) -> dict[str, dict[str, Any]]:
    """Per member: its log directory and the LRSN range restore replays from it ("to" None: nothing to replay,
    the log ends before the replay range)."""
    out: dict[str, dict[str, Any]] = {}
    for d in log_dirs:
        reader = LogReader(d)
        top = max((s.max_lrsn for s in reader.segments() if s.max_lrsn is not None), default=None)
        out[reader.member] = {"dir": str(d), "from": replay_from,
                              "to": top if top is not None and top >= replay_from else None}
    return out


def _admin_definition(admin: Admin, structure: str) -> StructureDef | None:
    """The structure's definition, or None when the admin structure was lost with the CF."""
    try:
        return admin.structure_def(structure)
    except AdminError:
        return None


def _redefine(admin: Admin, manifest: dict[str, Any]) -> StructureDef:
    """The admin structure was lost with the CF: define the group, the structure and its queues again from the
    backup (the header says RECOVERING first, so that no queue manager uses the structure meanwhile)."""
    admin.set_group_name(manifest["group"])
    sd = manifest["structure_def"]
    bulk.mark_recovering(admin.redis, sd["name"])
    sdef = admin.define_structure(sd["name"], max_entries=int(sd.get("max_entries", 0)),
                                  max_bytes=int(sd.get("max_bytes", 0)), replace=True)
    for q in manifest["queues"]:
        admin.define_queue(q["name"], sdef.name, backout_threshold=int(q.get("backout_threshold", 0)),
                           backout_queue=q.get("backout_queue", ""),
                           max_msg_length=int(q.get("max_msg_length", 4 * 2**20)), replace=True)
    return sdef


def _log_decisions(log: RecordLog, plan: RestorePlan) -> int:
    """Restore's decisions (in-flight UOWs backed out) as forced RECOVERY records, before anything is loaded.
    Appended to the log directly, not through a queue manager: one force covers them all."""
    for uow, owner in sorted(plan.decisions.items()):
        log.append(records.recovery(uow, plan.restore_lrsn, {plan.structure: 0}, commit=False, of=owner,
                                    by="restore"))
    if plan.decisions:
        log.force()
    return len(plan.decisions)


def _counts(plan: RestorePlan) -> dict[str, int]:
    counts = Counter({k: v for k, v in plan.counts.items()})
    # UOWs restore backed out: decided now, or by an earlier run of this restore (its RECOVERY records)
    counts["uows in flight backed out"] = sum(1 for v in restore_owned_uows(plan).values() if v == "B")
    return dict(counts)


def default_report_path(backup_root: Path, structure: str, when: datetime) -> Path:
    return backup_root / structure / f"restore-{when:%Y%m%dT%H%M%S%fZ}.json"


def run_restore(client: redis.Redis, structure: str, *, backup_root: Path, log_root: Path,
                backup_id: str | None = None, engine: str = "local", dry_run: bool = False,
                mark_failed: bool = False, progress: Progress = no_progress, report_path: Path | None = None,
                now_ms: int | None = None, engine_options: dict[str, Any] | None = None) -> RestoreResult:
    """Restore `structure` (see the module doc). Raises RestoreError, backup.files.BackupError,
    sqm.log.LogCorruptError / LogFormatError, cfemu.admin.AdminError; nothing is changed when it raises before
    the load starts. The report is written (as JSON) to report_path, default
    <backup_root>/<structure>/restore-<timestamp>.json (a dry run writes one only when report_path is given)."""
    started = datetime.now(UTC)
    try:
        keys.check_name("structure", structure)
    except ValueError as e:
        raise RestoreError(str(e)) from None
    backup_root, log_root = Path(backup_root), Path(log_root)
    admin = Admin(client)
    seen = bulk.observe(client, structure)  # what the claim compares against, after the plan
    state = seen.state or "FAILED"  # a structure missing from the CF counts as FAILED (Admin.state)
    sdef = _admin_definition(admin, structure)
    if state == "ACTIVE" and not (mark_failed or dry_run):
        raise RestoreError(f"structure {structure} is ACTIVE: restore works on a FAILED structure; mark it "
                           f"failed first (--mark-failed) if you mean to replace its content")
    chosen_engine = get_engine(engine, **(engine_options or {}))
    backup = open_backup(backup_root, structure, backup_id,
                         group=admin.group_name() if sdef is not None else None)
    manifest = backup.manifest
    replay_from = int(manifest["replay_from"])
    log_dirs = member_log_dirs(log_root, list(manifest["members"]), replay_from)
    decisions_seen = _decisions_logged(log_root)  # before the plan reads them: compared under the log's lock
    timer = PhaseTimer(progress)
    now = now_ms if now_ms is not None else time.time_ns() // 1_000_000

    def make_plan() -> RestorePlan:
        return chosen_engine.plan(structure, backup, log_dirs, replay_from, now, timer)

    result = RestoreResult(structure, backup.id, str(backup.path), chosen_engine.name, dry_run, state,
                           replay_from=replay_from, started_at=started.isoformat(timespec="seconds"))
    plan = make_plan()  # reads everything: a bad backup or log is refused here, before any change
    found_in_cf = 0
    if not dry_run:
        _refuse_if_changed(client, structure, seen)  # the common case, before restore's log is even opened
        with _restore_log(log_root, structure, decisions_seen) as rlog, _owning(client, structure, seen) as owner:
            owned = Admin(owner.client)  # the owner's connection: it never reconnects to another CF
            if state == "ACTIVE":
                plan = make_plan()  # again: members may have logged more before the claim stopped them
            if seen.state:
                found_in_cf = bulk.count_nonpersistent(owner.client, structure)
            if sdef is None:
                sdef = _redefine(owned, manifest)
            result.decisions_logged = _log_decisions(rlog, plan)
            queues = sorted({q["name"] for q in manifest["queues"]}
                            | {q.name for q in owned.queues() if q.structure == structure})
            loaded: LoadResult = load_plan(owner, plan, sdef, queues, progress=timer, restored_from=backup.id)
            result.keys_deleted, result.loaded_entries = loaded.keys_deleted, loaded.entries
            result.loaded_bytes = loaded.bytes

    result.replay_to, result.restore_lrsn = plan.max_lrsn, plan.restore_lrsn
    result.log_ranges = log_ranges(log_dirs, replay_from)
    result.records_by_member = dict(plan.records_by_member)
    result.counts = _counts(plan)
    result.nonpersistent_lost = {"skipped by the backup": int(manifest.get("nonpersistent_skipped", 0)),
                                 "found in the CF": found_in_cf}
    result.in_doubt_uows = plan.in_doubt_uows()  # the same set the count of UOWs in doubt counts
    result.timings = timer.seconds()
    if report_path is not None or not dry_run:
        path = report_path or default_report_path(backup_root, structure, started)
        result.report_path = str(path)
        write_report(result, path)
    return result


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


def run_purge(client: redis.Redis, structure: str, *, mark_failed: bool = False) -> PurgeResult:
    """RECOVER CFSTRUCT TYPE(PURGE): discard every message, keep the definition and queues, a new generation
    (so every unit of work from before is backed out when it next touches the structure), state ACTIVE."""
    try:
        keys.check_name("structure", structure)
    except ValueError as e:
        raise RestoreError(str(e)) from None
    admin = Admin(client)
    sdef = _admin_definition(admin, structure)
    if sdef is None:
        raise RestoreError(f"structure {structure} is not defined (a purge keeps a definition; restore it from "
                           f"a backup instead)")
    state = admin.state(structure)
    if state == "ACTIVE" and not mark_failed:
        raise RestoreError(f"structure {structure} is ACTIVE: purge it only once it has failed, or mark it "
                           f"failed first (--mark-failed)")
    queues = [q.name for q in admin.queues() if q.structure == structure]
    purged = bulk.purge(client, sdef, queues)
    return PurgeResult(structure, state, purged.discarded, purged.discarded_bytes, purged.gen)
