"""Conversations on the CF: their records (sqm.conversations.convrecord) taken and replaced inside the queue-manager
unit of work of the UOW status change they follow, and the receive that picks the next UOW a receiver may take by
RECEIVE's CONVID (NEW, OLD, ANY or a conversation id; docs/uow.md, "Conversations").

Every change of a record is a take (get by message id under syncpoint) and a put, like a control's: two receivers
that race for one conversation serialize on its record, so a conversation is delivered to one receiver, one UOW at a
time, in commit order."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import replace

from cfemu.entry import Entry
from cfemu.errors import MQError, NoMessageError, UowStatusError
from sqm.conversations import uowcontrols as ctl
from sqm.conversations.convrecord import (
    ANY,
    NEW,
    OLD,
    RECORD_CID_HEX,
    RECORD_LETTER,
    RETURNED,
    SETTLED,
    ConvRecord,
    after_delivered,
    bind,
    counted,
    idle,
    idle_unless_held_open,
    owned_by,
    record_id,
)
from sqm.conversations.uowstatus import ACCEPTED, ACTIVE, DELIVERED, RECEIVED, Control
from sqm.core import logon_token
from sqm.core.cfcall import CFCaller
from sqm.core.connection import Connection
from sqm.core.member import Member
from sqm.request_slots import nap

log = logging.getLogger(__name__)

# How long a first send's lock on its conversation's record lasts (renewed by nobody): far above the few CF round
# trips of the unit of work that makes the record, so that only a send whose member died lets it lapse.
FIRST_LOCK_MS = 30_000
RECORD_WAIT_S = 1.0  # how long a change waits for a record another short unit of work holds (a few CF round trips)
# A receive reads this many ACCEPTED controls first (most receives take one of the first few), then uowcontrols.
# PEEK_LIMIT, then twice as many each time none of those is this receiver's to take, up to WIDEST_LOOK times
# PEEK_LIMIT: UOWs of conversations bound to an instance that is not there (seed 003: bound to the fifth instance,
# three restarted) wait for it until they time out, and must not hide the rest of the service from every other
# instance. Each read is one snapshot in get order, so a conversation's UOWs are still taken in order.
FIRST_LOOK = 32
WIDEST_LOOK = 16
# Conversation records one CF call reads (peek_many.lua, at most 1000): a call's hold on the CF stays short (about
# a tenth of a millisecond a record), and a look at a window of 1000 UOWs costs a few calls, not one per record.
PEEK_BATCH = 250


def peek(qm: CFCaller, svc: ctl.Service, conversation: str) -> tuple[ConvRecord | None, bool]:
    """The conversation's record as the CF holds it, and whether a unit of work holds it now."""
    found = qm.cf_call(lambda: qm.structure(svc.structure).peek(svc.control, "m", record_id(conversation).hex(), 1))
    if not found:
        return None, False
    entry, data = found[0]
    return ConvRecord.unpack(data), entry.state == "UG"


def peek_all(qm: CFCaller, svc: ctl.Service, conversations: list[str]) -> dict[str, tuple[ConvRecord | None, bool]]:
    """``peek`` of each conversation, PEEK_BATCH of them a CF call (peek_many.lua): a look at a window of UOWs reads
    their conversations' records in one call, not one call each."""
    out: dict[str, tuple[ConvRecord | None, bool]] = {}
    for i in range(0, len(conversations), PEEK_BATCH):
        batch = conversations[i:i + PEEK_BATCH]
        found = _peek_records(qm, svc, [record_id(conv).hex() for conv in batch])
        for conv, one in zip(batch, found, strict=True):
            out[conv] = (None, False) if one is None else (ConvRecord.unpack(one[1]), one[0].state == "UG")
    return out


def _peek_records(qm: CFCaller, svc: ctl.Service, ids: list[str]) -> list[tuple[Entry, bytes] | None]:
    return list(qm.cf_call(lambda: qm.structure(svc.structure).peek_many(svc.control, "m", ids)))


