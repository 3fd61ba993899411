"""Request slots: at most N requests of a `sqm run` service do their work at once, up to their first wait.

Each connection of the service is a thread of its own (sqm.service.server). With many connections, every one of
them runnable, the threads spent their time handing the GIL to each other: the service's CPU per lifecycle rose
from 1,264 µs at 1 client to 1,896 at 64, and its throughput fell by a quarter from 4 clients to 64 (issue 15,
BENCHMARKS.md). A request now takes a slot before it runs and gives it back when it ends, so that only a few
threads compete at once and the rest sleep in the kernel.

A slot is given up, early and for good, the moment its request is about to wait: for the log's fsync (so that the
committers a slot lets through still share one fsync: group commit), for a message, for a peer's status change.
It is never taken back. A thread waiting to take a slot back could hold a lock (a checkpoint forces the log under
its own) that the slots' holders need, and none of them would ever give theirs up. So a slot is taken only at the
start of a request, where its thread holds nothing, and a thread that waits holds none. Work that runs outside a
request (restart, checkpoints, recovery, an application's own threads in process) holds no slot, and
``before_wait`` does nothing for it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator

_held = threading.local()  # .give_back: the current request's slot, or None once given up (or outside a request)


def default_slots() -> int:
    """One more than the CPUs: enough that a CPU is busy while a request waits for the CF's answer."""
    return max(2, (os.cpu_count() or 1) + 1)


class RequestSlots:
    """``n`` slots; a request runs inside ``running()``."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"request slots must be at least 1, not {n}")
        self.n = n
        self._free: queue.SimpleQueue[None] = queue.SimpleQueue()  # in C: a waiter sleeps without the GIL
        for _ in range(n):
            self._free.put(None)
        self._lock = threading.Lock()
        self.waiting = 0  # requests waiting for a slot now
        self.waits = 0  # requests that had to wait for one, ever

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Hold a slot for the calling thread's request until it ends or ``before_wait`` gives it up."""
        try:
            self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                self.waiting += 1
                self.waits += 1
            try:
                self._free.get()
            finally:
                with self._lock:
                    self.waiting -= 1
        given: list[bool] = []

        def give_back() -> None:
            if not given:  # once, whichever comes first: a wait or the request's end
                given.append(True)
                self._free.put(None)

        _held.give_back = give_back
        try:
            yield
        finally:
            _held.give_back = None
            give_back()


def before_wait() -> None:
    """The calling thread is about to wait: give up its request's slot, if it holds one, for the rest of its
    request (module docstring: never taken back)."""
    give_back: Callable[[], None] | None = getattr(_held, "give_back", None)
    if give_back is not None:
        _held.give_back = None
        give_back()


def nap(seconds: float) -> None:
    """``time.sleep`` for a request that polls (a get's wait, a receive's): its slot goes to another first."""
    before_wait()
    time.sleep(seconds)


__all__ = ["RequestSlots", "before_wait", "default_slots", "nap"]
