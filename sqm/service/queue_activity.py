"""The last put and the last get of each queue through one member's service: its part of DISPLAY QSTATUS."""

from __future__ import annotations

import time


class QueueActivity:
    """Wall-clock seconds of the last put and the last get of each queue through this member's service, kept in
    memory: two dict stores per request and no CF call (DISPLAY QSTATUS merges the members'). A store of one key
    is atomic under the interpreter lock and a reader takes a copy, so no lock is needed. ``used`` is the set of
    queues of the connection that made the request (its handle on the queue, as DISPLAY CONN counts it)."""

    def __init__(self) -> None:
        self.last_put: dict[str, float] = {}
        self.last_get: dict[str, float] = {}

    def put(self, used: set[str], queue: str) -> None:
        used.add(queue)
        self.last_put[queue] = time.time()

    def got(self, used: set[str], queue: str) -> None:
        used.add(queue)
        self.last_get[queue] = time.time()


__all__ = ["QueueActivity"]
