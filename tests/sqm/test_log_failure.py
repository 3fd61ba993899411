"""A queue manager whose record log cannot be written (its file size limit reached, as on a full disk) stops
serving and lets its lease lapse, so that a peer recovers its units of work: nothing is lost or held forever."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cfemu.errors import LogFailedError, NoMessageError
from sqm.service.client import Client
from sqm.service.server import EXIT_LOG_FAILED
from tests.sqm.test_service import TOKEN, TOKENS_ENV
from tests.support.group import define_group, start_qm

LOG_LIMIT = 256 * 1024  # bytes any file of the child may grow to: its log segment hits it first


def limit_file_size() -> None:  # runs in the child before exec
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (LOG_LIMIT, LOG_LIMIT))


def test_full_log_stops_the_member_and_a_peer_recovers_its_work(redis_url: str, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))
    ready = tmp_path / "QM2.ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sqm.cli", "run", "--name", "QM2", "--port", "0", "--redis-url", redis_url,
         "--log-root", str(logs), "--lease-ms", "1000", "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limit_file_size,
        env={**os.environ, **TOKENS_ENV})
    peer = None
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "QM2 did not start"
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        peer = start_qm(redis_url, logs, "QM1", lease_ms=1000)

        client = Client(("127.0.0.1", port), token=TOKEN, reconnect_timeout=1.0)
        client.put("Q1", b"held", syncpoint=False)
        client.get("Q1")  # held by an open UOW on QM2 when its log fills
        committed = 0  # puts acknowledged before the log filled
        with pytest.raises(LogFailedError):
            while committed < 10_000:
                client.put("Q1", b"x" * 4096, syncpoint=False)
                committed += 1
        assert proc.wait(timeout=30) == EXIT_LOG_FAILED
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        assert "cannot write its record log" in stderr

        # The peer fences QM2 and backs out its open UOW: the held message is available again.
        conn = peer.connect()
        deadline = time.monotonic() + 20
        while True:
            try:
                bodies = [conn.get("Q1", wait_ms=100).body for _ in range(committed + 1)]
                break
            except NoMessageError:
                conn.backout()
                assert time.monotonic() < deadline, "peer recovery did not release QM2's held message"
        conn.commit()
        assert bodies.count(b"held") == 1 and len(bodies) == committed + 1
        with pytest.raises(NoMessageError):
            conn.get("Q1")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if peer is not None:
            peer.stop()
