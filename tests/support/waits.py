"""Waiting for a condition, with a bound, instead of for a fixed time.

* ``wait_until(check, timeout, what)``: check() until it returns something true (returned), else AssertionError
  naming what was awaited. A test that sleeps a fixed time before its assertion fails on a slow or busy machine
  and wastes the time on a fast one.
* ``sigstop(pid)``: SIGSTOP, and wait until every thread of the process has stopped. kill() returns before the
  target stops: the kernel wakes one thread to take the signal and stop the others, and on a busy machine a thread
  that a request woke (a server's connection thread) may run first and answer it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float = 10.0, what: str = "the condition",
               interval: float = 0.02) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s (last: {value!r})")
        time.sleep(interval)


def _thread_states(pid: int) -> list[str]:
    """The state letter of each thread of pid (R, S, D, T, t, Z...); [] when it is gone."""
    states = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended
        states.append(stat[stat.rindex(")") + 2])  # the field after "(comm)", which may hold spaces
    return states


def is_stopped(pid: int) -> bool:
    states = _thread_states(pid)
    return bool(states) and all(s in "Tt" for s in states)


def sigstop(pid: int, timeout: float = 10.0) -> None:
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: is_stopped(pid), timeout, f"process {pid} stopped (SIGSTOP)", interval=0.001)
