"""Signal handlers for the length of a block: a command's own SIGTERM and SIGINT handling, put back as it was
found however the block ends, so that a command run in-process (a test, a program that embeds it) leaves the
process's handlers as they were: a Ctrl-C after it must still raise KeyboardInterrupt, not set the event of a
scheduler long gone."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any]


@contextlib.contextmanager
def handling(signals: Iterable[signal.Signals], handler: Handler) -> Iterator[bool]:
    """``handler`` for each of ``signals`` while the block runs; yields whether it was installed. Only the main
    thread may install a handler (signals reach it alone): elsewhere nothing changes and the block runs all the
    same (a caller that runs a command in a thread stops it by its own means)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    before: dict[signal.Signals, Any] = {}
    try:
        for sig in signals:
            before[sig] = signal.signal(sig, handler)
        yield True
    finally:
        for sig, previous in before.items():
            # None: a handler not installed from Python (the process started with it): the default is the
            # nearest Python can put back.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
