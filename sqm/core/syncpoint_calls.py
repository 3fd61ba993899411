"""Calls under syncpoint that run together with other applications' (sqm.core.lifecycles): a put or a get in the
unit of work of the application's own connection, and the commit of that unit of work.

Each is what the same call made alone on its connection does (Connection.put, Connection.get, Connection.commit),
split around one CF round trip the batch shares: ``start`` makes its script ready (the call's checks first: a
refusal changes nothing), the round trip runs every script of the batch, each atomic and in order, and ``take``
reads its reply. A put's or get's record is appended as alone, and not forced (the unit of work's commit forces
it). A commit's script is its standing check (standing.lua: the persistent store connected, asked before the
COMMIT is forced, as Outcomes.complete asks); the batch then appends every COMMIT together, forces them with one
fsync and applies them in one more round trip (Outcomes.decide_many, apply_many). The unit of work stays the
connection's (``Connection.uow``) from one request to the next, whichever thread runs each.

What the batch cannot do as alone does is left to the call's own path (``start`` or ``take`` answer None, and the
connection's thread makes the request again, with the unit of work as it was): a get with nothing to take that may
wait, one whose script met more expired messages than one call moves, a poison message (moved to its backout
queue in the unit of work first, as alone), a client seen to have left; a commit of a unit of work that is in
doubt, doomed, without persistent work, on several structures (their order of commit: Outcomes._refusing_first),
holding puts to redo, or that its structure says is on a disconnected persistent store (backed out, alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cfemu import keys
from cfemu.cf import Structure
from cfemu.entry import Entry
from cfemu.errors import BadRequestError, MQError, NoMessageError
from sqm.core import records
from sqm.core.clock import now_ms
from sqm.core.connection import Connection, Message, PutSpec
from sqm.core.failpoints import failpoint
from sqm.core.records import INFLIGHT
from sqm.core.uow import UnitOfWork


@dataclass
class SyncPut:
    """A put in the unit of work of ``conn``."""

    conn: Connection
    spec: PutSpec


@dataclass
class SyncGet:
    """A get of the next message of ``queue`` (no selection) in the unit of work of ``conn``; ``max_length`` and
    ``wait_ms`` as Connection.get."""

    conn: Connection
    queue: str
    max_length: int = 0
    wait_ms: int = 0


@dataclass
class SyncCommit:
    """The commit of the unit of work of ``conn`` (None: a connection that has made none)."""

    conn: Connection | None


UnderSyncpoint = SyncPut | SyncGet | SyncCommit


class Done:
    """The outcome of a call that succeeded with nothing to give back (a commit)."""

    def __repr__(self) -> str:
        return "DONE"


DONE = Done()


@dataclass
class Ready:
    """A call's script made ready for the batch's round trip, under ``uow`` on structure ``sname``."""

    uow: UnitOfWork
    sname: str
    call: tuple[str, str, list[Any]]
    entry: Entry | None = None


def start(call: UnderSyncpoint) -> Ready | Done | None:
    """The call's checks and its script (Ready); DONE when it is done already (a commit with nothing to commit);
    None when its own path makes it. A refusal raises, as the call alone raises it, and changes nothing."""
    if isinstance(call, SyncCommit):
        return _start_commit(call)
    conn = call.conn
    qm = conn.qm
    if isinstance(call, SyncPut):
        qdef, entry = conn._new_entry(call.spec)
        if call.spec.persistent:
            qm.ensure_log_space()
        uow = conn._current_uow()
        conn._check_umsgs(uow, "put", call.spec.queue)
        if uow.state != INFLIGHT:
            raise BadRequestError(f"unit of work {uow.id} is {uow.state}; commit or back it out first")
        s = qm.structure(qdef.structure)
        return Ready(uow, qdef.structure, s.put_call(qm.caller, entry, bytes(call.spec.body), uow=uow.id,
                                                     gen=uow.structures.get(qdef.structure, 0)), entry)
    qdef = qm.queue_def(call.queue)
    if conn.gone.seen_to_leave():  # its own path says so, and ends the unit of work's part in it as alone
        return None
    uow = conn._current_uow()
    if uow.state != INFLIGHT:
        raise BadRequestError(f"unit of work {uow.id} is {uow.state}; commit or back it out first")
    try:
        conn._check_umsgs(uow, "get", call.queue)
    except MQError:
        conn._drop_if_empty(uow)
        raise
    s = qm.structure(qdef.structure)
    return Ready(uow, qdef.structure, s.get_call(qm.caller, call.queue, uow=uow.id,
                                                 gen=uow.structures.get(qdef.structure, 0), now_ms=now_ms(),
                                                 max_length=call.max_length))


def _start_commit(call: SyncCommit) -> Ready | Done | None:
    conn = call.conn
    uow = conn.uow if conn is not None else None
    if conn is None or uow is None:
        if conn is not None:
            conn.refuse_prepared()  # as Connection.commit: a prepared unit of work is its coordinator's
        return DONE
    qm = conn.qm
    if (uow.state != INFLIGHT or uow.doomed or not uow.operations or not uow.persistent or uow.redo
            or len(uow.structures) != 1 or qm.log_failed):
        return None
    conn.uow = None  # as Connection.commit: the unit of work is the commit's from here
    (sname, gen), = uow.structures.items()
    return Ready(uow, sname, qm.structure(sname).standing_call(qm.caller, uow.id, gen=gen))


def let_go(call: UnderSyncpoint, uow: UnitOfWork) -> None:
    """A call made ready whose script was not sent: its connection's unit of work as it was before ``start``."""
    if isinstance(call, SyncCommit):
        assert call.conn is not None
        call.conn.uow = uow
    else:
        call.conn._drop_if_empty(uow)