def take(conn: Connection, svc: ctl.Service, conversation: str, *, wait_s: float = RECORD_WAIT_S) -> ConvRecord | None:
    """The record, taken under the connection's unit of work (None: there is none). One another unit of work holds
    is waited for, up to ``wait_s``; still held then: UowStatusError (the caller's change is refused, nothing done)."""
    deadline = time.monotonic() + wait_s
    delay = 0.005
    while True:
        try:
            m = conn.get(svc.control, syncpoint=True, msgid=record_id(conversation), counted=False)
            return ConvRecord.unpack(m.body)
        except NoMessageError:
            pass
        rec, held = peek(conn.qm, svc, conversation)
        if rec is None:
            return None
        if not held or time.monotonic() >= deadline:
            if held:
                raise UowStatusError(f"conversation {conversation} of service {svc.name} is changing: try again")
            continue  # given back between the get and the peek
        nap(delay)
        delay = min(delay * 2, 0.05)


def put(conn: Connection, svc: ctl.Service, rec: ConvRecord) -> None:
    conn.put(svc.control, rec.pack(), persistent=rec.persistent, syncpoint=True,
             msgid=record_id(rec.conversation), correlid=RECORD_LETTER.encode(), counted=False)


def open_for_send(qm: Member, conn: Connection, svc: ctl.Service, c: Control, *, new: bool = False) -> str:
    """A new UOW of conversation ``c.conversation`` (in its creation's unit of work): the conversation begins, or
    goes on; one ended by EOC or EOCCANCEL, or another sender's, is refused. ``new``: its id was made just now
    (CID=NEW), so it has no record to look for. Returns the holder of the conversation's first-record lock ("" none),
    for the caller to release (release_first) once that unit of work is committed or backed out."""
    rec = None if new else take(conn, svc, c.conversation)
    held = ""
    try:
        if rec is None and not new:
            # An uncommitted put is invisible to another unit of work's get and peek: two first sends serialize on
            # a CF lock, and the second finds the first's record once it is committed.
            held = _lock_first(qm, svc, c)
            if peek(qm, svc, c.conversation)[0] is not None:
                rec = take(conn, svc, c.conversation)
        _open(conn, svc, c, rec)
    except BaseException:
        release_first(qm, svc, c.conversation, held)
        raise
    return held


def _open(conn: Connection, svc: ctl.Service, c: Control, rec: ConvRecord | None) -> None:
    if rec is not None and not owned_by(rec, c.sender, c.token):
        raise UowStatusError(f"conversation {c.conversation} of service {svc.name} is another sender's: "
                             "send without a conversation id to begin one of your own")
    if rec is not None and rec.eoc:
        raise UowStatusError(f"conversation {c.conversation} of service {svc.name} was ended by {rec.eoc}: "
                             "send without a conversation id to begin a new one")
    if rec is None:
        rec = ConvRecord(c.conversation, svc.name, sender=c.sender, sender_token=c.token, changed_pc=c.created_pc,
                         lifetime_ms=c.lifetime_ms, nonact_ms=svc.attributes.conv_nonact_s * 1000,
                         persistent=c.entry_persistent)
    put(conn, svc, replace(rec, active=rec.active + 1, changed_pc=max(rec.changed_pc, c.created_pc),
                           lifetime_ms=max(rec.lifetime_ms, c.lifetime_ms),
                           nonact_ms=svc.attributes.conv_nonact_s * 1000,
                           persistent=rec.persistent or c.entry_persistent))


def _lock_first(qm: Member, svc: ctl.Service, c: Control) -> str:
    """Take the conversation's first-record lock for this UOW, waiting (up to uowcontrols.HELD_WAIT_S) while another
    first send holds it; still held then: UowStatusError, nothing done."""
    record = record_id(c.conversation).hex()
    deadline = time.monotonic() + ctl.HELD_WAIT_S
    delay = 0.005
    while not qm.cf_call(lambda: qm.admin.try_conversation_lock(svc.structure, svc.name, record, c.uow,
                                                                FIRST_LOCK_MS)):
        if time.monotonic() >= deadline:
            raise UowStatusError(f"conversation {c.conversation} of service {svc.name} is being begun by another "
                                 "send: try again")
        nap(delay)
        delay = min(delay * 2, 0.05)
    return c.uow


def release_first(qm: Member, svc: ctl.Service, conversation: str, holder: str) -> None:
    """Release the first-record lock open_for_send returned (nothing for ""). One the CF could not release lapses
    after FIRST_LOCK_MS."""
    if not holder:
        return
    record = record_id(conversation).hex()
    try:
        qm.cf_call(lambda: qm.admin.release_conversation_lock(svc.structure, svc.name, record, holder))
    except MQError as e:
        log.warning("conversation %s of service %s: first-record lock left to lapse (%s)", conversation, svc.name, e)


