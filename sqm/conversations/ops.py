"""The conversation operations of the service (EntireX's LOGON, SEND, RECEIVE, SYNCPOINT; sqm.conversations.conversation,
docs/uow.md): their rows and handlers. A connection has at most one session, made by logon; send, receive and
syncpoint use it (the dispatcher refuses them before a logon: ``needs_logon``), and it ends with the connection,
what it holds backed out (``logoff``).

This module imports nothing of sqm.service: only sqm.operations and the feature it serves."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from typing import Any, Protocol

from cfemu.errors import (
    BadRequestError,
    ClientGoneError,
    EndOfUowError,
    NoMessageError,
    TruncatedMessageError,
)
from sqm import operations
from sqm.conversations import operator_status
from sqm.conversations.conversation import MAX_USER, OPTIONS, Conversation, check_convid
from sqm.conversations.logon_guesses import LogonGuesses
from sqm.conversations.receive_watch import ReceiveWatch
from sqm.conversations.uowstatus import USER_STATUS_MAX
from sqm.core.manager import QueueManager
from sqm.operations import (
    ANY_ROLE,
    OPERATOR_ONLY,
    NotLoggedOnError,
    Operation,
    arg,
    bounded_str,
    service_name,
    short,
)
from sqm.request_slots import before_wait

log = logging.getLogger("sqm.service.server")  # the service's log lines keep one logger name

MAX_CONVERSATION_ID = 64  # a conversation id a sender chooses (one it is given is 16 hex characters)


class Service(operations.Service, Protocol):
    @property
    def qm(self) -> QueueManager: ...


class Session(operations.Session, Protocol):
    conversation: Conversation | None  # made by logon; closed with the connection

    @property
    def peer_ip(self) -> str: ...


# Each member's brake on logons that try ever new tokens for a user id (one per queue manager served).
_GUESSES: weakref.WeakKeyDictionary[QueueManager, LogonGuesses] = weakref.WeakKeyDictionary()
_GUESSES_LOCK = threading.Lock()


def _guesses(qm: QueueManager) -> LogonGuesses:
    with _GUESSES_LOCK:
        found = _GUESSES.get(qm)
        if found is None:
            found = _GUESSES[qm] = LogonGuesses()
        return found


def logoff(svc: Service, session: Session, why: str) -> None:
    """End the connection's session: what it holds is backed out (a sent UOW BACKEDOUT, a received one ACCEPTED
    again with its delivery counted); what the CF cannot settle now the sweeper settles later."""
    conv, session.conversation = session.conversation, None
    if conv is None:
        return
    try:
        conv.close()
    except Exception as e:  # noqa: BLE001 - the session ends whatever happens; the sweeper settles the rest
        log.warning("%s: ending the session of user %s on connection %d (%s): %s", svc.qm.name,
                    short(conv.user), session.number, why, e)


def _logged_on(session: Session) -> Conversation:
    if session.conversation is None:  # the dispatcher refuses it first; a logon that failed leaves none
        raise NotLoggedOnError("this connection has not logged on: send logon first")
    return session.conversation


def logon(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    user = _identity(args, "user", required=True)
    token = _identity(args, "token", required=False)
    wait_s = _guesses(svc.qm).delay(user, token, session.peer_ip, time.monotonic())
    if wait_s > 0:  # a user id logged on with ever new tokens: a token being guessed is slowed down
        before_wait()
        if threading.Event.wait(session.gone, wait_s):
            raise ClientGoneError(f"logon of user {user}: the client has gone")
    logoff(svc, session, "a new logon")  # one session per connection: the new one replaces it
    session.conversation = Conversation(svc.qm, user, token)
    return {"user": user, "token": bool(token), "qmgr": svc.qm.name}


def send(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    conv = _logged_on(session)
    eoc = arg(args, "send", "eoc", str, "")
    if eoc not in ("", "EOC", "EOCCANCEL"):
        raise BadRequestError(f"send: 'eoc' must be EOC or EOCCANCEL, not {short(eoc)}")
    sent = conv.send(service_name(args, "send"), arg(args, "send", "body", bytes),
                     option=_choice(args, "send", "option", ("SYNC", "MSG"), "SYNC"),
                     commit=arg(args, "send", "commit", bool, False),
                     store=arg(args, "send", "store", bool, None),
                     status_lifetime=arg(args, "send", "status_lifetime", int, 0),
                     lifetime_s=arg(args, "send", "lifetime_s", int, 0),
                     user_status=_user_status(args, "send"),
                     conversation=bounded_str(args, "send", "conversation", MAX_CONVERSATION_ID), eoc=eoc)
    return dataclasses.asdict(sent)


def receive(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    """A receive that may wait: polled here (not in Conversation.receive) so that it ends with its connection
    and takes nothing for a client that has gone."""
    conv = _logged_on(session)
    service = service_name(args, "receive")
    option = _choice(args, "receive", "option", ("ANY", "SYNC", "MSG"), "ANY")
    convid = check_convid(bounded_str(args, "receive", "convid", MAX_CONVERSATION_ID, "ANY"))
    wait_ms = arg(args, "receive", "wait_ms", int, 0)
    if not 0 <= wait_ms <= svc.max_wait_ms:
        raise BadRequestError(f"receive: wait_ms must be 0-{svc.max_wait_ms}, not {wait_ms}")
    deadline = time.monotonic() + wait_ms / 1000
    delay = 0.005
    # One for the whole wait: a poll looks at the service's UOWs again only when something changed.
    watch = ReceiveWatch() if wait_ms else None
    while True:
        if session.gone.is_set():
            raise ClientGoneError(f"receive on {service}: the client has gone")
        if svc.stopping:  # not carried out: the client may go on elsewhere (nothing was taken)
            raise svc.quiescing("receive")
        try:
            got = conv.receive(service, option=option, max_length=session.reply_room(), convid=convid,
                               watch=watch)
            break
        except EndOfUowError:
            raise
        except NoMessageError:
            if time.monotonic() >= deadline:
                raise
        before_wait()
        threading.Event.wait(session.gone, delay)  # a plain wait: a watched socket is looked at above
        delay = min(delay * 2, 0.05)
    if len(got.body) > session.reply_room():
        raise TruncatedMessageError(
            f"receive on {service}: a message of {len(got.body)} bytes does not fit the replies of this "
            f"connection to {svc.qm.name} ({session.reply_limit} bytes)"
            + (f"; unit of work {got.uow} stays held by this session: BACKOUT returns it" if got.uow else ""))
    return dataclasses.asdict(got)


def syncpoint(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    conv = _logged_on(session)
    option = _choice(args, "syncpoint", "option", OPTIONS)
    uow = bounded_str(args, "syncpoint", "uow", MAX_USER)
    return conv.syncpoint(option, uow, user_status=_user_status(args, "syncpoint"))


def set_uow_status(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    """ETBCMD SET-UOW-STATUS: an operator's, with no logon (sqm.conversations.operator_status)."""
    return operator_status.set_uow_status(svc.qm, bounded_str(args, "set_uow_status", "uow", MAX_USER),
                                          _choice(args, "set_uow_status", "status", operator_status.TARGETS),
                                          by=f"the operator on connection {session.number}")


