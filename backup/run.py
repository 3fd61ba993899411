"""BACKUP CFSTRUCT: a fuzzy backup of one CF structure while the queue-sharing group keeps working.

run_backup() checks the structure, marks the backup running in the CF (which sets the recovery floor), copies the
persistent entries in the patent's order (backup.protocol.STEPS), streaming each copy into the entry files as it
is fetched, ends the backup in the CF, counts the exception records the group wrote meanwhile, writes the manifest
(last, atomically) and records the backup in the admin catalog.

The mark never outlives its backup. It carries a lease in the CF's time (backup_begin.lua) that a thread of the
backup renews every LEASE_RENEW_SHARE of it (_Lease); a backup that died without a word (SIGKILL, a lost machine)
leaves a stale mark that the next backup takes over and every reader ignores. Every other way out of run_backup
(an error of any kind, the CF busy or refusing included, KeyboardInterrupt, SIGTERM as cfbackup turns it into
BackupTerminated) ends the backup as failed in the CF before it returns. A backup whose mark was cancelled
(cfbackup cancel) or taken over learns it at its next renewal and fails with BackupCancelledError, leaving no
directory.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import redis

from backup.catalog import OK, list_backups
from backup.files import BackupError, BackupWriter, new_backup_id, resolve_keys, signing_key
from backup.pacing import Pacer, probe_commands
from backup.points import FUZZY, kind_of
from backup.protocol import STEPS, StepCount, Wire, copy_step
from cfemu import bulk
from cfemu.admin import Admin, AdminError
from cfemu.cf import CF, Structure
from cfemu.credentials import BackupKeys
from cfemu.durable import disk_full_named
from cfemu.errors import BackupEndedError, BackupRunningError, MQError, StructureFailedError
from cfemu.private_files import refuse_others_writing
from cfemu.progress import Progress, no_progress
from cfemu.settings import DEFAULT_BACKUP_SHARE
from sqm.core.clock import LrsnClock
from sqm.core.records import lookup
from sqm.log import LogReader, find_log_dirs

log = logging.getLogger("backup.run")


class StructureNotReadyError(BackupError):
    """The structure is not defined, or not ACTIVE (a failed structure has nothing to back up)."""


class BackupCancelledError(BackupError):
    """The backup's mark is no longer its own (cfbackup cancel, or a later backup took over its stale mark), or its
    lease ended before it finished: it failed, and left nothing."""


class BackupTerminated(BaseException):  # noqa: N818 - a way out, as KeyboardInterrupt is, not an error
    """Raised in the main thread by cfbackup's SIGTERM handler: the backup ends as failed and leaves nothing."""


DEFAULT_LEASE_S = 30.0  # the backup mark's lease: a backup that died without a word blocks the next for this long
LEASE_RENEW_SHARE = 0.2  # renewed every fifth of the lease: four renewals in a row may fail before it ends
LEASE_RETRY_S = 1.0  # a renewal that failed (the CF busy or not answering) is tried again this soon


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


END_FAILED_RETRY_S = 10.0  # how long a failed backup keeps trying to clear its mark while the CF cannot do it


def _end_failed(s: Structure, backup_id: str, clock: LrsnClock) -> None:
    """Clear a failed backup's mark. A CF that could not do it (not answering: a duplexed CF promoting its copy, a
    cut link; answering BUSY while a long script runs, LOADING, READONLY) is asked again for a while; after that
    the mark's lease ends it. A CF that refused (the mark is not this backup's: cancelled, taken over, or gone with
    a lost CF) is not asked again."""
    deadline = time.monotonic() + END_FAILED_RETRY_S
    while True:
        try:
            s.backup_end(backup_id, clock.now(), ok=False)
            return
        except MQError:  # the script answered: nothing of this backup's to clear
            return
        except Exception as e:  # noqa: BLE001 - the backup's own failure is what the caller reports
            if time.monotonic() >= deadline:
                log.warning("backup %s: could not clear its mark (%s); its lease ends it", backup_id, e)
                return
            time.sleep(0.2)


