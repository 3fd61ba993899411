"""The outcome of a unit of work on the CF: a commit or backout decided (logged and forced when the UOW has
persistent work), then applied on every structure it touched; outcomes the CF could not take wait, pending, and
housekeeping retries them (retry_pending). Part of sqm.core.manager.QueueManager (a mixin: the methods run on the
queue manager's own state)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

import redis

from cfemu import keys
from cfemu.cf import Caller, Structure
from cfemu.entry import Entry
from cfemu.errors import (
    BackedOutError,
    BackupActiveError,
    BadRequestError,
    CompletedByRecoveryError,
    FencedError,
    FloorError,
    LogFailedError,
    MQError,
    OutcomePendingError,
    OutcomeUnknownError,
    StructureFailedError,
)
from sqm.core import records
from sqm.core.cfcall import CF_DOWN, reply_lost
from sqm.core.cfgroup import GroupedCF
from sqm.core.clock import LrsnClock
from sqm.core.config import QueueManagerConfig
from sqm.core.failpoints import failpoint
from sqm.core.records import INBACKOUT, INCOMMIT, INDOUBT, INFLIGHT, Record
from sqm.core.storereport import StoreReport
from sqm.core.uow import UnitOfWork
from sqm.log import RecordLog, RecordRefusedError
from sqm.log.format import LogPosition

log = logging.getLogger("sqm")

# The standings (standing.lua) that leave a PREPARE no yes vote to give: the UOW's outcome decided on the structure by
# recovery, or its work there lost (confirm_prepared).
NO_VOTE = {"B": "has it backed out by recovery", "C": "has it committed by recovery", "A": "has its put committed",
           "L": "lost its work (restored or purged since)"}


@dataclass
class Decided:
    """Units of work whose COMMIT records are appended together (Outcomes.decide_many), to be forced and applied
    (Outcomes.apply_many): the log position of the last, and each one's error (None: none yet)."""

    uows: list[UnitOfWork]
    errors: list[MQError | None]
    position: LogPosition | None = None


