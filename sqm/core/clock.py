"""The LRSN clock: a hybrid logical clock, max(physical microseconds, last + 1), merged with the CF's clock.

Every CF script returns the structure's clock after max(cf, caller) + 1; the queue manager observes it, so any
record it writes afterwards sorts after every transition it has seen, on any member (causality across the
group even when physical clocks disagree).
"""

from __future__ import annotations

import threading
import time


class LrsnClock:
    def __init__(self, skew_us: int = 0) -> None:
        self._last = 0
        self._lock = threading.Lock()
        self.skew_us = skew_us  # for tests: a member whose physical clock is off by this much

    def now(self) -> int:
        with self._lock:
            self._last = max(time.time_ns() // 1000 + self.skew_us, self._last + 1)
            return self._last

    def observe(self, lrsn: int) -> None:
        with self._lock:
            if lrsn > self._last:
                self._last = lrsn

    @property
    def last(self) -> int:
        return self._last


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch (expiry and put times)."""
    return time.time_ns() // 1_000_000
