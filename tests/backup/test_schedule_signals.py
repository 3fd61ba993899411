"""The backup scheduler run in-process (an embedding program, a test): SIGINT stops it, as in its own process, and
when it returns the process's handlers are those it found, so that a later Ctrl-C raises KeyboardInterrupt
instead of setting the event of a scheduler long gone."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from backup.schedule import run_backup_scheduler
from cfemu.settings import resolve


def _interrupt_when_installed(before: object, stop: threading.Event, sent: threading.Event) -> None:
    """SIGINT to this process once the scheduler has its own handler; a scheduler that never installs one is
    stopped by its event instead (a SIGINT then would meet pytest's handler and end the whole run)."""
    deadline = time.monotonic() + 30
    while signal.getsignal(signal.SIGINT) is before:
        if time.monotonic() > deadline:
            stop.set()
            return
        time.sleep(0.01)
    sent.set()
    os.kill(os.getpid(), signal.SIGINT)


def test_sigint_stops_the_scheduler_and_its_handlers_go_with_it(tmp_path: Path, ctrl_c_raises: None) -> None:
    settings = resolve(redis_url="redis://127.0.0.1:1", backup_dir=tmp_path / "backups", log_root=tmp_path / "logs",
                       env={})
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop, sent = threading.Event(), threading.Event()
    threading.Thread(target=_interrupt_when_installed, args=(before[signal.SIGINT], stop, sent), daemon=True).start()
    run_backup_scheduler(3600, settings, ["APP1"], stop)  # its first tick an hour away: only the signal ends it
    assert sent.is_set(), "the scheduler installed no SIGINT handler"
    assert {sig: signal.getsignal(sig) for sig in before} == before
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C does what it did before the scheduler ran
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