class Outcomes:
    """Completing units of work: complete, apply, log_decision, resolve, retry_pending."""

    name: str
    redis: redis.Redis
    caller: Caller
    clock: LrsnClock
    log: RecordLog | None
    uows: dict[str, UnitOfWork]
    uow_lock: threading.RLock
    pending: dict[str, Callable[[], None]]
    counters: dict[str, int]
    store_report: StoreReport | None  # PSTORE-REPORT=YES (sqm.core.storereport)
    log_failed: str  # why the log cannot be written, once it cannot (QueueManager.log_failure)
    _refused_retries: set[str]
    # Per structure, the UOWs of puts committed in one CF operation whose END this member has appended: once a
    # later forced record has taken those ENDs to disk, no redo can come for them, and the next such put tells the
    # CF to drop their tombstones (put_committed.lua).
    _ended_fused: dict[str, list[str]]

    if TYPE_CHECKING:  # the queue manager's own (sqm.core.manager)
        def check_usable(self) -> None: ...
        def cf_call(self, fn: Callable[[], Any]) -> Any: ...
        def structure(self, name: str) -> Structure: ...
        def forget(self, uow: UnitOfWork) -> None: ...
        def append(self, record: Record, *, uow: UnitOfWork | None = None, state: str | None = None) -> None: ...
        def append_many(self, recs: list[Record]) -> None: ...
        def checkpoint(self, why: str) -> None: ...
        def log_failure(self, e: OSError, uow: UnitOfWork | None = None) -> NoReturn: ...
        config: QueueManagerConfig
        cf: GroupedCF
        activity: int

    def complete(self, uow: UnitOfWork, commit: bool, *, reason: str = "application",
                 for_member: str | None = None, pstore_checked: bool = False) -> None:
        """Decide and apply a UOW's outcome: log it (forced) when it has persistent work, then apply it on every
        structure it touched. for_member: peer recovery deciding another member's UOW (a RECOVERY record).
        pstore_checked: the UOW is one put or get outside syncpoint whose own CF script, just now, checked that
        the persistent store is connected (put.lua and get.lua refuse persistent work while it is not); asking
        standing.lua again before the force would answer the same question a few microseconds later at the cost
        of a CF round trip per message (BENCHMARKS.md). Either way the check comes before the force, which is the
        rule (docs/pstore.md): a disconnect after it refuses from the next commit on."""
        self.check_usable()
        prepared = uow.state == INDOUBT  # its coordinator resolves it: a restore keeps it in doubt for that
        # A recovery (restart, or a peer) backing out a UOW carries the data of its persistent gets as the CF
        # holds them: their GET records may have died with the member (a UOW known only from the CF), and the
        # backout raises their backout counts, which a later restore must not forget (invariant 1).
        if commit and uow.persistent and for_member is None and uow.state != INDOUBT and not pstore_checked:
            self._refuse_if_disconnected(uow)
        recovering = not commit and (for_member is not None or reason == "restart")
        carry = not commit and (recovering or self._backup_running(uow))
        if recovering and not uow.persistent and for_member is None and self._gets_data(uow, best_effort=True):
            uow.persistent = True  # its gets are persistent: the backout is logged, forced, like any other
        if commit and uow.redo and for_member is None:
            with self.uow_lock:  # the COMMIT forced below takes these ENDs to disk with it
                for sname in {r[0] for r in uow.redo}:
                    uow.forget.setdefault(sname, []).extend(self._ended_fused.pop(sname, ()))
        # The log cannot be written: a UOW still in flight (no outcome record begun) is backed out without a record.
        # Its log holds no outcome for it, so every recovery (restart, a peer, restore) backs it out as well: the
        # member acts only as its log on disk already decides (docs/pstore.md).
        # A unit of work holding persistent gets is not backed out here: a backout raises their backout counts, and
        # one with no record is not where a restore places it (the restore would put it at its restore point, after
        # later events on those messages). Its entries stay locked until the member stops and a peer, or its
        # restart, backs it out from the log with a record; only a UOW known to hold no persistent get (its puts
        # vanish, as every recovery of an outcome-less UOW makes them vanish) is backed out without a record.
        unlogged = bool(self.log_failed) and not commit and for_member is None and uow.state == INFLIGHT
        if unlogged and uow.persistent and self._holds_persistent_gets(uow):
            uow.doomed = uow.doomed or f"queue manager {self.name} cannot write its log ({self.log_failed})"
            log.warning("%s: unit of work %s holds persistent gets and the log cannot be written (%s): its messages "
                        "stay locked until the member stops and a peer (or its restart) backs it out from its log",
                        self.name, uow.id, self.log_failed)
            return
        if unlogged and uow.persistent:
            log.warning("%s: unit of work %s backed out with no BACKOUT record (the log cannot be written: %s); "
                        "it holds no persistent get, and its log has no outcome for it, which every recovery takes "
                        "as backed out", self.name, uow.id, self.log_failed)
        elif uow.persistent or for_member is not None:
            failpoint("before-log-force")
            # A backout carries what data the CF can give: one the CF cannot answer now is logged without it and
            # finished later (the CF refuses it while a backup runs, and then it is logged again with the data);
            # raising here would leave the UOW's entries locked for good (say the CF's node is lost between the
            # check for a running backup and the read of the gets' data; invariant 1, docs/invariants.md).
            self.log_decision(uow, commit, for_member=for_member, with_data=carry, reason=reason,
                              best_effort=not commit)
            failpoint("after-log-force" if commit else "backout-after-log")
        uow.state = INCOMMIT if commit else INBACKOUT
        self._apply_decided(uow, commit, for_member, prepared)

    def _apply_decided(self, uow: UnitOfWork, commit: bool, for_member: str | None, prepared: bool) -> None:
        """Apply a decided outcome (complete, commit_many): a structure that cannot take it now leaves it pending,
        and the application hears what it may know of it."""
        try:
            self.apply(uow, commit, for_member=for_member)
        except (StructureFailedError, *CF_DOWN) as e:
            if uow.persistent or for_member or not commit:
                # The log decided the outcome (or it is a backout, which is always the outcome of a UOW whose
                # decision reached no log); the CF is not there: finish when it (or its restore) is back. A UOW
                # left unapplied here held its entries locked until the member restarted (B7, CHAOS-RESULTS.md).
                self._finish_later(uow, commit, for_member, e)
                if commit and for_member is None and not prepared:
                    raise self._commit_pending(uow, e) from None
                return
            self._commit_failed(uow, e)
        except FencedError as e:
            if commit and for_member is None:
                raise self._fenced_commit(uow, e) from None
            raise
        finally:
            self.counters["commits" if commit else "backouts"] += 1

    def decide_many(self, uows: list[UnitOfWork], logged: list[Record]) -> Decided:
        """The first half of committing, together, units of work on one structure each whose persistent store was
        checked just now (complete's pstore_checked: by the script of their one put or get outside syncpoint, or by
        their standing check under syncpoint, sqm.core.syncpoint_calls): ``logged`` (their PUT
        and GET records) and their COMMIT records appended under one hold of the lock, not yet forced. The second
        half is ``apply_many``, which forces them (one fsync for every Decided it is given) before it applies any.
        Raises only when no COMMIT was appended; once one was, a failure backs out the units of work not decided
        (their error in ``errors``), and the decided ones go on."""
        self.check_usable()
        decided = Decided(uows, [None] * len(uows))
        if not uows:
            return decided
        if self.activity >= self.config.logload:
            self.checkpoint("logload")
        commits = [records.commit(u.id, self.clock.now(), u.structures) for u in uows]
        assert self.log is not None
        appended = tried = 0  # COMMITs appended; COMMITs whose append began
        try:
            with self.uow_lock:
                for record in logged:
                    self.log.append(record)
                for u, record in zip(uows, commits, strict=True):
                    tried += 1
                    decided.position = self.log.append(record)
                    appended += 1
                    u.first_lrsn = u.first_lrsn or int(record["l"])
                    u.decide(INCOMMIT, record)
        except OSError as e:
            # A COMMIT appended, or whose append failed part way, may be on disk: its outcome is unknown here. One the
            # log refused whole (RecordRefusedError), or never began, is not: its unit of work is refused.
            self._log_failed_for(decided, e, appended if isinstance(e, RecordRefusedError) else tried)
        except Exception as e:
            if not appended:
                raise  # nothing decided: the caller backs each unit of work out
            # The COMMITs appended are decided (a later force takes them to disk whatever happens here): they go on
            # to apply_many, which forces and applies them. The units of work after them are not decided: each is
            # backed out here, and hears so.
            log.error("%s: appending the COMMITs of a batch failed after %d of %d (%s: %s)", self.name, appended,
                      len(uows), type(e).__name__, e, exc_info=e)
            for i in range(appended, len(uows)):
                decided.errors[i] = self._back_out_undecided(uows[i], e)
        self.activity += len(logged) + len(uows)
        return decided

    def _back_out_undecided(self, uow: UnitOfWork, why: Exception) -> MQError:
        """A unit of work of decide_many whose COMMIT was not appended: backed out, as its batch's failure before
        its decision backs it out; its caller's error. What cannot be backed out now, recovery backs out."""
        try:
            self.complete(uow, False, reason="its COMMIT could not be appended")
        except MQError as e:
            return e
        except Exception as e:
            log.error("%s: backing out uow %s failed (%s: %s)", self.name, uow.id, type(e).__name__, e, exc_info=e)
            return MQError(f"internal error: {type(why).__name__}: {why}")
        return BackedOutError(f"unit of work {uow.id} was backed out: its COMMIT could not be appended "
                              f"({type(why).__name__}: {why})")

    def _log_failed_for(self, decided: Decided, e: OSError, maybe_on_disk: int) -> None:
        """The log failed while a batch's records were appended: the first ``maybe_on_disk`` units of work hear that
        their outcome is unknown (their COMMIT may be on disk: the restart decides it), the others that they were
        refused (LogFailedError: no COMMIT of theirs was written, so the restart backs them out; a get's message is
        not delivered, or it would be delivered again then)."""
        for i, u in enumerate(decided.uows):
            if decided.errors[i] is None:
                try:
                    self.log_failure(e, u if i < maybe_on_disk else None)
                except MQError as failed:
                    decided.errors[i] = failed
        decided.position = None

    def apply_many(self, batches: list[Decided], *, applications: bool = False) -> None:
        """The second half (decide_many): every COMMIT of ``batches`` forced by one fsync, then their commits
        applied in one CF round trip (each commit.lua atomic, in order). A commit the round trip did not finish
        (refused, a floor, the CF gone) goes on alone by complete's path, as its own commit would have. Each
        unit of work's error (None: committed) is in its Decided's ``errors``; every COMMIT is on disk, or its
        unit of work has an error, before this returns. ``applications``: the batches hold commits an application
        asked for (under syncpoint), which pass complete's failpoints too, as alone."""
        assert self.log is not None
        batches = [d for d in batches if d.uows]
        if not batches:  # nothing to force (a batch of puts and gets under syncpoint): no failpoint of a force
            return
        failpoint("lifecycles-before-force")
        if applications:
            failpoint("before-log-force")
        for d in batches:
            if d.position is None:
                continue
            try:
                self.log.force(d.position)  # the first force takes the later batches' records with it
            except OSError as e:  # whatever failed in the force (RecordLog.force): the log is not trusted again
                self._log_failed_for(d, e, len(d.uows))  # every COMMIT of d was appended: each may be on disk
        failpoint("lifecycles-after-force")
        if applications:
            failpoint("after-log-force")
        todo = [(d, i, u) for d in batches if d.position is not None for i, u in enumerate(d.uows)
                if d.errors[i] is None]
        # From here every unit of work of ``todo`` has its COMMIT on disk: whatever fails below, each ends applied,
        # or pending (retry_pending completes it) with its error told to its caller. One left neither would hold
        # its entries locked on the CF until the member restarted.
        calls: list[tuple[str, str, list[Any]]] = []
        unmade: list[Exception | None] = []  # each one's call, or why it could not be made (it goes alone)
        for _, _, u in todo:
            try:
                (sname, gen), = u.structures.items()
                calls.append(self.structure(sname).commit_call(self.caller, u.id, gen=gen, lrsn=u.record_lrsn,
                                                               at=u.decided_lrsn))
                unmade.append(None)
            except Exception as e:
                unmade.append(e)
        unreachable: BaseException | None = None  # the CF did not answer the round trip
        sent: list[Any]
        try:
            sent = self.cf_call(lambda: self.cf.run_many(calls)) if calls else []
        except (StructureFailedError, *CF_DOWN) as e:
            sent, unreachable = [e] * len(calls), e
        except MQError as e:
            sent = [e] * len(calls)
        except Exception as e:  # not a refusal the CF names (a reply not understood, a bug): what ran is not known
            log.error("%s: the round trip of %d commits failed (%s: %s); each goes on alone", self.name,
                      len(calls), type(e).__name__, e, exc_info=e)
            sent = [e] * len(calls)
        answers = iter(sent)
        replies = [e if e is not None else next(answers) for e in unmade]
        ended: list[Record] = []
        done: list[UnitOfWork] = []
        for (d, i, u), reply in zip(todo, replies, strict=True):
            if unreachable is not None:
                # Each commit is on disk and waits, pending, as complete's path leaves one the CF cannot take: made
                # again one at a time now, each would wait for the same CF in turn (a hung one: its full timeout
                # each), and every reply of the batch with them.
                self._finish_later(u, True, None, unreachable)
                d.errors[i] = self._commit_pending(u, unreachable)
                self.counters["commits"] += 1
                continue
            try:
                alone = isinstance(reply, BaseException) or Structure.step_more(self.caller, reply)
            except Exception as e:  # a reply this cannot read: the commit goes on alone, as a refused one does
                log.error("%s: the reply to the commit of uow %s cannot be read (%r): it goes on alone", self.name,
                          u.id, reply, exc_info=e)
                alone = True
            if alone:
                d.errors[i] = self._apply_alone(u)
                continue
            self.counters["commits"] += 1
            u.applied.update(u.structures)
            if self.store_report is not None:
                with contextlib.suppress(Exception):  # a report's failure is not the commit's
                    self.store_report.outcome(u, True)
            ended.append(records.end(u.id, self.clock.now()))
            done.append(u)
        try:
            if ended:
                self.append_many(ended)
        except Exception as e:  # applied: a restart completes them again from the log
            if not isinstance(e, LogFailedError):
                log.error("%s: the END records of %d applied commits were not appended", self.name, len(ended),
                          exc_info=e)
        finally:
            for u in done:
                self.forget(u)

    def _apply_alone(self, uow: UnitOfWork) -> MQError | None:
        """A commit forced by apply_many that its round trip did not finish, applied alone as complete applies it:
        its error (None: committed). Whatever that raises, the commit ends applied or pending, never neither."""
        try:
            self._apply_decided(uow, True, None, False)  # counted there
        except MQError as e:
            return e
        except Exception as e:  # on disk, so decided: it waits, pending, and its caller hears so
            log.error("%s: the commit of uow %s failed (%s: %s); it waits, pending", self.name, uow.id,
                      type(e).__name__, e, exc_info=e)
            self._finish_later(uow, True, None, e)
            return self._commit_pending(uow, e)
        return None

    def _holds_persistent_gets(self, uow: UnitOfWork) -> bool:
        """The UOW holds a persistent get on the CF, or a structure cannot say (then it is taken to hold one)."""
        try:
            return bool(self._gets_data(uow))
        except (MQError, *CF_DOWN):
            return True

    def _refuse_if_disconnected(self, uow: UnitOfWork) -> None:
        """The only place a disconnected persistent store refuses a commit (docs/pstore.md): before its COMMIT is
        forced, when a structure holding the UOW answers 'D' (standing.lua). The UOW is backed out everywhere
        (a BACKOUT, never after a COMMIT) and the application gets BackedOutError. Once the COMMIT is logged the
        commit is decided and completes on every structure, disconnected or not (commit.lua no longer refuses it):
        refusing it there would back out on one structure what another had committed (invariant 2). A structure that
        cannot answer is left to the commit's own path (it waits, or is refused there, as before this check).
        A prepared UOW is not asked: it voted yes, and its coordinator decides."""
        for sname in list(uow.structures):
            try:
                standing = self._standing(uow, sname)
            except (MQError, *CF_DOWN):
                continue
            if standing == "D":
                self.complete(uow, False, reason="persistent store disconnected")
                raise BackedOutError(f"unit of work {uow.id} was backed out: structure {sname}: the persistent store "
                                     "is disconnected (cfemu pstore connect)")

    def _fenced_commit(self, uow: UnitOfWork, e: FencedError) -> MQError:
        """What the application learns of a commit during which a peer fenced this member. The peer decides the
        member's work from its log as the peer read it: a COMMIT on disk by then it carries through (unless a
        structure refuses it), anything else it backs out, a COMMIT forced after the peer read the log included.
        This member cannot tell which, so the message says how it is decided, never that it was completed.
        'Failed' is wrong for a logged commit: a put outside syncpoint reported failed would then be delivered (a
        'phantom'; invariant 1, docs/invariants.md)."""
        if uow.persistent:
            return OutcomeUnknownError(
                f"the commit of unit of work {uow.id} was logged when peer recovery fenced {self.name} ({e}): the "
                "peer decides it from this member's log, committed if its COMMIT was on disk when the peer read "
                "the log (and no structure refused it), else backed out; its outcome is not known here")
        if uow.applied:
            done = ", ".join(sorted(uow.applied))
            rest = ", ".join(sorted(set(uow.structures) - uow.applied)) or "none"
            return OutcomeUnknownError(
                f"the commit of unit of work {uow.id} (no persistent work, so no log decides it) was applied on "
                f"{done} when peer recovery fenced {self.name} ({e}): the peer backs out what it held on the other "
                f"structures ({rest}); its outcome there is not known here")
        return BackedOutError(f"unit of work {uow.id} is backed out: peer recovery fenced {self.name} before its "
                              f"commit was applied or logged ({e})")

    def back_out_later(self, uow: UnitOfWork, why: BaseException) -> None:
        """Back out, once the CF answers again (retry_pending), a unit of work in flight with no record in the log
        whose CF calls got no answer (``why``: the CF unreachable): what complete's backout would come to after
        its own wait for the same CF. A batch's units of work (sqm.core.lifecycles) go so, all at once, rather
        than each waiting out its own timeout."""
        assert uow.state == INFLIGHT and not uow.persistent, uow
        uow.state = INBACKOUT
        self._finish_later(uow, False, None, why)
        self.counters["backouts"] += 1

    def _finish_later(self, uow: UnitOfWork, commit: bool, for_member: str | None, why: BaseException) -> None:
        log.warning("%s: %s of uow %s waits for the CF: %s", self.name, "commit" if commit else "backout", uow.id,
                    why)
        self.pending[uow.id] = lambda: self.apply(uow, commit, for_member=for_member)

    def _commit_pending(self, uow: UnitOfWork, e: BaseException) -> OutcomePendingError:
        """What the application learns of its commit, logged (forced), that a structure could not take: the
        structure failed, being restored, or the CF unreachable. The commit waits, pending, and completes when the
        structure is back; but a restore reads the logs once the structure has failed, and one that read them before
        this COMMIT was forced has backed the unit of work out (it was in flight in the logs it read): the retry
        then learns that and logs the BACKOUT. Which of the two it ends as is not known here, so the application is
        never told "committed" (a put told so would be lost; a get told so would be delivered again). A structure
        that answers after the force can no longer be restored without reading it (_refusing_first)."""
        where = ", ".join(sorted(set(uow.structures) - uow.applied)) or "its structures"
        return OutcomePendingError(
            f"the commit of unit of work {uow.id} is logged, but {where} could not take it now ({e}): it completes "
            f"when the structure is back, committed, unless a restore of it read the logs before this commit and "
            f"backed the unit of work out; look for its messages once the structure is ACTIVE (docs/client.md)")

    def _commit_failed(self, uow: UnitOfWork, e: BaseException) -> NoReturn:
        """A commit of a UOW with no persistent work (nothing logged decides it) that the CF did not take. When no
        structure can have applied it, it is backed out (MQRC_BACKED_OUT); when one may have (applied already, or
        its reply lost), the commit is carried through and its outcome is unknown to the application. Either way
        the outcome is finished when the CF is back: never left holding its entries."""
        if uow.applied:
            self._finish_later(uow, True, None, e)
            raise OutcomeUnknownError(f"the commit of unit of work {uow.id} was applied on "
                                      f"{', '.join(sorted(uow.applied))}, but the rest could not take it ({e}); it "
                                      "is finished when the CF is back (its non-persistent work there may be lost)")
        if getattr(e, "maybe_applied", False) or reply_lost(e):
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
        waiting: StructureFailedError | None = None
        for sname in todo:
            try:
                self._apply_one(uow, sname, commit, for_member)
            except StructureFailedError as e:
                # A backout keeps no order between structures: one that answers it cannot take it now (failed,
                # being restored) waits alone, and the rest are released now, so that an application can do its
                # work again on the structures still serving. A CF that does not answer stops the round (the rest
                # would wait the same way), and a commit keeps its order (_refusing_first).
                if commit or getattr(e, "no_answer", False):
                    raise
                waiting = waiting or e
                continue
            uow.applied.add(sname)
            failpoint("during-apply")
        if waiting is not None:
            raise waiting
        if self.store_report is not None and for_member is None:
            self.store_report.outcome(uow, commit)
        if (uow.persistent or for_member is not None) and self.log is not None and not self.log_failed:
            try:
                self.append(records.end(uow.id, self.clock.now()))
            except LogFailedError:
                # Applied already: the outcome stands and the application hears it. With no END on disk, the
                # member's restart (or a peer) completes it again from its log, which the CF answers as done.
                self.pending.pop(uow.id, None)
                self.forget(uow)
                return
            if commit and uow.redo and for_member is None:  # a peer's redo keeps the tombstone for the owner
                with self.uow_lock:
                    for sname in {r[0] for r in uow.redo}:
                        self._ended_fused.setdefault(sname, []).append(uow.id)
        self.pending.pop(uow.id, None)
        self.forget(uow)

    def confirm_prepared(self, uow: UnitOfWork) -> None:
        """After a UOW's PREPARE is forced, ask each of its structures how it stands there (standing.lua), by the
        rule of _refusing_first: a restore reads the logs only once its structure has failed, so a structure that
        answers ACTIVE, holding the UOW's work, can no longer be restored without this PREPARE and keeps the UOW in
        doubt for its coordinator, whichever way it decides. A yes vote needs every structure so. One that is not
        ACTIVE or does not answer may be restored from logs read before the PREPARE, which back the UOW out; one
        that has the UOW's outcome decided by recovery ('B', 'C'; 'A' a put committed) or lost its work there ('L':
        a restore or a purge since the UOW worked there) leaves the coordinator nothing to decide. The UOW is backed
        out (a BACKOUT forced after the PREPARE, which every restore agrees with) and the prepare refused with
        BackedOutError, a no vote; where recovery committed it, the backout cannot undo it, and the prepare answers
        OutcomeUnknownError instead (_vote_no). A peer that fenced this member decides the UOW from its log
        (_fenced_prepare). Cost: one CF round trip per structure of the UOW on top of the prepare's own force, paid
        by two-phase commit only."""
        answers: dict[str, str | BaseException] = {}
        for sname in list(uow.structures):
            try:
                answers[sname] = self._standing(uow, sname)
            except FencedError as e:
                raise self._fenced_prepare(uow, e) from None
            except (MQError, *CF_DOWN) as e:
                answers[sname] = e
        refusing = {s: a for s, a in answers.items() if not isinstance(a, str) or a in NO_VOTE}
        if refusing:
            self._vote_no(uow, refusing)

    def _vote_no(self, uow: UnitOfWork, refusing: dict[str, str | BaseException]) -> NoReturn:
        """Back out a UOW whose PREPARE cannot be a yes vote, and say why. A structure where recovery committed the
        UOW keeps that commit (the backout skips it: nothing there is left to undo, and nothing can be)."""
        why = "; ".join(f"structure {s} " + (NO_VOTE[a] if isinstance(a, str) else f"cannot answer ({a})")
                        for s, a in refusing.items())
        committed = sorted(s for s, a in refusing.items() if a in ("C", "A"))
        uow.applied.update(committed)
        try:
            self.complete(uow, False, reason="prepare refused")
        except FencedError as e:
            raise self._fenced_prepare(uow, e) from None
        except CompletedByRecoveryError as e:  # recovery committed it on a structure since it was asked
            committed.append(str(e))
        if committed:
            raise OutcomeUnknownError(f"unit of work {uow.id} was not prepared: {why}; recovery committed it on "
                                      f"{', '.join(committed)}, and it is backed out on the rest")
        raise BackedOutError(f"unit of work {uow.id} was backed out, not prepared: {why}; a restore of the "
                             "structure may not see its PREPARE (the coordinator backs out)")

    def _fenced_prepare(self, uow: UnitOfWork, e: FencedError) -> OutcomeUnknownError:
        """What the coordinator learns of a prepare during which a peer fenced this member: the peer decides the
        UOW from this member's log as it read it, in doubt if its PREPARE was on disk by then (the coordinator
        resolves it on this member once restarted), else backed out. This member cannot tell which."""
        return OutcomeUnknownError(
            f"the PREPARE of unit of work {uow.id} was logged when peer recovery fenced {self.name} ({e}): in doubt "
            f"if the peer read it, else backed out; ask for it in doubt on {self.name} once it is restarted")

    def _standing(self, uow: UnitOfWork, sname: str) -> str:
        """How the UOW stands on structure ``sname`` (standing.lua): raises as commit would when it is not ACTIVE."""
        return str(self.cf_call(partial(self.structure(sname).standing, self.caller, uow.id,
                                        gen=uow.structures[sname])))

    def _refusing_first(self, uow: UnitOfWork, todo: list[str]) -> list[str]:
        """Before a commit touches any of several structures, ask each how the UOW stands there (standing.lua,
        after the COMMIT is forced): one that is not ACTIVE makes the whole commit wait, applied nowhere yet
        (StructureFailedError: the caller keeps it pending); one that will refuse it (backed out by recovery, or its
        work there lost with the CF) goes first, so that the UOW is backed out everywhere before it is committed
        anywhere. A restore reads the logs only once its structure has failed, so a structure that answers here,
        after the COMMIT was forced, can no longer be restored without seeing it. A disconnected persistent store
        ('D') does not refuse a decided commit: it refused before the force (_refuse_if_disconnected)."""
        refusing = [sname for sname in todo if self._standing(uow, sname) in ("B", "L")]
        return refusing + [sname for sname in todo if sname not in refusing]

    def _apply_one(self, uow: UnitOfWork, sname: str, commit: bool, for_member: str | None) -> None:
        s = self.structure(sname)
        gen = uow.structures[sname]
        logged = uow.persistent or for_member is not None
        # The record's own LRSN is checked against the floor; the entries are stamped with the LRSN at which the
        # decision counts (sqm.core.records.counts_at), which a re-log below keeps.
        lrsn = (uow.record_lrsn or uow.decided_lrsn) if logged else 0
        at = uow.decided_lrsn if logged else 0
        has_data = uow.data_logged  # else the CF refuses a get backout while a backup runs (BACKUPACTIVE)
        by_recovery = for_member is not None
        while True:
            try:
                if commit and any(r[0] == sname for r in uow.redo):
                    # A put committed in one CF operation is the UOW's only work here: no commit.lua to call.
                    self._redo_puts(uow, sname, lrsn, at)
                elif commit:
                    self.cf_call(partial(s.commit, self.caller, uow.id, gen=gen, lrsn=lrsn, at=at,
                                          decided_by_recovery=by_recovery))
                else:
                    self.cf_call(partial(s.backout, self.caller, uow.id, gen=gen, lrsn=lrsn, at=at,
                                          has_data=has_data, decided_by_recovery=by_recovery))
                return
            except FloorError as e:
                # Our record sits below the recovery floor of a backup that started meanwhile: log afresh (the
                # re-log still counts where the first record did; a put to redo is logged afresh before it).
                self.counters["floor_retries"] += 1
                self.clock.observe(e.floor)
                if commit:
                    self._relog_puts(uow, sname)
                lrsn = self.log_decision(uow, commit, for_member=for_member, with_data=has_data)
            except BackupActiveError:
                if self.log_failed:  # the gets' data cannot be logged: the backout waits for the backup to end
                    raise StructureFailedError(f"a backup of {sname} is running and the log cannot carry the data "
                                               f"of the gets of unit of work {uow.id}: its backout waits") from None
                lrsn = self.log_decision(uow, commit, for_member=for_member, with_data=True)
                has_data = True
            except CompletedByRecoveryError:
                if commit:
                    return
                raise
            except BackedOutError as e:
                if not commit:
                    return
                if uow.applied and not logged:
                    # No log decides a UOW with no persistent work, and no restore keeps a non-persistent message
                    # (docs/pstore.md): its work here went with the structure (or its recovery), which is all a
                    # commit of it can come to here. The commit is complete, never pending for good.
                    log.warning("%s: structure %s refused the commit of uow %s (no persistent work), which %s "
                                "committed already: its non-persistent work there is lost (%s)", self.name, sname,
                                uow.id, ", ".join(sorted(uow.applied)), e)
                    return
                if uow.applied:
                    # Committed on another structure already: a backout now would split the UOW (and a BACKOUT
                    # after its COMMIT tells a restore to undo what that structure committed: invariant 2). The
                    # commit stays decided; it waits, pending, for this structure to take it.
                    log.error("%s: structure %s refused the commit of uow %s, which %s committed already: kept "
                              "pending (%s)", self.name, sname, uow.id, ", ".join(sorted(uow.applied)), e)
                    raise StructureFailedError(f"structure {sname} refused the commit of unit of work {uow.id} "
                                               f"after {', '.join(sorted(uow.applied))} applied it ({e}): it waits "
                                               "for the structure") from None
                self._backed_out_by_recovery(uow, for_member)
                raise

    def _redo_puts(self, uow: UnitOfWork, sname: str, lrsn: int, at: int) -> None:
        """The UOW's puts committed in one CF operation on this structure (put_committed.lua), from their records:
        applied once, whoever calls (the CF keeps a tombstone for it), so every call completes the logged decision.
        Each put counts after its own record."""
        puts = [r for r in uow.redo if r[0] == sname]
        if not puts:
            return
        s = self.structure(sname)
        forget = uow.forget.pop(sname, [])
        try:
            for _, wire, data, put_lrsn in puts:
                self.cf_call(partial(s.put_committed, self.caller, Entry.from_wire(wire), data, uow=uow.id,
                                     gen=uow.structures[sname], put_lrsn=put_lrsn, lrsn=lrsn,
                                     at=at if at > put_lrsn else put_lrsn + 1, redo=True, forget=forget))
                forget = []
        except BaseException:
            if forget:  # not told to the CF: the next such put tells it
                with self.uow_lock:
                    self._ended_fused.setdefault(sname, []).extend(forget)
            raise

    def _relog_puts(self, uow: UnitOfWork, sname: str) -> None:
        """A put to redo whose record lies below a backup's floor is logged afresh above it, so that a restore from
        that backup finds it (the re-logged decision after it is forced with it)."""
        for r in uow.redo:
            if r[0] == sname:
                r[3] = self.clock.now()
                self.append(records.put(uow.id, r[3], structure=sname, gen=uow.structures[sname], entry=r[1],
                                        data=r[2], redo=True))

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

    def claim_xid(self, uow: UnitOfWork, xid: str) -> None:
        """Give ``uow`` the xid it is being prepared with, refused (BadRequestError, nothing changed) while another
        unit of work of this member holds it: in doubt, being prepared, or resolved with its outcome not yet
        applied. An xid names one unit of work until it is decided: a coordinator that lost a prepare's reply finds
        its unit of work by the xid (indoubt) and resolves what it finds, and a second one under the same xid (the
        branch done again, or another application's) would be committed with it. Checked and set under the UOW
        table's lock, so two prepares at once cannot both take it."""
        with self.uow_lock:
            if any(u.xid == xid and u is not uow for u in self.uows.values()):
                raise BadRequestError(f"prepare: the xid {xid!r} already names a unit of work on {self.name}, in "
                                      "doubt or its resolution not yet applied (an xid names one until then); this "
                                      "unit of work stays open")
            uow.xid = xid

    def resolve(self, uow_id: str, commit: bool, *, check: Callable[[UnitOfWork], None] | None = None) -> None:
        """Resolve an in-doubt UOW (the external coordinator's decision), also after a restart. check (a caller's
        authorization: it raises to refuse; quick, it runs under the UOW table's lock) is run on the UOW found in
        doubt, before anything is done: a check made by the caller beforehand could find the UOW not yet in doubt
        and let it through. It runs before the claim, so that a refused caller never holds the UOW, even for a
        moment: one guessing ids (they are predictable) would otherwise make its coordinator's resolve find it
        "being resolved" as often as it guessed.

        A UOW has one decision: the first resolve claims it (found in doubt and claimed in one step) and any other
        is refused until the claim ends. A claim ends without a decision only when none was logged (the check
        refused, or the log could not be written, which stops the member's further decisions): then the UOW is
        still in doubt and may be resolved again. Two resolves both logged would leave COMMIT and BACKOUT in the
        log, and a restore follows the last one (restore.settle), whatever the CF applied."""
        with self.uow_lock:
            uow = self.uows.get(uow_id)
            if uow is None or uow.state != INDOUBT:
                raise BadRequestError(f"unit of work {uow_id} is not in doubt on {self.name}")
            if check is not None:
                check(uow)
            if uow.resolving:
                raise BadRequestError(f"unit of work {uow_id} is being resolved on {self.name}: it takes one "
                                      "resolution")
            uow.resolving = True
        try:
            self.complete(uow, commit, reason="resolved by coordinator")
        except BaseException:
            with self.uow_lock:
                if uow.state == INDOUBT:  # nothing decided: the UOW may be resolved again
                    uow.resolving = False
            raise

    def retry_pending(self) -> int:
        """Try again each decided outcome the CF could not take (housekeeping's first job); returns how many went
        through. A CF not reachable stops the round (the others would wait the same way); a structure not back yet
        (or refusing, pending, a commit another structure took) keeps only that UOW waiting. A retry refused for a
        reason of its own, or failing for one no one names, is that UOW's alone: it stays pending and is tried
        again, and neither stops the others' retries nor the rest of housekeeping (peer recovery, RECAUTO, expiry):
        a backout blocked so would leave its gets locked (invariant 1, docs/invariants.md). Said once a UOW,
        at warning level (housekeeping logs its own errors at debug)."""
        done = 0
        for uid, fn in list(self.pending.items()):
            try:
                fn()
                self.pending.pop(uid, None)
                done += 1
            except BackedOutError:
                self.pending.pop(uid, None)
            except StructureFailedError:
                continue  # that UOW's structure is not back yet: the others' may be
            except CF_DOWN:
                break
            except Exception as e:  # that UOW's own (a refusal, or a failure no one names): it stays pending
                if uid not in self._refused_retries:
                    self._refused_retries.add(uid)
                    log.warning("%s: the pending %s was refused, tried again later: %s", self.name, uid, e,
                                exc_info=None if isinstance(e, MQError) else e)
        self._refused_retries &= set(self.pending)
        return done


__all__ = ["Outcomes"]