def commit_send(conn: Connection, svc: ctl.Service, conversation: str, eoc: str, pc: int, *, wait_s: float) -> None:
    """The sender's COMMIT, EOC or EOCCANCEL of a UOW of the conversation (in its commit's unit of work, which holds
    the record, so that it and an EOC serialize): refused when the conversation was ended, so that no UOW of it is
    delivered after the one that ended it; EOC and EOCCANCEL end it (no further send on it)."""
    if not conversation:
        return
    found, _ = peek(conn.qm, svc, conversation)
    if found is not None and found.eoc:  # refused before the record is held: it stays free for everyone else
        raise _ended(svc, conversation, found.eoc)
    rec = take(conn, svc, conversation, wait_s=wait_s)
    if rec is None:
        return
    if rec.eoc:
        raise _ended(svc, conversation, rec.eoc)
    put(conn, svc, replace(rec, eoc=eoc, changed_pc=max(pc, rec.changed_pc)) if eoc else rec)


def _ended(svc: ctl.Service, conversation: str, eoc: str) -> UowStatusError:
    return UowStatusError(f"conversation {conversation} of service {svc.name} was ended by {eoc}: "
                          "back out this unit of work")


def follow(conn: Connection, svc: ctl.Service, old: Control, new: Control | None, how: str) -> None:
    """A UOW's status changed (in the unit of work of that change): its conversation's record follows when the UOW
    left DELIVERED (convrecord.after_delivered) or the active statuses (convrecord.counted). Registered with
    uowcontrols.replace."""
    left_delivered = old.status == DELIVERED and (new is None or new.status != DELIVERED)
    was_active, is_active = old.status in ACTIVE, new is not None and new.status in ACTIVE
    if not old.conversation or not (left_delivered or was_active != is_active):
        return
    rec = take(conn, svc, old.conversation)
    if rec is None:
        return
    pc = new.changed_pc if new is not None else old.changed_pc
    if left_delivered:
        rec = after_delivered(rec, old.uow, how, pc)
    put(conn, svc, replace(counted(rec, was_active, is_active), changed_pc=max(pc, rec.changed_pc)))


def _may_take(rec: ConvRecord | None, mode: str, user: str, token: str, sealed: str) -> bool:
    """Whether a receiver (user id, token) may take a UOW of this conversation with RECEIVE CONVID ``mode``."""
    if rec is None:  # a UOW without a record (its conversation ended idle while it waited): a new conversation's
        return mode != OLD
    if rec.delivering:
        return False
    mine = rec.bound and rec.receiver == user and logon_token.matches(rec.receiver_token, token, sealed)
    if mode == NEW:
        return not rec.bound
    if mode == OLD:
        return mine
    return mine or not rec.bound  # a conversation id of its own


def _passes(mode: str) -> Iterator[str]:
    """CONVID=ANY: the receiver's old conversations first, then new ones (seed 003); an id: that one only."""
    if mode == ANY:
        yield OLD
        yield NEW
    else:
        yield mode


def take_next(qm: Member, conn: Connection, svc: ctl.Service, mode: str, user: str, token: str, sealed: str,
              pc: int, *, wide: bool = False) -> Control | None:
    """The next ACCEPTED UOW this receiver may take with CONVID ``mode``, taken under ``conn``'s unit of work with its
    conversation's record bound to the receiver (the caller makes the UOW DELIVERED and commits); None when there is
    none. Candidates are read in get order (priority, then commit order), in widening windows (FIRST_LOOK); the
    first UOW of a conversation that another receiver holds or races for makes the whole conversation wait, so that
    its UOWs stay in order. ``wide``: begin with the second window (a waiting receive's look again, after one that
    found nothing: the first window's read costs the CF as much as the second's, peek.lua reading every match)."""
    looked: dict[str, tuple[ConvRecord | None, bool]] = {}  # each conversation's record, read once per receive
    for limit in _windows(wide):
        candidates = ctl.peek_status(qm, svc, ACCEPTED, limit)
        got = _first_takeable(qm, conn, svc, candidates, mode, user, token, sealed, pc, looked)
        if got is not None or len(candidates) < limit:
            return got
    return None


