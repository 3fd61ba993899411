"""The operator's messages about the log (seed 002; docs/log-management.md, "The operator's view"): a restarted
member's restart initiated and completed around its phases (MQ's CSQR001I and CSQR002I around CSQR003I-006I), and
the circular log's warning that space is low (AMQ7466's role), said once per episode before it refuses work."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cfemu.errors import ResourceProblemError
from sqm.service.client import Client
from tests.sqm.test_service import TOKEN, TOKENS_ENV
from tests.support.group import define_group, start_qm
from tests.support.waits import wait_until


def sqm_run(redis_url: str, logs: Path, ready: Path) -> subprocess.Popen[bytes]:
    ready.unlink(missing_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "sqm.cli", "run", "--name", "QM2", "--port", "0", "--redis-url", redis_url,
         "--log-root", str(logs), "--lease-ms", "1000", "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **TOKENS_ENV})


def wait_ready(proc: subprocess.Popen[bytes], ready: Path) -> int:
    wait_until(lambda: ready.exists() or proc.poll() is not None, 60, "the member to start")
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    return int(json.loads(ready.read_text())["port"])


def test_a_restart_says_it_was_initiated_and_completed_around_its_phases(redis_url: str, tmp_path: Path) -> None:
    """A member killed by SIGKILL with a unit of work in flight; its restart (a new process) says CSQR001I first,
    then what it reads (CSQR003I, CSQR004I), the backward recovery (CSQR006I), and CSQR002I last."""
    logs, ready = tmp_path / "logs", tmp_path / "QM2.ready"
    define_group(redis_url, queues=("Q1",))
    proc = sqm_run(redis_url, logs, ready)
    try:
        client = Client(("127.0.0.1", wait_ready(proc, ready)), token=TOKEN, reconnect_timeout=1.0)
        client.put("Q1", b"in flight")  # in a unit of work never committed
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        client.close()
        proc = sqm_run(redis_url, logs, ready)
        wait_ready(proc, ready)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        stderr = proc.stderr.read().decode() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    said = [line for line in stderr.splitlines() if "CSQR0" in line]
    ids = [next(w for w in line.split() if w.startswith("CSQR0")) for line in said]
    assert ids[0] == "CSQR001I" and ids[-1] == "CSQR002I", said
    order = [ids.index(i) for i in ("CSQR001I", "CSQR003I", "CSQR004I", "CSQR006I", "CSQR002I")]
    assert order == sorted(order), said
    assert "QM2 restart initiated" in said[0]
    assert "1 backed out" in said[-1], said[-1]


def test_a_filling_circular_log_warns_once_before_it_refuses(redis_url: str, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A ring of 4 segments held by an in-doubt unit of work fills: the member warns that log space is low once
    (the warning precedes the first refusal, and is not repeated for each refused put), and says so in its status."""
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False, cpl_entries=1, segment_bytes=4096,
                  log_mode="circular", log_ring=4)
    try:
        held = qm.connect()
        held.put("Q1", b"in-doubt")
        uow_id = held.prepare("xid-1")
        c = qm.connect()
        caplog.set_level(logging.INFO, logger="sqm")
        with pytest.raises(ResourceProblemError):
            for i in range(500):
                c.put("Q1", b"m-%d" % i + b"." * 200, syncpoint=False)
                c.get("Q1", syncpoint=False)
        refusals = qm.counters["log_full_refusals"]
        for _ in range(5):
            with pytest.raises(ResourceProblemError):
                c.put("Q1", b"refused", syncpoint=False)
        warnings = [r.getMessage() for r in caplog.records if "AMQ7466W" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "QM1: log space is low" in warnings[0] and "circular log" in warnings[0]
        assert qm.counters["log_full_refusals"] == refusals + 5
        assert qm.counters["log_space_warnings"] == 1
        assert "circular log" in qm.status()["log_space_low"]
        qm.resolve(uow_id, True)
    finally:
        qm.stop()
