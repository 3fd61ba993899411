"""What a CF that cannot be reached looks like to a CF call, whether a failed call's request went out, and what
makes CF calls for a queue manager (CFCaller: sqm.core.manager.QueueManager.cf_call and .structure)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import redis

from cfemu.cf import Structure

CF_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class CFCaller(Protocol):
    def cf_call(self, fn: Callable[[], Any]) -> Any: ...
    def structure(self, name: str) -> Structure: ...


def reply_lost(e: BaseException) -> bool:
    """Did a CF call fail after its request was sent (the reply was lost: a reset or a timeout while reading)?
    Then the script may have run: its effect is unknown, not absent. A refused or failed connect sent nothing."""
    if isinstance(e, redis.exceptions.TimeoutError):
        return "connect" not in str(e).lower()
    text = str(e)
    return "while reading" in text or "reading from" in text or "closed by server" in text


__all__ = ["CF_DOWN", "CFCaller", "reply_lost"]
