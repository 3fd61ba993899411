"""The client library's publish and subscribe requests (sqm.pubsub.ops, docs/pubsub.md), a part of
sqm.service.client.Client.

The connection's publish/subscribe session ends with the connection: what it held (a publication being published,
publications received) is backed out by the server; a pub_commit lost in flight may or may not have committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cfemu.errors import BackedOutError, OutcomeUnknownError


def _owner(user: str | None, token: str) -> dict[str, str]:
    """The owner arguments of a subscription request: none (the logged-on user's), or an operator's choice."""
    return {} if user is None else {"user": user, "token": token}


class PubSubCalls:
    """SUBSCRIBE, UNSUBSCRIBE, PUBLISH, RECEIVE and the commit and backout of a Client's publish/subscribe
    session, and what a lost connection means for them."""

    if TYPE_CHECKING:  # Client's
        def _call(self, op: str, args: dict[str, Any], *, syncpoint: bool = True, wait_s: float = 0.0,
                  settles: str = "") -> Any: ...

    @staticmethod
    def _pubsub_lost(op: str, was_held: bool, *, in_flight: bool, where: str, why: str) -> None:
        """The publish/subscribe session ended with the connection: what it held (a publication being published,
        publications received) was backed out by the server; a commit lost in flight may or may not have happened."""
        if op == "pub_backout" or op in ("subscribe", "subscriptions"):
            return  # backed out, as asked; subscribe finds the subscription it made, if it made one
        if op == "pub_commit" and in_flight and was_held:
            raise OutcomeUnknownError(f"connection to {where} lost during pub_commit ({why}): the publication and "
                                      "the subscriptions' positions may or may not have committed")
        if op == "unsubscribe" and in_flight:
            raise OutcomeUnknownError(f"connection to {where} lost during unsubscribe ({why}): it may or may not "
                                      "have taken effect")
        if was_held or (in_flight and op == "receive_pub"):
            raise BackedOutError(f"connection to {where} lost during {op} ({why}): the publish/subscribe session "
                                 "was backed out (a publication being published dropped, received ones returned)")

    def subscribe(self, topic: str, name: str, *, durable: bool | None = None, user: str | None = None,
                  token: str = "") -> dict[str, Any]:
        """SUBSCRIBE (once: an existing subscription is returned as it is). Returns its public fields. It belongs to
        the user this connection logged on as (the anonymous owner without a logon); ``user``, ``token``: another
        owner's, for an operator."""
        args: dict[str, Any] = {"topic": topic, "name": name, **_owner(user, token)}
        if durable is not None:
            args["durable"] = durable
        return dict(self._call("subscribe", args))

    def unsubscribe(self, topic: str, name: str = "", *, user: str | None = None, token: str = "",
                    id: str | None = None) -> dict[str, Any]:
        """UNSUBSCRIBE the logged-on user's subscription ``name`` (an operator: ``user``'s with ``token``), or, for
        an operator, any owner's by its ``id`` (the listing's), without its owner's token. Returns its fields."""
        if id is not None:
            return dict(self._call("unsubscribe", {"topic": topic, "id": id}))
        return dict(self._call("unsubscribe", {"topic": topic, "name": name, **_owner(user, token)}))

    def subscriptions(self, topic: str, *, user: str | None = None, token: str = "") -> list[dict[str, Any]]:
        """The logged-on user's subscriptions (an operator's connection: every owner's, or ``user``'s)."""
        return list(self._call("subscriptions", {"topic": topic, **_owner(user, token)}))

    def publish(self, topic: str, body: bytes, *, commit: bool = False) -> dict[str, Any]:
        """A message of the publication this connection is publishing (begun by the first); ``commit``: commit
        after it (pub_commit). Returns pub, topic, messages, committed."""
        return dict(self._call("publish", {"topic": topic, "body": body, "commit": commit}))

    def receive_pub(self, topic: str, name: str, *, wait_ms: int = 0) -> dict[str, Any]:
        """The next publication for subscription ``name``, whole: topic, pub, lrsn, messages (list of bytes),
        created_pc, persistent. NoMessageError when none comes within ``wait_ms``. Settle it with pub_commit."""
        return dict(self._call("receive_pub", {"topic": topic, "name": name, "wait_ms": wait_ms},
                               wait_s=wait_ms / 1000))

    def pub_commit(self) -> dict[str, Any]:
        """COMMIT of the publish/subscribe session: the publication being published, and the positions of the
        subscriptions received for. Lost in flight: OutcomeUnknownError."""
        return dict(self._call("pub_commit", {}))

    def pub_backout(self) -> dict[str, Any]:
        return dict(self._call("pub_backout", {}))


__all__ = ["PubSubCalls"]
