"""BACKUP CFSTRUCT: a fuzzy backup of one CF structure while the queue-sharing group keeps working.

run_backup() checks the structure, marks the backup running in the CF (which sets the recovery floor), copies the
persistent entries in the patent's order (backup.protocol.STEPS), streaming each copy into the entry files as it
is fetched, ends the backup in the CF, counts the exception records the group wrote meanwhile, writes the manifest
(last, atomically) and records the backup in the admin catalog.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from backup.catalog import OK, list_backups
from backup.files import BackupError, BackupWriter, new_backup_id, resolve_keys, signing_key
from backup.pacing import Pacer, probe_commands
from backup.points import FUZZY, kind_of
from backup.protocol import STEPS, StepCount, Wire, copy_step_raw
from cfemu import bulk
from cfemu.admin import Admin, AdminError
from cfemu.cf import CF
from cfemu.credentials import BackupKeys
from cfemu.errors import StructureFailedError
from cfemu.progress import Progress, no_progress
from cfemu.settings import DEFAULT_BACKUP_SHARE
from sqm.core.clock import LrsnClock
from sqm.core.records import lookup
from sqm.log import LogReader, find_log_dirs


class StructureNotReadyError(BackupError):
    """The structure is not defined, or not ACTIVE (a failed structure has nothing to back up)."""


# Called before each copy step starts: (step number 1-5, state); tests use it to act between steps.
StepHook = Callable[[int, str], None]

DEFAULT_BATCH = 500


def count_exception_records(log_root: Path, structure: str, start_lrsn: int, end_lrsn: int) -> int:
    """BACKOUT / RECOVERY records carrying the data of this structure's gets ("dd"), written by any member of
    the group between the backup's start and end: the only log records the backup caused (the patent's
    exception). Those records are forced, so they are on disk by the time the backup ends."""
    n = 0
    for directory in find_log_dirs(log_root):
        for _, rec in LogReader(directory).records(min_lrsn=start_lrsn):
            if (lookup(rec).carries_data and rec.get("dd") and start_lrsn <= rec["l"] <= end_lrsn
                    and any(d[0] == structure for d in rec["dd"])):
                n += 1
    return n


def catalog_entry(manifest: dict[str, Any], path: Path) -> dict[str, Any]:
    """The summary the admin structure keeps for each good backup (the directory holds the full record)."""
    fields = ("id", "structure", "group", "start_lrsn", "floor_lrsn", "replay_from", "end_lrsn", "started_at",
              "ended_at", "entries", "bytes", "exception_records")
    # gen: log retention (sqm.core.retention) compares it with a relog pass's, as restore's choice of start does.
    return {**{k: manifest[k] for k in fields}, "gen": int(manifest.get("gen", 0) or 0), "kind": kind_of(manifest),
            "path": str(path)}


def rebuild_catalog(admin: Admin, backup_root: Path, structure: str, *,
                    backup_keys: BackupKeys | None = None) -> int:
    """The admin structure's copy of the catalog, from the good backups on disk (restore and purge points
    included): after a CF loss the CF's copy is gone, and `cfemu status` would say "last backup: never".
    Returns how many backups it lists."""
    good = [b for b in list_backups(backup_root, structure, backup_keys=backup_keys)
            if b.state == OK and b.manifest is not None]
    for b in good:
        assert b.manifest is not None
        admin.record_backup(structure, catalog_entry(b.manifest, b.path))
    return len(good)


def _iso(t: datetime) -> str:
    return t.isoformat(timespec="microseconds")


END_FAILED_RETRY_S = 10.0  # how long a failed backup keeps trying to clear its mark while the CF does not answer


def _end_failed(s: Any, backup_id: str, clock: LrsnClock) -> None:
    """Clear a failed backup's mark. A CF that did not answer (a duplexed CF promoting its copy takes a fraction of
    a second; a link cut) is asked again for a while: a mark left behind on a CF that kept its data refused every
    later backup of the structure (BACKUPRUNNING). A CF that answers with a refusal (the structure gone with a
    lost CF: no mark either) is not asked again."""
    deadline = time.monotonic() + END_FAILED_RETRY_S
    while True:
        try:
            s.backup_end(backup_id, clock.now(), ok=False)
            return
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            if time.monotonic() >= deadline:
                return
            time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the backup's own failure is what the caller reports
            return


def run_backup(client: redis.Redis, structure: str, backup_root: Path, *, log_root: Path | None = None,
               exclint_s: int = 0, progress: Progress = no_progress, batch: int = DEFAULT_BATCH,
               on_step: StepHook | None = None, backup_keys: BackupKeys | None = None,
               share: float = DEFAULT_BACKUP_SHARE) -> dict[str, Any]:
    """Back up `structure` into backup_root/<structure>/<id>/; returns the manifest.

    exclint_s (MQ's EXCLINT): leave out entries put less than this many seconds before the backup started; the
    manifest's replay_from is lowered to the lowest put LRSN among them, so restore replays their history.
    log_root: where the members' logs are; when given, the manifest counts the exception records.
    progress(phase, done, total): one phase per copy step ("1 <label>" .. "5 <label>"), counting its snapshot.
    backup_keys: the group's backup keys (default: those this process's settings find); the manifest is signed
    with the current one, and without one the backup is refused before it starts (backup.files.NoBackupKeyError).
    share: the share of the time the backup works while the CF serves the group's work (backup.pacing; 1: it
    never pauses); on an idle CF it runs at full speed whatever the share.
    Raises StructureNotReadyError (also for a structure running from a WARM start: docs/pstore.md),
    cfemu.errors.BackupRunningError (a backup of the structure is running), or
    whatever the CF or the file system raise; a failed backup is ended as failed and leaves no directory.
    """
    if exclint_s < 0:
        raise ValueError(f"EXCLINT must be >= 0 seconds, not {exclint_s}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1 entry, not {batch}")
    if not 0 < share <= 1:
        raise ValueError(f"the backup's share must be above 0 and at most 1, not {share}")
    backup_keys = resolve_keys(backup_keys)
    signing_key(backup_keys)  # no key, no backup: refused before the CF is touched
    admin = Admin(client)
    try:
        sdef = admin.structure_def(structure)
    except AdminError as e:
        raise StructureNotReadyError(str(e)) from None
    state = admin.state(structure)
    if state != "ACTIVE":
        raise StructureNotReadyError(f"structure {structure} is {state}; only an ACTIVE structure can be backed up")
    s = CF(client).structure(structure)
    group = admin.group_name()
    members = sorted(admin.members())
    queues = [asdict(q) for q in admin.queues() if q.structure == structure]

    clock = LrsnClock()
    started_at = datetime.now(UTC)
    backup_id = new_backup_id(structure, started_at)
    try:
        start_lrsn, floor_lrsn = s.backup_begin(backup_id, clock.now())
    except StructureFailedError as e:  # no longer ACTIVE, or running from a WARM start (backup_begin.lua)
        raise StructureNotReadyError(str(e)) from None
    clock.observe(start_lrsn)
    t0 = time.monotonic()
    cutoff_ms = int(started_at.timestamp() * 1000) - exclint_s * 1000
    lowest_excluded = [floor_lrsn]

    def old_enough(wire: Wire) -> bool:
        if wire["pt"] <= cutoff_ms:
            return True
        lowest_excluded[0] = min(lowest_excluded[0], wire["o2"])  # its put LRSN: replay from there
        return False

    pacer = Pacer(probe_commands(client, structure), share)
    writer: BackupWriter | None = None
    ended = False
    counts: list[StepCount] = []
    try:
        writer = BackupWriter(Path(backup_root) / structure / backup_id, backup_keys=backup_keys)
        for number, (state_name, label) in enumerate(STEPS, start=1):
            if on_step is not None:
                on_step(number, state_name)
            count = StepCount()
            counts.append(count)
            phase = f"{number} {label}"
            progress(phase, 0, None)  # the snapshot, and so the total, is taken when the step's copy starts
            # Each copy's descriptor goes into its frame as the CF's bytes: decoded only when its persistence
            # is not plain at sight, or for EXCLINT (backup.protocol.select_raw).
            pacer.new_step()
            for copies in copy_step_raw(s, state_name, count, batch, keep=old_enough if exclint_s else None,
                                        before_read=pacer.before_read, depth=pacer.reads_in_flight):
                writer.add_raw(number, copies)
                progress(phase, count.copied + count.skipped_nonpersistent + count.vanished + count.excluded,
                         count.snapshot)
            progress(phase, count.snapshot, count.snapshot)
        # The tombstones (outcomes decided for owners that may still retry) are part of the structure's state
        # as a restore from this backup must rebuild it: the decisions behind them may lie before its replay.
        tombstones = bulk.tombstones(client, structure)
        # So are the UOWs it holds a record of: an in-doubt UOW registered without entries (its work here was
        # non-persistent) is known to a restore from this backup only by its records, of an older generation.
        uows = bulk.registered(client, structure)
        end_lrsn = s.backup_end(backup_id, clock.now(), ok=True)
        ended = True
        steps = [{"step": n, "state": st, "label": label, **asdict(c)}
                 for n, ((st, label), c) in enumerate(zip(STEPS, counts), start=1)]
        manifest = writer.finish({
            "id": backup_id, "kind": FUZZY, "group": group, "structure": structure, "structure_def": asdict(sdef),
            "queues": queues, "members": members, "gen": int(s.info().get("gen", 0)),
            "start_lrsn": start_lrsn, "floor_lrsn": floor_lrsn, "replay_from": lowest_excluded[0],
            "end_lrsn": end_lrsn, "started_at": _iso(started_at), "ended_at": _iso(datetime.now(UTC)),
            "elapsed_s": round(time.monotonic() - t0, 3), "exclint_s": exclint_s, "steps": steps,
            "entries": sum(c.copied for c in counts), "bytes": sum(c.bytes for c in counts),
            "nonpersistent_skipped": sum(c.skipped_nonpersistent for c in counts),
            "excluded": sum(c.excluded for c in counts),
            "exception_records": (count_exception_records(log_root, structure, start_lrsn, end_lrsn)
                                  if log_root is not None else None),
            "tombstones": tombstones, "uows": uows,
            "pacing": {"share": share, "pauses": pacer.stats.paused, "paused_s": round(pacer.stats.pause_s, 3)},
        })
    except BaseException:
        if not ended:
            _end_failed(s, backup_id, clock)
        if writer is not None:
            writer.abort()
        raise
    admin.record_backup(structure, catalog_entry(manifest, writer.directory))
    return manifest
