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
from collections.abc import Iterator
from contextlib import contextmanager

SWITCH_INTERVAL_S = 0.0005  # a tenth of CPython's default

_lock = threading.Lock()
_holders = 0
_before: tuple[float, bool] = (0.0, True)  # the switch interval, and whether the collector was on, at the first


@contextmanager
def loading() -> Iterator[None]:
    """A short switch interval and the cyclic collector paused while the `with` runs (see the module doc)."""
    global _holders, _before
    with _lock:
        if _holders == 0:
            _before = (sys.getswitchinterval(), gc.isenabled())
            sys.setswitchinterval(min(SWITCH_INTERVAL_S, _before[0]))
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                sys.setswitchinterval(_before[0])
                if _before[1]:
                    gc.enable()
