"""Control entries: where a UOW's status is kept on the CF, and the one way it changes (a replacement inside a
queue-manager unit of work). Shared by the application's conversation (sqm.conversations.conversation), the sweeper that runs
lifetimes and postponement (sqm.conversations.uowsweeper) and recovery's settling of UOWs whose process is gone."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from cfemu.admin import QueueDef
from cfemu.entry import Entry
from cfemu.errors import NoMessageError, UowStatusError
from cfemu.uow_attributes import UowAttributes, UowDefaults, control_queue, data_queue, service_attributes
from sqm.conversations.convrecord import RETURNED
from sqm.conversations.group_defaults import group_defaults
from sqm.conversations.uowstatus import LETTER, Control, status_letter_hex
from sqm.core import logon_token
from sqm.core.cfcall import CFCaller
from sqm.core.connection import Connection, Message
from sqm.core.member import Member
from sqm.core.pclock import PCLOCK_GAP_MS, cf_now_ms, pseudo_clock  # the conversations' clocks, shared
from sqm.request_slots import nap

log = logging.getLogger(__name__)

LAST_LETTER = "L"  # a user's pointer to the last UOW it sent (SYNCPOINT LAST)
PEEK_LIMIT = 1000
# How long a status change, QUERY or LAST waits for a UOW's control that another unit of work holds, before it
# answers as the control stands. A control is held only while a status change is in flight (take, put, commit: a few
# CF round trips), by a sweeper that takes it to check it is still as its batch read it and gives it back, or by a
# change whose commit was forced while the CF was away (a duplexed CF's failover), which its member applies within
# about a second and a half of finding the new primary (chaos runs: 0.3-1.5 s). Refusing at once refused a
# receiver's COMMIT of a UOW its session held because a sweeper looked at that moment, and a QUERY right after an
# acknowledged COMMIT read the status before it (CHAOS-RESULTS.md, 2026-11-26 20:10). Below a client's 5 s request
# timeout, so the answer still reaches it: it is one request's budget, not one per control (a COMMIT BOTH takes
# two: sqm.conversations.conversation.Conversation.commit).
HELD_WAIT_S = 3.0


def wait_left(deadline: float) -> float:
    """What is left of a request's wait budget (``time.monotonic() + HELD_WAIT_S`` when it began)."""
    return max(0.0, deadline - time.monotonic())


@dataclass(frozen=True)
class Service:
    name: str
    structure: str
    attributes: UowAttributes
    backout_queue: str

    @property
    def data(self) -> str:
        return data_queue(self.name)

    @property
    def control(self) -> str:
        return control_queue(self.name)


def service_of(qdef: QueueDef, group: UowDefaults) -> Service:
    """The service a queue definition makes, its attributes as they apply: the definition's, then the group's
    defaults (cfemu.uow_attributes.service_attributes)."""
    if not qdef.uow:
        raise UowStatusError(f"queue {qdef.name} is not a service: define it with UOW attributes "
                             "(cfemu define queue NAME --uow ...)")
    return Service(qdef.name, qdef.structure, service_attributes(qdef.uow, group), qdef.backout_queue)


def service(qm: Member, name: str) -> Service:
    return service_of(qm.queue_def(name), group_defaults(qm))


def services(qm: Member) -> Iterator[Service]:
    """Every service of the group (queues with UOW attributes), for lookups by UOW id alone and the sweeper: the CF's
    definitions, and the group repository's where the CF lost them (its structure then answers FAILED, 2373, until
    it is restored, where "no such UOW" would tell an application it has no work in progress)."""
    defs = {q.name: q for q in (qm.repository.queues() if qm.repository is not None else [])}
    defs.update({q.name: q for q in qm.cf_call(qm.admin.queues)})
    group = group_defaults(qm)
    for qdef in sorted(defs.values(), key=lambda q: q.name):
        if qdef.uow:
            yield service_of(qdef, group)


def _peek_entry(qm: CFCaller, svc: Service, uow: str) -> tuple[Entry, bytes] | None:
    found = qm.cf_call(lambda: qm.structure(svc.structure).peek(svc.control, "m", uow, 1))
    return found[0] if found else None


