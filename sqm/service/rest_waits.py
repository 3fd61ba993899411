"""The waiting gets of the REST door (a DELETE with ``wait``): how many may wait at once, and what tells one that
its caller has gone.

A waiting get holds a thread for its whole wait (the queue manager's get polls the CF in it). Had waits and puts
shared one pool, waiting gets (held by their callers, or abandoned by callers that had hung up) took every thread,
and a put queued behind them for a whole wait: 40 waiting DELETEs from one client held another client's POST for
58 s. So waiting gets run in threads of their own, ``total`` of them at most, at most ``per_peer`` from one address
(so one client cannot take them all); past either bound a get waits in line, on the event loop, holding no thread,
for no longer than its own ``wait``: when that is over it takes a message that is there, or none (204), as a get
that had waited in a thread. And a waiting get whose caller hung up stops at the next poll of the CF and takes
nothing (RestWatch): a message that arrives then goes to a caller who is there, not backed out by one who is not.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

from sqm.core.client_watch import ClientWatch
from sqm.http_guard import peer_has_finished

RECHECK_S = 0.25  # how often a get waiting in line looks whether its caller is still there


class RestWatch(ClientWatch):
    """Set when the caller of a REST request has gone: ``is_set()`` looks at the request's HTTP connection (the
    peer's end of stream, a reset, or closing), as the native service's watch reads its socket; ``set()`` by the
    server's stop."""

    def __init__(self, request: web.Request) -> None:
        super().__init__()
        self._request = request

    def is_set(self) -> bool:
        if super().is_set():
            return True
        # Read from a worker thread: attribute reads of the event loop's objects, which the GIL keeps whole; the
        # loop sets the transport to None (or closing) when the peer's reset arrives, the guard marks its end of
        # stream (a hang-up, or a half-close: TCP does not tell them apart until a write fails).
        if peer_has_finished(self._request.transport):
            self.set()
            return True
        return False


class WaitSlots:
    """At most ``total`` REST gets waiting at once, at most ``per_peer`` of them from one address. Used on the event
    loop only (no lock)."""

    def __init__(self, total: int, per_peer: int) -> None:
        if not 1 <= per_peer <= total:
            raise ValueError(f"waiting gets: 1 <= per_peer <= total, not {per_peer} and {total}")
        self.total, self.per_peer = total, per_peer
        self.held: Counter[str] = Counter()  # address -> its gets waiting now
        self.waiting = 0  # all gets waiting now
        self._freed = asyncio.Event()  # set (and replaced) each time a slot is given back

    def _full(self, peer: str) -> bool:
        return self.waiting >= self.total or self.held[peer] >= self.per_peer

    async def take(self, peer: str, deadline: float, gone: ClientWatch) -> bool:
        """Take a slot for a get from ``peer``: True once it holds one; False when ``deadline`` (the event loop's
        time) passed or its caller left before one was free."""
        loop = asyncio.get_running_loop()
        while self._full(peer):
            left = deadline - loop.time()
            if left <= 0 or gone.is_set():
                return False
            try:
                await asyncio.wait_for(self._freed.wait(), min(left, RECHECK_S))
            except TimeoutError:
                pass
        self.waiting += 1
        self.held[peer] += 1
        return True

    def give(self, peer: str) -> None:
        """Give back the slot ``take`` gave: the next get in line may wait in a thread."""
        self.waiting -= 1
        self.held[peer] -= 1
        if self.held[peer] <= 0:
            del self.held[peer]
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()


__all__ = ["RECHECK_S", "RestWatch", "WaitSlots"]
