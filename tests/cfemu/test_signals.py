"""A command's signal handlers for the length of a block (cfemu.signals.handling): real signals sent to this
process, the handlers before the block put back however it ends, nothing installed from another thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import FrameType

import pytest

from cfemu.signals import handling


def _interrupted_soon() -> None:
    """Send SIGINT to this process and give the main thread the time to run its handler."""
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs at the first check after the signal; a handler that raises ends this


def test_the_handlers_hold_for_the_block_and_are_put_back_after_it(ctrl_c_raises: None) -> None:
    got: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        got.append(signum)
        raise _Handled

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with handling((signal.SIGINT, signal.SIGTERM), on_signal) as installed:
        assert installed
        with pytest.raises(_Handled):
            _interrupted_soon()
        assert got == [signal.SIGINT]
    assert {sig: signal.getsignal(sig) for sig in before} == before
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C does what it did before the block
        _interrupted_soon()


def test_the_handlers_are_put_back_when_the_block_raises() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="the command failed"), handling((signal.SIGTERM,), lambda *_: None):
        assert signal.getsignal(signal.SIGTERM) is not before
        raise RuntimeError("the command failed")
    assert signal.getsignal(signal.SIGTERM) is before


def test_outside_the_main_thread_nothing_is_installed_and_the_block_runs() -> None:
    before = signal.getsignal(signal.SIGINT)
    seen: list[object] = []

    def command() -> None:
        with handling((signal.SIGINT,), lambda *_: None) as installed:
            seen.extend([installed, signal.getsignal(signal.SIGINT)])

    t = threading.Thread(target=command)
    t.start()
    t.join(10)
    assert seen == [False, before]


class _Handled(Exception):
    pass


def test_a_handler_in_a_thread_sets_an_event_whose_lock_the_main_thread_holds() -> None:
    """A backup scheduler's Ctrl-C hung its run: the signal came while the main thread held its stop event's lock
    (entering or leaving the wait), and the handler, run in the main thread, waited for that lock for ever. Run in a
    thread of its own, it sets the event once the main thread lets go. A child process: the hang it guards against
    would be this process's."""
    code = textwrap.dedent("""
        import signal, threading
        from cfemu.signals import handling
        stop = threading.Event()
        with handling((signal.SIGINT,), lambda *_: stop.set(), in_thread=%s):
            handler = signal.getsignal(signal.SIGINT)
            with stop._cond:  # held, as inside Event.wait, when the signal comes: Python runs the handler here
                handler(signal.SIGINT, None)
            print(stop.wait(5))
    """)
    done = subprocess.run([sys.executable, "-c", code % "True"], capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "True", done.stderr
    with pytest.raises(subprocess.TimeoutExpired):  # in the main thread, the same signal hangs it
        subprocess.run([sys.executable, "-c", code % "False"], capture_output=True, text=True, timeout=3)
