"""Many applications' puts and gets outside syncpoint run together: the calls of one turn of the service's event loop
(sqm.service.batch_loop), each a unit of work of its own, as the same calls made one by one would be, at the cost
of one of them.

Each persistent put outside syncpoint and each get outside syncpoint is the unit of work it is alone
(Connection.put, Connection.get): put.lua or get.lua first, under its own UOW; then its PUT or GET record, its
COMMIT forced; then commit.lua. Together, their CF scripts go in one pipelined round trip (CF.run_many: each script
atomic, applied in order), their records are one append and one fsync (Outcomes.commit_many), and their commits one
more round trip; every COMMIT is on disk before any of them returns, so no reply can come before its commit is
durable. Each call's outcome is its own: a refusal (no such queue, a full structure, a message too long) is that
call's error and the others go on. What the plain path does with more care than a batch can take is left to it:
a get that finds a poison message (moved to its backout queue, committed, and then the request is made again
alone), a get that finds nothing and may wait, a get whose script met more expired messages than one call moves.

Puts, gets and commits under syncpoint (sqm.core.syncpoint_calls) run in the same batches, in their connections'
units of work: their scripts and the commits' standing checks in the same round trip, the commits' COMMITs
appended, forced and applied with the others.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from cfemu.cf import Structure, with_epoch
from cfemu.entry import Entry
from cfemu.errors import (
    ClientGoneError,
    MQError,
    NoMessageError,
    OutcomeUnknownError,
    StructureFailedError,
)
from sqm.core import records, syncpoint_calls
from sqm.core.cfcall import CF_DOWN
from sqm.core.client_watch import ClientWatch
from sqm.core.clock import now_ms
from sqm.core.connection import Connection, Message, PutSpec, QueueManagerPort
from sqm.core.outcomes import Decided
from sqm.core.records import INFLIGHT, Record
from sqm.core.syncpoint_calls import DONE, Done, Ready, SyncCommit, SyncGet, SyncPut
from sqm.core.uow import UnitOfWork


@dataclass
class OnePut:
    """A persistent put outside syncpoint (``spec.persistent`` must be set)."""

    spec: PutSpec


@dataclass
class OneGet:
    """A get outside syncpoint of the next message of ``queue`` (no selection). ``max_length``: as Connection.get;
    ``wait_ms``: when no message is there and it is not 0, the call is left to the plain path, which waits."""

    queue: str
    max_length: int = 0
    wait_ms: int = 0
    gone: ClientWatch = field(default_factory=ClientWatch)


Call = OnePut | OneGet | SyncPut | SyncGet | SyncCommit
# the message put or got, DONE (a commit), the call's error, or None: make it alone
Outcome = Message | Done | MQError | None


@dataclass
class Begun:
    """Calls whose CF scripts ran and whose records are appended (Lifecycles.begin), to be finished: ``out`` holds
    the outcomes known so far, and all of them after Lifecycles.finish."""

    calls: list[Call]
    out: list[Outcome]
    together: list[tuple[int, UnitOfWork, Message | None]] = field(default_factory=list)  # None: a commit
    decided: Decided | None = None


class Lifecycles(Connection):
    """Runs calls of many applications together (``run``); it holds no unit of work of its own between runs."""

    def __init__(self, qm: QueueManagerPort) -> None:
        super().__init__(qm)

    def run(self, calls: list[Call]) -> list[Outcome]:
        """Each call's outcome, in their order (see the module)."""
        begun = self.begin(calls)
        self.finish([begun])
        return begun.out

    def begin(self, calls: list[Call]) -> Begun:
        """The first half of ``run``: the calls' CF scripts in one round trip, their records and COMMITs appended
        (nothing forced yet). Their outcomes are known only after ``finish``."""
        qm = self.qm
        out: list[Outcome] = [None] * len(calls)
        try:
            qm.check_usable()
        except MQError as e:
            return Begun(calls, [e] * len(calls))
        todo: list[tuple[int, UnitOfWork, str, tuple[str, str, list[Any]], Entry | None]] = []
        unreachable: MQError | None = None  # the CF did not answer a call's checks (a queue's definition)
        for i, call in enumerate(calls):
            uow: UnitOfWork | None = None
            if unreachable is not None:  # the next call would wait for the same CF (a hung one: its timeout each)
                out[i] = unreachable
                continue
            try:
                if isinstance(call, SyncPut | SyncGet | SyncCommit):
                    ready = syncpoint_calls.start(call)  # cleans up after itself when it raises
                    if isinstance(ready, Ready):
                        todo.append((i, ready.uow, ready.sname, ready.call, ready.entry))
                    else:
                        out[i] = ready
                elif isinstance(call, OnePut):
                    qdef, entry = self._new_entry(call.spec)
                    qm.ensure_log_space()
                    uow = qm.new_uow()
                    s = qm.structure(qdef.structure)
                    todo.append((i, uow, qdef.structure, s.put_call(qm.caller, entry, bytes(call.spec.body),
                                                                    uow=uow.id), entry))
                else:
                    qdef = qm.queue_def(call.queue)
                    uow = qm.new_uow()
                    s = qm.structure(qdef.structure)
                    todo.append((i, uow, qdef.structure, s.get_call(qm.caller, call.queue, uow=uow.id,
                                                                    now_ms=now_ms(), max_length=call.max_length),
                                 None))
            except Exception as e:  # refused before anything was sent: nothing to undo
                if uow is not None:
                    qm.forget(uow)
                failed = out[i] = _as_mq_error(e)
                if isinstance(e, CF_DOWN) or getattr(e, "no_answer", False):
                    unreachable = failed
        if unreachable is not None:  # nothing was sent: the calls made ready hear it too, with nothing to undo
            for i, uow, *_ in todo:
                self._let_go(calls[i], uow)
                out[i] = unreachable
            todo = []
        if not todo:
            return Begun(calls, out)
        # A commit's standing check changes nothing on the CF: its failure dooms nothing (a scratch unit of work
        # takes what _batch_cf_call marks).
        marked = [UnitOfWork("", "") if isinstance(calls[t[0]], SyncCommit) else t[1] for t in todo]
        unanswered: MQError | None = None  # the round trip got no answer: what ran of it is unknown
        try:
            # The calls were built before: each is made (and made again) with the member's epoch of the time, which
            # a re-join in between (its own, when the batch is refused NOTJOINED) has raised.
            replies = self._batch_cf_call(marked, [t[2] for t in todo], lambda k: with_epoch(todo[k][3], qm.caller),
                                          len(todo))
        except StructureFailedError as e:
            replies = [e] * len(todo)
            unanswered = e if e.no_answer else None
        except MQError as e:
            replies = [e] * len(todo)
        except Exception as e:  # what ran is unknown: each unit of work can only be backed out (as no answer is)
            for (_, _, sname, _, _), uow in zip(todo, marked, strict=True):
                uow.structures.setdefault(sname, 0)
                uow.doomed = uow.doomed or f"a batch of CF calls of it failed ({e})"
            replies = [_as_mq_error(e)] * len(todo)
        if unanswered is not None:
            # Each unit of work of its own is backed out once the CF answers again: now, each backout would wait
            # for the same CF in turn (a hung one: its full timeout each), and the whole batch with it. A put or
            # get under syncpoint hears it (its unit of work, doomed, can only be backed out); a commit goes on as
            # alone, its standing check unanswered.
            for i, uow, *_ in todo:
                if isinstance(calls[i], OnePut | OneGet):
                    qm.back_out_later(uow, unanswered)
                    out[i] = unanswered
                elif not isinstance(calls[i], SyncCommit):
                    out[i] = unanswered
            kept = [k for k, t in enumerate(todo) if isinstance(calls[t[0]], SyncCommit)]
            todo, replies = [todo[k] for k in kept], [replies[k] for k in kept]
            if not todo:
                return Begun(calls, out)
        together: list[tuple[int, UnitOfWork, Message | None]] = []
        try:
            logged = self._take(calls, todo, replies, out, together)
            decided = qm.decide_many([u for _, u, _ in together], logged)
        except Exception as e:  # the member cannot commit now (fenced, stopping, a checkpoint the CF refused)
            self._undo(calls, todo, out, e)
            return Begun(calls, out)
        return Begun(calls, out, together, decided)

    def _let_go(self, call: Call, uow: UnitOfWork) -> None:
        """A call made ready whose script was not sent: nothing of it to undo."""
        if isinstance(call, SyncPut | SyncGet | SyncCommit):
            syncpoint_calls.let_go(call, uow)
        else:
            self.qm.forget(uow)

    def _take(self, calls: list[Call],
              todo: list[tuple[int, UnitOfWork, str, tuple[str, str, list[Any]], Entry | None]],
              replies: list[Any], out: list[Outcome],
              together: list[tuple[int, UnitOfWork, Message | None]]) -> list[Record]:
        """Each call's CF reply taken: a refusal its outcome, a call the batch commits into ``together`` with its
        record (returned, in order; a commit under syncpoint with None), a get the batch does not commit finished
        alone, a put or get under syncpoint into its connection's unit of work. One call's unexpected failure is
        its own: every other call whose script ran is still taken (a put under syncpoint left untaken would be made
        again by its own path: a second message in its unit of work, the first with no record)."""
        logged: list[Record] = []
        for (i, uow, sname, cfcall, made), raw in zip(todo, replies, strict=True):
            call = calls[i]
            if isinstance(call, SyncCommit):
                if syncpoint_calls.may_commit(call, raw):
                    together.append((i, uow, None))
                else:
                    syncpoint_calls.let_go(call, uow)  # its own path backs it out, and says why
                continue
            if isinstance(call, SyncPut | SyncGet):
                try:
                    out[i] = syncpoint_calls.take(call, Ready(uow, sname, cfcall, made), raw)
                except Exception as e:  # as the call alone raises it (a record the log refused, a failed move)
                    out[i] = _as_mq_error(e)
                continue
            try:
                taken = self._take_own(call, uow, sname, made, raw, out, i)
            except Exception as e:  # that call's own failure: the others of the round trip are taken all the same
                uow.doomed = uow.doomed or f"taking its CF reply failed ({e})"
                with contextlib.suppress(Exception):  # what cannot be backed out now, recovery backs out
                    self._abandon(uow)
                out[i] = _as_mq_error(e)
                continue
            if taken is not None:
                rec, message = taken
                logged.append(rec)
                together.append((i, uow, message))
        return logged

    def _take_own(self, call: OnePut | OneGet, uow: UnitOfWork, sname: str, made: Entry | None, raw: Any,
                  out: list[Outcome], i: int) -> tuple[Record, Message] | None:
        """A put's or get's reply outside syncpoint taken into its own unit of work: its record and message for the
        batch to commit, or None with its outcome in ``out`` (a refusal, nothing to get, a get finished alone)."""
        qm = self.qm
        if isinstance(raw, BaseException):
            self._abandon(uow)
            out[i] = raw if isinstance(raw, MQError) else MQError(f"the CF refused the call: {raw}")
            return None
        if isinstance(call, OnePut):
            assert made is not None
            reply = Structure.put_reply(qm.caller, raw)
            uow.structures[sname] = reply.gen
            uow.operations += 1
            uow.persistent = True
            rec = records.put(uow.id, reply.clock, structure=sname, gen=reply.gen, entry=made.wire(),
                              data=bytes(call.spec.body))
            qm.note_store(uow, rec)
            return rec, Message.from_entry(made, bytes(call.spec.body))
        got = Structure.get_reply(qm.caller, raw)
        uow.structures[sname] = got.gen
        if got.entry is None:
            qm.forget(uow)
            if not got.again and not call.wait_ms:
                out[i] = NoMessageError(f"no message available on {call.queue}")
            return None  # None in out: the plain path waits, or goes on past the expired messages
        uow.operations += 1
        message = Message.from_entry(got.entry, got.data or b"")
        rec = records.get(uow.id, got.entry.lrsn, structure=sname, gen=got.gen, entry_id=got.entry.id,
                          queue=call.queue)
        if not got.entry.persistent or self._is_poison(qm.queue_def(call.queue), got.entry) \
                or call.gone.seen_to_leave():
            out[i] = self._alone(call, uow, rec, got.entry, message)
            return None
        uow.persistent = True
        qm.note_store(uow, rec)
        return rec, message

    def _undo(self, calls: list[Call], todo: list[tuple[int, UnitOfWork, str, tuple[str, str, list[Any]], Entry | None]],
              out: list[Outcome], e: Exception) -> None:
        """The batch failed before its commits were decided: each call not answered yet whose unit of work is
        still open is backed out (what cannot be backed out now, recovery backs out, as it would the plain path's)
        and hears ``e``; one whose COMMIT was appended hears that its outcome is unknown (a force may take it)."""
        qm = self.qm
        failed = _as_mq_error(e)
        for i, uow, *_ in todo:
            call = calls[i]
            if (out[i] is not None or uow.id not in qm.uows or isinstance(call, SyncPut | SyncGet)
                    or (isinstance(call, SyncCommit) and call.conn is not None and call.conn.uow is uow)):
                continue  # answered already, or finished (a get that found nothing and may wait: the plain path's),
                # or its connection's unit of work, which goes on (the connection commits or backs it out; a commit
                # let go to its own path is made there, as alone)
            if uow.state != INFLIGHT:
                out[i] = OutcomeUnknownError(f"unit of work {uow.id}: its COMMIT was appended when the batch "
                                             f"failed ({failed}): committed if it reached the disk")
                continue
            uow.doomed = uow.doomed or f"its batch failed ({failed})"  # backed out even if it did nothing yet
            with contextlib.suppress(Exception):  # what cannot be backed out now, recovery backs out
                self._abandon(uow)
            out[i] = failed

    def finish(self, batches: list[Begun]) -> None:
        """The second half of ``run`` for several begun batches together: every COMMIT forced by one fsync, their
        commits applied in one CF round trip; each batch's ``out`` then holds its calls' outcomes."""
        qm = self.qm
        qm.apply_many([b.decided for b in batches if b.decided is not None],
                      applications=any(m is None for b in batches for _, _, m in b.together))
        for b in batches:
            if b.decided is not None:
                for (i, _, message), error in zip(b.together, b.decided.errors, strict=True):
                    if isinstance(error, OutcomeUnknownError) and isinstance(b.calls[i], OneGet):
                        error.message = message  # delivered with it, as a get outside syncpoint (Connection.get)
                    b.out[i] = error or (DONE if message is None else message)
            for call, outcome in zip(b.calls, b.out, strict=True):  # under syncpoint: counted when taken
                if not isinstance(call, OnePut | OneGet):
                    continue
                if isinstance(outcome, Message) or getattr(outcome, "message", None) is not None:
                    qm.counters["puts" if isinstance(call, OnePut) else "gets"] += 1

    def _alone(self, call: OneGet, uow: UnitOfWork, rec: Record, entry: Entry, message: Message) -> Outcome:
        """A get that took a message the batch does not commit with the others: a non-persistent one (nothing to
        log), a poison one (moved to its backout queue, then the request is made again alone: None; backed out
        when it cannot move), or one whose client has left (backed out: the message stays on its queue)."""
        qm = self.qm
        if entry.persistent:
            uow.persistent = True
            qm.append(rec)
            qm.note_store(uow, rec)
        try:
            if call.gone.seen_to_leave():
                qm.complete(uow, False)
                return ClientGoneError(f"the client left before a message from {call.queue} could be delivered")
            qdef = qm.queue_def(call.queue)
            if self._is_poison(qdef, entry):
                try:
                    self._move_to_backout_queue(qdef, entry, message.body, uow)
                except MQError as e:  # not moved: the message goes back to its queue (as Connection.get leaves it)
                    with contextlib.suppress(MQError):  # what cannot be backed out now, recovery backs out
                        qm.complete(uow, False)
                    return e
                qm.complete(uow, True)
                return None
            qm.complete(uow, True, pstore_checked=True)
        except OutcomeUnknownError as e:  # pending or unknown: the message goes with it, never consumed for nobody
            e.message = message
            return e
        except MQError as e:
            return e
        return message


def _as_mq_error(e: Exception) -> MQError:
    """What a call hears of what its batch raised (an MQError as it is; the CF unreachable: a failed structure)."""
    if isinstance(e, MQError):
        return e
    if isinstance(e, CF_DOWN):
        return StructureFailedError(f"the CF is unavailable: {e}")
    return MQError(f"internal error: {type(e).__name__}: {e}")


__all__ = ["Begun", "Call", "Lifecycles", "OneGet", "OnePut", "Outcome"]
