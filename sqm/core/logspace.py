"""A queue manager's log space: checkpoints (with the relog passes they complete, sqm.core.relog), what recovery
still needs of the log after each (sqm.core.retention), archiving or releasing what it no longer needs, and the
circular log's reserve (docs/log-management.md). Part of sqm.core.manager.QueueManager (a mixin: the methods run on
the queue manager's own state)."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from cfemu.admin import Admin
from cfemu.cf import Caller, Structure
from cfemu.errors import ResourceProblemError
from sqm.core import records, relog
from sqm.core.clock import LrsnClock
from sqm.core.config import CIRCULAR, LINEAR, QueueManagerConfig
from sqm.core.failpoints import failpoint
from sqm.core.retention import Retention, member_retention
from sqm.core.uow import UnitOfWork
from sqm.log import LogCorruptError, LogFormatError, RecordLog

log = logging.getLogger("sqm")


class LogSpace:
    """Checkpoints and log space: checkpoint, manage_log, ensure_log_space, log_reserve, archive_dir."""

    name: str
    config: QueueManagerConfig
    admin: Admin
    caller: Caller
    clock: LrsnClock
    log: RecordLog | None
    uows: dict[str, UnitOfWork]
    uow_lock: threading.RLock
    counters: dict[str, int]
    activity: int  # log records since the last checkpoint (LOGLOAD counts them)
    last_checkpoint_at: float
    # The last complete relog pass of each structure this member relogged (sqm.core.relog), carried forward in
    # every checkpoint record: restore finds the newest window in the members' last checkpoints.
    relog_passes: dict[str, dict[str, Any]]
    retention: Retention | None  # what recovery needed of the log at the last checkpoint
    backups_noted: dict[str, dict[str, Any]]  # the last BACKUP record of each structure (sqm.core.backupnote)
    log_space_low: str  # why log space is low while it is (said once per episode: say_log_space), else ""
    _checkpointing: threading.Lock

    if TYPE_CHECKING:  # the queue manager's own (sqm.core.manager)
        @property
        def log_dir(self) -> Path: ...
        def log_failure(self, e: OSError) -> NoReturn: ...
        def refuse_if_log_failed(self) -> None: ...
        def cf_call(self, fn: Callable[[], Any]) -> Any: ...
        def structure(self, name: str) -> Structure: ...

    def checkpoint(self, why: str) -> None:
        """A checkpoint record carries the active UOW table, so restart reads the log from here on, and completes
        the relog passes taken before it (sqm.core.relog: their windows and CPLs). One checkpoint at a time: a LOGLOAD
        checkpoint that finds another running leaves it to that one."""
        if self.log is None:
            return
        if not self._checkpointing.acquire(blocking=why != "logload"):
            return
        try:
            passes = relog.begin_passes(self, why)
            failpoint("relog-before-checkpoint")
            with self.uow_lock:
                uows = {u.id: u.snapshot() for u in self.uows.values() if u.persistent}
                n, self.activity = self.activity, 0
                lrsn = self.clock.now()
                for p in passes:
                    p.complete(lrsn, self.config.cpl_entries, termination=why == "shutdown")
                    self.relog_passes[p.structure] = p.as_record()
                try:
                    self.log.checkpoint(records.checkpoint(lrsn, uows=uows, n=n, why=why, passes=self.relog_passes,
                                                       backups=self.backups_noted))
                except OSError as e:
                    self.log_failure(e)
            relog.finish(self, passes)
            self.last_checkpoint_at = time.monotonic()
            self.manage_log()
        finally:
            self._checkpointing.release()

    @property
    def archive_dir(self) -> Path:
        root = self.config.log_archive_dir
        return Path(root) / self.name if root is not None else self.log_dir / "archive"

    def manage_log(self) -> Retention | None:
        """After a checkpoint: what recovery still needs of this member's log (sqm.core.retention); the segments wholly
        before it are inactive: linear logging archives them, circular logging releases them for reuse."""
        if self.log is None:
            return None
        ret = self.retention = member_retention(self)
        below = ret.inactive_below(self.log.segments())
        if self.config.log_mode == CIRCULAR:
            self.log.release_below(below)
            return ret
        try:
            moved = self.log.archive(below, self.archive_dir)
        except (OSError, LogFormatError, LogCorruptError) as e:  # the segments stay in the active log: nothing is lost
            log.warning("%s: archiving the inactive log segments failed (%s); they stay in the active log",
                        self.name, e)
            return ret
        if moved:
            log.info("%s: archived log segments %s to %s (recovery needs the log from LRSN %d on)", self.name,
                     ", ".join(str(m.segment) for m in moved), self.archive_dir, ret.lrsn)
            self.counters["segments_archived"] = self.counters.get("segments_archived", 0) + len(moved)
        try:  # the sealed active segments' copies, for media recovery (sqm.log.mediacopy)
            self.log.copy_sealed(self.archive_dir)
        except (OSError, LogFormatError, LogCorruptError) as e:  # corrupt: the segment is damaged already
            log.warning("%s: copying the sealed log segments to the archive failed (%s): a damaged one cannot be "
                        "restored from a copy until this succeeds", self.name, e)
        return ret

    @property
    def log_reserve(self) -> int:
        """Circular logging: the log space kept for checkpoints and the outcomes of work already begun (one
        segment): relog passes stop short of it, new persistent work is refused before it is reached."""
        return self.config.segment_bytes

    def ensure_log_space(self) -> None:
        """Circular logging: before new persistent work, make sure the ring has room beyond twice the reserve.
        When it has not, take checkpoints (each relogs and moves the windows on, so that segments become inactive)
        until it has; when it still has not, refuse the work with the reason: a needed record is never
        overwritten. A log that cannot be written refuses it first (QueueManager.log_failure)."""
        self.refuse_if_log_failed()
        if self.log is None or self.config.log_mode != CIRCULAR:
            return
        room = self.log.room()
        if room > 2 * self.log_reserve:
            if self.log_space_low and room > 3 * self.log_reserve:  # apart from the warning's: no flapping
                self.say_log_space("")
            return
        self.say_log_space(f"the circular log has {self.log.room()} bytes of room left in its ring of "
                           f"{self.config.log_ring} segments")
        for _ in range(max(1, self.config.cpl_entries) + 1):
            self.checkpoint("log full")
            if self.log is None or self.log.room() > 2 * self.log_reserve:
                return
        ret = self.retention
        oldest = self.log.segments()[0]
        why = "; ".join(ret.kept_for(oldest)) if ret is not None else "unknown"
        self.counters["log_full_refusals"] = self.counters.get("log_full_refusals", 0) + 1
        raise ResourceProblemError(
            f"queue manager {self.name}: the circular log is full ({self.config.log_ring} segments) and no segment "
            f"can be freed: segment {oldest.segment} is still needed by {why}; new persistent work is refused until "
            "that is resolved (commit or resolve the unit of work, back up the structure) or the ring is made larger")

    def say_log_space(self, low: str) -> None:
        """The operator's warning that log space is low (the role of MQ's AMQ7466W), said once when it becomes low
        and once when it is not any more: a member refusing every put of a busy hour would otherwise bury its log
        under the same line. low: why it is low, or "" when it is not. Counted in the status (log_space_warnings)."""
        if bool(low) == bool(self.log_space_low):
            return
        self.log_space_low = low
        if low:
            self.counters["log_space_warnings"] = self.counters.get("log_space_warnings", 0) + 1
            log.warning("AMQ7466W %s: log space is low: %s; checkpoints are taken to free space, and new persistent "
                        "work will be refused if none can be freed", self.name, low)
        else:
            log.warning("%s: log space is no longer low", self.name)

    def _checkpoint_when_due(self) -> None:
        """Checkpoints by time and when log space runs low (besides LOGLOAD's count of records)."""
        if self.log is None:
            return
        cfg = self.config
        if cfg.checkpoint_interval_s and time.monotonic() - self.last_checkpoint_at >= cfg.checkpoint_interval_s:
            self.checkpoint("time")
        elif cfg.log_mode == CIRCULAR:
            room = self.log.room()
            low = 0 <= room <= 3 * self.log_reserve
            self.say_log_space(f"the circular log has {room} bytes of room left in its ring of {cfg.log_ring} "
                               "segments" if low else "")
            if low:
                self.checkpoint("log space")
        elif cfg.log_mode == LINEAR and cfg.log_low_space_bytes:
            try:
                free = shutil.disk_usage(self.log_dir).free
            except OSError:
                return
            low = free < cfg.log_low_space_bytes
            self.say_log_space(f"the log's file system has {free} bytes free (below {cfg.log_low_space_bytes})"
                               if low else "")
            if low and time.monotonic() - self.last_checkpoint_at > 5.0:
                self.checkpoint("log space")


__all__ = ["LogSpace"]