def _withdraw(s: Structure, backup_id: str, previous: str) -> None:
    """Set the header's last_backup back from a backup that ended ok and could not be kept (backup_withdraw.lua);
    a CF that cannot be asked leaves it naming the backup, which status then shows missing."""
    try:
        s.backup_withdraw(backup_id, previous)
    except Exception as e:  # noqa: BLE001 - the backup's own failure is what the caller reports
        log.warning("backup %s: ended in the CF and could not be kept; its header still names it (%s)",
                    backup_id, e)


class _Lease:
    """Renews a running backup's lease from a thread, and records why when its mark is no longer its own."""

    def __init__(self, s: Structure, backup_id: str, lease_s: float) -> None:
        self.s, self.backup_id = s, backup_id
        self.lease_ms = max(1, int(lease_s * 1000))
        self.every_s = lease_s * LEASE_RENEW_SHARE
        self.lost = ""  # why the mark is no longer this backup's ("" while it is)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"backup-lease-{backup_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        wait = self.every_s
        while not self._stop.wait(wait):
            try:
                self.s.backup_renew(self.backup_id, lease_ms=self.lease_ms)
                wait = self.every_s
            except BackupEndedError as e:
                self.lost = str(e)
                return
            except Exception as e:  # noqa: BLE001 - the CF busy or not answering: the lease leaves time to retry
                log.warning("backup %s: renewing its lease failed (%s); trying again", self.backup_id, e)
                wait = min(LEASE_RETRY_S, self.every_s)

    def check(self) -> None:
        """Raise BackupCancelledError once a renewal was refused."""
        if self.lost:
            raise ended_before_it_finished(self.backup_id, self.lost)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)  # a renewal waiting on a CF that does not answer is left to its timeout


def ended_before_it_finished(backup_id: str, why: str) -> BackupCancelledError:
    """The one error of a backup whose mark was taken from it (cancelled, its lease ended, or a restore or a purge
    claimed the structure), whether a renewal or its end found out: the operator reads the same cause either way."""
    return BackupCancelledError(f"backup {backup_id} ended before it finished: {why} (cancelled with cfbackup "
                                "cancel, its lease ended, or a restore or a purge took the structure over); nothing "
                                "was kept")


DEFAULT_WAIT_S = 120.0  # how long an operator's backup waits for one running (cfbackup run --wait)
WAIT_PHASE = "waiting for backup"  # the progress phase of a wait for another backup (its id follows)
WAIT_POLL_S = 0.25


def wait_for_running_backup(s: Structure, wait_s: float, progress: Progress = no_progress) -> str | None:
    """Wait, at most wait_s seconds, until no backup of the structure runs (no mark, or a stale one: its backup
    cannot end well). Returns None once none runs, else the id of the backup still running after wait_s. Progress:
    phase "waiting for backup <id>", counting whole seconds of the wait out of wait_s."""
    t0 = time.monotonic()
    said = ""
    while True:
        mark = s.backup_mark()
        running = mark.backup if mark is not None and not mark.stale else None
        waited = time.monotonic() - t0
        if running is None:
            if said:
                progress(said, int(wait_s), int(wait_s))
            return None
        if waited >= wait_s:
            return running
        if said != f"{WAIT_PHASE} {running}":
            said = f"{WAIT_PHASE} {running}"
            log.info("backup %s of %s is running: waiting for it to end (at most %gs)", running, s.name, wait_s)
        progress(said, int(waited), int(wait_s))
        time.sleep(min(WAIT_POLL_S, max(0.0, wait_s - waited)))


T = TypeVar("T")


def when_no_backup_runs(s: Structure, wait_s: float, progress: Progress, attempt: Callable[[], T],
                        refused: type[Exception], still_running: Callable[[str], Exception]) -> T:
    """attempt(), once no backup of the structure runs: each wait at most what is left of wait_s (0: attempt at
    once, its refusal raised as it is). An attempt refused because another backup began between the wait and it
    (refused) is made again after another wait, until wait_s has passed; still_running(id) is the error when a
    backup is still running at the end of the wait."""
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        if wait_s > 0:
            running = wait_for_running_backup(s, max(0.0, deadline - time.monotonic()), progress)
            if running is not None:
                raise still_running(running)
        try:
            return attempt()
        except refused:
            if time.monotonic() >= deadline:
                raise


