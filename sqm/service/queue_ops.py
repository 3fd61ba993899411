"""The queue operations of the service (ping, put, get, browse, put_batch, get_batch, commit, backout, prepare,
resolve, indoubt, status, define): their rows and handlers. Each runs on the connection's MQ connection handle (sqm.core.connection.Connection),
made by its first request, which keeps the connection's unit of work on one handle, like an MQ connection
handle."""

from __future__ import annotations

import hmac
import time
from typing import Any, Protocol

from cfemu import repository
from cfemu.cf import Browsed
from cfemu.errors import BadRequestError, MQError, OutcomeUnknownError, TruncatedMessageError
from cfemu.topic_attributes import PUB_SUFFIX, SUB_SUFFIX
from cfemu.uow_attributes import CONTROL_SUFFIX, DATA_SUFFIX
from sqm import operations
from sqm.core.connection import BatchResult, Connection, Message, PutSpec
from sqm.core.lifecycles import Call, OneGet, OnePut
from sqm.core.manager import QueueManager
from sqm.core.syncpoint_calls import Done, SyncCommit, SyncGet, SyncPut
from sqm.core.uow import UnitOfWork
from sqm.operations import ANY_ROLE, OPERATOR, OPERATOR_ONLY, Operation, arg, short
from sqm.service.protocol import (
    ENVELOPE,
    MAX_BATCH,
    MESSAGE_COST,
    NotAuthorizedError,
    error_reply,
    message_to_wire,
)
from sqm.service.queue_activity import QueueActivity

COMPANION_SUFFIXES = (DATA_SUFFIX, CONTROL_SUFFIX, PUB_SUFFIX, SUB_SUFFIX)
MAX_BROWSE = 10_000
PUT_REPLY_COST = 160  # what one message costs a put_batch reply: its ids, times and the field names
MAX_UOW_ATTRIBUTES = 16  # entries of a define's UOW attribute map (UowAttributes has 7)


class Service(operations.Service, Protocol):
    @property
    def qm(self) -> QueueManager: ...

    @property
    def activity(self) -> QueueActivity:
        """The last put and get of each queue through this member (DISPLAY QSTATUS)."""
        ...

    def service_status(self) -> dict[str, Any]:
        """The server's part of a status reply: its address, connections, authentication and limits."""
        ...


class Session(operations.Session, Protocol):
    conn: Connection | None  # the connection's MQ connection handle, made by its first queue request
    queues: set[str]  # the queues it used (DISPLAY CONN counts them as its handles)


def _connection(svc: Service, session: Session) -> Connection:
    if session.conn is None:
        session.conn = svc.qm.connect()
        session.conn.gone = session.gone
    return session.conn


