"""A queue manager's housekeeping failure that repeats every pass (five a second: the process out of file
descriptors, say) is logged once per kind per interval, the first time with its traceback, then one line with the
count of the repeats not logged; a whole interval without failure is said once. Before, every pass logged its full
traceback. A real queue manager on a real redis-server, its housekeeping thread failing in a task of its own."""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path

import pytest

from sqm.core import manager
from tests.support.group import define_group, start_qm
from tests.support.waits import wait_until


def failed_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "housekeeping failed" in r.getMessage()]


def out_of_fds() -> None:
    raise OSError(errno.EMFILE, "Too many open files")


def test_a_failure_of_every_pass_is_logged_once_with_its_traceback(
        redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    define_group(redis_url)
    caplog.set_level(logging.DEBUG, "sqm")
    qm = start_qm(redis_url, tmp_path / "logs", "QM1")
    try:
        calls: list[float] = []

        def broken() -> None:
            calls.append(time.monotonic())
            raise ValueError("a task of its own, broken")

        qm.hooks.every(0.0, out_of_fds)  # every pass
        qm.hooks.every(0.0, lambda: None)
        wait_until(lambda: len(failed_lines(caplog)) >= 1, 10, "the first failure logged")
        time.sleep(1.5)  # about seven passes more, each failing
        lines = failed_lines(caplog)
        assert len(lines) == 1, [r.getMessage() for r in lines]
        (line,) = lines
        assert line.levelno == logging.ERROR and "Too many open files" in line.getMessage()
        assert line.exc_info is not None and isinstance(line.exc_info[1], OSError)  # the traceback, once
        qm.hooks.every(0.0, broken)  # never runs: the task before it fails first, and ends the pass
        assert calls == []
    finally:
        qm.stop()


def test_each_interval_says_how_many_were_not_logged_and_a_quiet_interval_is_said(
        redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager, "HOUSEKEEPING_LOG_EVERY_S", 0.6)
    define_group(redis_url)
    caplog.set_level(logging.DEBUG, "sqm")
    qm = start_qm(redis_url, tmp_path / "logs", "QM1")
    failing = threading.Event()
    failing.set()

    def sometimes() -> None:
        if failing.is_set():
            out_of_fds()

    try:
        qm.hooks.every(0.0, sometimes)
        wait_until(lambda: len(failed_lines(caplog)) >= 3, 10, "three intervals of failures")
        failing.clear()
        wait_until(lambda: any("has not failed for" in r.getMessage() for r in caplog.records), 10,
                   "the all-clear")
    finally:
        qm.stop()
    lines = failed_lines(caplog)
    assert lines[0].exc_info is not None  # the first in full
    assert all(r.exc_info is None for r in lines[1:])  # the repeats: one line each, no traceback
    assert all("more like it not logged" in r.getMessage() for r in lines[1:3]), [r.getMessage() for r in lines]
    passes = 1 + sum(int(r.getMessage().rsplit("(", 1)[1].split()[0]) for r in lines[1:])
    assert passes >= 3 * len(lines) // 2  # the counts add up to many more passes than lines
    (clear,) = [r for r in caplog.records if "has not failed for" in r.getMessage()]
    assert "failures since the last line not logged" in clear.getMessage()
