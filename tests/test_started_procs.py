"""A child process a test leaves running is killed after the test by its pid (tests.support.started_procs)."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.support.started_procs import STARTED, kill_left_running, started


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_process_started_during_the_test_and_left_running_is_killed_and_one_started_before_is_not() -> None:
    before = started(_sleeper())
    since = len(STARTED)
    left = started(_sleeper())
    ended = started(subprocess.Popen([sys.executable, "-c", "pass"]))
    ended.wait(30)
    try:
        assert kill_left_running(since) == [left.pid]
        assert left.returncode == -signal.SIGKILL
        assert before.poll() is None  # a wider fixture's: its own to stop
        assert STARTED[-1] is before
    finally:
        kill_left_running(since - 1)
    assert before.returncode == -signal.SIGKILL
