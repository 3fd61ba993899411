"""One question put to every member of the group through its service, each member asked on its own connection.

A member that does not answer (down, refusing the connection, hung past MEMBER_TIMEOUT_S) does not stop the others
being asked: it is noted with its error, and the verb shows what the others said, names it after them, and exits
75 (retry later: raise_if_partial), so that an empty answer never passes for a full one. A member that refuses the
token is a one-line error at once (CLIError): the command is wrong, and asking the others would not mend it.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from cfemu.clitools import CLIError, Output
from cfemu.errors import MQError
from qsg.cli_common import RetryLaterError
from sqm.service.client import Client
from sqm.service.protocol import NotAuthorizedError

CLIENT_NAME = "cfemu"
MEMBER_TIMEOUT_S = 5.0  # a member that hangs must not hang the command for longer

Reply = TypeVar("Reply")


@dataclass(frozen=True)
class Answered(Generic[Reply]):
    """A member's reply."""

    server: str
    reply: Reply


@dataclass(frozen=True)
class NoAnswer:
    """A member that did not answer, and why: "ExceptionName: message"."""

    server: str
    error: str


def ask_each_member(servers: list[str], ask: Callable[[Client], Reply], *, token: str | None, role: str,
                    tls: ssl.SSLContext | None = None) -> list[Answered[Reply] | NoAnswer]:
    """``ask`` put to each of ``servers`` (its service's endpoint), in their order: one answer each."""
    answers: list[Answered[Reply] | NoAnswer] = []
    for endpoint in servers:
        try:
            with Client([endpoint], token=token, role=role, tls=tls, client_name=CLIENT_NAME,
                        connect_timeout=MEMBER_TIMEOUT_S, request_timeout=MEMBER_TIMEOUT_S,
                        reconnect_timeout=0.0) as c:
                answers.append(Answered(endpoint, ask(c)))
        except NotAuthorizedError as e:
            raise CLIError(f"{endpoint}: {e}") from None
        except (MQError, OSError) as e:
            answers.append(NoAnswer(endpoint, f"{type(e).__name__}: {e}"))
    return answers


def unanswered(answers: list[Answered[Reply] | NoAnswer]) -> list[dict[str, str]]:
    """The members that did not answer, as the verbs' JSON lists them: {"server": ..., "error": ...}."""
    return [{"server": a.server, "error": a.error} for a in answers if isinstance(a, NoAnswer)]


def name_unanswered(out: Output, failed: list[dict[str, str]]) -> None:
    """One line each for the members that did not answer, after the table of those that did."""
    for f in failed:
        out.line(f"{f['server']}: no answer: {f['error']}")


def raise_if_partial(failed: list[dict[str, str]], missing: str = "") -> None:
    """Exit 75 (retry later) when any member did not answer; ``missing``: what the answer lacks for it."""
    if failed:
        raise RetryLaterError(f"{len(failed)} member(s) did not answer{', ' + missing if missing else ''}: "
                              f"{failed[0]['server']}: {failed[0]['error']}")


__all__ = ["CLIENT_NAME", "MEMBER_TIMEOUT_S", "Answered", "NoAnswer", "ask_each_member", "name_unanswered",
           "raise_if_partial", "unanswered"]
