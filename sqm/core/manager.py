"""A shared queue manager (SQM): one member of the queue-sharing group, with its own durable record log.

Puts and gets inside a UOW run on the CF first and are then logged (not forced) with the LRSN the CF script
returned. Commit and backout are logged and forced first (the log decides the outcome), then applied on the CF.
A persistent put outside syncpoint is a UOW of its own (put on the CF, then its PUT and a forced COMMIT logged, then
committed). Non-persistent work is never logged. The application's handle (MQCONN) is
sqm.core.connection.Connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import redis

from cfemu.admin import Admin, AdminError, QueueDef
from cfemu.cf import Caller, Structure
from cfemu.connection import PoolExhaustedError, connect
from cfemu.errors import (
    BadRequestError,
    FencedError,
    LogFailedError,
    MQError,
    NotJoinedError,
    OutcomeUnknownError,
    ResourceProblemError,
    StructureFailedError,
    UnknownObjectError,
)
from cfemu.keys import check_member_name
from cfemu.latency import Latency
from cfemu.repository import GroupRepository, RepositoryError, open_group_repository
from sqm.core import records, relog
from sqm.core.backupnote import note_new_backups
from sqm.core.cfcall import CF_DOWN, reply_lost
from sqm.core.cfgroup import GroupedCF
from sqm.core.clock import LrsnClock, now_ms
from sqm.core.config import CIRCULAR, LOG_MODES, QueueManagerConfig
from sqm.core.connection import Connection
from sqm.core.failpoints import failpoint
from sqm.core.hooks import Hooks
from sqm.core.logon_token import open_group_key, restore_key_file
from sqm.core.logspace import LogSpace
from sqm.core.outcomes import Outcomes
from sqm.core.own_log import begins_anew, join_info, refuse_live_elsewhere
from sqm.core.recauto import StructureRecovery
from sqm.core.records import INBACKOUT, INCOMMIT, INDOUBT, INFLIGHT, Record
from sqm.core.recovery import recover_peers, restart
from sqm.core.retention import Retention
from sqm.core.scans import ScanSlots
from sqm.core.storereport import StoreReport
from sqm.core.uow import UnitOfWork
from sqm.log import RecordLog, RecordRefusedError
from sqm.throttled_log import ThrottledLog

log = logging.getLogger("sqm")

# A feature installed on a queue manager when it is made (sqm.wings: the conversations and publish/subscribe): it
# registers its housekeeping tasks and listeners with the queue manager's hooks (sqm.core.hooks).
Wing = Callable[["QueueManager"], None]

# A housekeeping failure that repeats (every pass, five a second, as when the process is out of file descriptors) is
# logged once a minute per kind, the first with its traceback, the repeats counted: never a log flood.
HOUSEKEEPING_LOG_EVERY_S = 60.0
HEARTBEAT_RETRY_S = 0.1  # how soon a failed lease renewal is tried again


def failure_kind(e: BaseException) -> str:
    """What makes two failures "the same" for the log: the exception's type and where it was raised (its message
    may differ each time: a path, a count)."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
    return f"{type(e).__name__} at {where}"


