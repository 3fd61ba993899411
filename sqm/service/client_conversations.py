"""The client library's conversation requests (EntireX's LOGON, SEND, RECEIVE, SYNCPOINT through the service:
sqm.conversations.ops, docs/uow.md), a part of sqm.service.client.Client.

The session lives as long as the connection: when the connection is lost the server ends it, backing out what it
held, and the application logs on again (with the same user id and token, LAST and QUERY find its work). So a lost
connection during a conversation request is never hidden by a re-send: a COMMIT (or EOC, EOCCANCEL, a send with
``commit``) in flight raises OutcomeUnknownError (ask QUERY or LAST after logging on again); one that held a UOW,
or a send or receive in flight, BackedOutError; otherwise SessionLostError. Only a logon is re-sent on the next
endpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cfemu.errors import BackedOutError, OutcomeUnknownError
from sqm.service.protocol import SessionLostError

# SYNCPOINT options that commit (the outcome of one lost in flight is unknown) or change a status on their own.
SYNCPOINT_COMMITS = frozenset({"COMMIT", "EOC", "EOCCANCEL"})
SYNCPOINT_ALONE = frozenset({"CANCEL", "SETUSTATUS", "DELETE"})


class ConversationCalls:
    """LOGON, SEND, RECEIVE and SYNCPOINT of a Client, and what a lost connection means for them."""

    _user: str | None  # the user id this connection's session logged on with
    _held: bool  # the session holds a unit of work (sent or received, not settled): the server says

    if TYPE_CHECKING:  # Client's
        def _call(self, op: str, args: dict[str, Any], *, syncpoint: bool = True, wait_s: float = 0.0,
                  settles: str = "") -> Any: ...

    @property
    def user(self) -> str | None:
        """The user id this connection's session logged on with; None when it has none (never logged on, or the
        session ended with a lost connection)."""
        return self._user

    @property
    def held(self) -> bool:
        """Does the session hold a unit of work (being sent or received, not settled)?"""
        return self._held

    @staticmethod
    def _session_lost(op: str, user: str | None, was_held: bool, *, in_flight: bool, where: str, why: str,
                      settles: str) -> None:
        """A conversation request whose connection was lost: only a logon (or a request of a client that never
        logged on: the server refuses an application's, and an operator's SET-UOW-STATUS needs none) is re-sent,
        but one that changes a status on its own lost in flight is not (its outcome is unknown); otherwise the
        application must log on again."""
        if op == "logon" or (user is None and not (in_flight and settles)):
            return
        again = f"the session of user {user} ended with it: log on again"
        if in_flight and settles == "commit":
            raise OutcomeUnknownError(f"connection to {where} lost during {op} ({why}): the unit of work may or may "
                                      f"not have committed; {again} and ask QUERY or LAST")
        if in_flight and settles:
            raise OutcomeUnknownError(f"connection to {where} lost during {op} ({why}): it may or may not have "
                                      f"taken effect; {again}")
        if was_held or (in_flight and op in ("send", "receive")):
            raise BackedOutError(f"connection to {where} lost during {op} ({why}): what the session held was "
                                 f"backed out (a sent unit of work BACKEDOUT, a received one ACCEPTED again); {again}")
        raise SessionLostError(f"connection to {where} lost during {op} ({why}): nothing was held; {again}")

    def logon(self, user: str, token: str = "") -> None:
        """LOGON: this connection's session, as ``user`` (1-32 characters) with ``token`` (by which LAST finds the
        user's work again after a failure). A second logon ends the first session (what it held is backed out)."""
        self._call("logon", {"user": user, "token": token})
        self._user, self._held = user, False

    def send(self, service: str, body: bytes, *, option: str = "SYNC", commit: bool = False,
             store: bool | None = None, status_lifetime: int = 0, lifetime_s: int = 0,
             user_status: bytes | None = None, conversation: str = "", eoc: str = "") -> dict[str, Any]:
        """SEND (sqm.conversations.conversation.Conversation.send): ``option`` SYNC adds the message to the unit of work this
        session is sending (made by the first send), MSG sends it outside any; ``commit`` commits the UOW after
        it. Returns uow, status, messages, persistent, conversation."""
        args: dict[str, Any] = {"service": service, "body": body, "option": option, "commit": commit,
                                "status_lifetime": status_lifetime, "lifetime_s": lifetime_s,
                                "conversation": conversation, "eoc": eoc}
        if store is not None:
            args["store"] = store
        if user_status is not None:
            args["user_status"] = user_status
        settles = "commit" if commit or eoc else "alone" if option == "MSG" else ""
        return dict(self._call("send", args, settles=settles))

    def receive(self, service: str, *, option: str = "ANY", wait_ms: int = 0, convid: str = "ANY") -> dict[str, Any]:
        """RECEIVE: the next message of the unit of work being received (EndOfUowError past its last), else SYNC
        the first of the next ACCEPTED UOW this session may take by ``convid`` (CONVID NEW, OLD, ANY or a
        conversation's id: docs/uow.md, "Conversations"), MSG a message outside any UOW, ANY either; waiting up to
        ``wait_ms``.
        Returns body, uow, recv (RECV_FIRST / MIDDLE / LAST / ONLY / NONE), status, persistent, user_status, eoc,
        deliveries, conversation."""
        # A message outside any UOW is taken outside syncpoint: one lost in flight may have been taken.
        settles = "alone" if option in ("MSG", "ANY") and not self._held else ""
        args: dict[str, Any] = {"service": service, "option": option, "wait_ms": wait_ms}
        if convid != "ANY":
            args["convid"] = convid
        return dict(self._call("receive", args,
                               wait_s=wait_ms / 1000, settles=settles))

    def syncpoint(self, option: str, uow: str = "", *, user_status: bytes | None = None) -> dict[str, Any]:
        """SYNCPOINT with OPTION COMMIT, BACKOUT, CANCEL, QUERY, LAST, SETUSTATUS, DELETE, EOC or EOCCANCEL, for
        ``uow`` ("" the one the session holds; "BOTH" for COMMIT or BACKOUT of the received and the sent UOW at
        once). Returns the UOW's status (QUERY and LAST: its public fields). A COMMIT whose connection is lost in
        flight raises OutcomeUnknownError."""
        args: dict[str, Any] = {"option": option, "uow": uow}
        if user_status is not None:
            args["user_status"] = user_status
        settles = "commit" if option in SYNCPOINT_COMMITS else "alone" if option in SYNCPOINT_ALONE else ""
        return dict(self._call("syncpoint", args, settles=settles))

    def set_uow_status(self, uow: str, status: str) -> dict[str, Any]:
        """ETBCMD SET-UOW-STATUS (an operator's; no logon needed): a POSTPONED UOW ACCEPTED now, or an ACCEPTED or
        POSTPONED one CANCELLED (docs/uow.md). Returns its status after it, ``was`` the one before. Lost in flight:
        OutcomeUnknownError (ask QUERY)."""
        return dict(self._call("set_uow_status", {"uow": uow, "status": status}, settles="alone"))


__all__ = ["SYNCPOINT_ALONE", "SYNCPOINT_COMMITS", "ConversationCalls"]