def _windows(wide: bool = False) -> Iterator[int]:
    if not wide:
        yield FIRST_LOOK
    limit = ctl.PEEK_LIMIT
    while limit <= WIDEST_LOOK * ctl.PEEK_LIMIT:
        yield limit
        limit *= 2


def _first_takeable(qm: Member, conn: Connection, svc: ctl.Service, candidates: list[Control], mode: str,
                    user: str, token: str, sealed: str, pc: int,
                    looked: dict[str, tuple[ConvRecord | None, bool]]) -> Control | None:
    wanted = {c.conversation for c in candidates if mode in (NEW, OLD, ANY) or c.conversation == mode}
    looked.update(peek_all(qm, svc, sorted(wanted - {""} - looked.keys())))  # the window's records, read at once
    looked.setdefault("", (None, False))  # a UOW of no conversation
    for want in _passes(mode):
        rule = want if want in (NEW, OLD) else ""
        passed: set[str] = set()  # conversations not for this receiver, or busy
        for seen in candidates:
            conv = seen.conversation
            if conv in passed or (rule == "" and conv != want):
                continue
            if conv not in looked:  # given up after a failed take: read again
                looked[conv] = peek(qm, svc, conv) if conv else (None, False)
            rec, held = looked[conv]
            if held or not _may_take(rec, rule, user, token, sealed):
                passed.add(conv)
                continue
            c = _take_candidate(conn, svc, seen.uow, conv, rule, user, token, sealed, pc)
            if c is not None:
                return c
            looked.pop(conv, None)
            passed.add(conv)  # held, raced or changed: its conversation waits for it
    return None


def _take_candidate(conn: Connection, svc: ctl.Service, uow: str, conv: str, rule: str, user: str, token: str,
                    sealed: str, pc: int) -> Control | None:
    """The UOW's control and its conversation's record taken under ``conn``'s unit of work, the record bound to the
    receiver; None (nothing kept) when either is held by another unit of work or no longer lets this receiver."""
    try:
        c = Control.unpack(conn.get(svc.control, syncpoint=True, msgid=bytes.fromhex(uow), counted=False).body)
        rec = take(conn, svc, conv, wait_s=0.0) if conv else None
    except (NoMessageError, UowStatusError):
        conn.backout()
        return None
    if c.status != ACCEPTED or not _may_take(rec, rule, user, token, sealed):
        conn.backout()
        return None
    if rec is not None:
        put(conn, svc, bind(rec, c.uow, user, sealed, pc))
    return c


def expire_idle(qm: Member, svc: ctl.Service, pc: int, cursor: str = "0", count: int = 500) -> tuple[str, int]:
    """One bounded batch of the service's conversation records (the sweeper's): a conversation that is over
    (convrecord.idle: no active UOW for CONV-NONACT) has its record removed; its id may begin a new one. Returns
    the cursor of the next batch ("0": pass over) and how many ended."""
    with qm.scans.call():  # one of the member's scan slots for the batch (sqm.core.scans)
        nxt, found = qm.cf_call(lambda: qm.structure(svc.structure).peek_scan(svc.control, "c", RECORD_CID_HEX,
                                                                              cursor, count))
    ended = 0
    held_open: set[str] | None = None  # conversations with a UOW its sender holds open: read once, when needed
    for _, data in found:
        try:
            seen = ConvRecord.unpack(data)
        except Exception:  # noqa: BLE001 - not a record: left alone
            continue
        if not idle(seen, pc):
            continue
        if idle_unless_held_open(seen, pc):
            if held_open is None:
                held_open = {c.conversation for c in ctl.scan_all(qm, svc, RECEIVED) if c.conversation}
            if seen.conversation in held_open:
                continue
        conn = qm.connect()
        try:
            rec = take(conn, svc, seen.conversation, wait_s=0.0)
            if rec is None or not idle(rec, pc, held_open=seen.conversation in (held_open or ())):
                conn.backout()
                continue
            conn.commit()
            ended += 1
        except UowStatusError:
            conn.backout()
        except BaseException:
            conn.backout()
            raise
    return nxt, ended


ctl.FOLLOWERS.append(follow)

__all__ = ["ANY", "NEW", "OLD", "RETURNED", "SETTLED", "commit_send", "expire_idle", "follow", "open_for_send", "release_first", "peek", "peek_all", "take",
           "take_next"]