class QueueManager(Outcomes, LogSpace):
    """One SQM. Start it, connect() handles to it, stop() it. See sqm.core.recovery for restart and peer recovery."""

    def __init__(self, config: QueueManagerConfig, client: redis.Redis | None = None, *,
                 wings: Iterable[Wing] = ()) -> None:
        self.config = config
        self.name = check_member_name(config.name)
        self.redis = client if client is not None else connect(
            config.redis_url, max_connections=config.cf_connections, pool_timeout=config.cf_pool_timeout_s)
        self.cf = GroupedCF(self.redis)  # concurrent requests' CF calls share round trips (sqm.core.cfgroup)
        self.scans = ScanSlots(config.scan_slots)  # the calls of its scans in the CF at once (sqm.core.scans)
        self.admin = Admin(self.redis)
        # The lease is renewed over connections of its own: requests that take every connection of the pool, or a
        # long step holding one, never make a renewal wait for a free one (a member given a client shares it).
        self.lease_admin = self.admin if client is not None else Admin(connect(
            config.redis_url, max_connections=2, pool_timeout=config.lease_ms / 3000,
            socket_timeout=max(1.0, config.lease_ms / 1000)))
        self.clock = LrsnClock(config.clock_skew_us)
        self.caller = Caller(self.name, 0, self.clock)
        self.log: RecordLog | None = None
        self.repository: GroupRepository | None = None  # the group's (cfemu.repository), once started
        self.uows: dict[str, UnitOfWork] = {}
        self.uow_lock = threading.RLock()
        self.pending: dict[str, Callable[[], None]] = {}  # durable work the CF has not seen yet, retried
        self._ended_fused: dict[str, list[str]] = {}  # Outcomes: tombstones the CF may drop
        self._refused_retries: set[str] = set()  # pending UOWs whose retry was refused (warned once: retry_pending)
        self.fenced = False
        self.log_failed = ""  # why the log cannot be written, once it cannot
        self.running = False
        self.activity = 0
        self.counters = {"commits": 0, "backouts": 0, "puts": 0, "gets": 0, "peer_recoveries": 0,
                         "backout_records_with_data": 0, "floor_retries": 0}
        self.cf_call_seconds = Latency()  # every CF call made through cf_call (sqm.service.metrics exports it)
        self._queue_cache: dict[str, QueueDef] = {}
        self._membership_lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.last_restart: Any = None
        self._checkpointing = threading.Lock()
        self.relog_passes: dict[str, dict[str, Any]] = {}  # sqm.core.logspace.LogSpace
        self.retention: Retention | None = None
        self.log_space_low = ""
        self.store_report: StoreReport | None = None  # PSTORE-REPORT=YES (sqm.core.storereport), once started
        self.backups_noted: dict[str, dict[str, Any]] = {}  # sqm.core.backupnote
        self.backups_checked_at = 0.0
        self.last_checkpoint_at = time.monotonic()
        if config.log_mode not in LOG_MODES:
            raise ValueError(f"log mode must be one of {', '.join(LOG_MODES)}, not {config.log_mode!r}")
        self.recauto = StructureRecovery(self, config.recover_structure) if config.recover_structure else None
        self.hooks = Hooks()  # what the wings registered: housekeeping tasks, member-recovered listeners
        for install in wings:
            install(self)

    # --- life cycle -------------------------------------------------------------------------------------
    @property
    def log_dir(self) -> Path:
        return Path(self.config.log_root) / self.name

    def start(self, progress: Callable[[str, dict[str, int]], None] | None = None) -> Any:
        """Open the log, join the group (a new epoch fences any older incarnation), run restart recovery."""
        # The group's log root first (before anything is created here): a member logging where peer recovery,
        # backup and restore do not read would have its committed work dropped by them (invariant 1,
        # docs/invariants.md; the group repository: cfemu.repository).
        self.repository = open_group_repository(self.admin, self.config.log_root, who=self.name)
        open_group_key(self.config.log_root, self.repository)  # a key that cannot be used refuses the start
        anew = begins_anew(self.repository, self.name, self.log_dir)  # before anything is created there
        self.log = RecordLog(self.log_dir, self.name, segment_bytes=self.config.segment_bytes,
                             ring=self.config.log_ring if self.config.log_mode == CIRCULAR else 0)
        try:
            repo_id = self.repository.id
            if repo_id is not None:  # the log says whose it is: another group's log root never reads it as its own
                self.log.stamp_group(repo_id)
            self.log.before_shared_flush = partial(failpoint, "group-force")
            last = self.log.last_checkpoint()
            self.relog_passes = relog.last_passes(last[1] if last else None)
            if self.config.pstore_report is not None and self.store_report is None:
                self.store_report = StoreReport(Path(self.config.pstore_report), self.name)
        except BaseException:
            self.log.close()
            self.log = None
            raise
        try:
            # Before anything of this start is recorded: another incarnation that runs is not fenced by it.
            refuse_live_elsewhere(self.admin.members(), self.name, self.log_dir)
            self.repository.record_member(self.name, self.log_dir, began_anew=anew)  # restore reads this log
            if anew:
                log.warning("%s: its log was declared lost; a new log begins at %s (its units of work on "
                            "the CF are backed out by this restart)", self.name, self.log_dir)
            self.caller.epoch = self.admin.join(self.name, join_info(self.log_dir, os.getpid()), self.config.lease_ms)
            self.running = True
            # The lease is renewed from the join on: restart recovery, its checkpoint and relog pass may take
            # longer than the lease, and a member that stopped renewing meanwhile was fenced by a peer as soon as
            # it served. Housekeeping (peer recovery, expiry, the wings' sweepers) waits for restart to finish.
            if self.config.background:
                self._start_thread(self._heartbeat_loop)
            self.last_restart = restart(self, progress)
        except BaseException:  # leave nothing open or locked: the caller may try again
            self.running = False
            self._stop_threads()
            self.log.close()
            self.log = None
            raise
        if self.config.background:
            self._start_thread(self._housekeeping_loop)
        return self.last_restart

    def _start_thread(self, target: Callable[[], None]) -> None:
        t = threading.Thread(target=target, name=f"{self.name}-{target.__name__}", daemon=True)
        t.start()
        self._threads.append(t)

    def _stop_threads(self) -> None:
        """Stop the background threads and wait for them; a later start begins with none running."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self._threads.clear()
        self._stop = threading.Event()

    def stop(self, *, checkpoint: bool = True) -> None:
        """Graceful shutdown: stop background work, take a checkpoint, leave the group, close the log."""
        self._stop_threads()
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
        if self.store_report is not None:
            self.store_report.close()
            self.store_report = None
        self.running = False

    def __enter__(self) -> QueueManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def connect(self) -> Connection:
        self.check_usable()
        return Connection(self)

    # --- helpers shared by connections and recovery -------------------------------------------------------
    def check_usable(self) -> None:
        if self.fenced:
            raise FencedError(f"queue manager {self.name} was fenced by peer recovery; restart it")
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
                failed = StructureFailedError(f"the CF is unavailable: {e}")
                failed.no_answer = True
                raise failed from None
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
                                        f"hold (it came back empty): {self._who_restores(known[queue])}")
        return UnknownObjectError(f"queue {queue} is not defined")

    def _who_restores(self, structure: str) -> str:
        """What brings a structure the CF lost back, as the group repository defines it: RECAUTO when it is on
        (a member restores it by itself), the operator's restore when it is off or the structure was migrated."""
        repo = self.repository
        sdef = repo.structures().get(structure) if repo is not None else None
        if repo is not None and structure in repo.migrated():
            return (f"it was migrated, so neither RECAUTO nor a restore brings it back here (its messages are "
                    f"served by the migration's target; 'cfemu migrate status {structure}')")
        if sdef is not None and sdef.recauto:
            return f"RECAUTO will restore it (or 'cfrestore run {structure}' now)"
        return f"RECAUTO is off for it: restore it with 'cfrestore run {structure}'"

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
        """Append a record, and wait for it to be on disk when its kind is forced (sqm.core.records.KINDS). With uow
        and state, the UOW takes that state together with the append, as any checkpoint sees it: a checkpoint can
        never show a UOW in flight after its COMMIT or PREPARE record (restart reads only from the checkpoint on,
        and would back it out)."""
        assert self.log is not None
        force = records.kind_of(record).forced
        # A COMMIT or PREPARE of it may be on disk already: whatever this record's fate, its outcome is the disk's.
        decided = uow is not None and uow.state in (INCOMMIT, INDOUBT)
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
            written = force and not isinstance(e, RecordRefusedError)
            if uow is not None and state is not None and written and uow.state != state:
                with self.uow_lock:  # buffered, its write failed part way: it may be on disk, as it decides
                    uow.decide(state, record)
            unknown = decided or (written and uow is not None and uow.state in (INCOMMIT, INDOUBT))
            self.log_failure(e, uow if unknown else None)

    def append_many(self, recs: list[Record]) -> None:
        """Append records of kinds that are not forced (a batch's PUT and GET records) together, under one hold of
        the lock: the commit's forced record takes them to disk with it, in one write and one fsync."""
        if not recs:
            return
        assert self.log is not None
        if self.activity >= self.config.logload:
            self.checkpoint("logload")
        try:
            with self.uow_lock:
                for record in recs:
                    assert not records.kind_of(record).forced, record["k"]
                    self.log.append(record)
                    owner = self.uows.get(record["u"]) if record.get("u") else None
                    if owner is not None and not owner.first_lrsn:
                        owner.first_lrsn = int(record["l"])
            self.activity += len(recs)
        except OSError as e:
            self.log_failure(e)

    def log_failure(self, e: OSError, uow: UnitOfWork | None = None) -> NoReturn:
        """The log cannot be written (disk full, an I/O error on a write or an fsync): from now on this member acts
        on persistent state only as its log on disk already decides (docs/pstore.md, "When a member's log cannot be
        written"). Persistent work is refused (LogFailedError, MQRC_RESOURCE_PROBLEM) and non-persistent work goes
        on. Each unit of work with persistent work still in flight (no outcome record begun) is doomed: at its
        application's next step it is backed out without a record when it holds only puts (its log has no outcome
        for it, so every recovery backs it out too), and kept locked until a peer or the restart backs it out with
        a record when it holds persistent gets (Outcomes.complete). A unit of work whose COMMIT or PREPARE may have reached the disk (its write was attempted: a
        write or an fsync that fails part way may leave it there, or in the page cache a restart reads) keeps its
        entries until the member restarts and reads its log, and the application's commit hears that its outcome
        is unknown (OutcomeUnknownError), never that it was refused: a put told "refused" must never be delivered
        (the rule of Outcomes._fenced_commit). uow: the unit of work whose COMMIT or PREPARE may be on disk (its
        outcome is unknown here). The writer refuses every later append (an fsync that failed once is never trusted
        again), so nothing is logged after this; the operator restarts the member once the disk is fixed."""
        first = not self.log_failed
        if first:
            self.log_failed = str(e)
            self.counters["log_failures"] = self.counters.get("log_failures", 0) + 1
            log.error("%s: the record log cannot be written (%s): persistent work is refused and in-flight "
                      "persistent units of work are backed out; non-persistent work goes on. Fix the log's disk, "
                      "then restart the member", self.name, e)
        with self.uow_lock:
            doomed = [u for u in self.uows.values() if u.persistent and u.state == INFLIGHT and not u.doomed]
            for u in doomed:
                u.doomed = f"queue manager {self.name} cannot write its log ({self.log_failed})"
        for u in doomed:
            log.warning("%s: unit of work %s (persistent, in flight) is backed out: the log cannot be written",
                        self.name, u.id)
        if uow is not None:
            raise OutcomeUnknownError(
                f"queue manager {self.name} cannot write its log ({self.log_failed}) and the COMMIT or PREPARE "
                f"record of unit of work {uow.id} may have reached the disk: its outcome is not known here; it is "
                "decided "
                "from the log on disk when the member restarts or a peer recovers it (committed if that record "
                "is there, else backed out)") from None
        raise LogFailedError(f"queue manager {self.name} cannot write its log ({self.log_failed}): persistent "
                             "work is refused until it is restarted with its log disk fixed") from None

    def note_store(self, uow: UnitOfWork, record: Record) -> None:
        """A persistent PUT or GET record of the unit of work, for the running store report (if any)."""
        if self.store_report is not None:
            self.store_report.note(uow, record)

    def refuse_if_log_failed(self) -> None:
        """Persistent work is refused while the log cannot be written (log_failure)."""
        if self.log_failed:
            raise LogFailedError(f"queue manager {self.name} cannot write its log ({self.log_failed}): persistent "
                                 "work is refused until it is restarted with its log disk fixed; non-persistent "
                                 "work goes on")

    def forget(self, uow: UnitOfWork) -> None:
        with self.uow_lock:
            self.uows.pop(uow.id, None)

    def cf_call(self, fn: Callable[[], Any]) -> Any:
        """Run a CF call; a fencing refusal marks this queue manager fenced; a dead CF is a failed structure; a
        structure rebuilt after a CF loss that does not know this member yet is joined, and the call retried.
        Its duration, retries included, goes to ``cf_call_seconds`` (the clock read here rather than by a timing
        context, Latency.time: six CF calls a message)."""
        t0 = time.perf_counter()
        try:
            return self._cf_call(fn)
        finally:
            self.cf_call_seconds.observe(time.perf_counter() - t0)

    def _cf_call(self, fn: Callable[[], Any]) -> Any:
        epoch = self.caller.epoch
        try:
            try:
                return fn()
            except NotJoinedError:
                self.renew_membership()
                return fn()
        except FencedError:
            if not self.fenced and self._rejoined_since(epoch):
                # The member re-joined a CF that came back empty (a higher epoch) while this call, built with the
                # old one, was on its way: the stale epoch is its own, not a peer's fencing. FENCED is answered
                # before a script changes anything, so the call is made again with the new epoch.
                return self._cf_call(fn)
            self.fenced = True
            raise
        except CF_DOWN as e:
            failed = StructureFailedError(f"the CF is unavailable: {e}")
            failed.maybe_applied = reply_lost(e)
            failed.no_answer = True
            raise failed from None
        except PoolExhaustedError as e:
            raise ResourceProblemError(f"queue manager {self.name}: {e}; raise --cf-connections") from None

    def _rejoined_since(self, epoch: int) -> bool:
        """Has this member re-joined the group (a higher epoch) since a call made with ``epoch``? A re-join raises
        the structures' fences to its new epoch before the caller takes it: a call refused FENCED in between would
        see the old epoch still current and take its own re-join for a peer's fencing. The membership lock, held
        through the whole re-join, is waited for first."""
        with self._membership_lock:
            return self.caller.epoch != epoch

    def renew_membership(self) -> None:
        """Renew the lease; re-join the group when the CF lost it (a new, higher epoch); mark fenced when a peer
        took over. Called by the heartbeat, and at once when a structure does not know this member."""
        admin = self.lease_admin
        with self._membership_lock:
            rc = admin.heartbeat(self.name, self.caller.epoch, self.config.lease_ms)
            if rc == 0:
                if not self.fenced:
                    log.error("%s: fenced (epoch %d is stale): peer recovery took over; restart required",
                              self.name, self.caller.epoch)
                self.fenced = True
                raise FencedError(f"queue manager {self.name} was fenced by peer recovery; restart it")
            if rc < 0:  # the CF was lost and rebuilt: join the group again, with a higher epoch
                self._reclaim_repository()
                self.caller.epoch = admin.join(self.name, {**join_info(self.log_dir, os.getpid()),
                                                           "min_epoch": self.caller.epoch + 1},
                                               self.config.lease_ms)
                self._queue_cache.clear()
                log.warning("%s: re-joined the group after the CF was lost (epoch %d)", self.name,
                            self.caller.epoch)
            else:  # joined, but a structure rebuilt since does not carry our epoch yet
                admin.join_structures(self.name, self.caller.epoch)

    def _reclaim_repository(self) -> None:
        """Tell a new CF where the group's repository is (this member's log root was checked at start), so that a
        member started meanwhile with another log root is refused. A running member never stops over it."""
        try:
            open_group_repository(self.lease_admin, self.config.log_root, who=self.name)
        except RepositoryError as e:
            log.error("%s", e)

    # --- background work --------------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        """Renew the lease every third of it, from the join on (restart recovery may still be running: nothing here
        may assume it finished). Only a fenced member stops renewing: one whose log failed serves non-persistent
        work and keeps its units of work (log_failure) until it is stopped; then its lease lapses."""
        period = self.config.lease_ms / 3000
        # A failed renewal is tried again soon, not a period later: after a cut of 2/3 of the lease, the lease set
        # just under a period before the cut lapsed a moment after the link came back, before the next period's
        # renewal, and peers fenced a member that had been reachable again for most of a second.
        retry = min(period, HEARTBEAT_RETRY_S)
        wait = period
        failing = ""
        stop = self._stop
        while not stop.wait(wait):
            try:
                self.renew_membership()
            except FencedError:
                return
            except Exception as e:  # noqa: BLE001 - the heartbeat must outlive any one failed renewal
                # A dead CF, a transient OOM refusal, a script error on a malformed admin entry: the lease is
                # ours until it lapses, so try again soon. A heartbeat thread that died here let a healthy
                # member's lease lapse for good, and its peers fenced it: the rule is that only a fenced member
                # or a failed log stops renewing (docs/invariants.md, invariant 1).
                what = f"{type(e).__name__}: {e}"
                if what != failing:
                    log.warning("%s: lease renewal failed (will retry every %.1fs): %s", self.name, retry, what)
                failing = what
                wait = retry
                continue
            wait = period
            if failing:
                log.warning("%s: lease renewed again", self.name)
                failing = ""

    def _housekeeping_loop(self) -> None:
        next_expiry = 0.0
        stop = self._stop
        failures = ThrottledLog(log, HOUSEKEEPING_LOG_EVERY_S, level=logging.ERROR)
        last_failed = 0.0  # monotonic time of the last failure logged or counted (0.0: none since the last all-clear)
        while not stop.wait(0.2):
            if self.fenced:
                return
            try:
                self.retry_pending()
                if restore_key_file(self.config.log_root):
                    log.warning("%s: the group's logon key file was gone: written back from this member's copy",
                                self.name)
                if self.log_failed:
                    continue  # the rest logs (recoveries, checkpoints, expiry, the wings' sweepers): not now
                recover_peers(self)
                if self.recauto is not None:
                    self.recauto.check()
                self._checkpoint_when_due()
                note_new_backups(self)
                if time.monotonic() >= next_expiry:
                    next_expiry = time.monotonic() + self.config.expiry_interval_ms / 1000
                    self.expire_messages()
                self.hooks.run_due(time.monotonic())  # the wings' tasks (their sweepers)
            except (MQError, *CF_DOWN) as e:
                log.debug("%s housekeeping: %s", self.name, e)
                continue
            except Exception as e:  # keep the queue manager alive; the failure is in its log (throttled)
                last_failed = time.monotonic()
                failures(failure_kind(e), "%s housekeeping failed: %s: %s", self.name, type(e).__name__, e,
                         exc_info=e)
                continue
            # A whole interval of passes without a failure: say so, with the count not said yet. (Sooner would
            # misread a task that fails each time it is due, with good passes between, as healed.)
            if last_failed and time.monotonic() - last_failed >= HOUSEKEEPING_LOG_EVERY_S:
                last_failed = 0.0
                log.warning("%s housekeeping has not failed for %.0fs (%d failures since the last line not logged)",
                            self.name, HOUSEKEEPING_LOG_EVERY_S, failures.forget())

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
                if self.store_report is not None:
                    self.store_report.expired(ids)
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
                "fsyncs": getattr(stats, "fsyncs", 0), "log_space_low": self.log_space_low,
                "cf_calls": getattr(self.cf, "calls", 0), "cf_round_trips": getattr(self.cf, "round_trips", 0)}


__all__ = ["QueueManager", "QueueManagerConfig", "INCOMMIT", "INBACKOUT", "INDOUBT"]