def peek(qm: Member, svc: Service, uow: str, *, wait_s: float = 0.0) -> Control | None:
    """The UOW's control as the CF holds it (also while a transition holds it), without taking it. ``wait_s``: while
    a unit of work holds it (a status change in flight), wait up to that long for the change to end, so that a
    change already acknowledged to its caller is seen (QUERY, LAST); then the control as it stands."""
    deadline = time.monotonic() + wait_s
    delay = 0.005
    while True:
        found = _peek_entry(qm, svc, uow)
        if found is None or found[0].state != "UG" or time.monotonic() >= deadline:
            return Control.unpack(found[1]) if found else None
        nap(delay)
        delay = min(delay * 2, 0.05)


def peek_status(qm: Member, svc: Service, status: str, limit: int = PEEK_LIMIT) -> list[Control]:
    """Controls in one status, in commit order (the sweeper's and recovery's scan). An entry that is not a control
    (something put there by other means) is skipped and logged: one must not stop every service's sweeping."""
    found = qm.cf_call(lambda: qm.structure(svc.structure).peek(svc.control, "c", status_letter_hex(status), limit))
    return _controls(svc, found)


def _controls(svc: Service, found: list[tuple[Any, bytes]]) -> list[Control]:
    out = []
    for entry, data in found:
        try:
            out.append(Control.unpack(data))
        except Exception as e:  # noqa: BLE001 - any undecodable body
            log.warning("%s: entry %s is not a UOW control (%s): skipped", svc.control, entry.id, e)
    return out


def scan_status(qm: Member, svc: Service, status: str, cursor: str = "0",
                count: int = 500) -> tuple[str, list[Control]]:
    """A bounded batch of the controls in one status, in no order, and the cursor of the next ("0": pass over)."""
    nxt, found = qm.cf_call(lambda: qm.structure(svc.structure).peek_scan(svc.control, "c",
                                                                        status_letter_hex(status), cursor, count))
    return nxt, _controls(svc, found)


def scan_all(qm: Member, svc: Service, status: str) -> list[Control]:
    """Every control in one status, read in bounded batches (a restart's settling: once, not every second)."""
    out: list[Control] = []
    cursor = "0"
    while True:
        cursor, batch = scan_status(qm, svc, status, cursor)
        out += batch
        if cursor == "0":
            return list({c.uow: c for c in out}.values())  # a pass may return an entry twice


def count_status(qm: Member, svc: Service, status: str) -> int:
    return int(qm.cf_call(lambda: qm.structure(svc.structure).index_count(svc.control, "c",
                                                                           status_letter_hex(status))))


def put_control(conn: Connection, svc: Service, c: Control) -> None:
    c = logon_token.seal_control(conn.qm, c)  # the owners' tokens only ever in their stored form
    conn.put(svc.control, c.pack(), persistent=c.entry_persistent, syncpoint=True, msgid=bytes.fromhex(c.uow),
             correlid=LETTER[c.status].encode(), counted=False)


def take_control(conn: Connection, svc: Service, uow: str, *, wait_s: float = HELD_WAIT_S,
                 also_mine: str = "") -> Control:
    """Get the UOW's control under the connection's unit of work (it is replaced or removed at its commit). A control
    another unit of work holds (a status change in flight, or a sweeper's look) is waited for, up to ``wait_s``: the
    change it makes, if any, is then judged by the caller's own check. Refused when there is no control (its status
    is not kept), when this connection's unit of work holds it already, or ``also_mine`` (the caller's session's
    scope, which cannot end while its own thread waits here: waiting for it would lose the whole wait), or when it is
    still held after the wait."""
    deadline = time.monotonic() + wait_s
    delay = 0.005
    while True:
        try:
            msg = conn.get(svc.control, syncpoint=True, msgid=bytes.fromhex(uow), counted=False)
            return Control.unpack(msg.body)
        except NoMessageError:
            pass
        mine = {conn.uow.id if conn.uow is not None else "", also_mine} - {""}
        found = _peek_entry(conn.qm, svc, uow) if time.monotonic() < deadline else None
        if found is None or found[0].state == "UG" and found[0].uow in mine:
            raise UowStatusError(f"unit of work {uow} changed status meanwhile (or its status is not kept)")
        if found[0].state == "UG":  # given back (a look), or replaced (a change) in a moment: try again then
            nap(delay)
            delay = min(delay * 2, 0.05)


