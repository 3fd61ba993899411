"""Service operations as rows: what an operation of the ``sqm run`` service is, and what its handler may use.

An operation is one ``Operation`` row in its owner's module (the queue operations in sqm/service/queue_ops.py,
the conversations' and publish/subscribe's in their own modules); sqm/service/ops.py gathers the rows into the
one table that the wire protocol's list of operations, the server's dispatcher and its role check all read, and
the client library asks how a request lost with its connection is treated. Adding an operation is one row in its
owner's module and one client method (docs/architecture.md, "A service operation").

A handler is ``handler(service, session, args) -> result``: ``service`` is what it may use of the server,
``session`` of its connection (the narrow protocols below, which an owner extends with its own state), ``args``
the request's argument map, each read with ``arg`` (a wrong or missing one is a BadRequestError naming it). It
runs in its connection's thread; what it raises (an MQError) is the reply.

This module imports nothing of sqm.service, so the rows of a feature can live in the feature's own package below
the service (docs/architecture.md, the floors).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from cfemu.errors import BadRequestError, MQError
from sqm.core.client_watch import ClientWatch

# --- roles -----------------------------------------------------------------------------------------------------
APPLICATION, OPERATOR = "application", "operator"
ROLES = (APPLICATION, OPERATOR)
ANY_ROLE = frozenset(ROLES)  # an application's operation (an operator may run every operation)
OPERATOR_ONLY = frozenset({OPERATOR})
NO_ROLE = frozenset[str]()  # the handshake's: run before the connection has a role

MAX_NAME = 48  # a service or topic name in a request; the CF refuses a bad one with its own message
# A user id or token a request names (EntireX's USER-ID and TOKEN; sqm.conversations.conversation.MAX_USER, checked by test):
# here so that a subscription's owner is bounded without the conversations.
MAX_USER = 32


# --- what a handler may use -------------------------------------------------------------------------------------
class Service(Protocol):
    """What a handler may use of the server (an owner's module adds what it needs, e.g. the queue manager)."""

    @property
    def max_wait_ms(self) -> int:
        """The longest wait a request may ask for."""
        ...

    @property
    def stopping(self) -> bool:
        """Is the server shutting down? A waiting request checks it between polls and ends with ``quiescing``."""
        ...

    def quiescing(self, op: str) -> MQError:
        """The refusal of a request the server does not carry out because it is stopping."""
        ...


class Session(Protocol):
    """What a handler may use of its connection's session (an owner's module adds its own state on it)."""

    @property
    def number(self) -> int: ...

    @property
    def role(self) -> str | None: ...

    @property
    def reply_limit(self) -> int:
        """The longest reply frame this connection's client accepts."""
        ...

    @property
    def gone(self) -> ClientWatch:
        """Set when the client has left: a waiting request ends, and takes nothing for nobody."""
        ...

    def reply_room(self, messages: int = 1) -> int:
        """The bytes of message data a reply carrying ``messages`` messages has room for."""
        ...


Handler = Callable[[Any, Any, dict[str, Any]], Any]


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation of the service.

    ``family``: its owner ("handshake", "queue", "conversation", "pubsub"): the module its row lives in.
    ``roles``: the roles that may run it (an operator may run every operation but the handshake's).
    ``handler``: ``(service, session, args) -> result``; None for the handshake's, which the transport runs.
    ``needs_logon``: refused, before it runs, with NotLoggedOnError on a connection that has no conversation.
    ``read_only``: changes nothing: a client re-sends it on the next endpoint when its connection is lost.
    ``alone``: takes effect on its own, outside the connection's unit of work: lost in flight, its outcome is
    unknown to the client (OutcomeUnknownError).
    """

    name: str
    family: str
    roles: frozenset[str]
    handler: Handler | None
    needs_logon: bool = False
    read_only: bool = False
    alone: bool = False


class Operations:
    """The operations of the service, in order, one row each (a name twice, or a row without a handler or roles,
    is refused here rather than found at run time)."""

    def __init__(self, rows: Iterable[Operation]) -> None:
        self._rows: dict[str, Operation] = {}
        for row in rows:
            if row.name in self._rows:
                raise ValueError(f"operation {row.name!r} is defined twice")
            if row.family != "handshake" and (row.handler is None or not row.roles or OPERATOR not in row.roles):
                raise ValueError(f"operation {row.name!r} needs a handler and roles (an operator's among them)")
            if not row.roles <= ANY_ROLE:
                raise ValueError(f"operation {row.name!r}: unknown roles {sorted(row.roles - ANY_ROLE)}")
            self._rows[row.name] = row

    def __iter__(self) -> Iterator[Operation]:
        return iter(self._rows.values())

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def __getitem__(self, name: str) -> Operation:
        return self._rows[name]

    def get(self, name: str) -> Operation | None:
        return self._rows.get(name)

    def names(self, family: str | None = None) -> tuple[str, ...]:
        return tuple(r.name for r in self._rows.values() if family is None or r.family == family)

    def for_role(self, role: str) -> frozenset[str]:
        return frozenset(r.name for r in self._rows.values() if role in r.roles)


# --- request arguments ------------------------------------------------------------------------------------------
class NotLoggedOnError(MQError):
    """A send, receive or syncpoint on a connection that has not logged on (or whose session ended with its
    previous connection): log on first."""

    reason, reason_name = 2018, "MQRC_HCONN_ERROR"


_MISSING = object()


def arg(args: dict[str, Any], op: str, name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """One request argument, type-checked: a wrong type is a BadRequestError naming the op and argument."""
    value = args.get(name, default)
    if type(value) is kind:  # the common case, at once (a bool is never taken for an int here: its type is bool)
        return value
    if value is _MISSING:
        raise BadRequestError(f"{op}: missing argument '{name}'")
    if value is None and default is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        wanted = " or ".join(k.__name__ for k in kinds)
        raise BadRequestError(f"{op}: argument '{name}' must be {wanted}, not {type(value).__name__}")
    return value


def short(text: str, n: int = 40) -> str:
    """A peer-chosen string as it may appear in a message or a log line: quoted, bounded, its control characters
    escaped (repr), so that it is one line with nothing in it for a terminal, a log reader or a header to act on."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"...({len(text)} chars)"


def one_line(text: str, n: int = 400) -> str:
    """A message that may hold peer-chosen strings (an MQ error naming a queue, a library's error) as a reply or a
    log line repeats it: its control characters escaped (a line break or a terminal escape of a peer's never
    reaches a log, a header or a terminal as such), at most ``n`` characters of it, with its length when cut."""
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:n])
    return escaped if len(text) <= n else f"{escaped}...({len(text)} chars)"


def bounded_str(args: dict[str, Any], op: str, name: str, longest: int, default: str = "") -> str:
    """A string argument of at most ``longest`` characters, bounded before anything runs."""
    value = arg(args, op, name, str, default)
    if len(value) > longest:
        raise BadRequestError(f"{op}: '{name}' must be at most {longest} characters, not {len(value)}")
    return str(value)


def service_name(args: dict[str, Any], op: str, name: str = "service") -> str:
    """A service's or topic's name argument: 1-MAX_NAME characters."""
    service = bounded_str(args, op, name, MAX_NAME)
    if not service:
        raise BadRequestError(f"{op}: missing argument '{name}'")
    return service


__all__ = ["ANY_ROLE", "APPLICATION", "MAX_NAME", "MAX_USER", "NO_ROLE", "OPERATOR", "OPERATOR_ONLY", "ROLES", "Handler",
           "NotLoggedOnError", "Operation", "Operations", "Service", "Session", "arg", "bounded_str",
           "one_line", "service_name", "short"]
