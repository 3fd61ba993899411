"""Units of work as conversations (seeds 003 and 004): an application logs on with a user id and a token, sends
units of work (UOWs) of several messages to a service, receives a UOW whole and in order, and settles it with
SYNCPOINT; each UOW has a status every member shares (sqm.conversations.uowstatus), kept on the CF and logged like any message.

One Conversation is one participant's session on a queue manager. It holds one *scope*: a queue-manager unit of
work that carries the messages of the UOW it is sending (uncommitted puts) and of the UOW it is receiving
(uncommitted gets), so that COMMIT BOTH settles the two atomically. While both are open, each must be settled with
BOTH (or backed out together): committing one would commit the other. Status changes that stand on their own
(creation, ACCEPTED -> DELIVERED, a backout's return) are short units of work of their own, committed at once, so
every member sees them. docs/uow.md has the model, the state diagram and the restart tables.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cfemu.errors import (
    BackedOutError,
    BadRequestError,
    EndOfUowError,
    MQError,
    NoMessageError,
    OutcomeUnknownError,
    UnknownUowError,
    UowLimitError,
    UowStatusError,
)
from cfemu.uow_attributes import UWSTATP_DEFAULT, UWSTATP_NONE
from sqm.conversations import bindings
from sqm.conversations import uowcontrols as ctl
from sqm.conversations.convrecord import NEW, OLD, SETTLED
from sqm.conversations.receive_watch import ReceiveWatch
from sqm.conversations.uowstatus import (
    ACCEPTED,
    ACTIVE,
    DELIVERED,
    FINAL,
    POSTPONED,
    PROCESSED,
    RECEIVED,
    RECEIVER,
    RECV_FIRST,
    RECV_LAST,
    RECV_MIDDLE,
    RECV_NONE,
    RECV_ONLY,
    SENDER,
    USER_STATUS_ALLOWED,
    USER_STATUS_MAX,
    Control,
    TransitionError,
    after_backout,
    after_restart,
    finish,
    transition,
)
from sqm.core import logon_token
from sqm.core.clock import now_ms
from sqm.core.connection import Connection, Message
from sqm.core.member import Member

SYNC, MSG, ANY = "SYNC", "MSG", "ANY"  # what a receive may be satisfied with (EntireX's "Options used for UOWs", docs/uow.md)
BOTH = "BOTH"  # COMMIT / BACKOUT of the received and the sent UOW at once
OPTIONS = ("COMMIT", "BACKOUT", "CANCEL", "QUERY", "LAST", "SETUSTATUS", "DELETE", "EOC", "EOCCANCEL")
MAX_USER = 32  # EntireX's USER-ID and TOKEN are 32 characters


@dataclass
class Sent:
    uow: str
    status: str
    messages: int
    persistent: bool
    conversation: str


@dataclass
class Received:
    body: bytes
    uow: str  # "" for a message outside a UOW
    recv: str  # RECV_NONE / FIRST / MIDDLE / LAST / ONLY
    status: str  # DELIVERED for a UOW message, "" otherwise
    persistent: bool
    user_status: bytes = b""
    eoc: str = ""
    deliveries: int = 0
    conversation: str = ""


@dataclass
class _Open:
    svc: ctl.Service
    control: Control
    received: int = 0  # receiving: messages taken so far


def _check_identity(kind: str, value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_USER or not value.isprintable():
        raise BadRequestError(f"{kind} must be 1-{MAX_USER} printable characters, not {value!r}")
    return value


class Conversation:
    """A participant's session (EntireX's LOGON with USER-ID and TOKEN): send, receive, syncpoint."""

    def __init__(self, qm: Member, user: str, token: str = "") -> None:
        self.qm = qm
        self.user = _check_identity("user id", user)
        self.token = _check_identity("token", token) if token else ""
        self.sealed = logon_token.seal(qm, self.user, self.token)  # what the CF keeps of the token (sqm.core.logon_token)
        self.scope: Connection = qm.connect()
        self.sending: _Open | None = None
        self.receiving: _Open | None = None
        self._known: dict[str, ctl.Service] = {}  # uow -> its service, a hint for lookups by id (_remember)
        self._max_length = 0  # the current receive's bound (receive's max_length)

    # --- send -----------------------------------------------------------------------------------------------
    def send(self, service: str, body: bytes, *, option: str = SYNC, commit: bool = False, store: bool | None = None,
             status_lifetime: int = UWSTATP_DEFAULT, lifetime_s: int = 0, user_status: bytes | None = None,
             conversation: str = "", eoc: str = "") -> Sent:
        """SEND. ``option`` SYNC: the message joins the UOW this session is sending (made on the first send);
        MSG: a message outside any UOW. ``commit``: SEND with COMMIT (the UOW is committed after this message).
        ``store``: the UOW's messages persistent (None: the service's STORE). ``status_lifetime``: UWSTATP (0 the
        service's, 1-254 lifetimes, 255 none). ``lifetime_s``: UWTIME (0: the service's)."""
        svc = ctl.service(self.qm, service)
        if not isinstance(body, bytes | bytearray):
            raise BadRequestError(f"message body must be bytes, not {type(body).__name__}")
        if option == MSG:
            persistent = svc.attributes.store if store is None else bool(store)
            self.qm.connect().put(svc.name, bytes(body), persistent=persistent, syncpoint=False)
            return Sent("", "", 1, persistent, "")
        if option != SYNC:
            raise BadRequestError(f"send option must be SYNC or MSG, not {option!r}")
        check_conversation_id(conversation)
        if self.sending is None:
            self.sending = self._create(svc, store=store, status_lifetime=status_lifetime, lifetime_s=lifetime_s,
                                        user_status=user_status, conversation=conversation)
        elif self.sending.svc.name != svc.name:
            raise UowStatusError(f"unit of work {self.sending.control.uow} is being sent to "
                                 f"{self.sending.svc.name}: commit or back it out before sending to {svc.name}")
        op = self.sending
        self._check_scope(op)
        c = op.control
        if c.messages >= svc.attributes.max_messages:
            raise UowLimitError(f"unit of work {c.uow} holds {c.messages} messages, service {svc.name}'s "
                                f"MAX-MESSAGES-IN-UOW")
        self.scope.put(svc.data, bytes(body), persistent=c.persistent, syncpoint=True,
                       correlid=bytes.fromhex(c.uow), properties={"uow.seq": c.messages})
        op.control = replace(c, messages=c.messages + 1, length=c.length + len(body))
        if commit or eoc:
            status = self._commit_sent(eoc=eoc)
            return Sent(c.uow, status, op.control.messages, c.persistent, c.conversation)
        return Sent(c.uow, RECEIVED, op.control.messages, c.persistent, c.conversation)

    def _create(self, svc: ctl.Service, *, store: bool | None, status_lifetime: int, lifetime_s: int,
                user_status: bytes | None, conversation: str) -> _Open:
        """A new UOW in RECEIVED status, committed at once so that every member (and a restart) sees it."""
        a = svc.attributes
        if a.max_uows == 0:
            raise UowLimitError(f"service {svc.name} takes no units of work (MAX-UOWS 0)")
        if not 0 <= status_lifetime <= 255:
            raise BadRequestError(f"status lifetime (UWSTATP) must be 0-255, not {status_lifetime}")
        if not 0 <= lifetime_s <= 366 * 86400:
            raise BadRequestError(f"UOW lifetime must be 0-{366 * 86400} s, not {lifetime_s}")
        ustatus = self._check_user_status(user_status)
        active = sum(ctl.count_status(self.qm, svc, s) for s in ACTIVE)
        if active >= a.max_uows:
            raise UowLimitError(f"service {svc.name} has {active} active units of work, its MAX-UOWS")
        mult = a.status_lifetime if status_lifetime == UWSTATP_DEFAULT else (
            0 if status_lifetime == UWSTATP_NONE else status_lifetime)
        scope_uow = self.scope._current_uow()  # the owner must exist before the control names it
        pc = ctl.pseudo_clock(self.qm, svc.structure)
        uow = os.urandom(16).hex()
        c = Control(uow=uow, service=svc.name, status=RECEIVED, sender=self.user, token=self.sealed,
                    persistent=a.store if store is None else bool(store), status_mult=mult,
                    lifetime_ms=(lifetime_s or a.lifetime_s) * 1000, created_pc=pc, changed_pc=pc,
                    user_status=ustatus, home=self._incarnation(), owner=scope_uow.id,
                    conversation=conversation or os.urandom(8).hex())
        conn = self.qm.connect()
        held = ""
        try:
            ctl.put_control(conn, svc, c)
            held = bindings.open_for_send(self.qm, conn, svc, c, new=not conversation)
            ctl.set_last(conn, svc, self.user, self.sealed, uow, ctl.cf_now_ms(self.qm, svc.structure),
                         c.entry_persistent)
            conn.commit()
        except BaseException:
            conn.backout()
            raise
        finally:
            bindings.release_first(self.qm, svc, c.conversation, held)
        self._remember(uow, svc)
        return _Open(svc, c)

    def _commit_sent(self, *, eoc: str = "") -> str:
        """Sender COMMIT (or EOC / EOCCANCEL): RECEIVED -> ACCEPTED with its messages, in one commit."""
        op = self._need(self.sending, "no unit of work is being sent")
        if self.receiving is not None:
            raise UowStatusError(f"unit of work {self.receiving.control.uow} is being received in the same syncpoint "
                                 f"scope: COMMIT BOTH, or settle it first")
        deadline = time.monotonic() + ctl.HELD_WAIT_S  # the request's wait for held controls (ctl.HELD_WAIT_S)
        self._stage_sent(op, eoc, deadline)
        self._commit_scope(deadline)
        self.sending = None
        return ACCEPTED

    @staticmethod
    def _ready_to_commit(op: _Open) -> None:
        if op.control.messages == 0:
            raise UowStatusError(f"unit of work {op.control.uow} holds no message: send one before COMMIT")

    def _stage_sent(self, op: _Open, eoc: str, deadline: float) -> None:
        event = eoc or "COMMIT"
        if eoc not in ("", "EOC", "EOCCANCEL"):
            raise BadRequestError(f"end of conversation must be EOC or EOCCANCEL, not {eoc!r}")
        self._ready_to_commit(op)
        self._check_scope(op)
        pc = ctl.pseudo_clock(self.qm, op.svc.structure)

        def accept(old: Control) -> Control | None:
            self._expect(old, op.control.owner)
            to = transition(SENDER, event, old.status)
            return replace(op.control, status=to, owner="", changed_pc=pc, committed_ms=now_ms(), eoc=eoc,
                           user_status=old.user_status)
        bindings.commit_send(self.scope, op.svc, op.control.conversation, eoc, pc, wait_s=ctl.wait_left(deadline))
        ctl.replace(self.qm, op.svc, op.control.uow, self._refusing(accept), conn=self.scope,
                    wait_s=ctl.wait_left(deadline))

    # --- receive --------------------------------------------------------------------------------------------
    def receive(self, service: str, *, option: str = ANY, wait_ms: int = 0, max_length: int = 0,
                convid: str = ANY, watch: ReceiveWatch | None = None) -> Received:
        """RECEIVE. Within a UOW being received: its next message (RECV_MIDDLE / LAST), or EndOfUowError after the
        last. Otherwise SYNC: the first message of the next ACCEPTED UOW (commit order) this receiver may take by
        ``convid`` (CONVID: NEW a conversation nobody received yet, OLD one bound to this user id and token, ANY its
        own first then new ones, or one conversation's id; docs/uow.md, "Conversations"), MSG: a message outside any
        UOW, ANY: either. ``max_length`` (0: any): the longest message the caller can carry (Connection.get); a
        longer one raises TruncatedMessageError and is not taken (a UOW's first message: the UOW is ACCEPTED again).
        ``watch``: what this receive's wait learned so far, for a caller that polls this receive itself (made here
        for a wait of its own): a look at the service's UOWs is made again only when something changed."""
        self._max_length = max_length
        if option not in (SYNC, MSG, ANY):
            raise BadRequestError(f"receive option must be SYNC, MSG or ANY, not {option!r}")
        check_convid(convid)
        svc = ctl.service(self.qm, service)
        if self.receiving is not None and option != MSG:
            if self.receiving.svc.name != svc.name:
                raise UowStatusError(f"unit of work {self.receiving.control.uow} from {self.receiving.svc.name} is "
                                     "being received: settle it first")
            return self._next_of(self.receiving)
        deadline = time.monotonic() + wait_ms / 1000
        delay = 0.005
        watch = watch or (ReceiveWatch() if wait_ms else None)
        while True:
            if option in (SYNC, ANY):
                got = self._start_receiving(svc, convid, watch)
                if got is not None:
                    return got
            if option in (MSG, ANY):
                try:
                    m = self.qm.connect().get(svc.name, syncpoint=False, max_length=max_length)
                    return Received(m.body, "", RECV_NONE, "", m.persistent)
                except OutcomeUnknownError as e:  # pending or unknown: delivered with the error, as the get does
                    m = e.message
                    if m is not None:
                        e.message = Received(m.body, "", RECV_NONE, "", m.persistent)
                    raise
                except NoMessageError:
                    pass
            if time.monotonic() >= deadline:
                what = {SYNC: "unit of work", MSG: "message outside a unit of work", ANY: "message"}[option]
                raise NoMessageError(f"no {what} available on service {svc.name}")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _start_receiving(self, svc: ctl.Service, convid: str = ANY,
                         watch: ReceiveWatch | None = None) -> Received | None:
        """Take the next ACCEPTED UOW this receiver may take by ``convid``: ACCEPTED -> DELIVERED and its conversation
        bound to this receiver (committed at once, owned by this session's scope), then its first message into the
        scope. With ``watch``: None at once while nothing changed since its last look found nothing."""
        if watch is not None and not watch.worth_a_look(self.qm, svc, convid):
            return None
        scope_uow = self.scope._current_uow()
        pc = ctl.pseudo_clock(self.qm, svc.structure)
        conn = self.qm.connect()
        delivered: Control | None = None
        try:
            old = bindings.take_next(self.qm, conn, svc, convid, self.user, self.token, self.sealed, pc,
                                     wide=watch is not None and watch.looked)
            if old is None:
                conn.backout()
                if watch is not None:
                    watch.found_nothing()
                return None
            to = transition(RECEIVER, "RECEIVE", old.status)
            new = delivered = replace(old, status=to, owner=scope_uow.id, receiver=self.user,
                                      receiver_token=self.sealed, changed_pc=pc)
            ctl.put_control(conn, svc, new)
            conn.commit()
        except OutcomeUnknownError:
            # DELIVERED to this session, or still ACCEPTED: not knowing which, give it back if it is ours (an idle
            # scope would otherwise hold it for as long as the session lives).
            if delivered is not None:
                settle_orphan(self.qm, svc, delivered.uow, delivered.owner)
            if self.sending is None:  # an idle scope ends, so that the sweeper sees a UOW it still holds as orphaned
                self.scope.backout()
            raise
        except BaseException:
            conn.backout()
            raise
        self._remember(new.uow, svc)
        self.receiving = _Open(svc, new)
        try:
            return self._next_of(self.receiving)
        except BaseException:
            # Nothing of it taken (too long for this caller, or the get refused): ACCEPTED again at once, for a
            # receiver that can take it, rather than held by a scope the refusal may have ended.
            if self.receiving is not None and self.sending is None:
                with contextlib.suppress(MQError):
                    self.backout(new.uow)
            raise

    def _next_of(self, op: _Open) -> Received:
        self._check_scope(op)
        c = op.control
        if op.received >= c.messages:
            raise EndOfUowError(f"end of unit of work {c.uow}: all {c.messages} messages were received")
        try:
            m = self.scope.get(op.svc.data, syncpoint=True, correlid=bytes.fromhex(c.uow),
                               max_length=self._max_length)
        except NoMessageError:
            raise EndOfUowError(f"end of unit of work {c.uow}: no further message (received {op.received} of "
                                f"{c.messages})") from None
        op.received += 1
        if c.messages == 1:
            recv = RECV_ONLY
        elif op.received == 1:
            recv = RECV_FIRST
        elif op.received == c.messages:
            recv = RECV_LAST
        else:
            recv = RECV_MIDDLE
        return Received(m.body, c.uow, recv, DELIVERED, c.persistent, c.user_status, c.eoc, c.deliveries,
                        c.conversation)

    # --- syncpoint ------------------------------------------------------------------------------------------
    def syncpoint(self, option: str, uow: str = "", *, user_status: bytes | None = None) -> dict[str, Any]:
        """SYNCPOINT with OPTION=COMMIT, BACKOUT, CANCEL, QUERY, LAST, SETUSTATUS, DELETE, EOC, EOCCANCEL. ``uow``:
        the UOW it applies to ("" the one this session holds; BOTH for COMMIT or BACKOUT of the received and the
        sent UOW at once). Returns the UOW's status (QUERY's fields; ``status`` None when no trace is kept)."""
        handler: dict[str, Callable[[], dict[str, Any]]] = {
            "COMMIT": lambda: self.commit(uow),
            "EOC": lambda: self._commit_sent_by_id(uow, "EOC"),
            "EOCCANCEL": lambda: self._commit_sent_by_id(uow, "EOCCANCEL"),
            "BACKOUT": lambda: self.backout(uow),
            "CANCEL": lambda: self.cancel(uow),
            "QUERY": lambda: self.query(uow),
            "LAST": lambda: self.last(),
            "SETUSTATUS": lambda: self.set_user_status(uow, user_status),
            "DELETE": lambda: self.delete(uow),
        }
        if option not in handler:
            raise BadRequestError(f"syncpoint option must be one of {', '.join(OPTIONS)}, not {option!r}")
        return handler[option]()

    def commit(self, uow: str = "") -> dict[str, Any]:
        """COMMIT: the sent UOW (RECEIVED -> ACCEPTED), the received one (DELIVERED -> PROCESSED), or BOTH."""
        if uow == BOTH:
            snd = self._need(self.sending, "COMMIT BOTH needs a unit of work being sent")
            rcv = self._need(self.receiving, "COMMIT BOTH needs a unit of work being received")
            self._ready_to_commit(snd)  # before anything is staged: a refusal half way left the session stuck
            # One wait for held controls for the request, not one per control: two waits of 3 s outlasted a client's
            # 5 s request timeout, and a COMMIT that was carried out answered 'outcome unknown'.
            deadline = time.monotonic() + ctl.HELD_WAIT_S
            self._stage_processed(rcv, deadline)
            self._stage_sent(snd, "", deadline)
            self._commit_scope(deadline)
            self.sending = self.receiving = None
            return {"status": ACCEPTED, "uow": snd.control.uow, "received": {"uow": rcv.control.uow,
                                                                              "status": PROCESSED}}
        op = self._held(uow)
        if op is self.sending:
            return self._commit_sent_by_id(uow, "")
        if self.sending is not None:
            raise UowStatusError(f"unit of work {self.sending.control.uow} is being sent in the same syncpoint "
                                 "scope: COMMIT BOTH, or settle it first")
        deadline = time.monotonic() + ctl.HELD_WAIT_S
        self._stage_processed(op, deadline)
        self._commit_scope(deadline)
        self.receiving = None
        return {"status": PROCESSED, "uow": op.control.uow}

    def _commit_sent_by_id(self, uow: str, eoc: str) -> dict[str, Any]:
        op = self._held(uow)
        if op is not self.sending:
            raise UowStatusError(f"unit of work {op.control.uow} is being received: {eoc or 'COMMIT'} is the "
                                 "sender's")
        status = self._commit_sent(eoc=eoc)
        return {"status": status, "uow": op.control.uow}

    def _stage_processed(self, op: _Open, deadline: float) -> None:
        """Receiver COMMIT, staged in the scope: the rest of its messages taken, DELIVERED -> PROCESSED."""
        self._check_scope(op)
        pc = ctl.pseudo_clock(self.qm, op.svc.structure)

        def process(old: Control) -> Control | None:
            self._expect(old, op.control.owner)
            return finish(old, transition(RECEIVER, "COMMIT", old.status), pc)
        ctl.replace(self.qm, op.svc, op.control.uow, self._refusing(process), drain=lambda old, new: True,
                    conn=self.scope, wait_s=ctl.wait_left(deadline), how=SETTLED)

    def backout(self, uow: str = "") -> dict[str, Any]:
        """BACKOUT: a sent UOW becomes BACKEDOUT (its messages gone); a received one is ACCEPTED again, its delivery
        count raised. BOTH: both at once."""
        ops = [o for o in (self.receiving, self.sending) if o is not None] if uow == BOTH else [self._held(uow)]
        if uow != BOTH and len([o for o in (self.receiving, self.sending) if o is not None]) > 1:
            raise UowStatusError("a unit of work is being sent and one received in the same syncpoint scope: "
                                 "BACKOUT BOTH")
        if not ops:
            raise UowStatusError("no unit of work to back out")
        self.scope.backout()
        self.sending = self.receiving = None
        out: dict[str, Any] = {}
        deadline = time.monotonic() + ctl.HELD_WAIT_S  # one wait for the request (BOTH: two controls), as COMMIT's
        for op in ops:
            who = SENDER if op.control.status == RECEIVED else RECEIVER
            pc = ctl.pseudo_clock(self.qm, op.svc.structure)

            def back(old: Control, op: _Open = op, who: str = who, pc: int = pc) -> Control | None:
                self._expect(old, op.control.owner)
                to = transition(who, "BACKOUT", old.status)
                if to == ACCEPTED:
                    return replace(old, status=ACCEPTED, owner="", deliveries=old.deliveries + 1, changed_pc=pc)
                return finish(old, to, pc)
            try:
                _, new = ctl.replace(self.qm, op.svc, op.control.uow, self._refusing(back),
                                     wait_s=ctl.wait_left(deadline))
            except UowStatusError:  # settled meanwhile (the sweeper found its scope gone): report what it is now
                new = ctl.peek(self.qm, op.svc, op.control.uow)
            out = {"uow": op.control.uow, "status": new.status if new else None, **out}
        return out

    def cancel(self, uow: str = "") -> dict[str, Any]:
        """CANCEL. Receiver (of the UOW it holds): postponed while POSTPONE-ATTEMPTS remain, else CANCELLED, its
        messages removed or moved to the service's backout queue. Sender (by id): an ACCEPTED UOW it sent is
        withdrawn: CANCELLED, its messages removed."""
        if self.receiving is not None and uow in ("", self.receiving.control.uow):
            return self._cancel_received(self.receiving)
        if not uow:
            raise UowStatusError("CANCEL needs the id of a unit of work you sent, or one being received")
        svc, c = self._find(uow)
        if not self._is_sender(c):
            raise UowStatusError(f"unit of work {uow} was sent by another user: only its sender may CANCEL it")
        pc = ctl.pseudo_clock(self.qm, svc.structure)

        def withdraw(old: Control) -> Control | None:
            return finish(old, transition(SENDER, "CANCEL", old.status), pc)
        _, new = ctl.replace(self.qm, svc, uow, self._refusing(withdraw), drain=lambda old, new: True,
                             also_mine=self._scope_id())
        return {"uow": uow, "status": new.status if new else None}

    def _cancel_received(self, op: _Open) -> dict[str, Any]:
        if self.sending is not None:
            raise UowStatusError(f"unit of work {self.sending.control.uow} is being sent in the same syncpoint "
                                 "scope: commit or back it out before CANCEL")
        a = op.svc.attributes
        pc = ctl.pseudo_clock(self.qm, op.svc.structure)
        c = op.control
        if c.postponements < a.postpone_attempts:
            self.scope.backout()  # its messages stay for the next attempt
            self.receiving = None

            def postpone(old: Control) -> Control | None:
                self._expect(old, c.owner)
                to = transition(RECEIVER, "POSTPONE", old.status)
                # Its home member's current incarnation: the next restart of the member it was sent through ends the
                # postponement (Table 1), and no restart the UOW lived through before does.
                return replace(old, status=to, owner="", postponements=old.postponements + 1, changed_pc=pc,
                               until_pc=pc + a.postpone_delay_s * 1000, home=home)
            home = self._current_incarnation(c.home)
            _, new = ctl.replace(self.qm, op.svc, c.uow, self._refusing(postpone))
            return {"uow": c.uow, "status": POSTPONED, "postponements": new.postponements if new else 0}

        def cancelled(old: Control) -> Control | None:
            self._expect(old, c.owner)
            return finish(old, transition(RECEIVER, "CANCEL", old.status), pc)
        # The scope's gets are given back first, so that every message of the UOW (read or not) is moved whole.
        self.scope.backout()
        self.receiving = None
        conn = self.qm.connect()
        try:
            ctl.replace(self.qm, op.svc, c.uow, self._refusing(cancelled), conn=conn, how=SETTLED)
            moved = move_to_backout_queue(conn, op.svc, c.uow)
            conn.commit()
        except BaseException:
            conn.backout()
            raise
        new = ctl.peek(self.qm, op.svc, c.uow)
        return {"uow": c.uow, "status": new.status if new else None, "moved_to": op.svc.backout_queue if moved else ""}

    def query(self, uow: str) -> dict[str, Any]:
        """QUERY: the status of a UOW by id (any member's)."""
        if not uow:
            raise BadRequestError("QUERY needs a unit of work id")
        for op in (self.sending, self.receiving):
            if op is not None and op.control.uow == uow:
                return op.control.public()
        # A status change in flight (one logged while its commit waits for the CF, say) is waited for: a QUERY
        # after a COMMIT that answered must not read the status before it.
        _, c = self._find(uow, wait_s=ctl.HELD_WAIT_S)
        return c.public()

    def last(self) -> dict[str, Any]:
        """LAST: the status of the last UOW this user (id and token) sent, found again after any failure."""
        if self.sending is not None:
            return self.sending.control.public()
        found = ctl.find_last(self.qm, self.user, self.sealed)
        if found is None and self.token:  # a pointer made before tokens were sealed
            found = ctl.find_last(self.qm, self.user, self.token)
        if found is None:
            raise UnknownUowError(f"user {self.user} has sent no unit of work whose status is kept")
        svc, uow = found
        c = ctl.peek(self.qm, svc, uow, wait_s=ctl.HELD_WAIT_S)  # as QUERY: a change in flight is waited for
        if c is None:
            return {"uow": uow, "service": svc.name, "status": None}
        return c.public()

    def set_user_status(self, uow: str, user_status: bytes | None) -> dict[str, Any]:
        """SETUSTATUS: the UOW's user status, in RECEIVED, ACCEPTED or DELIVERED, by its sender or receiver."""
        value = self._check_user_status(user_status)
        uow = uow or (self.sending or self.receiving or _no_uow()).control.uow
        svc, c = self._find(uow)
        if not (self._is_sender(c) or self._is_receiver(c)):
            raise UowStatusError(f"unit of work {uow} is neither sent nor received by user {self.user} with this "
                                 "token")

        def set_it(old: Control) -> Control | None:
            # Asked again of the control taken: the one read above may be a change in flight's old one, waited for
            # since (a receiver of record that backed out, while another receiver takes the UOW).
            if not (self._is_sender(old) or self._is_receiver(old)):
                raise UowStatusError(f"unit of work {uow} is neither sent nor received by user {self.user} with "
                                     "this token")
            if old.status not in USER_STATUS_ALLOWED:
                raise TransitionError(f"SETUSTATUS is not allowed in status {old.status} (only in "
                                      f"{', '.join(USER_STATUS_ALLOWED)})")
            return replace(old, user_status=value)
        _, new = ctl.replace(self.qm, svc, uow, self._refusing(set_it), also_mine=self._scope_id())
        for op in (self.sending, self.receiving):
            if op is not None and op.control.uow == uow:
                op.control = replace(op.control, user_status=value)
        assert new is not None
        return new.public()

    def delete(self, uow: str) -> dict[str, Any]:
        """DELETE: the persistent status of a finished UOW this user sent; no trace remains."""
        svc, c = self._find(uow)
        if not self._is_sender(c):
            raise UowStatusError(f"unit of work {uow} was sent by another user: only its sender may DELETE it")

        def gone(old: Control) -> Control | None:
            if old.status not in FINAL:
                raise TransitionError(f"DELETE is not allowed in status {old.status} (only in {', '.join(FINAL)})")
            return None
        ctl.replace(self.qm, svc, uow, self._refusing(gone), also_mine=self._scope_id())
        return {"uow": uow, "status": None, "deleted": True}

    def close(self) -> None:
        """LOGOFF: what this session holds is backed out (a sent UOW BACKEDOUT, a received one ACCEPTED again).
        What cannot be settled now (the CF is away) the sweeper settles later."""
        if self.sending is None and self.receiving is None:
            self.scope.close()
            return
        try:
            self.backout(BOTH)
        except Exception:  # noqa: BLE001 - the sweeper finds a control whose owner is gone and settles it
            self.scope.close()

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers --------------------------------------------------------------------------------------------
    def _is_sender(self, c: Control) -> bool:
        """Whether this logon (user id and token) sent the UOW (tokens compared as sqm.core.logon_token keeps them)."""
        return c.sender == self.user and logon_token.matches(c.token, self.token, self.sealed)

    def _is_receiver(self, c: Control) -> bool:
        return bool(c.receiver) and c.receiver == self.user and logon_token.matches(c.receiver_token, self.token,
                                                                                    self.sealed)

    def _commit_scope(self, deadline: float) -> None:
        """Commit the scope; if it was backed out instead, what it held is settled as a backout would be (waiting for
        a held control until ``deadline``, the request's: what is still held then is left to the sweeper)."""
        held = [o for o in (self.sending, self.receiving) if o is not None]
        try:
            self.scope.commit()
        except BaseException as e:
            # The scope's unit of work is over whatever the outcome (committed, backed out, or not known: then
            # recovery decides it, and the sweeper settles a UOW it left held): this session holds neither any more.
            self.sending = self.receiving = None
            if isinstance(e, BackedOutError):
                for op in held:
                    settle_orphan(self.qm, op.svc, op.control.uow, op.control.owner, wait_s=ctl.wait_left(deadline))
            raise

    def _scope_id(self) -> str:
        """The scope's unit of work, if any: a control it holds (a settle staged in it and refused, until the session
        backs out) is this session's own, and a change on another connection is refused at once, not after waiting
        for a holder that only this thread can end."""
        return self.scope.uow.id if self.scope.uow is not None else ""

    def _incarnation(self) -> str:
        return f"{self.qm.name}.{self.qm.caller.epoch:x}"

    def _current_incarnation(self, home: str) -> str:
        """The current incarnation of the member ``home`` names (its epoch now), or ``home`` as it is."""
        member = home.split(".", 1)[0]
        if not member:
            return home
        epoch = int(self.qm.cf_call(lambda: self.qm.admin.epoch(member)))
        return f"{member}.{epoch:x}" if epoch else home

    def _check_scope(self, op: _Open) -> None:
        """The scope's unit of work must still be the one the UOW's control names as its holder. A refused call can
        end an idle unit of work under the session (Connection forgets one that did nothing): going on under a new
        one let the sweeper give the UOW back while this session still read it, and a second receiver got the rest
        of it (invariant 9, docs/invariants.md). Then the UOW is given back now, and the caller told."""
        cur = self.scope.uow
        if cur is not None and cur.id == op.control.owner:
            return
        if op is self.sending:
            self.sending = None
        if op is self.receiving:
            self.receiving = None
        settle_orphan(self.qm, op.svc, op.control.uow, op.control.owner)
        raise UowStatusError(f"unit of work {op.control.uow}: this session's syncpoint scope ended under it (a call "
                             "was refused); it was given back as a backout leaves it")

    def _held(self, uow: str) -> _Open:
        for op in (self.sending, self.receiving):
            if op is not None and uow in ("", op.control.uow):
                if uow == "" and self.sending is not None and self.receiving is not None:
                    raise UowStatusError("a unit of work is being sent and one received: name it, or use BOTH")
                return op
        if uow:
            raise UowStatusError(f"unit of work {uow} is not held by this session (sent and committed, or never "
                                 "received here)")
        raise UowStatusError("this session holds no unit of work")

    def _find(self, uow: str, *, wait_s: float = 0.0) -> tuple[ctl.Service, Control]:
        found = ctl.find(self.qm, uow, self._known.get(uow), wait_s=wait_s)
        if found is None:
            raise UnknownUowError(f"unit of work {uow} is not known (never sent, or its status was not kept)")
        self._remember(uow, found[0])
        return found

    def _remember(self, uow: str, svc: ctl.Service) -> None:
        """The service of a UOW this session sent, received or named, newest KNOWN_MAX of them: only a hint
        (ctl.find looks over every service without it), so a session that lives for millions of UOWs stays small."""
        self._known.pop(uow, None)
        self._known[uow] = svc
        while len(self._known) > KNOWN_MAX:
            del self._known[next(iter(self._known))]

    @staticmethod
    def _need(op: _Open | None, why: str) -> _Open:
        if op is None:
            raise UowStatusError(why)
        return op

    @staticmethod
    def _expect(c: Control, owner: str) -> None:
        if c.owner != owner:
            raise UowStatusError(f"unit of work {c.uow} is {c.status} and no longer held by this session")

    @staticmethod
    def _refusing(fn: Callable[[Control], Control | None]) -> Callable[[Control], Control | None]:
        def run(c: Control) -> Control | None:
            try:
                return fn(c)
            except TransitionError as e:
                raise UowStatusError(f"unit of work {c.uow}: {e}") from None
        return run

    @staticmethod
    def _check_user_status(value: bytes | None) -> bytes:
        if value is None:
            return b""
        if not isinstance(value, bytes | bytearray) or len(value) > USER_STATUS_MAX:
            raise BadRequestError(f"user status must be at most {USER_STATUS_MAX} bytes")
        return bytes(value)


KNOWN_MAX = 1024  # the UOW -> service hints a session keeps (Conversation._remember)
MAX_CONVID = 64  # a conversation id a sender chooses (sqm.conversations.ops)


def check_conversation_id(conversation: str) -> str:
    """A sender's conversation id ("" for a new one): one RECEIVE can name by CONVID, so 1-64 printable characters
    and none of CONVID's keywords (NEW, OLD, ANY)."""
    if conversation == "":
        return conversation
    if (not isinstance(conversation, str) or len(conversation) > MAX_CONVID or not conversation.isprintable()
            or conversation in (NEW, OLD, ANY)):
        raise BadRequestError(f"send: a conversation id must be 1-{MAX_CONVID} printable characters other than "
                              f"{NEW}, {OLD} and {ANY}, not {conversation!r}")
    return conversation


def check_convid(convid: str) -> str:
    """RECEIVE's CONVID: NEW, OLD, ANY, or a conversation's id (1-64 printable characters)."""
    if not isinstance(convid, str) or not convid or len(convid) > MAX_CONVID or not convid.isprintable():
        raise BadRequestError(f"receive: CONVID must be {NEW}, {OLD}, {ANY} or a conversation id of 1-{MAX_CONVID} "
                              f"printable characters, not {convid!r}")
    return convid


def _no_uow() -> Any:
    raise UowStatusError("this session holds no unit of work: name one")


def move_to_backout_queue(conn: Connection, svc: ctl.Service, uow: str) -> bool:
    """A cancelled UOW's remaining messages: to the service's backout queue as plain messages when it has one, else
    removed; in the connection's unit of work."""
    def move(m: Message) -> None:
        conn.put(svc.backout_queue, m.body, persistent=m.persistent, syncpoint=True, correlid=bytes.fromhex(uow),
                 properties=m.properties, counted=False)
    return ctl.drain_data(conn, svc, uow, move if svc.backout_queue else None) > 0 and bool(svc.backout_queue)


def settle_orphan(qm: Member, svc: ctl.Service, uow: str, owner: str, *, gone: bool = False,
                  wait_s: float = ctl.HELD_WAIT_S) -> Control | None:
    """A UOW whose owning scope was backed out (``gone``: died with its member): its status as a backout leaves it
    (sqm.conversations.uowstatus.after_backout) or, when its process is gone, as the restart tables say (after_restart); its
    remaining messages are removed when it is not restored. Best effort: a control that changed meanwhile, or a CF
    that cannot be reached, is left to the sweeper (which passes ``wait_s`` 0: see ctl.replace)."""
    def settle(old: Control) -> Control | None:
        if old.owner != owner or old.status not in (RECEIVED, DELIVERED):
            raise UowStatusError(f"unit of work {uow} changed meanwhile")
        return after_restart(old) if gone else after_backout(old, pc)
    try:
        pc = ctl.pseudo_clock(qm, svc.structure) if not gone else 0
        _, new = ctl.replace(qm, svc, uow, settle, drain=lambda old, new: new is None or new.status in FINAL,
                             wait_s=wait_s)
        return new
    except Exception:  # noqa: BLE001 - left to the sweeper
        return None


__all__ = ["Conversation", "Sent", "Received", "SYNC", "MSG", "ANY", "NEW", "OLD", "BOTH", "OPTIONS", "check_convid",
           "check_conversation_id", "settle_orphan",
           "move_to_backout_queue"]