def drain_data(conn: Connection, svc: Service, uow: str, each: Callable[[Message], None] | None = None) -> int:
    """Get (under the connection's unit of work) every message of the UOW still on the service's data queue,
    handing each to ``each`` when given (a cancel moving them to the backout queue)."""
    n = 0
    while True:
        try:
            m = conn.get(svc.data, syncpoint=True, correlid=bytes.fromhex(uow), counted=False)
        except NoMessageError:
            return n
        if each is not None:
            each(m)
        n += 1


# What else follows a status change, in its unit of work: (connection, service, old, new, how) -> None. A feature
# of the conversations registers here (sqm.conversations.bindings: a conversation's record follows its UOWs);
# ``how`` is replace's: RETURNED unless the caller says SETTLED (sqm.conversations.convrecord).
Follower = Callable[[Connection, Service, Control, "Control | None", str], None]
FOLLOWERS: list[Follower] = []


def replace(qm: Member, svc: Service, uow: str, change: Callable[[Control], Control | None], *,
            drain: Callable[[Control, Control | None], bool] = lambda old, new: False,
            conn: Connection | None = None, wait_s: float = HELD_WAIT_S,
            also_mine: str = "", how: str = RETURNED) -> tuple[Control, Control | None]:
    """One status change, as one unit of work: take the control (waiting up to ``wait_s`` while another change holds
    it; ``also_mine``: as take_control's), compute its successor (``change`` may raise UowStatusError, which changes
    nothing), take the UOW's messages where ``drain`` says so, put the successor (None: no trace kept), let the
    FOLLOWERS follow (``how``: what the change is, for them), commit. With ``conn`` the change joins that
    connection's unit of work, uncommitted."""
    own = conn is None
    c = conn or qm.connect()
    try:
        old = take_control(c, svc, uow, wait_s=wait_s, also_mine=also_mine)
        new = change(old)
        for follow in FOLLOWERS:
            follow(c, svc, old, new, how)
        if drain(old, new):
            drain_data(c, svc, uow)
        if new is not None:
            put_control(c, svc, new)
        if own:
            c.commit()
    except BaseException:
        if own:
            c.backout()
        raise
    return old, new


def last_pointer_id(user: str, token: str) -> bytes:
    """The message id of a user's pointer to its last UOW (SYNCPOINT LAST finds it by user id and token; ``token``
    in its stored form, sqm.core.logon_token)."""
    return hashlib.sha256(f"{user}\0{token}".encode()).digest()[:24]


def set_last(conn: Connection, svc: Service, user: str, token: str, uow: str, created_ms: int,
             persistent: bool) -> None:
    """Replace the user's pointer on this service's control queue, in the connection's unit of work."""
    pid = last_pointer_id(user, token)
    try:
        conn.get(svc.control, syncpoint=True, msgid=pid, counted=False)
    except NoMessageError:
        pass
    conn.put(svc.control, msgpack.packb({"uow": uow, "at": created_ms}), persistent=persistent, syncpoint=True,
             msgid=pid, correlid=LAST_LETTER.encode(), counted=False)


def _peek_id(qm: Member, svc: Service, value: str, limit: int = 1) -> list[tuple[Any, bytes]]:
    return list(qm.cf_call(lambda: qm.structure(svc.structure).peek(svc.control, "m", value, limit)))


def find_last(qm: Member, user: str, token: str) -> tuple[Service, str] | None:
    """The service and id of the user's last UOW, over every service."""
    pid = last_pointer_id(user, token).hex()
    best: tuple[int, Service, str] | None = None
    for svc in services(qm):
        # Two sessions of one user creating UOWs at once can each leave a pointer: the newest counts.
        for _, raw in _peek_id(qm, svc, pid, 16):
            p = msgpack.unpackb(raw)
            if best is None or int(p["at"]) > best[0]:
                best = (int(p["at"]), svc, str(p["uow"]))
    return (best[1], best[2]) if best else None


def find(qm: Member, uow: str, hint: Service | None = None, *,
         wait_s: float = 0.0) -> tuple[Service, Control] | None:
    """A UOW's service and control, by its id alone (``wait_s``: as peek's)."""
    for svc in ([hint] if hint else []) + [s for s in services(qm) if s != hint]:
        c = peek(qm, svc, uow, wait_s=wait_s)
        if c is not None:
            return svc, c
    return None


__all__ = ["Service", "service", "services", "pseudo_clock", "peek", "peek_status", "put_control", "take_control",
           "drain_data", "replace", "set_last", "find_last", "find", "PCLOCK_GAP_MS", "cf_now_ms", "HELD_WAIT_S",
           "wait_left"]
