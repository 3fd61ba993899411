"""Request slots: at most N requests of a `sqm run` service do their work at once, up to their first wait.

Each connection of the service is a thread of its own (sqm.service.server). With many connections, every one of
them runnable, the threads spent their time handing the GIL to each other: the service's CPU per lifecycle rose
from 1,264 µs at 1 client to 1,896 at 64, and its throughput fell by a quarter from 4 clients to 64
(BENCHMARKS.md). A request now takes a slot before it runs and gives it back when it ends, so that only a few
threads compete at once and the rest sleep in the kernel.

A slot is given up, early and for good, the moment its request is about to wait: for the log's fsync (so that the
committers a slot lets through still share one fsync: group commit), for a CF round trip another request
leads (so that more requests join it: sqm.core.cfgroup), for a message, for a peer's status change.
It is never taken back. A thread waiting to take a slot back could hold a lock (a checkpoint forces the log under
its own) that the slots' holders need, and none of them would ever give theirs up. So a slot is taken only at the
start of a request, where its thread holds nothing, and a thread that waits holds none. Work that runs outside a
request (restart, checkpoints, recovery, an application's own threads in process) holds no slot, and
``before_wait`` does nothing for it.

A request can also wait where it cannot say so: on a CF that does not answer (a socket read in cfemu, a floor
below), on the group repository's file lock. So a slot is a **lease**: a request that has held one for
``lease_s`` (a normal one holds it for a millisecond or two) counts as waiting, and the next request that waits
for a slot takes it back on its behalf. One stuck request then costs the others a lease, not its whole wait: a
silent CF would make every request through one slot fail one socket timeout after another.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable

_held = threading.local()  # .give_back: the current request's slot, or None once given up (or outside a request)
LEASE_S = 0.1  # how long a request holds its slot before it counts as waiting (--slot-lease-ms)
MAX_SLOTS = 4096  # more would be a mistake (a slot is an item held in memory; connections are fewer anyway)


def default_slots() -> int:
    """One more than the CPUs this process may run on (its affinity: a cpuset or taskset, not the host's count):
    enough that a CPU is busy while a request waits for the CF's answer."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(2, cpus + 1)


class RequestSlots:
    """``n`` slots; a request runs inside ``running()``."""

    def __init__(self, n: int, lease_s: float = LEASE_S) -> None:
        if not 1 <= n <= MAX_SLOTS:
            raise ValueError(f"request slots must be 1-{MAX_SLOTS}, not {n}")
        if lease_s <= 0:
            raise ValueError(f"a request slot's lease must be > 0 s, not {lease_s}")
        self.n = n
        self.lease_s = lease_s
        self._free: queue.SimpleQueue[None] = queue.SimpleQueue()  # in C: a waiter sleeps without the GIL
        for _ in range(n):
            self._free.put(None)
        self._lock = threading.Lock()
        self._holders: dict[int, float] = {}  # request number -> when it took its slot (monotonic)
        self._numbers = itertools.count()
        self.closed = False
        self.waiting = 0  # requests waiting for a slot now
        self.waits = 0  # requests that had to wait for one, ever
        self.expired = 0  # slots taken back from requests that held them past the lease

    def running(self) -> _Running:
        """Hold a slot for the calling thread's request until it ends, ``before_wait`` gives it up, or its lease
        runs out. Entering yields whether the request had to wait for it (then its client may have left, or the
        server begun to stop, meanwhile); after ``close`` a waiting request goes on without one."""
        return _Running(self)

    def _take(self) -> tuple[int, bool]:
        """(the request's number, whether it waited) once it holds a slot, or once the slots were closed."""
        waited = False
        try:
            self._free.get_nowait()
            took = True
        except queue.Empty:
            waited = True
            took = self._wait()
        number = next(self._numbers)
        if took:
            with self._lock:
                self._holders[number] = time.monotonic()
        return number, waited

    def _give_back(self, number: int) -> None:
        """By the holder, or by a waiter whose holder outlived its lease."""
        with self._lock:
            if self._holders.pop(number, None) is None:
                return  # given back already (a wait, the lease), or never taken (closed)
        self._free.put(None)

    def _wait(self) -> bool:
        """Wait for a slot; True when one was taken, False when the slots were closed meanwhile."""
        with self._lock:
            self.waiting += 1
            self.waits += 1
        try:
            while not self.closed:
                try:
                    self._free.get(timeout=self.lease_s)
                    return True
                except queue.Empty:
                    self._expire()
            return False
        finally:
            with self._lock:
                self.waiting -= 1

    def _expire(self) -> None:
        """Give back the slots of requests that have held theirs past the lease: they wait on something."""
        now = time.monotonic()
        with self._lock:
            late = [k for k, since in self._holders.items() if now - since >= self.lease_s]
            for k in late:
                del self._holders[k]
            self.expired += len(late)
        for _ in late:
            self._free.put(None)

    def close(self) -> None:
        """The server stops: requests waiting for a slot stop waiting and go on at once (the server refuses them:
        they waited); the slots are no longer counted."""
        self.closed = True
        with self._lock:
            waiting = self.waiting
        for _ in range(waiting + 1):  # one each, and one for a request on its way to waiting
            self._free.put(None)


class _Running:
    """A request's hold of a slot (RequestSlots.running): a plain object rather than a generator-based context
    manager, as every request of the service takes one."""

    __slots__ = ("slots", "number")

    def __init__(self, slots: RequestSlots) -> None:
        self.slots = slots
        self.number = -1

    def __enter__(self) -> bool:
        self.number, waited = self.slots._take()
        _held.give_back = self.give_back
        return waited

    def give_back(self) -> None:
        self.slots._give_back(self.number)

    def __exit__(self, *exc: object) -> None:
        _held.give_back = None
        self.slots._give_back(self.number)


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


__all__ = ["LEASE_S", "MAX_SLOTS", "RequestSlots", "before_wait", "default_slots", "nap"]
