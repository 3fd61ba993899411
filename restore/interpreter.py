"""What a restore's load asks of the Python interpreter while it runs (restore.load), and gives back after.

The load runs three threads in one process: one prepares the batches (Python a message: the plan's output read,
the descriptors packed), one sends them to the CF and waits for its replies, one writes the restore point. The
sending thread is on the critical path, and it gives up the GIL at every socket call; under CPython's default
switch interval (5 ms) it then waits up to that long to get it back from the preparing thread after each reply,
which comes far sooner: the wait, not the CF, sets the pace (the figures: BENCHMARKS.md, "The load's time at 1M
within 512 MiB"). So while a load runs:

  * the switch interval is short (SWITCH_INTERVAL_S): a thread that waits for the GIL gets it within that;
  * the cyclic garbage collector is paused: a load makes a few million small dicts, lists and Settled objects,
    none of them in a cycle (reference counting frees every one), and the collector would scan the batches in
    flight again and again, for nothing. (The partitioned plan pauses it too.)

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

_lock = threading.Lock()
_holders = 0
# The switch interval, and whether the collector was on, before the first of the loads running: None once they
# are given back. Kept until they are: a load that takes the settings while a giving back is owed does not take
# the changed settings for the process's own.
_before: tuple[float, bool] | None = None


@contextmanager
def loading() -> Iterator[None]:
    """A short switch interval and the cyclic collector paused while the `with` runs (see the module doc). They are
    given back however the `with` is left, a Ctrl-C on the way in or out included: the way out gives back exactly
    what the way in took (`held`), and is done again when an interrupt stops it midway (then raised once done): a
    process that goes on after a Ctrl-C (a member, a notebook) must not keep the collector off for good, nor a later
    load take the changed settings for the process's own."""
    held = [False]  # set together with the count of loads: what the way out has to give back
    try:
        _take(held)
        yield
    finally:
        _until_done(_give_back, held)


def _take(held: list[bool]) -> None:
    global _holders, _before
    with _lock:
        if _before is None:
            _before = (sys.getswitchinterval(), gc.isenabled())
        _holders += 1
        held[0] = True  # no call between the count and this: no interrupt is raised in between
        sys.setswitchinterval(min(SWITCH_INTERVAL_S, _before[0]))
        gc.disable()


def _give_back(held: list[bool]) -> None:
    global _holders, _before
    with _lock:
        if held[0]:
            _holders -= 1
            held[0] = False
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
