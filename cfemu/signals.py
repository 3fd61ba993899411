"""Signal handlers for the length of a block: a command's own SIGTERM and SIGINT handling, put back as it was
found however the block ends, so that a command run in-process (a test, a program that embeds it) leaves the
process's handlers as they were: a Ctrl-C after it must still raise KeyboardInterrupt, not set the event of a
scheduler long gone.

A handler that sets an event the main thread waits on runs in a thread of its own (``in_thread``), not in the main
thread where Python runs it: a signal that came while the main thread held the event's lock (entering or leaving
its wait) ran a handler that waited for that same lock, in the same thread, for ever (a backup scheduler's Ctrl-C
hung a run for 300 s). A handler that raises into the main thread (to end what it does) runs there."""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any]


@contextlib.contextmanager
def handling(signals: Iterable[signal.Signals], handler: Handler, *, in_thread: bool = False) -> Iterator[bool]:
    """``handler`` for each of ``signals`` while the block runs; yields whether it was installed. Only the main
    thread may install a handler (signals reach it alone): elsewhere nothing changes and the block runs all the
    same (a caller that runs a command in a thread stops it by its own means). ``in_thread``: the handler runs in a
    thread of its own (module doc), for a handler that takes a lock the main thread may hold (an event's set)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    before: dict[signal.Signals, Any] = {}

    def in_a_thread(signum: int, frame: FrameType | None) -> None:
        # _thread, not threading: starting a threading.Thread waits on locks of its own the main thread may hold
        _thread.start_new_thread(handler, (signum, frame))

    try:
        for sig in signals:
            before[sig] = signal.signal(sig, in_a_thread if in_thread else handler)
        yield True
    finally:
        for sig, previous in before.items():
            # None: a handler not installed from Python (the process started with it): the default is the
            # nearest Python can put back.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
