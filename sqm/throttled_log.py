"""A log that a failure repeating many times a second cannot flood: at most one line per kind of failure every
``every_s`` seconds, the repeats meanwhile counted and said with the next line of that kind.

Used by the HTTP doors (aiohttp's error lines, the event loop's accept errors: sqm.http_guard) and by a queue
manager's housekeeping (a failure that repeats every pass, as when the process is out of file descriptors). The
first line of a kind, and the first after the kind was quiet for ``every_s``, carries its exception's traceback
when it is given one (the one an operator needs to find the cause); the lines between only the count."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any


class ThrottledLog:
    """One line per key every ``every_s`` seconds at most, at ``level``; what comes meanwhile is counted and said
    with the next line of the key. ``clock``: monotonic seconds (a test's own)."""

    def __init__(self, log: logging.Logger, every_s: float = 1.0, *, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.every_s = every_s
        self.level = level
        self.clock = clock
        self._last: dict[str, float] = {}  # when a line of the key was last written
        self._seen: dict[str, float] = {}  # when the key last happened (written or not)
        self._dropped: dict[str, int] = {}

    def __call__(self, key: str, msg: str, *args: Any, exc_info: BaseException | None = None) -> None:
        now = self.clock()
        seen, last = self._seen.get(key), self._last.get(key)
        quiet = seen is None or now - seen >= self.every_s
        self._seen[key] = now
        if last is not None and now - last < self.every_s:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            msg, args = msg + " (%d more like it not logged)", (*args, dropped)
        self.log.log(self.level, msg, *args, exc_info=exc_info if quiet else None)

    def dropped(self) -> int:
        """The lines counted and not written yet, of every key."""
        return sum(self._dropped.values())

    def forget(self) -> int:
        """Forget every key (the failures are over): the next failure of any kind is written in full. Returns the
        lines that were counted and not written."""
        dropped = self.dropped()
        self._last.clear()
        self._seen.clear()
        self._dropped.clear()
        return dropped


__all__ = ["ThrottledLog"]
