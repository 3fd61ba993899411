"""The operator's DISPLAY CONN and the member's part of DISPLAY QSTATUS: the ``connections`` operation.

Its reply lists every connection open on this member (the operator's own included): its number, the application
name its client gave at hello, its role, how that role was established and the user it logged on as, its peer
address, TLS or not, when it connected, its last request and how many it made, and its open unit of work (id, state,
age). It adds, per queue, the connections that used it (its handle count on this member) and the last put and get
through this member. Nothing secret is in it: no token, nonce or sealed token of a session; an application's token
is refused the operation (operator only).

What is verified and what is only claimed, so that an operator does not take an impostor's word for fact: the role
is proven (``auth``: "challenge" or "bearer", the role's token; "none" when the member runs without authentication,
which proves nothing; null before the connection authenticated, when it can do nothing but its handshake), the peer
address and TLS are what the member saw, and ``certificate`` the subject of the client's certificate, checked
against the member's CA (mutual TLS, ``sqm run --tls-ca``): with a certificate per application, the one verified
name an application has. The application name and the logon's user id are what the client said
(``CLAIMED``): every application holds the same token, so any of them, and any connection still in its handshake,
can give any name.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from sqm import operations
from sqm.operations import OPERATOR_ONLY, Operation
from sqm.service.queue_activity import QueueActivity

# The fields of a row that are the client's word, not checked by the member (in every row, for a script's sake).
CLAIMED = ("application", "user")


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
    def auth_method(self) -> str | None: ...

    @property
    def peer(self) -> str: ...

    @property
    def tls(self) -> bool: ...

    @property
    def certificate(self) -> str | None: ...

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
            "auth": session.auth_method, "claimed": list(CLAIMED),
            "user": conversation.user if conversation is not None else None, "peer": session.peer,
            "tls": session.tls, "certificate": session.certificate, "connected": session.connected,
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

__all__ = ["CLAIMED", "OPERATIONS", "Service", "connection_row", "connections"]
