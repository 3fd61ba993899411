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
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqm.request_slots import before_wait

DEFAULT_SCAN_SLOTS = 2
MAX_SCAN_SLOTS = 1024  # more would no longer bound anything: a member has at most --cf-connections CF connections


class ScanSlots:
    """``n`` slots for the calls of a member's scans; each call runs inside ``call()``."""

    def __init__(self, n: int = DEFAULT_SCAN_SLOTS) -> None:
        if not 1 <= n <= MAX_SCAN_SLOTS:
            raise ValueError(f"scan slots must be 1-{MAX_SCAN_SLOTS}, not {n}")
        self.n = n
        self._free = threading.BoundedSemaphore(n)
        self._lock = threading.Lock()
        self.running = 0  # calls holding a slot now
        self.waiting = 0  # calls waiting for a slot now
        self.waits = 0  # calls that had to wait for one, ever

    @contextmanager
    def call(self) -> Iterator[None]:
        """Hold a slot for the time of one CF call of a scan, waiting for one when all are held."""
        if not self._free.acquire(blocking=False):
            with self._lock:
                self.waiting += 1
                self.waits += 1
            try:
                before_wait()
                self._free.acquire()
            finally:
                with self._lock:
                    self.waiting -= 1
        with self._lock:
            self.running += 1
        try:
            yield
        finally:
            with self._lock:
                self.running -= 1
            self._free.release()


__all__ = ["DEFAULT_SCAN_SLOTS", "MAX_SCAN_SLOTS", "ScanSlots"]