def run_backup(client: redis.Redis, structure: str, backup_root: Path, *, log_root: Path | None = None,
               exclint_s: int = 0, progress: Progress = no_progress, batch: int = DEFAULT_BATCH,
               on_step: StepHook | None = None, backup_keys: BackupKeys | None = None,
               share: float = DEFAULT_BACKUP_SHARE, lease_s: float = DEFAULT_LEASE_S,
               wait_s: float = 0.0) -> dict[str, Any]:
    """Back up `structure` into backup_root/<structure>/<id>/; returns the manifest.

    wait_s: while another backup of the structure runs (a scheduler's), wait for it to end, at most this long
    (progress: wait_for_running_backup), then begin; 0 refuses at once with BackupRunningError, as does a wait that
    ran out. The rest of the arguments are _run_backup's."""
    if not 0 <= wait_s < math.inf:  # NaN too: it compares with nothing, and the wait would never end
        raise ValueError(f"the wait for another backup must be 0 seconds or more, and finite, not {wait_s}")
    with disk_full_named(backup_root / structure, "the backup was not kept (its files removed, its mark cleared)"):
        return _when_no_backup_runs(client, structure, backup_root, log_root=log_root, exclint_s=exclint_s,
                                    progress=progress, batch=batch, on_step=on_step, backup_keys=backup_keys,
                                    share=share, lease_s=lease_s, wait_s=wait_s)


def _when_no_backup_runs(client: redis.Redis, structure: str, backup_root: Path, *, log_root: Path | None,
                         exclint_s: int, progress: Progress, batch: int, on_step: StepHook | None,
                         backup_keys: BackupKeys | None, share: float, lease_s: float,
                         wait_s: float) -> dict[str, Any]:
    return when_no_backup_runs(
        CF(client).structure(structure), wait_s, progress,
        lambda: _run_backup(client, structure, backup_root, log_root=log_root, exclint_s=exclint_s,
                            progress=progress, batch=batch, on_step=on_step, backup_keys=backup_keys, share=share,
                            lease_s=lease_s),
        BackupRunningError,
        lambda running: BackupRunningError(f"backup {running} of {structure} is still running after waiting "
                                           f"{wait_s:g}s for it: try again once it has ended"))