def ping(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    return {"qmgr": svc.qm.name, "time": time.time()}


def _plain(svc: Service, queue: str, op: str) -> str:
    """A queue an application may put to, get from or browse: not a companion queue of a service or a topic,
    whose entries are the product's own state and every user's (a status and its owner, a UOW's messages, a
    subscription's position, a publication): a put there by hand would block a service's receives, a get take a
    UOW's status away, a browse show other users' units of work (docs/security.md). An operator may browse them."""
    base, dot, suffix = queue.rpartition(".")
    if dot and f".{suffix}" in COMPANION_SUFFIXES:
        try:
            qdef = svc.qm.queue_def(base)
        except MQError:  # no such service or topic: a plain queue that happens to end so
            return queue
        if qdef.uow or qdef.topic:
            raise NotAuthorizedError(f"{op} on {queue}: it holds the state of {base}'s units of work or "
                                         "publications; use send/receive/syncpoint or the publish/subscribe ops")
    return queue


def _put_spec(svc: Service, args: dict[str, Any], op: str) -> PutSpec:
    """A put's message from its arguments (a put's, or one of a put_batch's messages)."""
    return PutSpec(_plain(svc, arg(args, op, "queue", str), "put"), arg(args, op, "body", bytes),
                   persistent=arg(args, op, "persistent", bool, True), priority=arg(args, op, "priority", int, 0),
                   msgid=arg(args, op, "msgid", bytes, None), correlid=arg(args, op, "correlid", bytes, b""),
                   expiry_ms=arg(args, op, "expiry_ms", int, 0), properties=arg(args, op, "properties", dict, None))


def put(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    conn = _connection(svc, session)
    spec = _put_spec(svc, args, "put")
    m = conn.put(spec.queue, spec.body, persistent=spec.persistent, syncpoint=arg(args, "put", "syncpoint", bool, True),
                 priority=spec.priority, msgid=spec.msgid, correlid=spec.correlid, expiry_ms=spec.expiry_ms,
                 properties=spec.properties)
    return _put_result(svc, session, m)


def _put_result(svc: Service, session: Session, m: Message) -> dict[str, Any]:
    svc.activity.put(session.queues, m.queue)
    m.body = b""  # the client has the body; do not send it back
    return message_to_wire(m)


def _get_wait(svc: Service, args: dict[str, Any], op: str) -> int:
    wait_ms = arg(args, op, "wait_ms", int, 0)
    if not 0 <= wait_ms <= svc.max_wait_ms:
        raise BadRequestError(f"{op}: wait_ms must be 0-{svc.max_wait_ms}, not {wait_ms}")
    return wait_ms


def get(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    conn = _connection(svc, session)
    wait_ms = _get_wait(svc, args, "get")
    queue = _plain(svc, arg(args, "get", "queue", str), "get")
    try:  # the CF refuses, untouched, a message the reply could not carry: nothing is taken for nobody
        m = conn.get(queue, syncpoint=arg(args, "get", "syncpoint", bool, True),
                     wait_ms=wait_ms, msgid=arg(args, "get", "msgid", bytes, None),
                     correlid=arg(args, "get", "correlid", bytes, None),
                     max_length=session.reply_limit - ENVELOPE - MESSAGE_COST)
    except TruncatedMessageError as e:
        raise _too_long(svc, session, "get", queue, e) from None
    except OutcomeUnknownError as e:  # pending or unknown: delivered with the error (its "delivered")
        if e.message is not None:
            svc.activity.got(session.queues, queue)
        raise
    svc.activity.got(session.queues, queue)
    return message_to_wire(m)


def runs_together(op: str, args: dict[str, Any]) -> bool:
    """Whether a request is of the kinds ``together`` takes, from its shape alone (no check of its arguments'
    values): a put (outside syncpoint: one that is not non-persistent), a get with no selection, a commit."""
    if op == "commit":
        return True
    if op == "get":
        return args.get("msgid") is None and args.get("correlid") is None
    return op == "put" and (args.get("syncpoint", True) is not False or args.get("persistent", True) is not False)


def together(svc: Service, session: Session, op: str, args: dict[str, Any]) -> Call | None:
    """The request as a call that runs together with other connections' (sqm.core.lifecycles): a persistent put
    outside syncpoint, a get outside syncpoint of the next message, each a unit of work of its own; a put, a get of
    the next message and a commit under syncpoint, in the connection's unit of work (sqm.core.syncpoint_calls);
    None for any other request (it goes by its own handler). Raises what its handler would raise for its
    arguments."""
    if not runs_together(op, args):
        return None
    if op == "commit":
        return SyncCommit(session.conn)
    syncpoint = arg(args, op, "syncpoint", bool, True)
    if op == "put":
        spec = _put_spec(svc, args, "put")
        if syncpoint:
            return SyncPut(_connection(svc, session), spec)
        return OnePut(spec) if spec.persistent else None
    wait_ms = _get_wait(svc, args, "get")
    queue = _plain(svc, arg(args, "get", "queue", str), "get")
    max_length = session.reply_limit - ENVELOPE - MESSAGE_COST
    if syncpoint:
        return SyncGet(_connection(svc, session), queue, max_length=max_length, wait_ms=wait_ms)
    return OneGet(queue, max_length=max_length, wait_ms=wait_ms, gone=session.gone)


def together_result(svc: Service, session: Session, call: Call, outcome: Message | Done | MQError) -> Any:
    """The result of a call run together (``together``), as its handler returns it, or its error raised as the
    handler raises it."""
    if isinstance(outcome, Done):
        return None
    if isinstance(call, SyncCommit):
        assert isinstance(outcome, MQError)
        raise outcome
    if isinstance(call, OnePut | SyncPut):
        if isinstance(outcome, MQError):
            raise outcome
        return _put_result(svc, session, outcome)
    if isinstance(outcome, TruncatedMessageError):
        raise _too_long(svc, session, "get", call.queue, outcome)
    if isinstance(outcome, Message) or (isinstance(outcome, OutcomeUnknownError) and outcome.message is not None):
        svc.activity.got(session.queues, call.queue)
    if isinstance(outcome, MQError):
        raise outcome
    return message_to_wire(outcome)


def put_batch(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    """Several puts in one request (Connection.put_batch): the messages' own fields as put takes them. The reply
    carries what each message was given (its ids and times, not its body or properties), the outcome of the commit,
    and the refusal that stopped a message, if one did (the others were done)."""
    items = arg(args, "put_batch", "messages", list)
    if not 1 <= len(items) <= MAX_BATCH:
        raise BadRequestError(f"put_batch: 1-{MAX_BATCH} messages, not {len(items)}")
    if len(items) * PUT_REPLY_COST > session.reply_limit - ENVELOPE:
        raise BadRequestError(f"put_batch: the reply to {len(items)} puts would not fit this connection's replies "
                              f"of {session.reply_limit} bytes: send fewer")
    specs = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequestError(f"put_batch: message {i} must be a map of put's arguments")
        specs.append(_put_spec(svc, item, f"put_batch message {i}"))
    done = _connection(svc, session).put_batch(specs, syncpoint=arg(args, "put_batch", "syncpoint", bool, True),
                                               commit=arg(args, "put_batch", "commit", bool, False))
    for queue in {m.queue for m in done.messages}:
        svc.activity.put(session.queues, queue)
    return _batch_reply(done, [{"msgid": m.msgid, "entry_id": m.entry_id, "put_time": m.put_time,
                                "expiry": m.expiry} for m in done.messages])


def get_batch(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    """Up to ``max_messages`` messages of a queue in one request, under syncpoint (Connection.get_batch), as many as
    one reply carries; with ``commit``, the unit of work committed before the reply."""
    limit = arg(args, "get_batch", "max_messages", int)
    if not 1 <= limit <= MAX_BATCH:
        raise BadRequestError(f"get_batch: max_messages must be 1-{MAX_BATCH}, not {limit}")
    wait_ms = _get_wait(svc, args, "get_batch")
    queue = _plain(svc, arg(args, "get_batch", "queue", str), "get")
    room = session.reply_limit - ENVELOPE
    if limit * (MESSAGE_COST + 1) > room:
        raise BadRequestError(f"get_batch: {limit} messages cannot fit this connection's replies of "
                              f"{session.reply_limit} bytes: ask for fewer")
    conn = _connection(svc, session)
    try:
        done = conn.get_batch(queue, limit, wait_ms=wait_ms, max_bytes=room, each=MESSAGE_COST,
                              commit=arg(args, "get_batch", "commit", bool, False))
    except TruncatedMessageError as e:
        raise _too_long(svc, session, "get_batch", queue, e) from None
    if done.messages:
        svc.activity.got(session.queues, queue)
    return _batch_reply(done, [message_to_wire(m) for m in done.messages])


def _batch_reply(done: BatchResult, messages: list[dict[str, Any]]) -> dict[str, Any]:
    error = None if done.error is None else error_reply(None, done.error)["error"]
    return {"messages": messages, "committed": done.committed, "error": error}


def browse(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    limit = arg(args, "browse", "limit", int, 100)
    queue = arg(args, "browse", "queue", str)
    found = browse_messages(svc, session, queue, limit)
    return {"messages": [message_to_wire(m) for m in found], "more": found.more}


def browse_messages(svc: Service, session: Session, queue: str, limit: int, *,
                    exact_more: bool = True) -> Browsed[Message]:
    """Up to ``limit`` available messages of ``queue`` in get order, not taken, as many as one reply carries:
    ``more`` on the result says some were left out (Connection.browse; ``exact_more`` False for a caller that does
    not pass ``more`` on), under browse's rules of who may browse what."""
    if not 1 <= limit <= MAX_BROWSE:
        raise BadRequestError(f"browse: limit must be 1-{MAX_BROWSE}, not {limit}")
    if session.role != OPERATOR:
        _plain(svc, queue, "browse")
    conn = _connection(svc, session)
    try:  # as many as one reply carries; "more" tells the client it did not get them all
        found = conn.browse(queue, limit, max_bytes=session.reply_limit - ENVELOPE, each=MESSAGE_COST,
                            exact_more=exact_more)
    except TruncatedMessageError as e:
        raise _too_long(svc, session, "browse", queue, e) from None
    session.queues.add(queue)
    return found


def browse_matching(svc: Service, session: Session, queue: str, match: str, values: list[bytes], limit: int, *,
                    bodies: bool = True) -> list[Message]:
    """Up to ``limit`` available messages of ``queue`` whose message id (``match`` 'm') or correlation id ('c') is
    one of ``values``, in get order, not taken (Connection.browse_matching: the id's index in bounded batches, not
    the queue), under browse's rules of who may browse what."""
    if not 1 <= limit <= MAX_BROWSE:
        raise BadRequestError(f"browse: limit must be 1-{MAX_BROWSE}, not {limit}")
    if session.role != OPERATOR:
        _plain(svc, queue, "browse")
    found = _connection(svc, session).browse_matching(queue, match, values, limit, bodies=bodies,
                                                      max_bytes=session.reply_limit - ENVELOPE, each=MESSAGE_COST)
    session.queues.add(queue)
    return found


def _too_long(svc: Service, session: Session, op: str, queue: str,
              e: TruncatedMessageError) -> TruncatedMessageError:
    detail = e.args[0] if e.args else ""
    return TruncatedMessageError(f"{op} on {queue}: {detail}: replies on this connection to {svc.qm.name} are "
                                 f"limited to {session.reply_limit} bytes; the message stays on the queue")


def commit(svc: Service, session: Session, args: dict[str, Any]) -> None:
    if session.conn is not None:
        session.conn.commit()


def backout(svc: Service, session: Session, args: dict[str, Any]) -> None:
    if session.conn is not None:
        session.conn.backout()


def prepare(svc: Service, session: Session, args: dict[str, Any]) -> str:
    return _connection(svc, session).prepare(arg(args, "prepare", "xid", str))


def resolve(svc: Service, session: Session, args: dict[str, Any]) -> None:
    uow_id = arg(args, "resolve", "uow", str)
    commit = arg(args, "resolve", "commit", bool)
    if session.role == OPERATOR:
        svc.qm.resolve(uow_id, commit)
        return
    # An application resolves its own in-doubt UOWs: those it names by the xid it prepared them with, checked on the
    # UOW the queue manager finds in doubt (a UOW not yet in doubt when looked at first would otherwise go through).
    xid = arg(args, "resolve", "xid", str, None)
    if xid is None:
        raise NotAuthorizedError("resolve: an application resolves only its own in-doubt units of work: give "
                                 "the xid it prepared the unit of work with (an operator may resolve any)")

    def prepared_with_xid(uow: UnitOfWork) -> None:
        # A unit of work with no xid (a PREPARE logged before xids were kept) is no application's to name: the
        # operator resolves it.
        if not uow.xid or not hmac.compare_digest(uow.xid.encode(), xid.encode()):
            raise NotAuthorizedError(f"resolve: unit of work {short(uow_id)} was not prepared with that xid: an "
                                     "application resolves only its own (an operator may resolve any)")

    svc.qm.resolve(uow_id, commit, check=prepared_with_xid)


def indoubt(svc: Service, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    found = svc.qm.indoubt()
    if session.role != OPERATOR:
        # An application lists its own: the in-doubt UOWs of the xids it names.
        xids = arg(args, "indoubt", "xids", list, None)
        if xids is None:
            raise NotAuthorizedError("indoubt: an application lists only its own in-doubt units of work: give "
                                     "their xids (an operator may list all)")
        wanted = {x for x in xids if isinstance(x, str) and x}  # no xid names a unit of work with none
        found = [u for u in found if u.xid in wanted]
    return [{"uow": u.id, "xid": u.xid, "owner": u.owner, "structures": sorted(u.structures)} for u in found]


def status(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    return {**svc.qm.status(), **svc.service_status()}


def define(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    kind = arg(args, "define", "kind", str)
    name = arg(args, "define", "name", str)
    replace = arg(args, "define", "replace", bool, False)
    qm = svc.qm
    admin, repo = qm.admin, qm.repository
    if repo is None:
        raise BadRequestError(f"queue manager {qm.name} is not running")
    if kind == "structure":  # in the CF and, durably, in the group repository (cfemu.repository)
        sdef = repository.define_structure(admin, repo, name,
                                           max_entries=arg(args, "define", "max_entries", int, 0),
                                           max_bytes=arg(args, "define", "max_bytes", int, 0), replace=replace,
                                           recauto=arg(args, "define", "recauto", bool, True))
        return vars(sdef)
    if kind == "queue":
        qdef = repository.define_queue(admin, repo, name, arg(args, "define", "structure", str),
                                       backout_threshold=arg(args, "define", "backout_threshold", int, 0),
                                       backout_queue=arg(args, "define", "backout_queue", str, ""),
                                       max_msg_length=arg(args, "define", "max_msg_length", int, 4 * 2**20),
                                       replace=replace, uow=_uow_attributes(args),
                                       topic=_uow_attributes(args, "topic"))
        for queue in (name, *qdef.companions):
            qm.forget_queue_def(queue)
        return vars(qdef)
    raise BadRequestError(f"define: kind must be 'structure' or 'queue', not {kind!r}")


def _uow_attributes(args: dict[str, Any], field: str = "uow") -> dict[str, Any] | None:
    """A define's UOW attributes (a service: cfemu.uow_attributes) or, with field "topic", a topic's
    (cfemu.topic_attributes), bounded; their values are checked there."""
    uow = arg(args, "define", field, dict, None)
    if uow is None:
        return None
    if len(uow) > MAX_UOW_ATTRIBUTES or not all(isinstance(k, str) and len(k) <= 64 for k in uow):
        raise BadRequestError(f"define: '{field}' must map at most {MAX_UOW_ATTRIBUTES} attribute names to values")
    bad = [k for k, v in uow.items() if not isinstance(v, bool | int)]
    if bad:
        raise BadRequestError(f"define: {field} attribute {short(bad[0])} must be an integer or a boolean")
    return dict(uow)


# An application resolves and lists only the in-doubt UOWs it names by their xid (resolve and indoubt check it);
# an operator may do anything, and resolve any in-doubt UOW.
OPERATIONS = (
    Operation("ping", "queue", ANY_ROLE, ping, read_only=True),
    Operation("put", "queue", ANY_ROLE, put),
    Operation("get", "queue", ANY_ROLE, get),
    Operation("browse", "queue", ANY_ROLE, browse, read_only=True),
    Operation("put_batch", "queue", ANY_ROLE, put_batch),
    Operation("get_batch", "queue", ANY_ROLE, get_batch),
    Operation("commit", "queue", ANY_ROLE, commit),
    Operation("backout", "queue", ANY_ROLE, backout),
    Operation("prepare", "queue", ANY_ROLE, prepare, alone=True),
    Operation("resolve", "queue", ANY_ROLE, resolve, alone=True),
    Operation("indoubt", "queue", ANY_ROLE, indoubt, read_only=True),
    Operation("status", "queue", OPERATOR_ONLY, status, read_only=True),
    Operation("define", "queue", OPERATOR_ONLY, define, alone=True),
)

__all__ = ["COMPANION_SUFFIXES", "MAX_BATCH", "MAX_BROWSE", "MAX_UOW_ATTRIBUTES", "OPERATIONS", "Service", "Session",
           "runs_together", "together", "together_result"]
