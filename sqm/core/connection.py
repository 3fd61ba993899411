"""The application's connection to a queue manager (like MQCONN): put, get, browse and syncpoint, holding at
most one current unit of work. The queue manager itself (log, CF calls, completion) is sqm.core.manager."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from cfemu.admin import QueueDef
from cfemu.cf import CF, Browsed, Caller, Structure
from cfemu.entry import Entry, check_properties
from cfemu.errors import (
    BackedOutError,
    BadRequestError,
    ClientGoneError,
    FencedError,
    InDoubtError,
    MessageTooBigError,
    MQError,
    NoMessageError,
    NotJoinedError,
    OutcomeUnknownError,
    StructureFailedError,
    SyncpointLimitError,
    TruncatedMessageError,
)
from cfemu.limits import CF_STEP, CF_STEP_BYTES, check_id
from cfemu.settings import ENV_MAX_UMSGS
from sqm.core import records
from sqm.core.client_watch import ClientWatch
from sqm.core.clock import LrsnClock, now_ms
from sqm.core.config import QueueManagerConfig
from sqm.core.failpoints import failpoint
from sqm.core.messaging import UnitOfWorkScope
from sqm.core.outcomes import Decided
from sqm.core.random_bytes import random_bytes
from sqm.core.records import INDOUBT, INFLIGHT, Record
from sqm.core.scans import ScanSlots
from sqm.core.uow import UnitOfWork
from sqm.request_slots import nap

log = logging.getLogger("sqm")

# MQ's expiry is a 32-bit count of tenths of a second: bounded so that expiry arithmetic cannot overflow.
MAX_EXPIRY_MS = (2**31 - 1) * 100



class MemberWork(Protocol):
    """What a member's work runs on, for a connection and for the log's helpers (sqm.core.member.LogUser): its
    identity in CF calls, its LRSN clock, its counters and its table of units of work."""

    @property
    def name(self) -> str: ...
    @property
    def caller(self) -> Caller: ...
    @property
    def clock(self) -> LrsnClock: ...
    @property
    def counters(self) -> dict[str, int]: ...
    @property
    def uows(self) -> dict[str, UnitOfWork]: ...


class QueueManagerPort(MemberWork, Protocol):
    """What a connection uses of its queue manager (sqm.core.manager.QueueManager is one)."""

    @property
    def config(self) -> QueueManagerConfig: ...
    @property
    def log_failed(self) -> str:
        """Why the log cannot be written (empty: it can)."""
        ...
    @property
    def scans(self) -> ScanSlots:
        """The member's scan slots: each call of a multi-call scan runs in one (sqm.core.scans)."""
        ...

    def check_usable(self) -> None: ...
    def queue_def(self, queue: str) -> QueueDef: ...
    def structure(self, name: str) -> Structure: ...
    @property
    def cf(self) -> CF: ...

    def cf_call(self, fn: Callable[[], Any]) -> Any: ...
    def ensure_log_space(self) -> None: ...
    def new_uow(self) -> UnitOfWork: ...
    def forget(self, uow: UnitOfWork) -> None: ...
    def append(self, record: Record, *, uow: UnitOfWork | None = None, state: str | None = None) -> None: ...
    def append_many(self, recs: list[Record]) -> None: ...
    def note_store(self, uow: UnitOfWork, record: Record) -> None: ...
    def complete(self, uow: UnitOfWork, commit: bool, *, reason: str = "application",
                 for_member: str | None = None, pstore_checked: bool = False) -> None: ...
    def confirm_prepared(self, uow: UnitOfWork) -> None: ...
    def claim_xid(self, uow: UnitOfWork, xid: str) -> None: ...
    def decide_many(self, uows: list[UnitOfWork], logged: list[Record]) -> Decided: ...
    def back_out_later(self, uow: UnitOfWork, why: BaseException) -> None: ...
    def apply_many(self, batches: list[Decided], *, applications: bool = False) -> None: ...


@dataclass
class Message:
    body: bytes
    queue: str = ""
    msgid: bytes = b""
    correlid: bytes = b""
    priority: int = 0
    persistent: bool = True
    expiry: int = 0  # absolute ms since the epoch, 0 = never
    put_time: int = 0
    backout_count: int = 0
    properties: dict[str, Any] = field(default_factory=dict)
    entry_id: str = ""

    @classmethod
    def from_entry(cls, entry: Entry, data: bytes) -> Message:
        return cls(body=data, queue=entry.queue, msgid=bytes.fromhex(entry.msgid),
                   correlid=bytes.fromhex(entry.correlid), priority=entry.priority, persistent=entry.persistent,
                   expiry=entry.expiry, put_time=entry.put_time, backout_count=entry.backout_count,
                   properties=entry.properties, entry_id=entry.id)



@dataclass
class PutSpec:
    """One message of a batch of puts (Connection.put_batch): put's arguments."""

    queue: str
    body: bytes
    persistent: bool = True
    priority: int = 0
    msgid: bytes | None = None
    correlid: bytes = b""
    expiry_ms: int = 0
    properties: dict[str, Any] | None = None


