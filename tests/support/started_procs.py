"""The child processes the tests' harnesses start (a `sqm run` server, ...), so that one a test leaves running when
it fails half-way (before its own stop) is killed by its pid after the test, not left holding ports, a CF's
connections and a log's lock for the rest of the run."""

from __future__ import annotations

import subprocess

STARTED: list[subprocess.Popen[bytes]] = []


def started(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """`proc`, remembered as started by the test that runs now."""
    STARTED.append(proc)
    return proc


def kill_left_running(since: int) -> list[int]:
    """Kill (SIGKILL, then reap) every process started after the first `since` that still runs, and forget the
    ones started after `since`; the pids killed. A process started by a fixture of a wider scope before the test
    (index below `since`) is that fixture's to stop."""
    killed = []
    for proc in STARTED[since:]:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
            killed.append(proc.pid)
    del STARTED[since:]
    return killed
