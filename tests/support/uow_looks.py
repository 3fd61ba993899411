"""A sweeper's look at a UOW's control, held for as long as a test needs (the race behind CHAOS-RESULTS.md,
2026-11-26 20:10): shared by the held-control tests and the chaos drain's test."""

from __future__ import annotations

import threading
import time

from cfemu.errors import UowStatusError
from sqm.conversations import uowcontrols as ctl
from sqm.conversations import uowsweeper
from sqm.conversations.uowstatus import Control
from sqm.core.manager import QueueManager


def a_sweepers_look(qm: QueueManager, service: str, uow: str, hold_s: float) -> threading.Thread:
    """A sweeper that read the UOW in its batch takes its control to check it is still as it read it
    (uowsweeper._apply), finds it changed and gives it back: here the look lasts hold_s. Returns the look's thread,
    started once the control is taken."""
    svc = ctl.service(qm, service)
    seen = ctl.peek(qm, svc, uow)
    assert seen is not None
    taken = threading.Event()

    def changed_meanwhile(old: Control) -> Control | None:
        taken.set()
        time.sleep(hold_s)
        raise UowStatusError(f"unit of work {old.uow} changed meanwhile")
    t = threading.Thread(target=uowsweeper._apply, args=(qm, svc, seen, changed_meanwhile, "looked"))
    t.start()
    assert taken.wait(5)
    return t