@dataclass
class BatchResult:
    """What a batch of puts or gets did. ``messages``: those that took effect, in the order of the batch (each is
    in the unit of work, or committed when ``committed``). ``error``: the first refusal of a message of the
    batch (the others were done); then nothing was committed, unless the batch ran outside syncpoint, whose
    messages that took effect are committed as single puts outside syncpoint would be. A get batch whose commit
    is logged but pending (``error`` an OutcomePendingError: a structure could not take it then) delivers its
    messages all the same, as a get outside syncpoint does: never consumed for nobody."""

    messages: list[Message]
    error: MQError | None = None
    committed: bool = False


class Connection(UnitOfWorkScope):
    """A connection handle (like MQCONN): holds at most one current UOW."""

    def __init__(self, qm: QueueManagerPort, gone: ClientWatch | None = None) -> None:
        self.qm = qm
        self.uow: UnitOfWork | None = None
        # The unit of work this handle prepared last, until the handle begins another: its coordinator's to
        # resolve, which a commit or backout asked here meanwhile is told (refuse_prepared).
        self.prepared: UnitOfWork | None = None
        # Set when the application behind this handle has left (the service's client disconnected): a waiting
        # get stops waiting, and a get outside syncpoint that found a message backs it out instead of consuming
        # it for nobody (invariant 1, docs/invariants.md).
        self.gone = gone or ClientWatch()

    def _current_uow(self) -> UnitOfWork:
        if self.uow is None:
            self.uow = self.qm.new_uow()
            self.prepared = None
        return self.uow

    # --- put ----------------------------------------------------------------------------------------------
    def put(self, queue: str, body: bytes, *, persistent: bool = True, syncpoint: bool = True, priority: int = 0,
            msgid: bytes | None = None, correlid: bytes = b"", expiry_ms: int = 0,
            properties: dict[str, Any] | None = None, counted: bool = True) -> Message:
        """Put a message. ``counted`` False: a wing's bookkeeping entry, not an application's message; it does not
        count towards the unit of work's MAXUMSGS (QueueManagerConfig.max_umsgs)."""
        qm = self.qm
        qm.check_usable()
        qdef, entry = self._new_entry(PutSpec(queue, body, persistent, priority, msgid, correlid, expiry_ms,
                                              properties))
        if persistent:
            qm.ensure_log_space()  # a full circular log refuses new persistent work, with the reason
        uow = self._current_uow() if syncpoint else None
        if uow is not None and counted:
            self._check_umsgs(uow, "put", queue)
        self._put_entry(qdef.structure, entry, bytes(body), uow)
        if uow is not None and counted:
            uow.umsgs += 1
        qm.counters["puts"] += 1
        return Message.from_entry(entry, bytes(body))

    def _new_entry(self, spec: PutSpec) -> tuple[QueueDef, Entry]:
        """A put's checks (nothing is changed when one fails) and the entry it makes."""
        qdef = self.qm.queue_def(spec.queue)
        queue, body, priority, expiry_ms = spec.queue, spec.body, spec.priority, spec.expiry_ms
        msgid, correlid = spec.msgid, spec.correlid
        if not isinstance(body, bytes | bytearray):
            raise BadRequestError(f"message body must be bytes, not {type(body).__name__}")
        if len(body) > qdef.max_msg_length:
            raise MessageTooBigError(f"message of {len(body)} bytes exceeds {queue}'s limit of "
                                     f"{qdef.max_msg_length}")
        if not 0 <= priority <= 9:
            raise BadRequestError(f"priority must be 0-9, not {priority}")
        if not 0 <= expiry_ms <= MAX_EXPIRY_MS:
            raise BadRequestError(f"expiry must be 0-{MAX_EXPIRY_MS} ms (MQ's limit), not {expiry_ms}")
        try:
            props = check_properties(spec.properties or {})
            if msgid is not None:
                check_id("msgid", msgid)
            check_id("correlid", correlid)
        except ValueError as e:
            raise BadRequestError(str(e)) from None
        t = now_ms()
        entry = Entry(id=random_bytes(12).hex(), queue=queue, priority=priority, persistent=spec.persistent,
                      msgid=(msgid if msgid is not None else random_bytes(24)).hex(), correlid=correlid.hex(),
                      expiry=t + expiry_ms if expiry_ms else 0, put_time=t, properties=props)
        return qdef, entry

    def _check_umsgs(self, uow: UnitOfWork, what: str, queue: str) -> None:
        """MAXUMSGS: refuse the put or get that would take the unit of work past the queue manager's limit. Nothing
        is changed and the unit of work stays open: it can be committed (the messages within the limit) or backed
        out, as IBM MQ leaves it."""
        limit = self.qm.config.max_umsgs
        if uow.umsgs >= limit:
            raise SyncpointLimitError(
                f"{what} on {queue} refused: unit of work {uow.id} holds {uow.umsgs} messages, the limit of queue "
                f"manager {uow.owner} (MAXUMSGS {limit}); commit or back it out, or raise the limit (sqm run "
                f"--max-umsgs, ${ENV_MAX_UMSGS})")

    def _put_entry(self, sname: str, entry: Entry, body: bytes, uow: UnitOfWork | None) -> None:
        qm = self.qm
        s = qm.structure(sname)
        if uow is not None:
            if uow.state != INFLIGHT:
                raise BadRequestError(f"unit of work {uow.id} is {uow.state}; commit or back it out first")
            cf, gen, _ = self._uow_cf_call(uow, sname, partial(s.put, qm.caller, entry, body, uow=uow.id,
                                                               gen=uow.structures.get(sname, 0)))
            uow.structures[sname] = gen
            uow.operations += 1
            failpoint("put-after-cf")
            if entry.persistent:
                uow.persistent = True
                rec = records.put(uow.id, cf, structure=sname, gen=gen, entry=entry.wire(), data=body)
                qm.append(rec)
                qm.note_store(uow, rec)
            return
        if not entry.persistent:
            try:
                qm.cf_call(lambda: s.put(qm.caller, entry, body))
            except StructureFailedError as e:
                if e.maybe_applied:  # a lost reply is an unknown outcome, never "failed": the put may be there
                    raise OutcomeUnknownError(f"the CF's reply to the put of message {entry.id} on {entry.queue} "
                                              f"was lost ({e}): it may or may not be on the queue") from None
                raise
            return
        # A persistent put outside syncpoint is a unit of work of its own, so that every retry, peer recovery and
        # restore treats it like any UOW: the put goes to the CF first (put.lua: refused there, with nothing logged,
        # when the structure is not ACTIVE, full or its persistent store disconnected), then its PUT and forced
        # COMMIT are logged and the commit applied. The member does not make the put committed in one CF operation
        # (put_committed.lua): see docs/cf-layout.md, "put_committed.lua is not used by members".
        own = qm.new_uow()
        try:
            self._put_entry(sname, entry, body, own)
        except BaseException:
            self._abandon(own)
            raise
        qm.complete(own, True, pstore_checked=True)  # put.lua refused it if the store was disconnected

    # --- get ----------------------------------------------------------------------------------------------
    def get(self, queue: str, *, syncpoint: bool = True, wait_ms: int = 0, msgid: bytes | None = None,
            correlid: bytes | None = None, max_length: int = 0, counted: bool = True) -> Message:
        """Take the next message. ``max_length`` (0: any): the longest message, data plus stored descriptor, the
        caller can carry (the service's frame); a longer one raises TruncatedMessageError and stays untouched.
        ``counted`` False: a wing's bookkeeping entry, not counted towards MAXUMSGS (put)."""
        qm = self.qm
        qm.check_usable()
        qdef = qm.queue_def(queue)
        if msgid is not None and correlid is not None:
            raise BadRequestError("get by message id or by correlation id, not both")
        try:
            for kind, wanted in (("msgid", msgid), ("correlid", correlid)):
                if wanted is not None:
                    check_id(kind, wanted)
        except ValueError as e:
            raise BadRequestError(str(e)) from None
        match, value = ("m", msgid.hex()) if msgid is not None else ("c", correlid.hex()) if correlid else ("", "")
        own = None if syncpoint else qm.new_uow()
        uow = own or self._current_uow()
        if uow.state != INFLIGHT:
            raise BadRequestError(f"unit of work {uow.id} is {uow.state}; commit or back it out first")
        s = qm.structure(qdef.structure)
        deadline = time.monotonic() + wait_ms / 1000
        delay = 0.002
        # The first attempt asks only whether the client was seen to leave (the flag); from the first wait on, each
        # attempt looks at its connection too (a service's watch reads the socket: a system call, and with it a
        # hand-off of the GIL, per get). A request that waited for its slot was looked at then
        # (sqm.service.server), and a get outside syncpoint looks again before its message is committed.
        waited = False
        try:
            while True:
                if self.gone.is_set() if waited else self.gone.seen_to_leave():
                    raise ClientGoneError(f"the client left while waiting for a message on {queue}")
                if own is None and counted:
                    self._check_umsgs(uow, "get", queue)
                got = self._uow_cf_call(uow, qdef.structure, lambda: s.get(
                    qm.caller, queue, uow=uow.id, gen=uow.structures.get(qdef.structure, 0), match=match,
                    value=value, now_ms=now_ms(), max_length=max_length))
                gen, entry, data = got.gen, got.entry, got.data
                uow.structures[qdef.structure] = gen
                if entry is not None:
                    assert data is not None
                    uow.operations += 1
                    if entry.persistent:
                        uow.persistent = True
                        rec = records.get(uow.id, entry.lrsn, structure=qdef.structure, gen=gen,
                                          entry_id=entry.id, queue=queue)
                        qm.append(rec)
                        qm.note_store(uow, rec)
                    if self._is_poison(qdef, entry):
                        self._move_to_backout_queue(qdef, entry, data, uow)
                        continue
                    if own is None and counted:
                        uow.umsgs += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoMessageError(f"no message available on {queue}")
                # The last look is at the end of the wait, never a poll interval past it: a message taken then is
                # answered to a caller that may have stopped waiting, and an empty queue is answered late.
                nap(min(delay, left))
                waited = True
                delay = min(delay * 2, 0.05)
        except BaseException as e:
            if uow.operations == 0 and not uow.doomed:  # nothing taken: no UOW to keep (an idle connection holds none)
                qm.forget(uow)
                if own is None:
                    self.uow = None
            elif own is not None and not own.doomed and isinstance(e, NoMessageError | ClientGoneError):
                # Outside syncpoint, poison messages moved to the backout queue on the way are this get's work
                # alone: they stay moved. Backed out, a poison message alone on its queue went back to its head at
                # every get, its backout count climbing, and never reached the backout queue.
                qm.complete(own, True)
            elif own is not None:
                qm.complete(own, False)
            raise
        if own is not None and self.gone.is_set():  # nobody to deliver it to: the message stays on the queue
            qm.complete(own, False)
            raise ClientGoneError(f"the client left before a message from {queue} could be delivered")
        qm.counters["gets"] += 1  # a get that took a message counts before its commit (as in syncpoint)
        message = Message.from_entry(entry, data)
        if own is not None:
            # get.lua refused a persistent message while disconnected: that check covers the commit only when the
            # get is the UOW's one piece of work. A poison message moved on the way (a get and a put) was checked
            # when it moved, perhaps a wait_ms ago; the message delivered may be non-persistent (taken while
            # disconnected): then standing.lua asks before the force, as for any UOW.
            try:
                qm.complete(own, True, pstore_checked=own.operations == 1)
            except OutcomeUnknownError as e:
                # Pending (a structure could not take it) or unknown (the log failed as its COMMIT was written): the
                # message is taken and its get logged, or perhaps logged: delivered with the error (e.message), so
                # that it is never consumed for nobody, and the application learns its get is not known done: a
                # restore that read the logs before it, or a restart that finds no COMMIT, makes it available again,
                # and then it is delivered again (at least once, never lost, never two gets both told done;
                # docs/client.md).
                log.warning("%s: the get of message %s from %s outside syncpoint is delivered with its outcome "
                            "not known: %s", qm.name, entry.id, queue, e)
                e.message = message
                raise
        return message

    def _uow_cf_call(self, uow: UnitOfWork, sname: str, fn: Callable[[], Any]) -> Any:
        """A CF call that works under ``uow`` on structure ``sname``. When the CF did not answer it, the member
        cannot know what it did there (a reply lost on a cut link means the script may have run after the member
        stopped waiting): the structure joins the UOW, so that its backout reaches it, and the UOW can only be
        backed out. A UOW that forgot such a call left its entry locked for good (B7, CHAOS-RESULTS.md). A
        structure that answered (FAILED, not in the CF) changed nothing: the UOW goes on."""
        try:
            return self.qm.cf_call(fn)
        except StructureFailedError as e:
            if not e.no_answer:
                raise
            uow.structures.setdefault(sname, 0)
            uow.doomed = uow.doomed or f"a CF call of it on {sname} failed ({e})"
            raise

    def _is_poison(self, qdef: QueueDef, entry: Entry) -> bool:
        return bool(qdef.backout_threshold and qdef.backout_queue
                    and entry.backout_count >= qdef.backout_threshold)

    def _move_to_backout_queue(self, qdef: QueueDef, entry: Entry, data: bytes, uow: UnitOfWork) -> None:
        """A poison message moves to the backout queue inside the same UOW (a get plus a put, all or nothing)."""
        bq = self.qm.queue_def(qdef.backout_queue)
        moved = Entry(id=random_bytes(12).hex(), queue=bq.name, priority=entry.priority, persistent=entry.persistent,
                      msgid=entry.msgid, correlid=entry.correlid, expiry=entry.expiry, put_time=entry.put_time,
                      backout_count=entry.backout_count, properties=entry.properties)
        self._put_entry(bq.structure, moved, data, uow)

    # --- batches --------------------------------------------------------------------------------------------
    # A batch is N puts or N gets with the semantics of N single calls in one unit of work, made in one CF round
    # trip (CF.run_many: each script atomic, applied in order; gets that met more expired messages than one call
    # moves are made again in a round of their own: get_batch) and, with its commit, one forced log write. Every
    # message the CF took is in the unit of work (a persistent one with its record appended); a refusal of one is
    # reported beside the others, and the unit of work is then left open with what was done (never committed by
    # the batch), as after a refused single call. Records are forced only by the commit, before the reply.
    def put_batch(self, specs: list[PutSpec], *, syncpoint: bool = True, commit: bool = False) -> BatchResult:
        """Put every message of ``specs``, in order. Under syncpoint they join the current unit of work, which
        ``commit`` then commits. Outside syncpoint the batch is a unit of work of its own, committed (forced)
        before this returns; a refused message leaves the others committed, as single puts would. A batch that
        would take the unit of work past MAXUMSGS is refused whole, before anything is done."""
        qm = self.qm
        qm.check_usable()
        if not specs:
            raise BadRequestError("a batch of puts needs at least one message")
        if commit and not syncpoint:
            raise BadRequestError("a batch outside syncpoint commits on its own: 'commit' is for one under syncpoint")
        made = [self._new_entry(spec) for spec in specs]
        if any(spec.persistent for spec in specs):
            qm.ensure_log_space()
        own = None if syncpoint else qm.new_uow()
        uow = own or self._current_uow()
        if uow.state != INFLIGHT:
            raise BadRequestError(f"unit of work {uow.id} is {uow.state}; commit or back it out first")
        if own is None:
            limit = qm.config.max_umsgs
            if uow.umsgs + len(specs) > limit:
                raise SyncpointLimitError(
                    f"a batch of {len(specs)} puts refused: unit of work {uow.id} holds {uow.umsgs} messages, and "
                    f"the limit of queue manager {uow.owner} is {limit} (MAXUMSGS); nothing was put")
        fresh = uow.operations == 0
        bodies = [bytes(spec.body) for spec in specs]
        try:
            def call(i: int) -> tuple[str, str, list[Any]]:
                qdef, entry = made[i]
                s = qm.structure(qdef.structure)
                return s.put_call(qm.caller, entry, bodies[i], uow=uow.id,
                                  gen=uow.structures.get(qdef.structure, 0))

            replies = self._batch_cf_call([uow] * len(made), [q.structure for q, _ in made], call, len(made))
            done: list[Message] = []
            error: MQError | None = None
            logged: list[Record] = []
            checked: set[str] = set()  # structures whose pstore a persistent put of this batch checked
            gens: dict[str, int] = {}
            for i, raw in enumerate(replies):
                if isinstance(raw, BaseException):
                    error = error or _batch_error(raw, i)
                    continue
                qdef, entry = made[i]
                reply = Structure.put_reply(qm.caller, raw)
                self._same_generation(uow, gens, qdef.structure, reply.gen)
                uow.operations += 1
                if entry.persistent:
                    uow.persistent = True
                    checked.add(qdef.structure)
                    logged.append(records.put(uow.id, reply.clock, structure=qdef.structure, gen=reply.gen,
                                              entry=entry.wire(), data=bodies[i]))
                done.append(Message.from_entry(entry, bodies[i]))
            qm.append_many(logged)
            for rec in logged:
                qm.note_store(uow, rec)
            failpoint("batch-before-force")
        except BaseException:
            if own is not None:
                self._abandon(own)
            raise
        qm.counters["puts"] += len(done)
        pstore_checked = fresh and set(uow.structures) <= checked
        if own is not None:
            if not own.operations and not own.doomed:
                qm.forget(own)
                return BatchResult(done, error)
            qm.complete(own, True, pstore_checked=pstore_checked)
            return BatchResult(done, error, committed=True)
        uow.umsgs += len(done)
        if error is None and commit:
            self._commit(pstore_checked)
            return BatchResult(done, None, committed=True)
        return BatchResult(done, error)

    def get_batch(self, queue: str, limit: int, *, wait_ms: int = 0, max_bytes: int = 0, each: int = 0,
                  commit: bool = False) -> BatchResult:
        """Take up to ``limit`` messages from ``queue`` under syncpoint, in get order, and with ``commit`` commit the
        unit of work. ``max_bytes`` (0: any) bounds the messages' lengths (data plus stored descriptor, plus
        ``each`` per message) that the caller can carry: each message may have its share of it, and a message
        longer than its share ends the batch unless it is the first (it is then taken alone, if it fits the
        whole). No more than MAXUMSGS allows are taken (none left: SyncpointLimitError, as a single get).
        ``wait_ms``: when no message is there, wait that long for one (then it is taken alone)."""
        qm = self.qm
        qm.check_usable()
        qdef = qm.queue_def(queue)
        if limit < 1:
            raise BadRequestError(f"a batch of gets takes at least one message, not {limit}")
        uow = self._current_uow()
        if uow.state != INFLIGHT:
            raise BadRequestError(f"unit of work {uow.id} is {uow.state}; commit or back it out first")
        room = qm.config.max_umsgs - uow.umsgs
        if room <= 0:
            self._drop_if_empty(uow)
            self._check_umsgs(uow, "get", queue)
        n = min(limit, room)
        share = max_bytes // n - each if max_bytes else 0
        if max_bytes and share <= 0:
            raise BadRequestError(f"a batch of {n} gets cannot carry a message in {max_bytes} bytes")
        fresh = uow.operations == 0
        sname = qdef.structure
        s = qm.structure(sname)
        taken: list[Message] = []
        error: MQError | None = None
        checked: set[str] = set()
        try:
            if self.gone.is_set():
                raise ClientGoneError(f"the client left before its batch of gets on {queue}")

            def call(i: int) -> tuple[str, str, list[Any]]:
                return s.get_call(qm.caller, queue, uow=uow.id, gen=uow.structures.get(sname, 0), now_ms=now_ms(),
                                  max_length=share)

            gens: dict[str, int] = {}
            longer = False  # a message longer than its share stays on the queue (the next batch's first)
            calls, made = n, 0  # gets in this round; gets of the batch made in earlier rounds
            while calls:
                replies = self._batch_cf_call([uow] * calls, [sname] * calls, call, calls)
                # Every reply is read, whatever came before it: a call after a refusal may still have taken a
                # message (another member took the one refused meanwhile), and a message taken is the unit of work's.
                again, exhausted = 0, False
                for i, raw in enumerate(replies, start=made):
                    if isinstance(raw, TruncatedMessageError) and max_bytes:
                        longer = True
                        continue
                    if isinstance(raw, BaseException):
                        error = error or _batch_error(raw, i)
                        continue
                    got = Structure.get_reply(qm.caller, raw)
                    self._same_generation(uow, gens, sname, got.gen)
                    if got.again:
                        again, exhausted = again + 1, False
                        continue
                    if got.entry is None:
                        exhausted = True
                        continue
                    m = self._took(qdef, got.entry, got.data or b"", got.gen, uow, checked)
                    if m is not None:
                        taken.append(m)
                # A get answered 'again' took nothing: its step ran out among expired messages at the head of the
                # queue (get.lua), and the gets after it in the round went on from where it stopped. As many gets
                # are made again, in a round of their own after this one, so every message taken in a round comes
                # before the next round's in get order, and the batch never takes more than n. No new round after a
                # refusal or a message too long for its share (each ends the batch, as in one round), nor when a get
                # after the last 'again' found no message (the queue held none then).
                made += calls
                calls = again if error is None and not longer and not exhausted else 0
            failpoint("batch-before-force")
        except BaseException:
            self._drop_if_empty(uow)
            raise
        if not taken and error is None and (wait_ms or (longer and n > 1)):
            # Nothing taken: wait for one (a single get, which ends its wait as soon as one comes), or take the
            # first message alone, its share of the room too small for it (TruncatedMessageError when even the
            # whole room is).
            try:
                taken.append(self.get(queue, wait_ms=wait_ms, max_length=max(0, max_bytes - each)))
            except NoMessageError:
                pass
            uow = self.uow or uow
            if taken and taken[0].persistent:
                checked.add(sname)
        elif not taken and error is None and longer:
            self._drop_if_empty(uow)
            raise TruncatedMessageError(f"the next message on {queue} is longer than the {max(0, max_bytes - each)} "
                                        "bytes the caller can carry")
        qm.counters["gets"] += len(taken)
        if error is None and commit:
            try:
                self._commit(fresh and set(uow.structures) <= checked)
            except OutcomeUnknownError as e:  # pending or unknown: the messages are delivered, as by a get alone
                return BatchResult(taken, e)
            return BatchResult(taken, None, committed=True)
        self._drop_if_empty(uow)
        return BatchResult(taken, error)

    def _took(self, qdef: QueueDef, entry: Entry, data: bytes, gen: int, uow: UnitOfWork,
              checked: set[str]) -> Message | None:
        """A message a get of a batch took: logged (appended) when persistent; a poison one moved to the backout
        queue in the same unit of work (None: not delivered)."""
        qm = self.qm
        uow.structures[qdef.structure] = gen
        uow.operations += 1
        if entry.persistent:
            uow.persistent = True
            checked.add(qdef.structure)
            rec = records.get(uow.id, entry.lrsn, structure=qdef.structure, gen=gen, entry_id=entry.id,
                              queue=qdef.name)
            qm.append(rec)
            qm.note_store(uow, rec)
        if self._is_poison(qdef, entry):
            self._move_to_backout_queue(qdef, entry, data, uow)
            if entry.persistent:
                checked.add(qm.queue_def(qdef.backout_queue).structure)
            return None
        uow.umsgs += 1
        return Message.from_entry(entry, data)

    def _abandon(self, own: UnitOfWork) -> None:
        """A failed call's unit of work of its own (outside syncpoint): backed out where it did anything or is
        doomed, else only forgotten (nothing to undo, nothing to log)."""
        if own.operations or own.doomed:
            self.qm.complete(own, False)
        else:
            self.qm.forget(own)

    def _drop_if_empty(self, uow: UnitOfWork) -> None:
        """A unit of work that did nothing is not kept (an idle connection holds none)."""
        if uow is self.uow and uow.operations == 0 and not uow.doomed:
            self.qm.forget(uow)
            self.uow = None

    def _batch_cf_call(self, uows: Sequence[UnitOfWork], snames: list[str],
                       call: Callable[[int], tuple[str, str, list[Any]]], n: int) -> list[Any]:
        """The n calls of a batch (call(i) makes the i-th, with the member's epoch of now) in one round trip
        (CF.run_many): each reply, or the error of its call, in its place. Without an answer (the CF or the link
        failed), what ran is unknown: every structure joins the unit of work, which can then only be backed out (as
        _uow_cf_call). A call refused because the structure did not know this member is made again, after the member
        joined it, and so is one refused for an epoch the member has since left for a newer one (a re-join); a
        fencing refusal marks the member fenced (QueueManager.cf_call). Each is made again in its turn: a structure
        refuses all of a batch's calls alike, so the order of the calls it takes is kept."""
        qm = self.qm
        try:
            replies = qm.cf_call(lambda: qm.cf.run_many([call(i) for i in range(n)]))
        except StructureFailedError as e:
            if e.no_answer:
                for uow, sname in zip(uows, snames, strict=True):
                    uow.structures.setdefault(sname, 0)
                    uow.doomed = uow.doomed or f"a batch of CF calls of it failed ({e})"
            raise
        # A FENCED or NOTJOINED refusal comes before a script changes anything: made again through cf_call, which
        # joins the structure, or takes the newer epoch of a re-join, or marks this member fenced.
        again = [i for i, r in enumerate(replies) if isinstance(r, NotJoinedError | FencedError)]
        def rerun(i: int) -> Any:
            return qm.cf.run(*call(i))

        for i in again:
            try:
                replies[i] = self._uow_cf_call(uows[i], snames[i], partial(rerun, i))
            except MQError as e:
                replies[i] = e
        return list(replies)

    @staticmethod
    def _same_generation(uow: UnitOfWork, gens: dict[str, int], sname: str, gen: int) -> None:
        """The calls of one batch on a structure must all have run in one generation of it: a restore between two
        of them (a new generation) may have lost what the earlier ones did, and the unit of work can then only be
        backed out."""
        seen = gens.setdefault(sname, gen)
        if seen != gen:
            uow.doomed = uow.doomed or f"structure {sname} was restored during a batch of it"
        uow.structures[sname] = gen

    def browse(self, queue: str, limit: int = 100, *, max_bytes: int = 0, each: int = 0,
               exact_more: bool = True) -> Browsed[Message]:
        """Up to ``limit`` available messages, not taken; ``max_bytes``/``each`` bound the reply (Structure.browse):
        ``more`` on the result says one was left out (``exact_more`` False: only that the browse stopped before the
        queue's end, which spares reading past ``limit``). The CF is read a bounded page a call, each call under
        one of the member's scan slots (sqm.core.scans)."""
        qm = self.qm
        qdef = qm.queue_def(queue)
        s = qm.structure(qdef.structure)
        found = qm.cf_call(lambda: s.browse(queue, limit, now_ms(), max_bytes=max_bytes, each=each,
                                            gate=qm.scans.call, exact_more=exact_more))
        return Browsed((Message.from_entry(e, d) for e, d in found), more=found.more)

    def browse_matching(self, queue: str, match: str, values: Sequence[bytes], limit: int, *,
                        bodies: bool = True, max_bytes: int = 0, each: int = 0) -> list[Message]:
        """Up to ``limit`` available messages whose message id (``match`` 'm') or correlation id ('c') is one of
        ``values``, not taken, in get order. The queue's index of each id is read a bounded batch per CF call, by
        the descriptors alone (peek_scan.lua's heads, CF_STEP entries at a time, each call under one of the member's
        scan slots), so that a call costs the CF a batch however long the queue, and a lookup in all the messages
        that have that id, not the queue's; only the best ``limit`` are kept meanwhile. Then the data of those
        chosen (``bodies``; else descriptors alone) are read, entry_data.lua, at most CF_STEP_BYTES a call: the CF
        carries the data of the messages shown and no others. ``max_bytes`` (0: any) bounds the data and each
        message's ``each``: as many as fit, in get order (a message taken meanwhile is left out)."""
        qm = self.qm
        s = qm.structure(qm.queue_def(queue).structure)
        now = now_ms()
        best: dict[str, tuple[tuple[int, int, int], Entry]] = {}  # entry id -> (get order key, entry)
        for value in dict.fromkeys(v.hex() for v in values):
            cursor = "0"
            while True:
                with qm.scans.call():
                    cursor, found = qm.cf_call(partial(s.peek_scan, queue, match, value, cursor, CF_STEP,
                                                       heads=True))
                for e, _ in found:
                    # Available only: committed (a held get's entry is taken), and not expired (get never takes it).
                    if e.state == "CP" and not 0 < e.expiry <= now:
                        best[e.id] = ((-e.priority, *e.order), e)
                if len(best) > limit:  # the best limit kept: a lookup's memory does not grow with its matches
                    best = dict(sorted(best.items(), key=lambda kv: kv[1][0])[:limit])
                if cursor == "0":
                    break
        chosen: list[Entry] = []
        used = 0
        for _, e in sorted(best.values(), key=lambda b: b[0])[:limit]:
            if max_bytes and used + e.length + each > max_bytes:
                break
            used += e.length + each
            chosen.append(e)
        if not bodies:
            return [Message.from_entry(e, b"") for e in chosen]
        out: list[Message] = []
        batch: list[str] = []
        batch_bytes = 0
        for k, e in enumerate(chosen):
            batch.append(e.id)
            batch_bytes += e.length
            if k + 1 == len(chosen) or len(batch) == 1000 or batch_bytes + chosen[k + 1].length > CF_STEP_BYTES:
                read = qm.cf_call(partial(s.entry_data, queue, batch))
                out += [Message.from_entry(got[0], got[1]) for got in read if got is not None]
                batch, batch_bytes = [], 0
        return out

    # --- syncpoint ----------------------------------------------------------------------------------------
    def commit(self) -> None:
        uow, self.uow = self.uow, None
        if uow is None:
            self.refuse_prepared()
            return
        if uow.doomed:
            self.qm.complete(uow, False, reason="a CF call failed")
            raise BackedOutError(f"unit of work {uow.id} was backed out: {uow.doomed}")
        if uow.operations == 0:
            self.qm.forget(uow)
            return
        self.qm.complete(uow, True)

    def _commit(self, pstore_checked: bool) -> None:
        """commit(); pstore_checked: every structure of the unit of work checked its persistent store in this
        request's CF calls (QueueManager.complete)."""
        uow = self.uow
        if (pstore_checked and uow is not None and uow.state == INFLIGHT and not uow.doomed
                and uow.operations):
            self.uow = None
            self.qm.complete(uow, True, pstore_checked=True)
            return
        self.commit()

    def backout(self) -> None:
        uow, self.uow = self.uow, None
        if uow is None:
            self.refuse_prepared()
            return
        if uow.operations == 0 and not uow.doomed:
            self.qm.forget(uow)
            return
        self.qm.complete(uow, False)

    def prepare(self, xid: str) -> str:
        """Two-phase commit, phase one: the UOW becomes in doubt (durably); resolve it with
        QueueManager.resolve(uow_id, commit) later, also after a restart. Returns the UOW id. After the PREPARE is
        forced each structure of the UOW is asked how it stands (QueueManager.confirm_prepared, one CF round trip a
        structure): one a restore may rebuild without this PREPARE refuses the vote (BackedOutError)."""
        check_xid(xid)  # before anything: a refused prepare leaves the unit of work open, as it was
        uow = self.uow
        if uow is None:
            raise BadRequestError("no unit of work to prepare")
        qm = self.qm
        qm.check_usable()
        qm.claim_xid(uow, xid)  # an xid in use by another unit of work is refused here, nothing changed
        self.uow = None
        if uow.doomed:  # a coordinator's commit would apply work the application was told had failed
            qm.complete(uow, False, reason="a CF call failed")
            raise BackedOutError(f"unit of work {uow.id} was backed out, not prepared: {uow.doomed}")
        was_persistent, was_doomed = uow.persistent, uow.doomed
        uow.persistent = True  # before the append: a checkpoint that sees it in doubt must see it logged
        # Claimed (as a resolve claims it: QueueManager.resolve) from before its PREPARE until its vote is known: it
        # is listed in doubt from the append on, and a resolve while the structures are asked (a CF round trip,
        # seconds when the CF does not answer) would log its decision beside the prepare's own no vote, COMMIT and
        # BACKOUT both, of which a restore follows the last. A resolve meanwhile is refused, "being resolved".
        uow.resolving = True
        try:
            qm.append(records.prepare(uow.id, qm.clock.now(), uow.structures, xid=xid), uow=uow, state=INDOUBT)
            qm.confirm_prepared(uow)  # a structure that may be restored without this PREPARE: a no vote
        except BaseException:
            if uow.state == INFLIGHT:
                # No PREPARE can be on disk (the log refused it before writing: LogFailedError): the unit of work
                # stays the application's, open as it was, to back out (or commit). Taken from the connection, it
                # held its messages locked, taken by nobody, until the member restarted. Work with nothing logged
                # is not doomed by the log's failure (non-persistent work goes on).
                uow.xid = ""
                if not was_persistent:
                    uow.persistent, uow.doomed = False, was_doomed
                self.uow = uow
            raise
        finally:
            uow.resolving = False  # the vote is known (or the prepare failed): its coordinator may resolve it
        self.prepared = uow
        return uow.id

    def refuse_prepared(self) -> None:
        """A commit or backout asked on this handle with no unit of work open, after it prepared one still in
        doubt: that one is its coordinator's to decide (QueueManager.resolve), not the application's. Answered
        as a commit or backout of nothing, the application would take its work for done while it stays in doubt,
        its messages locked."""
        uow = self.prepared
        if uow is not None and uow.state == INDOUBT:
            raise InDoubtError(f"unit of work {uow.id} is prepared (xid {uow.xid}) and in doubt: its coordinator "
                               "resolves it, not a commit or backout of the application")
        self.prepared = None


    def close(self) -> None:
        """Like MQDISC: an open UOW is backed out."""
        if self.uow is not None and self.uow.state == INFLIGHT:
            self.backout()


