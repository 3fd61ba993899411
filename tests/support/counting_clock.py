"""A caller's LRSN clock for tests that drive the CF's operations directly (cfemu.cf.Clock): a counter, raised past
every LRSN the CF returns; enough for the CF's Lamport merge."""

from __future__ import annotations


class CountingClock:
    def __init__(self, start: int = 0) -> None:
        self.t = start

    def now(self) -> int:
        self.t += 1
        return self.t

    def observe(self, lrsn: int) -> None:
        self.t = max(self.t, lrsn)
