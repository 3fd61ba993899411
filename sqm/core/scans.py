"""Scan slots: at most N calls of a member's multi-call scans are in the CF at once (``sqm run --scan-slots``).

A scan is a run of CF calls, each bounded (a browse's pages: browse.lua, at most cfemu.limits.CF_STEP entries and
CF_STEP_BYTES a call; a peek scan's batches: peek_scan.lua), going on from the cursor the last call returned. One
call is short, but many browsers at once (REST clients paging through a long queue, say) would each keep a call of
theirs in the CF, which runs one script at a time: every other call of every member (a get, a commit, a lease
renewal) would wait behind a queue of them. So each call of a scan takes a slot of its member's ``ScanSlots`` for the
time of that call only, and the calls of more scans than there are slots wait for one in this process, not in the
CF. A slot is held for one call rather than for the whole scan, so that a long scan (a million expired messages
to page past) delays a short one by a call, not by its whole length.

A call that must wait for a slot first gives up its request's slot (sqm.request_slots.before_wait), as every wait
of a request does. A slot is held only around one CF call, never while waiting for anything else, so slots cannot
deadlock against each other or against the request slots.

A slot is a **lease** of LEASE_S, as a request slot is (sqm.request_slots): a call holding one longer (a bounded
call takes milliseconds) waits on a CF that does not answer, and no longer keeps a waiter out. Without the lease, the
scans of a silent CF failed one socket timeout after another (four browses through two slots: 1, 2, 3 and 4 s),
where each should fail after its own. The lease frees a slot, not the bound: at most 2n calls are in the CF at
once, those past their lease counted, so that a CF that is slow (not silent) is not sent more scans the slower it
gets.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqm.request_slots import before_wait

DEFAULT_SCAN_SLOTS = 2
MAX_SCAN_SLOTS = 1024  # more would no longer bound anything: a member has at most --cf-connections CF connections
LEASE_S = 0.25  # a call holding its slot this long waits on the CF: its slot is a waiter's


class ScanSlots:
    """``n`` slots for the calls of a member's scans; each call runs inside ``call()``."""

    def __init__(self, n: int = DEFAULT_SCAN_SLOTS, lease_s: float = LEASE_S) -> None:
        if not 1 <= n <= MAX_SCAN_SLOTS:
            raise ValueError(f"scan slots must be 1-{MAX_SCAN_SLOTS}, not {n}")
        self.n = n
        self.lease_s = lease_s
        self._cond = threading.Condition()
        self._holders: dict[int, float] = {}  # call -> when it took its slot
        self._ids = itertools.count()
        self.waiting = 0  # calls waiting for a slot now
        self.waits = 0  # calls that had to wait for one, ever
        self.expired = 0  # slots a waiter took from a call that held its slot past the lease

    @property
    def running(self) -> int:
        """Calls in the CF now (those past their lease included)."""
        return len(self._holders)

    def _live(self, now: float) -> list[float]:
        return [since for since in self._holders.values() if now - since < self.lease_s]

    def _room(self, now: float) -> bool:
        return len(self._holders) < 2 * self.n and len(self._live(now)) < self.n

    @contextmanager
    def call(self) -> Iterator[None]:
        """Hold a slot for the time of one CF call of a scan, waiting for one when all are held (and in lease)."""
        me = next(self._ids)
        with self._cond:
            now = time.monotonic()
            must_wait = not self._room(now)
            if must_wait:
                self.waiting += 1
                self.waits += 1
            else:
                self._holders[me] = now
        if must_wait:
            try:
                before_wait()
                with self._cond:
                    while True:
                        now = time.monotonic()
                        if self._room(now):
                            break
                        live = self._live(now)
                        # a holder's lease ending, or (all 2n in the CF) a holder's release, makes room
                        self._cond.wait(timeout=max(0.001, min(live) + self.lease_s - now) if live else None)
                    if len(self._holders) >= self.n:  # past n in the CF: a slot of a call past its lease
                        self.expired += 1
                    self._holders[me] = now
            finally:
                with self._cond:
                    self.waiting -= 1
        try:
            yield
        finally:
            with self._cond:
                del self._holders[me]
                self._cond.notify()


__all__ = ["DEFAULT_SCAN_SLOTS", "LEASE_S", "MAX_SCAN_SLOTS", "ScanSlots"]