# An XA transaction id as a coordinator writes it: its format id, global transaction id and branch qualifier (at
# most 64 bytes each) in hex with separators fit in 300 characters. The xid is logged in the PREPARE record, kept
# while the unit of work is in doubt and carried by every in-doubt listing: unbounded, one application's xids
# could make the operator's listing too long for any reply.
XID_MAX_CHARS = 300


def check_xid(xid: object) -> None:
    """Refuse an xid that is not 1 to XID_MAX_CHARS printable ASCII characters (an empty one would let anyone
    naming no xid resolve the unit of work as its own)."""
    if not isinstance(xid, str) or not xid:
        raise BadRequestError("prepare: the xid must be a non-empty string")
    if len(xid) > XID_MAX_CHARS:
        raise BadRequestError(f"prepare: the xid is {len(xid)} characters long; at most {XID_MAX_CHARS}")
    if not (xid.isascii() and xid.isprintable()):
        raise BadRequestError("prepare: the xid must be printable ASCII characters")


def _batch_error(e: BaseException, index: int) -> MQError:
    """The refusal of message ``index`` of a batch, as the MQError a single call would have raised."""
    if isinstance(e, MQError):
        return e
    return StructureFailedError(f"message {index} of the batch: the CF refused it: {e}")


__all__ = ["XID_MAX_CHARS", "BatchResult", "Connection", "Message", "PutSpec", "check_xid"]
