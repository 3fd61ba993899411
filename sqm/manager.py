"""A shared queue manager (SQM): one member of the queue-sharing group, with its own durable record log.

Puts and gets inside a UOW run on the CF first and are then logged (not forced) with the LRSN the CF script
returned. Commit and backout are logged and forced first (the log decides the outcome), then applied on the CF.
A persistent put outside syncpoint is a UOW of its own (PUT, then a forced COMMIT). Non-persistent work is never
logged. The application's handle (MQCONN) is sqm.connection.Connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import redis

from cfemu import keys
from cfemu.admin import Admin, AdminError, QueueDef
from cfemu.cf import CF, Caller, Structure
from cfemu.connection import PoolExhaustedError, connect
from cfemu.errors import (
    BackedOutError,
    BackupActiveError,
    BadRequestError,
    CompletedByRecoveryError,
    FencedError,
    FloorError,
    LogFailedError,
    MQError,
    NotJoinedError,
    OutcomeUnknownError,
    ResourceProblemError,
    StructureFailedError,
    UnknownObjectError,
)
from cfemu.keys import check_member_name
from cfemu.repository import GroupRepository, RepositoryError, open_group_repository
from sqm import records, relog
from sqm.clock import LrsnClock, now_ms
from sqm.failpoints import failpoint
from sqm.log import LogFormatError, RecordLog
from sqm.recauto import RecoverStructure, StructureRecovery
from sqm.records import INBACKOUT, INCOMMIT, INDOUBT, Record
from sqm.retention import Retention, member_retention
from sqm.uow import UnitOfWork

if TYPE_CHECKING:
    from sqm.connection import Connection

log = logging.getLogger("sqm")

CF_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
LINEAR, CIRCULAR = "linear", "circular"
LOG_MODES = (LINEAR, CIRCULAR)


@dataclass
class QueueManagerConfig:
    name: str
    log_root: Path  # this member's log is log_root/name; peers' logs are beside it
    redis_url: str | None = None
    lease_ms: int = 5000
    logload: int = 10000  # take a checkpoint every this many log records (MQ's LOGLOAD)
    expiry_interval_ms: int = 1000
    uow_sweep_interval_ms: int = 1000  # units of work sent to services: lifetimes, postponement (sqm.uowsweeper)
    clock_skew_us: int = 0
    segment_bytes: int = 64 * 2**20
    background: bool = True  # heartbeat, peer recovery, expiry and pending-work threads
    # CF connections: requests beyond this wait for a free one (up to cf_pool_timeout_s), then fail with
    # MQRC_RESOURCE_PROBLEM; a local limit is never reported as a failed CF structure.
    cf_connections: int = 64
    cf_pool_timeout_s: float = 30.0
    # Selective relogging (docs/log-management.md): the CPL's n (0: no relogging), the relog lock's lease, the
    # entries one relog_scan batch looks at.
    cpl_entries: int = 3
    relog_lock_ms: int = 60_000
    relog_batch: int = 500
    # Log management (docs/log-management.md): linear (the default) archives the inactive segments to
    # log_archive_dir/NAME (default: the member's log directory's archive/) and removes them from the active log;
    # circular reuses a ring of log_ring segments once inactive, and refuses new persistent work when none can be
    # freed. Checkpoints also every checkpoint_interval_s (0: never by time) and when the log runs low on space
    # (linear: the log's file system has less than log_low_space_bytes free; circular: one free segment left).
    log_mode: str = "linear"
    log_ring: int = 8
    log_archive_dir: Path | None = None
    checkpoint_interval_s: float = 300.0
    log_low_space_bytes: int = 256 * 2**20
    # RECAUTO (sqm.recauto): how this member restores a failed structure; injected by the top floor (qsg.member
    # wires restore in); None: this member never recovers a structure by itself.
    recover_structure: RecoverStructure | None = None


def reply_lost(e: BaseException) -> bool:
    """Did a CF call fail after its request was sent (the reply was lost: a reset or a timeout while reading)?
    Then the script may have run: its effect is unknown, not absent. A refused or failed connect sent nothing."""
    if isinstance(e, redis.exceptions.TimeoutError):
        return "connect" not in str(e).lower()
    text = str(e)
    return "while reading" in text or "reading from" in text or "closed by server" in text


class QueueManager:
    """One SQM. Start it, connect() handles to it, stop() it. See sqm.recovery for restart and peer recovery."""

    def __init__(self, config: QueueManagerConfig, client: redis.Redis | None = None) -> None:
        self.config = config
        self.name = check_member_name(config.name)
        self.redis = client if client is not None else connect(
            config.redis_url, max_connections=config.cf_connections, pool_timeout=config.cf_pool_timeout_s)
        self.cf = CF(self.redis)
        self.admin = Admin(self.redis)
        self.clock = LrsnClock(config.clock_skew_us)
        self.caller = Caller(self.name, 0, self.clock)
        self.log: RecordLog | None = None
        self.repository: GroupRepository | None = None  # the group's (cfemu.repository), once started
        self.uows: dict[str, UnitOfWork] = {}
        self.uow_lock = threading.RLock()
        self.pending: dict[str, Callable[[], None]] = {}  # durable work the CF has not seen yet, retried
        self._refused_retries: set[str] = set()  # pending UOWs whose retry was refused (warned once: retry_pending)
        self.fenced = False
        self.log_failed = ""  # why the log cannot be written, once it cannot
        self.running = False
        self.activity = 0
        self.counters = {"commits": 0, "backouts": 0, "puts": 0, "gets": 0, "peer_recoveries": 0,
                         "backout_records_with_data": 0, "floor_retries": 0}
        self._queue_cache: dict[str, QueueDef] = {}
        self._membership_lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.last_restart: Any = None
        self.sweeper: Any = None  # sqm.uowsweeper.Sweeper, made by the housekeeping thread
        self._checkpointing = threading.Lock()
        # The last complete relog pass of each structure this member relogged (sqm.relog), carried forward in
        # every checkpoint record: restore finds the newest window in the members' last checkpoints.
        self.relog_passes: dict[str, dict[str, Any]] = {}
        self.retention: Retention | None = None  # what recovery needed of the log at the last checkpoint
        self.last_checkpoint_at = time.monotonic()
        if config.log_mode not in LOG_MODES:
            raise ValueError(f"log mode must be one of {', '.join(LOG_MODES)}, not {config.log_mode!r}")
        self.recauto = StructureRecovery(self, config.recover_structure) if config.recover_structure else None

    # --- life cycle -------------------------------------------------------------------------------------
    @property
    def log_dir(self) -> Path:
        return Path(self.config.log_root) / self.name

    def start(self, progress: Callable[[str, dict[str, int]], None] | None = None) -> Any:
        """Open the log, join the group (a new epoch fences any older incarnation), run restart recovery."""
        from sqm.recovery import restart

        # The group's log root first (before anything is created here): a member logging where peer recovery,
        # backup and restore do not read would have its committed work dropped by them (issue 10, hole 6).
        self.repository = open_group_repository(self.admin, self.config.log_root, who=self.name)
        self.log = RecordLog(self.log_dir, self.name, segment_bytes=self.config.segment_bytes,
                             ring=self.config.log_ring if self.config.log_mode == CIRCULAR else 0)
        last = self.log.last_checkpoint()
        self.relog_passes = relog.last_passes(last[1] if last else None)
        try:
            self.repository.record_member(self.name, self.log_dir)  # restore then knows to read this log
            self.caller.epoch = self.admin.join(self.name, {"pid": os.getpid(), "log": str(self.log_dir)},
                                                self.config.lease_ms)
            self.running = True
            self.last_restart = restart(self, progress)
        except BaseException:  # leave nothing open or locked: the caller may try again
            self.running = False
            self.log.close()
            self.log = None
            raise
        if self.config.background:
            for target in (self._heartbeat_loop, self._housekeeping_loop):
                t = threading.Thread(target=target, name=f"{self.name}-{target.__name__}", daemon=True)
                t.start()
                self._threads.append(t)
        return self.last_restart

    def stop(self, *, checkpoint: bool = True) -> None:
        """Graceful shutdown: stop background work, take a checkpoint, leave the group, close the log."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self._threads.clear()
        if self.log is not None:
            if checkpoint and not self.fenced and not self.log_failed:
                self.checkpoint("shutdown")
                with contextlib.suppress(*CF_DOWN):
                    self.admin.leave(self.name)
            try:
                self.log.close()
            except OSError as e:  # the log failed: what is on disk is what restart and peers will read
                log.error("%s: closing the log failed: %s", self.name, e)
            self.log = None
        self.running = False

    def __enter__(self) -> QueueManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def connect(self) -> Connection:
        from sqm.connection import Connection

        self.check_usable()
        return Connection(self)

    # --- helpers shared by connections and recovery -------------------------------------------------------
    def check_usable(self) -> None:
        if self.fenced:
            raise FencedError(f"queue manager {self.name} was fenced by peer recovery; restart it")
        if self.log_failed:
            raise LogFailedError(f"queue manager {self.name} cannot write its log ({self.log_failed}); "
                                 "a peer recovers its work; restart it when the log disk is fixed")
        if not self.running or self.log is None:
            raise BadRequestError(f"queue manager {self.name} is not running")

    def queue_def(self, queue: str) -> QueueDef:
        q = self._queue_cache.get(queue)
        if q is None:
            try:
                q = self.admin.queue_def(queue)
            except AdminError:
                raise self._not_in_cf(queue) from None
            except CF_DOWN as e:
                raise StructureFailedError(f"the CF is unavailable: {e}") from None
            except PoolExhaustedError as e:
                raise ResourceProblemError(f"queue manager {self.name}: {e}; raise --cf-connections") from None
            self._queue_cache[queue] = q
        return q

    def _not_in_cf(self, queue: str) -> MQError:
        """A queue the CF does not know: unknown (MQRC_UNKNOWN_OBJECT_NAME), unless the group repository defines it
        (the CF lost its definitions with everything else, and came back empty): then its structure has failed
        (MQRC_CF_STRUC_FAILED) until it is restored, as MQ answers while a CF structure is lost; an application
        that took 'unknown' for a configuration error stopped retrying, and an operator looked in the wrong place."""
        known = {q.name: q.structure for q in self.repository.queues()} if self.repository is not None else {}
        if queue in known:
            return StructureFailedError(f"queue {queue} is defined on structure {known[queue]}, which the CF does not "
                                        "hold (it came back empty): it is recovered automatically (RECAUTO) or by "
                                        f"'cfrestore run {known[queue]}'")
        return UnknownObjectError(f"queue {queue} is not defined")

    def forget_queue_def(self, queue: str) -> None:
        """Drop a cached queue definition (it was redefined)."""
        self._queue_cache.pop(queue, None)

    def structure(self, name: str) -> Structure:
        return self.cf.structure(name)

    def new_uow(self) -> UnitOfWork:
        with self.uow_lock:
            self._seq += 1
            uow = UnitOfWork(f"{self.name}.{self.caller.epoch:x}.{self._seq}", self.name)
            self.uows[uow.id] = uow
            return uow

    def append(self, record: Record, *, uow: UnitOfWork | None = None, state: str | None = None) -> None:
        """Append a record, and wait for it to be on disk when its kind is forced (sqm.records.KINDS). With uow
        and state, the UOW takes that state together with the append, as any checkpoint sees it: a checkpoint can
        never show a UOW in flight after its COMMIT or PREPARE record (restart reads only from the checkpoint on,
        and would back it out)."""
        assert self.log is not None
        force = records.kind_of(record).forced
        if self.activity >= self.config.logload:
            self.checkpoint("logload")
        try:
            with self.uow_lock:
                pos = self.log.append(record)
                owner = uow or (self.uows.get(record["u"]) if record.get("u") else None)
                if owner is not None and not owner.first_lrsn:
                    owner.first_lrsn = int(record["l"])
                if uow is not None and state is not None:
                    uow.decide(state, record)
            self.activity += 1
            if force:
                self.log.force(pos)  # outside the lock: concurrent committers share the fsync (group commit)
        except OSError as e:
            self._log_failure(e)

    def _log_failure(self, e: OSError) -> NoReturn:
        """The log cannot be written: stop renewing the lease (a peer then fences this member and recovers its
        work from the log as it is on disk) and refuse all work; the operator restarts it once the disk is fixed.
        Carrying on would hold the lease while every persistent request failed, and nobody would recover."""
        if not self.log_failed:
            self.log_failed = str(e)
            log.error("%s: the record log failed (%s): stopping; a peer will recover this member's work",
                      self.name, e)
        raise LogFailedError(f"queue manager {self.name} cannot write its log: {e}") from None

    def checkpoint(self, why: str) -> None:
        """A checkpoint record carries the active UOW table, so restart reads the log from here on, and completes
        the relog passes taken before it (sqm.relog: their windows and CPLs). One checkpoint at a time: a LOGLOAD
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
                    self.log.checkpoint(records.checkpoint(lrsn, uows=uows, n=n, why=why, passes=self.relog_passes))
                except OSError as e:
                    self._log_failure(e)
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
        """After a checkpoint: what recovery still needs of this member's log (sqm.retention); the segments wholly
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
        except (OSError, LogFormatError) as e:  # the segments stay in the active log: nothing is lost
            log.warning("%s: archiving the inactive log segments failed (%s); they stay in the active log",
                        self.name, e)
            return ret
        if moved:
            log.info("%s: archived log segments %s to %s (recovery needs the log from LRSN %d on)", self.name,
                     ", ".join(str(m.segment) for m in moved), self.archive_dir, ret.lrsn)
            self.counters["segments_archived"] = self.counters.get("segments_archived", 0) + len(moved)
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
        overwritten."""
        if self.log is None or self.config.log_mode != CIRCULAR or self.log.room() > 2 * self.log_reserve:
            return
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

    def forget(self, uow: UnitOfWork) -> None:
        with self.uow_lock:
            self.uows.pop(uow.id, None)

    def cf_call(self, fn: Callable[[], Any]) -> Any:
        """Run a CF call; a fencing refusal marks this queue manager fenced; a dead CF is a failed structure; a
        structure rebuilt after a CF loss that does not know this member yet is joined, and the call retried."""
        epoch = self.caller.epoch
        try:
            try:
                return fn()
            except NotJoinedError:
                self.renew_membership()
                return fn()
        except FencedError:
            if self.caller.epoch != epoch and not self.fenced:
                # The member re-joined a CF that came back empty (a higher epoch) while this call, built with the
                # old one, was on its way: the stale epoch is its own, not a peer's fencing. FENCED is answered
                # before a script changes anything, so the call is made again with the new epoch.
                return self.cf_call(fn)
            self.fenced = True
            raise
        except CF_DOWN as e:
            failed = StructureFailedError(f"the CF is unavailable: {e}")
            failed.maybe_applied = reply_lost(e)
            failed.no_answer = True
            raise failed from None
        except PoolExhaustedError as e:
            raise ResourceProblemError(f"queue manager {self.name}: {e}; raise --cf-connections") from None

    def renew_membership(self) -> None:
        """Renew the lease; re-join the group when the CF lost it (a new, higher epoch); mark fenced when a peer
        took over. Called by the heartbeat, and at once when a structure does not know this member."""
        with self._membership_lock:
            rc = self.admin.heartbeat(self.name, self.caller.epoch, self.config.lease_ms)
            if rc == 0:
                if not self.fenced:
                    log.error("%s: fenced (epoch %d is stale): peer recovery took over; restart required",
                              self.name, self.caller.epoch)
                self.fenced = True
                raise FencedError(f"queue manager {self.name} was fenced by peer recovery; restart it")
            if rc < 0:  # the CF was lost and rebuilt: join the group again, with a higher epoch
                self._reclaim_repository()
                self.caller.epoch = self.admin.join(self.name, {"pid": os.getpid(), "log": str(self.log_dir),
                                                                "min_epoch": self.caller.epoch + 1},
                                                    self.config.lease_ms)
                self._queue_cache.clear()
                log.warning("%s: re-joined the group after the CF was lost (epoch %d)", self.name,
                            self.caller.epoch)
            else:  # joined, but a structure rebuilt since does not carry our epoch yet
                self.admin.join_structures(self.name, self.caller.epoch)

    def _reclaim_repository(self) -> None:
        """Tell a new CF where the group's repository is (this member's log root was checked at start), so that a
        member started meanwhile with another log root is refused. A running member never stops over it."""
        try:
            open_group_repository(self.admin, self.config.log_root, who=self.name)
        except RepositoryError as e:
            log.error("%s", e)

    # --- completing a UOW (commit or backout) on the CF ----------------------------------------------------
    def complete(self, uow: UnitOfWork, commit: bool, *, reason: str = "application",
                 for_member: str | None = None, pstore_checked: bool = False) -> None:
        """Decide and apply a UOW's outcome: log it (forced) when it has persistent work, then apply it on every
        structure it touched. for_member: peer recovery deciding another member's UOW (a RECOVERY record).
        pstore_checked: the UOW is one put or get outside syncpoint whose own CF script, just now, checked that
        the persistent store is connected (put.lua and get.lua refuse persistent work while it is not); asking
        standing.lua again before the force would answer the same question a few microseconds later at the cost
        of a CF round trip per message (issue 15). Either way the check comes before the force, which is the
        rule (docs/pstore.md): a disconnect after it refuses from the next commit on."""
        self.check_usable()
        # A recovery (restart, or a peer) backing out a UOW carries the data of its persistent gets as the CF
        # holds them: their GET records may have died with the member (a UOW known only from the CF), and the
        # backout raises their backout counts, which a later restore must not forget (invariant 1).
        if commit and uow.persistent and for_member is None and uow.state != INDOUBT and not pstore_checked:
            self._refuse_if_disconnected(uow)
        recovering = not commit and (for_member is not None or reason == "restart")
        carry = not commit and (recovering or self._backup_running(uow))
        if recovering and not uow.persistent and for_member is None and self._gets_data(uow, best_effort=True):
            uow.persistent = True  # its gets are persistent: the backout is logged, forced, like any other
        if uow.persistent or for_member is not None:
            failpoint("before-log-force")
            # A backout carries what data the CF can give: one the CF cannot answer now is logged without it and
            # finished later (the CF refuses it while a backup runs, and then it is logged again with the data);
            # raising here left the UOW's entries locked for good (found by the chaos run against a Redis Cluster,
            # seed 3: the CF's node lost between the check for a running backup and the read of the gets' data).
            self.log_decision(uow, commit, for_member=for_member, with_data=carry, reason=reason,
                              best_effort=not commit)
            failpoint("after-log-force" if commit else "backout-after-log")
        uow.state = INCOMMIT if commit else INBACKOUT
        try:
            self.apply(uow, commit, for_member=for_member)
        except (StructureFailedError, *CF_DOWN) as e:
            if uow.persistent or for_member or not commit:
                # The log decided the outcome (or it is a backout, which is always the outcome of a UOW whose
                # decision reached no log); the CF is not there: finish when it (or its restore) is back. A UOW
                # left unapplied here held its entries locked until the member restarted (B7, CHAOS-RESULTS.md).
                self._finish_later(uow, commit, for_member, e)
                return
            self._commit_failed(uow, e)
        except FencedError as e:
            if commit and for_member is None:
                raise self._fenced_commit(uow, e) from None
            raise
        finally:
            self.counters["commits" if commit else "backouts"] += 1

    def _refuse_if_disconnected(self, uow: UnitOfWork) -> None:
        """The only place a disconnected persistent store refuses a commit (docs/pstore.md): before its COMMIT is
        forced, when a structure holding the UOW answers 'D' (standing.lua). The UOW is backed out everywhere
        (a BACKOUT, never after a COMMIT) and the application gets BackedOutError. Once the COMMIT is logged the
        commit is decided and completes on every structure, disconnected or not (commit.lua no longer refuses it):
        refusing it there backed out on one structure what another had committed (review R2). A structure that
        cannot answer is left to the commit's own path (it waits, or is refused there, as before this check).
        A prepared UOW is not asked: it voted yes, and its coordinator decides."""
        for sname, gen in list(uow.structures.items()):
            try:
                standing = self.cf_call(partial(self.structure(sname).standing, self.caller, uow.id, gen=gen))
            except (MQError, *CF_DOWN):
                continue
            if standing == "D":
                self.complete(uow, False, reason="persistent store disconnected")
                raise BackedOutError(f"unit of work {uow.id} was backed out: structure {sname}: the persistent store "
                                     "is disconnected (cfemu pstore connect)")

    def _fenced_commit(self, uow: UnitOfWork, e: FencedError) -> MQError:
        """What the application learns of a commit during which a peer fenced this member. The peer completes the
        member's work from its log: a forced COMMIT it carries through (unless a structure refuses it), work no
        log decided it backs out. 'Failed' was wrong for a logged commit: the chaos soak (seed 1, cf-link-halfopen)
        saw such a put outside syncpoint reported failed and then delivered (a 'phantom')."""
        if uow.persistent or uow.applied:
            return OutcomeUnknownError(f"the commit of unit of work {uow.id} was {'logged' if uow.persistent else 'begun'} "
                                       f"when peer recovery fenced {self.name} ({e}): the peer commits it or backs it out; its "
                                       "outcome is not known here")
        return BackedOutError(f"unit of work {uow.id} is backed out: peer recovery fenced {self.name} before its "
                              f"commit was applied or logged ({e})")

    def _finish_later(self, uow: UnitOfWork, commit: bool, for_member: str | None, why: BaseException) -> None:
        log.warning("%s: %s of uow %s waits for the CF: %s", self.name, "commit" if commit else "backout", uow.id,
                    why)
        self.pending[uow.id] = lambda: self.apply(uow, commit, for_member=for_member)

    def _commit_failed(self, uow: UnitOfWork, e: BaseException) -> NoReturn:
        """A commit of a UOW with no persistent work (nothing logged decides it) that the CF did not take. When no
        structure can have applied it, it is backed out (MQRC_BACKED_OUT); when one may have (applied already, or
        its reply lost), the commit is carried through and its outcome is unknown to the application. Either way
        the outcome is finished when the CF is back: never left holding its entries."""
        maybe = bool(uow.applied) or getattr(e, "maybe_applied", False) or reply_lost(e)
        if maybe:
            self._finish_later(uow, True, None, e)
            raise OutcomeUnknownError(f"the commit of unit of work {uow.id} may or may not have been applied: "
                                      f"the CF's reply was lost ({e}); it is finished when the CF is back")
        uow.state = INBACKOUT
        self._finish_later(uow, False, None, e)
        raise BackedOutError(f"unit of work {uow.id} was backed out: the CF did not take its commit ({e})")

    def apply(self, uow: UnitOfWork, commit: bool, *, for_member: str | None = None) -> None:
        """Apply a decided outcome on every structure of the UOW (idempotent), then log END."""
        todo = [s for s in uow.structures if s not in uow.applied]
        if commit and len(todo) > 1:
            todo = self._refusing_first(uow, todo)
        for sname in todo:
            self._apply_one(uow, sname, commit, for_member)
            uow.applied.add(sname)
            failpoint("during-apply")
        if (uow.persistent or for_member is not None) and self.log is not None:
            self.append(records.end(uow.id, self.clock.now()))
        self.pending.pop(uow.id, None)
        self.forget(uow)

    def _refusing_first(self, uow: UnitOfWork, todo: list[str]) -> list[str]:
        """Before a commit touches any of several structures, ask each how the UOW stands there (standing.lua,
        after the COMMIT is forced): one that is not ACTIVE makes the whole commit wait, applied nowhere yet
        (StructureFailedError: the caller keeps it pending); one that will refuse it (backed out by recovery, or its
        work there lost with the CF) goes first, so that the UOW is backed out everywhere before it is committed
        anywhere. A restore reads the logs only once its structure has failed, so a structure that answers here,
        after the COMMIT was forced, can no longer be restored without seeing it. A disconnected persistent store
        ('D') does not refuse a decided commit: it refused before the force (_refuse_if_disconnected)."""
        refusing = [sname for sname in todo
                    if self.cf_call(partial(self.structure(sname).standing, self.caller, uow.id,
                                            gen=uow.structures[sname])) in ("B", "L")]
        return refusing + [sname for sname in todo if sname not in refusing]

    def _apply_one(self, uow: UnitOfWork, sname: str, commit: bool, for_member: str | None) -> None:
        s = self.structure(sname)
        gen = uow.structures[sname]
        logged = uow.persistent or for_member is not None
        # The record's own LRSN is checked against the floor; the entries are stamped with the LRSN at which the
        # decision counts (sqm.records.counts_at), which a re-log below keeps.
        lrsn = (uow.record_lrsn or uow.decided_lrsn) if logged else 0
        at = uow.decided_lrsn if logged else 0
        has_data = uow.data_logged  # else the CF refuses a get backout while a backup runs (BACKUPACTIVE)
        by_recovery = for_member is not None
        while True:
            try:
                if commit:
                    self.cf_call(partial(s.commit, self.caller, uow.id, gen=gen, lrsn=lrsn, at=at,
                                          decided_by_recovery=by_recovery))
                else:
                    self.cf_call(partial(s.backout, self.caller, uow.id, gen=gen, lrsn=lrsn, at=at,
                                          has_data=has_data, decided_by_recovery=by_recovery))
                return
            except FloorError as e:
                # Our record sits below the recovery floor of a backup that started meanwhile: log afresh (the
                # re-log still counts where the first record did).
                self.counters["floor_retries"] += 1
                self.clock.observe(e.floor)
                lrsn = self.log_decision(uow, commit, for_member=for_member, with_data=has_data)
            except BackupActiveError:
                lrsn = self.log_decision(uow, commit, for_member=for_member, with_data=True)
                has_data = True
            except CompletedByRecoveryError:
                if commit:
                    return
                raise
            except BackedOutError as e:
                if not commit:
                    return
                if uow.applied:
                    # Committed on another structure already: a backout now would split the UOW (and a BACKOUT
                    # after its COMMIT tells a restore to undo what that structure committed, review R2). The
                    # commit stays decided; it waits, pending, for this structure to take it.
                    log.error("%s: structure %s refused the commit of uow %s, which %s committed already: kept "
                              "pending (%s)", self.name, sname, uow.id, ", ".join(sorted(uow.applied)), e)
                    raise StructureFailedError(f"structure {sname} refused the commit of unit of work {uow.id} "
                                               f"after {', '.join(sorted(uow.applied))} applied it ({e}): it waits "
                                               "for the structure") from None
                self._backed_out_by_recovery(uow, for_member)
                raise

    def _backed_out_by_recovery(self, uow: UnitOfWork, for_member: str | None) -> None:
        """A structure refused a commit: recovery (a peer, or restore after a CF loss) backed the UOW out there, or
        its work there was lost with the CF. The log must say so too, and every structure of the UOW backs it out
        (_refusing_first made the refusing one go first, so none has committed it: _apply_one never comes here once
        one has)."""
        if uow.persistent and for_member is None:
            self.log_decision(uow, False, reason="backed out by recovery")
        uow.applied.clear()
        try:
            self.apply(uow, False, for_member=for_member)
        except (StructureFailedError, *CF_DOWN):
            self.pending[uow.id] = lambda: self.apply(uow, False, for_member=for_member)

    def log_decision(self, uow: UnitOfWork, commit: bool, *, for_member: str | None = None,
                     with_data: bool = False, reason: str = "application", best_effort: bool = False) -> int:
        """Write the forced record that decides a UOW: COMMIT or BACKOUT for our own, RECOVERY when peer recovery
        decides another member's. A backout while a backup runs carries the data of the UOW's persistent gets
        (the patent's exception). Returns the record's LRSN, the one the CF checks against its recovery floor; the
        entries are stamped with the LRSN the decision counts at (uow.decided_lrsn). best_effort: a recovery's
        backout carries what data the CF can give, and is logged without it when the CF cannot answer."""
        lrsn = self.clock.now()  # taken before the CF is asked for the gets' data
        dd = self._gets_data(uow, best_effort=best_effort) if with_data and not commit else []
        if dd:
            self.counters["backout_records_with_data"] += 1
        ss = uow.structures
        state = INCOMMIT if commit else INBACKOUT
        # The decision taken already (a re-log after the CF refused the record, or peer recovery completing the
        # owner's own COMMIT or BACKOUT) counts where it was first taken: the record says so (counts_at).
        at = uow.decided_lrsn if uow.state == state and uow.decided_lrsn else 0
        if for_member is not None:
            rec = records.recovery(uow.id, lrsn, ss, commit=commit, of=for_member, by=self.name, data=dd, at=at)
        elif commit:
            rec = records.commit(uow.id, lrsn, ss, at=at)
        else:
            rec = records.backout(uow.id, lrsn, ss, reason=reason, data=dd, at=at)
        self.append(rec, uow=uow, state=state)
        uow.data_logged = bool(dd)
        return lrsn

    def _backup_running(self, uow: UnitOfWork) -> bool:
        try:
            return any(self.redis.hexists(keys.meta(s), "backup") for s in uow.structures)
        except CF_DOWN:
            return False

    def _gets_data(self, uow: UnitOfWork, *, best_effort: bool = False) -> list[list[Any]]:
        """[structure, descriptor, data] of each persistent get the UOW holds (the patent's exception). Best
        effort: a structure that cannot answer (failed, or the CF down) gives nothing."""
        out: list[list[Any]] = []
        for sname in uow.structures:
            try:
                held = self.cf_call(partial(self.structure(sname).uow_entries, uow.id))
            except (StructureFailedError, *CF_DOWN):
                if not best_effort:
                    raise
                continue
            for entry, data in held:
                if entry.state == "UG" and entry.persistent and entry.uow == uow.id:
                    out.append([sname, entry.wire(), data])
        return out

    def indoubt(self) -> list[UnitOfWork]:
        with self.uow_lock:
            return [u for u in self.uows.values() if u.state == INDOUBT]

    def resolve(self, uow_id: str, commit: bool) -> None:
        """Resolve an in-doubt UOW (the external coordinator's decision), also after a restart."""
        with self.uow_lock:
            uow = self.uows.get(uow_id)
        if uow is None or uow.state != INDOUBT:
            raise BadRequestError(f"unit of work {uow_id} is not in doubt on {self.name}")
        self.complete(uow, commit, reason="resolved by coordinator")

    # --- background work --------------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        period = self.config.lease_ms / 3000
        failing = ""
        while not self._stop.wait(period):
            if self.log_failed:
                return  # let the lease lapse: a peer recovers this member's work
            try:
                self.renew_membership()
            except FencedError:
                return
            except Exception as e:  # noqa: BLE001 - the heartbeat must outlive any one failed renewal
                # A dead CF, a transient OOM refusal, a script error on a malformed admin entry: the lease is
                # ours until it lapses, so try again next period. A heartbeat thread that died here let a healthy
                # member's lease lapse for good, and its peers fenced it (issue 10, hole 11).
                what = f"{type(e).__name__}: {e}"
                if what != failing:
                    log.warning("%s: lease renewal failed (will retry every %.1fs): %s", self.name, period, what)
                failing = what
                continue
            if failing:
                log.warning("%s: lease renewed again", self.name)
                failing = ""

    def _housekeeping_loop(self) -> None:
        from sqm import pubsub_sweeper
        from sqm.recovery import recover_peers
        from sqm.uowsweeper import Sweeper

        next_expiry = next_sweep = 0.0
        self.sweeper = Sweeper(self)
        while not self._stop.wait(0.2):
            if self.fenced or self.log_failed:
                return
            try:
                self.retry_pending()
                recover_peers(self)
                if self.recauto is not None:
                    self.recauto.check()
                self._checkpoint_when_due()
                if time.monotonic() >= next_expiry:
                    next_expiry = time.monotonic() + self.config.expiry_interval_ms / 1000
                    self.expire_messages()
                if self.config.uow_sweep_interval_ms and time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.config.uow_sweep_interval_ms / 1000
                    self.sweeper.sweep()
                    pubsub_sweeper.sweep(self)  # publications passed or past their lifetime, idle subscriptions
            except (MQError, *CF_DOWN) as e:
                log.debug("%s housekeeping: %s", self.name, e)
            except Exception:  # keep the queue manager alive; the failure is in its log
                log.exception("%s housekeeping failed", self.name)

    def _checkpoint_when_due(self) -> None:
        """Checkpoints by time and when log space runs low (besides LOGLOAD's count of records)."""
        if self.log is None:
            return
        cfg = self.config
        if cfg.checkpoint_interval_s and time.monotonic() - self.last_checkpoint_at >= cfg.checkpoint_interval_s:
            self.checkpoint("time")
        elif cfg.log_mode == CIRCULAR and 0 <= self.log.room() <= 3 * self.log_reserve:
            self.checkpoint("log space")
        elif cfg.log_mode == LINEAR and cfg.log_low_space_bytes:
            try:
                free = shutil.disk_usage(self.log_dir).free
            except OSError:
                return
            if free < cfg.log_low_space_bytes and time.monotonic() - self.last_checkpoint_at > 5.0:
                self.checkpoint("log space")

    def retry_pending(self) -> int:
        """Try again each decided outcome the CF could not take (housekeeping's first job); returns how many went
        through. A CF or structure not back yet stops the round (the others would wait the same way). A retry
        refused for a reason of its own is that UOW's alone: it stays pending and is tried again, and neither stops
        the others' retries nor the rest of housekeeping (peer recovery, RECAUTO, expiry), as it did when its error
        left this loop (chaos B9's candidate cause: a backout blocked so leaves its gets locked). Said once a UOW,
        at warning level (housekeeping logs its own errors at debug)."""
        done = 0
        for uid, fn in list(self.pending.items()):
            try:
                fn()
                self.pending.pop(uid, None)
                done += 1
            except BackedOutError:
                self.pending.pop(uid, None)
            except (StructureFailedError, *CF_DOWN):
                break
            except MQError as e:
                if uid not in self._refused_retries:
                    self._refused_retries.add(uid)
                    log.warning("%s: the pending %s was refused, tried again later: %s", self.name, uid, e)
        self._refused_retries &= set(self.pending)
        return done

    def expire_messages(self) -> int:
        """The expiry task: expired messages leave the structures (logged when persistent)."""
        n = 0
        for sdef in self.admin.structures():
            s = self.structure(sdef.name)
            if self.admin.state(sdef.name) != "ACTIVE":
                continue
            ids, purged = s.expire(now_ms())
            if ids:
                self.append(records.expire(self.clock.now(), structure=sdef.name, ids=ids))
            n += len(ids) + purged
        return n

    def status(self) -> dict[str, Any]:
        with self.uow_lock:
            states: dict[str, int] = {}
            for u in self.uows.values():
                states[u.state] = states.get(u.state, 0) + 1
        stats = self.log.stats if self.log else None
        return {"name": self.name, "epoch": self.caller.epoch, "fenced": self.fenced, "running": self.running,
                "uows": states, "pending": len(self.pending), "lrsn": self.clock.last, **self.counters,
                "log_records": getattr(stats, "records", 0), "log_bytes": getattr(stats, "bytes", 0),
                "fsyncs": getattr(stats, "fsyncs", 0)}


__all__ = ["QueueManager", "QueueManagerConfig", "INCOMMIT", "INBACKOUT", "INDOUBT"]
