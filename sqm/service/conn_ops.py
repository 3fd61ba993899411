"""The operator's DISPLAY CONN and the member's part of DISPLAY QSTATUS: the ``connections`` operation.

Its reply lists every connection open on this member (the operator's own included): its number, the application
name its client gave at hello, its role and the user it logged on as, its peer address, TLS or not, when it
connected, its last request and how many it made, and its open unit of work (id, state, age). It adds, per queue,
the connections that used it (its handle count on this member) and the last put and get through this member.
Nothing secret is in it: no token, nonce or sealed token of a session; an application's token is refused the
operation (operator only).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from sqm import operations
from sqm.operations import OPERATOR_ONLY, Operation
from sqm.service.queue_activity import QueueActivity


class Session(Protocol):
    """What DISPLAY CONN reads of a connection (sqm.service.session.Session, which itself reads the table of
    operations holding this module's row: a Protocol keeps the two modules out of an import circle)."""

    @property
    def conn(self) -> Any: ...  # sqm.core.connection.Connection, or None before its first queue request

    @property
    def conversation(self) -> Any: ...  # sqm.conversations.conversation.Conversation, or None before a logon

    @property
    def number(self) -> int: ...

    @property
    def client_name(self) -> str: ...

    @property
    def role(self) -> str | None: ...

    @property
    def peer(self) -> str: ...

    @property
    def tls(self) -> bool: ...

    @property
    def connected(self) -> float: ...

    @property
    def last_request(self) -> float: ...

    @property
    def served(self) -> int: ...

    @property
    def queues(self) -> set[str]: ...


class Service(operations.Service, Protocol):
    @property
    def name(self) -> str: ...

    @property
    def activity(self) -> QueueActivity: ...

    def sessions(self) -> Sequence[Session]:
        """The connections open on this member, in the order they were accepted."""
        ...


def _uow(session: Session, now: float) -> dict[str, Any] | None:
    conn = session.conn
    uow = conn.uow if conn is not None else None
    if uow is None or uow.operations <= 0:  # an empty UOW is not open work (Session.uow_open)
        return None
    return {"id": uow.id, "state": uow.state, "age_s": round(max(0.0, now - uow.began), 3),
            "operations": uow.operations, "messages": uow.umsgs}


def connection_row(session: Session, now: float) -> dict[str, Any]:
    """What DISPLAY CONN shows of one connection (never its secrets)."""
    conversation = session.conversation
    return {"connection": session.number, "application": session.client_name, "role": session.role,
            "user": conversation.user if conversation is not None else None, "peer": session.peer,
            "tls": session.tls, "connected": session.connected,
            "last_request": session.last_request or None, "requests": session.served,
            "queues": sorted(session.queues), "uow": _uow(session, now)}


def connections(svc: Service, session: operations.Session, args: dict[str, Any]) -> dict[str, Any]:
    now = time.time()
    live = list(svc.sessions())
    rows = [connection_row(s, now) for s in live]
    activity = svc.activity
    last_put, last_get = dict(activity.last_put), dict(activity.last_get)
    handles: dict[str, int] = {}
    for row in rows:
        for q in row["queues"]:
            handles[q] = handles.get(q, 0) + 1
    queues = {q: {"handles": handles.get(q, 0), "last_put": last_put.get(q), "last_get": last_get.get(q)}
              for q in sorted({*handles, *last_put, *last_get})}
    return {"qmgr": svc.name, "time": now, "connections": rows, "queues": queues}


OPERATIONS = (
    Operation("connections", "connection", OPERATOR_ONLY, connections, read_only=True),
)

__all__ = ["OPERATIONS", "Service", "connection_row", "connections"]
