"""What a restore's load asks of the Python interpreter while it runs (restore.load), and gives back after.

The load runs three threads in one process: one prepares the batches (Python a message: the plan's output read,
the descriptors packed), one sends them to the CF and waits for its replies, one writes the restore point. The
sending thread is on the critical path, and it gives up the GIL at every socket call; under CPython's default
switch interval (5 ms) it then waits up to that long to get it back from the preparing thread after each reply,
which comes far sooner: the wait, not the CF, sets the pace (the figures: BENCHMARKS.md, "The load's time at 1M
within 512 MiB"). So while a load runs:

  * the switch interval is short (SWITCH_INTERVAL_S): a thread that waits for the GIL gets it within that;
  * the cyclic garbage collector's own runs are paused: a load makes a few million small dicts, lists and Settled
    objects, none of them in a cycle (reference counting frees every one), and the collector would scan the
    batches in flight again and again, for nothing. (The partitioned plan pauses it too.) The young generations
    are still collected once every COLLECT_EVERY_S, by a thread of their own: the process may be serving clients
    meanwhile (a member's RECAUTO restore), and its requests leave garbage in cycles (a request refused by an
    exception keeps its traceback's frames: a few KiB each MQRC_NO_MSG_AVAILABLE), which would otherwise pile up
    for as long as the load runs. Such a run scans what was made since the last one and still lives (a few
    batches, under a millisecond); what was still in use at one (a request in flight) waits for the load's end.

Both are settings of the whole process: loads that overlap in one process (a member restoring two structures)
share them, and the settings in force before the first are given back when the last ends.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SWITCH_INTERVAL_S = 0.0005  # a tenth of CPython's default
COLLECT_EVERY_S = 1.0  # the young generations' collection while the collector's own runs are paused

_lock = threading.Lock()
_holders = 0
# The switch interval, and whether the collector was on, before the first of the loads running: None once they
# are given back. Kept until they are: a load that takes the settings while a giving back is owed does not take
# the changed settings for the process's own.
_before: tuple[float, bool] | None = None
_sweeping: threading.Event | None = None  # set to end the thread that collects the young generations
young_collections = 0  # the young generations' collections made while loads ran, in this process


def _sweep(stop: threading.Event) -> None:
    global young_collections
    while not stop.wait(COLLECT_EVERY_S):
        gc.collect(1)
        young_collections += 1


@contextmanager
def loading() -> Iterator[None]:
    """A short switch interval and the cyclic collector's own runs paused (the young generations collected every
    COLLECT_EVERY_S) while the `with` runs (see the module doc). They are given back however the `with` is left, a
    Ctrl-C on the way in or out included: the way out gives back exactly what the way in took (`held`), and is done
    again when an interrupt stops it midway (then raised once done): a process that goes on after a Ctrl-C (a
    member, a notebook) must not keep the collector off for good, nor a later load take the changed settings for
    the process's own."""
    held = [False]  # set together with the count of loads: what the way out has to give back
    try:
        _take(held)
        yield
    finally:
        _until_done(_give_back, held)


def _take(held: list[bool]) -> None:
    global _holders, _before, _sweeping
    with _lock:
        if _before is None:
            _before = (sys.getswitchinterval(), gc.isenabled())
        _holders += 1
        held[0] = True  # no call between the count and this: no interrupt is raised in between
        sys.setswitchinterval(min(SWITCH_INTERVAL_S, _before[0]))
        gc.disable()
        if _sweeping is None and _before[1]:  # a collector the process had paused itself stays paused
            _sweeping = threading.Event()
            threading.Thread(target=_sweep, args=(_sweeping,), name="restore-load-gc", daemon=True).start()


def _give_back(held: list[bool]) -> None:
    global _holders, _before, _sweeping
    with _lock:
        if held[0]:
            _holders -= 1
            held[0] = False
        if _holders == 0 and _sweeping is not None:
            _sweeping.set()
            _sweeping = None
        if _holders == 0 and _before is not None:
            sys.setswitchinterval(_before[0])
            if _before[1]:
                gc.enable()
            _before = None


def _until_done(step: Callable[[list[bool]], None], held: list[bool]) -> None:
    """step(held), done again while an interrupt (KeyboardInterrupt, SystemExit: not an Exception) stops it; the
    first interrupt is raised once it is done."""
    interrupted: BaseException | None = None
    while True:
        try:
            step(held)
            break
        except Exception:
            raise
        except BaseException as e:
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted
