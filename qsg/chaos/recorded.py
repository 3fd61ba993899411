"""One recorded call of a chaos action (the conversation and publish/subscribe actions alike): invoke in the
history, run, complete as OK, FAIL or UNKNOWN with the reason, so that both kinds of action record failures the same
way and the checker reads them the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from cfemu.errors import BackedOutError, MQError, OutcomeUnknownError
from qsg.chaos.history import FAIL, OK, UNKNOWN, History


class Closable(Protocol):
    name: str

    def close(self) -> None: ...


def reason_of(e: BaseException) -> str:
    return getattr(e, "reason_name", type(e).__name__)


class RecordedRunner:
    """Carries out one action's calls, each recorded under the action's key with ``tags`` (its service or topic);
    ``fields`` says what the history keeps of a result; errors of ``backed_out`` mean the session was backed out."""

    def __init__(self, history: History, session: Closable, key: str, *, tags: dict[str, Any],
                 fields: Callable[[str, Any], dict[str, Any]],
                 backed_out: tuple[type[BaseException], ...] = (BackedOutError,)) -> None:
        self.h = history
        self.s = session
        self.key = key
        self._tags = tags
        self._fields = fields
        self._backed_out = backed_out

    def call(self, op: str, fn: Callable[[], Any], **args: Any) -> tuple[str, Any]:
        op_id = self.h.invoke(self.s.name, op, uow=self.key, **self._tags, **args)
        try:
            result = fn()
        except OutcomeUnknownError as e:
            self.h.complete(op_id, UNKNOWN, reason=reason_of(e), error=type(e).__name__)
            return UNKNOWN, e
        except MQError as e:
            self.h.complete(op_id, FAIL, reason=reason_of(e), error=type(e).__name__,
                            backed_out=isinstance(e, self._backed_out), detail=str(e)[:200])
            return FAIL, e
        except (OSError, ValueError) as e:  # the connection broke in a way the client library did not map
            self.h.complete(op_id, UNKNOWN, reason=type(e).__name__, error=type(e).__name__, detail=str(e)[:200])
            self.s.close()
            return UNKNOWN, e
        self.h.complete(op_id, OK, **self._fields(op, result))
        return OK, result


__all__ = ["RecordedRunner", "reason_of"]