# --- arguments, bounded before anything runs -------------------------------------------------------------------
def _identity(args: dict[str, Any], name: str, *, required: bool) -> str:
    """A logon's user id or token: 1-32 printable characters (EntireX's USER-ID and TOKEN); a token may be empty."""
    value = bounded_str(args, "logon", name, MAX_USER)
    if (required and not value) or not value.isprintable():
        raise BadRequestError(f"logon: '{name}' must be 1-{MAX_USER} printable characters, not {short(value)}")
    return value


def _choice(args: dict[str, Any], op: str, name: str, allowed: tuple[str, ...], default: str | None = None) -> str:
    value = arg(args, op, name, str) if default is None else arg(args, op, name, str, default)
    if value not in allowed:
        raise BadRequestError(f"{op}: '{name}' must be one of {', '.join(allowed)}, not {short(value)}")
    return str(value)


def _user_status(args: dict[str, Any], op: str) -> bytes | None:
    value = arg(args, op, "user_status", bytes, None)
    if value is not None and len(value) > USER_STATUS_MAX:
        raise BadRequestError(f"{op}: a user status is at most {USER_STATUS_MAX} bytes, not {len(value)}")
    return None if value is None else bytes(value)


OPERATIONS = (
    Operation("logon", "conversation", ANY_ROLE, logon),
    Operation("send", "conversation", ANY_ROLE, send, needs_logon=True),
    Operation("receive", "conversation", ANY_ROLE, receive, needs_logon=True),
    Operation("syncpoint", "conversation", ANY_ROLE, syncpoint, needs_logon=True),
    Operation("set_uow_status", "conversation", OPERATOR_ONLY, set_uow_status, alone=True),
)

__all__ = ["MAX_CONVERSATION_ID", "OPERATIONS", "Service", "Session", "logoff"]