def take(call: SyncPut | SyncGet, ready: Ready, raw: Any) -> Message | MQError | None:
    """A put's or a get's reply (``raw``: what the round trip gave back, or its error) taken into the unit of
    work, its record appended (not forced): the call's outcome, None for its own path to make it again."""
    conn = call.conn
    qm = conn.qm
    uow = ready.uow
    if isinstance(raw, BaseException):
        if isinstance(call, SyncGet):
            conn._drop_if_empty(uow)
        return raw if isinstance(raw, MQError) else MQError(f"the CF refused the call: {raw}")
    if isinstance(call, SyncPut):
        entry = ready.entry
        assert entry is not None
        body = bytes(call.spec.body)
        reply = Structure.put_reply(qm.caller, raw)
        uow.structures[ready.sname] = reply.gen
        uow.operations += 1
        failpoint("put-after-cf")
        if entry.persistent:
            uow.persistent = True
            rec = records.put(uow.id, reply.clock, structure=ready.sname, gen=reply.gen, entry=entry.wire(),
                              data=body)
            qm.append(rec)
            qm.note_store(uow, rec)
        uow.umsgs += 1
        qm.counters["puts"] += 1
        return Message.from_entry(entry, body)
    got = Structure.get_reply(qm.caller, raw)
    uow.structures[ready.sname] = got.gen
    if got.entry is None:
        conn._drop_if_empty(uow)
        if got.again or call.wait_ms:
            return None  # its own path goes on past the expired messages, or waits
        return NoMessageError(f"no message available on {call.queue}")
    uow.operations += 1
    if got.entry.persistent:
        uow.persistent = True
        rec = records.get(uow.id, got.entry.lrsn, structure=ready.sname, gen=got.gen, entry_id=got.entry.id,
                          queue=call.queue)
        qm.append(rec)
        qm.note_store(uow, rec)
    qdef = qm.queue_def(call.queue)
    if conn._is_poison(qdef, got.entry):
        conn._move_to_backout_queue(qdef, got.entry, got.data or b"", uow)
        return None  # moved in the unit of work: the get is made again, alone
    uow.umsgs += 1
    qm.counters["gets"] += 1
    return Message.from_entry(got.entry, got.data or b"")


def may_commit(call: SyncCommit, raw: Any) -> bool:
    """The commit's standing check answered (``raw``): True when it goes on in the batch, False when it goes to its
    own path (its unit of work back on its connection), which backs out a unit of work whose persistent store is
    disconnected. A structure that cannot answer is left to the commit, as Outcomes.complete leaves it."""
    return isinstance(raw, BaseException) or keys.text(raw) != "D"


__all__ = ["DONE", "Done", "Ready", "SyncCommit", "SyncGet", "SyncPut", "UnderSyncpoint", "let_go", "may_commit",
           "start", "take"]
