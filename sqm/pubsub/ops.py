"""The publish and subscribe operations of the service (sqm.pubsub, docs/pubsub.md): their rows and handlers. A
connection's publish/subscribe session is made by its first publish, receive_pub, pub_commit or pub_backout;
pub_commit and pub_backout settle it, and it ends, backed out, with the connection (``end_session``).

This module imports nothing of sqm.service: only sqm.operations and the feature it serves."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from cfemu.errors import BadRequestError, TruncatedMessageError
from sqm import operations
from sqm.core.manager import QueueManager
from sqm.operations import ANY_ROLE, MAX_USER, OPERATOR, Operation, arg, bounded_str, service_name
from sqm.pubsub import pubsub
from sqm.pubsub.publication_bounds import DraftBudget

log = logging.getLogger("sqm.service.server")  # the service's log lines keep one logger name


class Service(operations.Service, Protocol):
    @property
    def qm(self) -> QueueManager: ...

    @property
    def draft_budget(self) -> DraftBudget:
        """The member's budget the publications being published count their bytes against."""
        ...


class LoggedOn(Protocol):
    """Who a connection logged on as (its conversation's user id and token): a subscription's owner."""

    @property
    def user(self) -> str: ...

    @property
    def token(self) -> str: ...


class Session(operations.Session, Protocol):
    pubsub: pubsub.PubSubSession | None  # made by the first publish or receive_pub; backed out with the connection

    @property
    def conversation(self) -> LoggedOn | None: ...


def _session(svc: Service, session: Session) -> pubsub.PubSubSession:
    if session.pubsub is None:
        session.pubsub = pubsub.PubSubSession(svc.qm, session.gone, svc.draft_budget)
    return session.pubsub


def end_session(svc: Service, session: Session) -> None:
    """Back out the connection's publish/subscribe session (a publication being published dropped, its bytes given
    back to the member's budget; received ones returned); what cannot be backed out now, recovery backs out."""
    ps, session.pubsub = session.pubsub, None
    if ps is None:
        return
    try:
        ps.close()
    except Exception as e:  # noqa: BLE001 - the connection ends whatever happens; recovery backs it out
        log.warning("%s: backing out the publish/subscribe session of connection %d: %s", svc.qm.name,
                    session.number, e)


def _owner(session: Session, args: dict[str, Any], op: str) -> tuple[str, str]:
    """Whose subscription a request names (docs/pubsub.md, "Who may use a subscription"): the logged-on user's
    (user id and token); an operator may name any owner with 'user' and 'token'; a connection that has not
    logged on names the anonymous owner's."""
    if session.role == OPERATOR and "user" in args:
        return bounded_str(args, op, "user", MAX_USER), bounded_str(args, op, "token", MAX_USER)
    conv = session.conversation
    return (conv.user, conv.token) if conv is not None else ("", "")


def subscribe(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    durable = arg(args, "subscribe", "durable", bool, None)
    user, token = _owner(session, args, "subscribe")
    return pubsub.subscribe(svc.qm, service_name(args, "subscribe", "topic"),
                            bounded_str(args, "subscribe", "name", pubsub.MAX_NAME), durable=durable,
                            user=user, token=token).public()


def unsubscribe(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    topic = service_name(args, "unsubscribe", "topic")
    if "id" in args:  # by its id, whoever its owner: an operator's alone (docs/pubsub.md, "Who may use ...")
        if session.role != OPERATOR:
            raise BadRequestError("unsubscribe: 'id' names any owner's subscription: an operator's connection only; "
                                  "name your own by its name")
        return pubsub.unsubscribe_id(svc.qm, topic, bounded_str(args, "unsubscribe", "id", 64)).public()
    user, token = _owner(session, args, "unsubscribe")
    return pubsub.unsubscribe(svc.qm, topic, bounded_str(args, "unsubscribe", "name", pubsub.MAX_NAME), user=user,
                              token=token).public()


def subscriptions(svc: Service, session: Session, args: dict[str, Any]) -> list[dict[str, Any]]:
    t = pubsub.topic(svc.qm, service_name(args, "subscriptions", "topic"))
    if session.role == OPERATOR and "user" not in args:  # an operator sees every owner's
        return [s.public() for s in pubsub.subscriptions(svc.qm, t)]
    user, token = _owner(session, args, "subscriptions")
    return [s.public() for s in pubsub.subscriptions(svc.qm, t, user=user, token=token)]


def publish(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    return _session(svc, session).publish(service_name(args, "publish", "topic"),
                                          arg(args, "publish", "body", bytes),
                                          commit=arg(args, "publish", "commit", bool, False))


def receive_pub(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    wait_ms = arg(args, "receive_pub", "wait_ms", int, 0)
    if not 0 <= wait_ms <= svc.max_wait_ms:
        raise BadRequestError(f"receive_pub: wait_ms must be 0-{svc.max_wait_ms}, not {wait_ms}")
    topic = service_name(args, "receive_pub", "topic")
    user, token = _owner(session, {}, "receive_pub")  # only the logged-on user's (never another's)
    try:
        got = _session(svc, session).receive(topic, bounded_str(args, "receive_pub", "name", pubsub.MAX_NAME),
                                             wait_ms=wait_ms, user=user, token=token,
                                             room=lambda n: session.reply_room(max(1, n)))
    except TruncatedMessageError as e:  # not received: a connection with room for it receives it
        raise TruncatedMessageError(f"receive_pub on {topic}: {e.args[0]}; replies on this connection to "
                                    f"{svc.qm.name} are {session.reply_limit} bytes") from None
    return got.public()


def pub_commit(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    return _session(svc, session).commit()


def pub_backout(svc: Service, session: Session, args: dict[str, Any]) -> dict[str, Any]:
    return _session(svc, session).backout()


OPERATIONS = (
    Operation("subscribe", "pubsub", ANY_ROLE, subscribe),
    Operation("unsubscribe", "pubsub", ANY_ROLE, unsubscribe),
    Operation("subscriptions", "pubsub", ANY_ROLE, subscriptions),
    Operation("publish", "pubsub", ANY_ROLE, publish),
    Operation("receive_pub", "pubsub", ANY_ROLE, receive_pub),
    Operation("pub_commit", "pubsub", ANY_ROLE, pub_commit),
    Operation("pub_backout", "pubsub", ANY_ROLE, pub_backout),
)

__all__ = ["OPERATIONS", "LoggedOn", "Service", "Session", "end_session"]