def _run_backup(client: redis.Redis, structure: str, backup_root: Path, *, log_root: Path | None,
                exclint_s: int, progress: Progress, batch: int, on_step: StepHook | None,
                backup_keys: BackupKeys | None, share: float, lease_s: float) -> dict[str, Any]:
    """One attempt at the backup.

    exclint_s (MQ's EXCLINT): leave out entries put less than this many seconds before the backup started; the
    manifest's replay_from is lowered to the lowest put LRSN among them, so restore replays their history.
    log_root: where the members' logs are; when given, the manifest counts the exception records.
    progress(phase, done, total): one phase per copy step ("1 <label>" .. "5 <label>"), counting its snapshot.
    backup_keys: the group's backup keys (default: those this process's settings find); the manifest is signed
    with the current one, and without one the backup is refused before it starts (backup.files.NoBackupKeyError).
    share: the share of the time the backup works while the CF serves the group's work (backup.pacing; 1: it
    never pauses); on an idle CF it runs at full speed whatever the share.
    lease_s: the mark's lease (see the module doc); a backup that takes over a stale mark logs it and names it in
    its manifest (took_over).
    Raises StructureNotReadyError (also for a structure running from a WARM start: docs/pstore.md),
    cfemu.errors.BackupRunningError (a backup of the structure is running), BackupCancelledError (its mark was
    cancelled or taken over meanwhile), cfemu.private_files.UnsafeDirectoryError (a backup directory others can
    write), or whatever the CF or the file system raise; a failed backup is ended as failed and leaves no
    directory.
    """
    if exclint_s < 0:
        raise ValueError(f"EXCLINT must be >= 0 seconds, not {exclint_s}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1 entry, not {batch}")
    if not 0 < share <= 1:
        raise ValueError(f"the backup's share must be above 0 and at most 1, not {share}")
    if not 0 < lease_s < math.inf:
        raise ValueError(f"the backup's lease must be above 0 seconds, and finite, not {lease_s}")
    backup_keys = resolve_keys(backup_keys)
    signing_key(backup_keys)  # no key, no backup: refused before the CF is touched
    for directory in (Path(backup_root), Path(backup_root) / structure):  # nor where others can write
        refuse_others_writing(directory)
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
    cutoff_ms = int(started_at.timestamp() * 1000) - exclint_s * 1000
    writer: BackupWriter | None = None
    lease: _Lease | None = None
    ended = False
    previous = ""  # the header's last_backup before this backup ends
    counts: list[StepCount] = []
    # From here on every way out ends the backup as failed in the CF: a reply lost after the mark was set
    # included (ending a backup whose mark is not there is refused and changes nothing).
    try:
        try:
            begun = s.backup_begin(backup_id, clock.now(), lease_ms=max(1, int(lease_s * 1000)))
        except StructureFailedError as e:  # no longer ACTIVE, or running from a WARM start (backup_begin.lua)
            raise StructureNotReadyError(str(e)) from None
        start_lrsn, floor_lrsn = begun.start, begun.floor
        lease = _Lease(s, backup_id, lease_s)
        lease.start()
        if begun.took_over:
            log.warning("backup %s of %s took over the stale mark of backup %s (its lease had ended: that backup "
                        "died or stalled)", backup_id, structure, begun.took_over)
        clock.observe(start_lrsn)
        t0 = time.monotonic()
        lowest_excluded = [floor_lrsn]

        def old_enough(wire: Wire) -> bool:
            if wire["pt"] <= cutoff_ms:
                return True
            lowest_excluded[0] = min(lowest_excluded[0], wire["o2"])  # its put LRSN: replay from there
            return False

        pacer = Pacer(probe_commands(client, structure), share)
        writer = BackupWriter(Path(backup_root) / structure / backup_id, backup_keys=backup_keys)
        for number, (state_name, label) in enumerate(STEPS, start=1):
            if on_step is not None:
                on_step(number, state_name)
            lease.check()
            count = StepCount()
            counts.append(count)
            phase = f"{number} {label}"
            progress(phase, 0, None)  # the snapshot, and so the total, is taken when the step's copy starts
            step_t0 = time.monotonic()
            # Each copy's descriptor goes into its frame as the CF's bytes: decoded only when its persistence
            # is not plain at sight, or for EXCLINT (backup.protocol.select_raw).
            pacer.new_step()
            for _ in copy_step(writer, number, s, state_name, count, partial(pacer.batch_size, batch),
                               keep=old_enough if exclint_s else None,
                               before_read=pacer.before_read, depth=pacer.reads_in_flight):
                lease.check()
                progress(phase, count.copied + count.skipped_nonpersistent + count.vanished + count.excluded,
                         count.snapshot)
            progress(phase, count.snapshot, count.snapshot)
            count.seconds = round(time.monotonic() - step_t0, 6)
        # The tombstones (outcomes decided for owners that may still retry) are part of the structure's state
        # as a restore from this backup must rebuild it: the decisions behind them may lie before its replay.
        tombstones = bulk.tombstones(client, structure)
        # So are the UOWs it holds a record of: an in-doubt UOW registered without entries (its work here was
        # non-persistent) is known to a restore from this backup only by its records, of an older generation.
        uows = bulk.registered(client, structure)
        # The entry files on disk before the CF is told the backup ended well (its header's last_backup): a write
        # or fsync that fails here ends the backup as failed, with nothing kept.
        writer.close_files()
        previous = str(s.info().get("last_backup", ""))  # what last_backup names again if this one is withdrawn
        lease.check()
        try:  # refused unless the mark is still this backup's and its lease runs (backup_end.lua)
            end_lrsn = s.backup_end(backup_id, clock.now(), ok=True)
        except BackupEndedError as e:
            raise ended_before_it_finished(backup_id, str(e)) from None
        ended = True
        lease.stop()
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
            **({"took_over": begun.took_over} if begun.took_over else {}),
        })
    except BaseException:
        try:
            if lease is not None:
                lease.stop()
            if not ended:
                _end_failed(s, backup_id, clock)
            else:  # ended ok in the CF, and its manifest could not be written: not the last backup after all
                _withdraw(s, backup_id, previous)
        finally:
            if writer is not None:
                writer.abort()
        raise
    admin.record_backup(structure, catalog_entry(manifest, writer.directory))
    return manifest
