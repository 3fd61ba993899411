"""An in-process queue manager that dies as kill -9 leaves one, for tests that need many deaths and cannot pay for
a process each (tests/support/sqm_child.py is the real process).

``failpoint_armed(name)`` makes the named sqm.core.failpoints point raise Crash in this process instead of killing it;
``crash(qm)`` then stops the queue manager the way a SIGKILL does: what its log held in memory (appended, not yet
written) is lost, nothing is forced, no checkpoint, no manifest update, no leaving the group (its lease is left to
lapse), and the log's writer lock is released as the kernel releases a dead process's locks. What is on disk, and
what is on the CF, is exactly what a real kill at that line leaves.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from unittest import mock

from sqm.core.manager import QueueManager


class Crash(BaseException):  # noqa: N818 - not an error the product may catch: the process is gone
    """The queue manager died here (an armed failpoint fired)."""


@contextlib.contextmanager
def failpoint_armed(name: str) -> Iterator[None]:
    """While inside, the first hit of sqm.core.failpoints point `name` in this process raises Crash (sqm.core.failpoints
    lists the points: before-log-force, after-log-force, backout-after-log, during-apply, put-after-cf)."""

    def fire(point: str) -> None:
        if point == name:
            raise Crash(point)

    with mock.patch("sqm.core.outcomes.failpoint", fire), mock.patch("sqm.core.logspace.failpoint", fire), \
            mock.patch("sqm.core.connection.failpoint", fire):
        yield


def crash(qm: QueueManager) -> None:
    """Stop qm as kill -9 does (see the module doc). The object stays readable (its UOWs), never usable."""
    log = qm.log
    if log is not None:
        with log._lock:  # the writer's own lock: no append or flush is half done
            log._buf.clear()  # appended, never written: gone with the process
            log._closed = True
            for fd in [*log._retired, log._fd]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            log._retired.clear()
            log._fd = -1
            log._release_lock()
    qm.log = None
    qm.running = False
    qm._stop.set()
    qm.redis.close()
