"""sqm.throttled_log: one line per kind per interval, the repeats counted and said with the next line, the traceback
with the first line of a kind and with the first after the kind was quiet for an interval (pure logic: a clock of
the test's own)."""

from __future__ import annotations

import logging

import pytest

from sqm.throttled_log import ThrottledLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_kind_per_interval_with_the_count_and_the_first_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = ThrottledLog(logging.getLogger("sqm.test.throttled"), 0.6, level=logging.ERROR, clock=clock)
    boom = OSError(24, "Too many open files")
    with caplog.at_level(logging.DEBUG, "sqm.test.throttled"):
        for _ in range(10):  # five a second for two seconds, of one kind
            log("fds", "failed: %s", boom, exc_info=boom)
            log("other", "other failed", exc_info=ValueError("x"))
            clock.now += 0.2
        log("fds", "failed: %s", boom, exc_info=boom)  # hard on the heels of the line before: counted
        assert log.dropped() > 0
        clock.now += 5.0  # quiet for longer than the interval
        log("fds", "failed: %s", boom, exc_info=boom)
    fds = [r for r in caplog.records if r.getMessage().startswith("failed")]
    assert [r.levelno for r in fds] == [logging.ERROR] * len(fds)
    assert 3 <= len(fds) <= 5, [r.getMessage() for r in fds]
    assert fds[0].exc_info is not None and all(r.exc_info is None for r in fds[1:-1])
    assert all("more like it not logged" in r.getMessage() for r in fds[1:])
    assert fds[-1].exc_info is not None  # after a quiet interval: in full again
    said = sum(int(r.getMessage().rsplit("(", 1)[1].split()[0]) for r in fds[1:])
    assert said + len(fds) == 12  # every failure is a line or counted in one
    others = [r for r in caplog.records if r.getMessage().startswith("other")]
    assert others[0].exc_info is not None and len(others) == len(fds) - 1  # a kind of its own
    assert log.forget() >= 0 and log.dropped() == 0
