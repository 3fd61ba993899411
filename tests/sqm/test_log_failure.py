"""A queue manager whose record log cannot be written (its file size limit reached, as on a full disk: a write fails
with EFBIG as it would with ENOSPC) refuses persistent work with its reason code and serves non-persistent work, as
a disconnected persistent store does (docs/pstore.md); its in-flight persistent units of work are backed out (said in
its log; one holding persistent gets keeps them locked until a peer backs it out with a record); stopped, it exits 4
and a peer recovers what its log decided; restarted with room, it serves again."""

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

from cfemu.errors import BackedOutError, LogFailedError, NoMessageError, OutcomeUnknownError
from sqm.service.client import Client
from sqm.service.server import EXIT_LOG_FAILED
from tests.support.group import define_group, start_qm
from tests.support.service_proc import TOKEN, TOKENS_ENV
from tests.support.waits import wait_until

LOG_LIMIT = 256 * 1024  # bytes any file of the child may grow to: its log segment hits it first


def limit_file_size() -> None:  # runs in the child before exec
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (LOG_LIMIT, LOG_LIMIT))


def start_member(redis_url: str, logs: Path, ready: Path, *, limited: bool) -> subprocess.Popen[bytes]:
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sqm.cli", "run", "--name", "QM2", "--port", "0", "--redis-url", redis_url,
         "--log-root", str(logs), "--lease-ms", "1000", "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limit_file_size if limited else None,
        env={**os.environ, **TOKENS_ENV})
    wait_until(lambda: ready.exists() or proc.poll() is not None, 60, "QM2 to start")
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    return proc


@pytest.mark.slow
def test_a_full_log_refuses_persistent_work_and_the_rest_goes_on(redis_url: str, tmp_path: Path) -> None:
    logs, ready = tmp_path / "logs", tmp_path / "QM2.ready"
    define_group(redis_url, queues=("Q1", "Q2"))
    proc = start_member(redis_url, logs, ready, limited=True)
    peer = None
    try:
        port = json.loads(ready.read_text())["port"]
        peer = start_qm(redis_url, logs, "QM1", lease_ms=1000)

        def client() -> Client:
            return Client(("127.0.0.1", port), token=TOKEN, reconnect_timeout=1.0)
        holder, filler, other = client(), client(), client()
        holder.put("Q1", b"held", syncpoint=False)
        holder.get("Q1")  # a persistent get in a unit of work still in flight when the log fills
        other.put("Q2", b"np-in-flight", persistent=False)  # non-persistent work in flight too
        committed = 0  # persistent puts acknowledged before the log filled
        unknown = 0  # one whose COMMIT's write failed part way: its outcome is unknown, never "refused"
        with pytest.raises(LogFailedError):
            while committed < 10_000:
                try:
                    filler.put("Q1", b"x" * 4096, syncpoint=False)
                except OutcomeUnknownError:
                    unknown += 1
                    continue
                committed += 1
        assert committed > 10 and unknown <= 1

        # Persistent work is refused with its reason code, and changes nothing; the member stays up.
        with pytest.raises(LogFailedError) as refused:
            other.put("Q1", b"refused", syncpoint=False)
        assert refused.value.reason == 2102 and "cannot write its log" in str(refused.value)
        # Non-persistent work goes on: the unit of work in flight commits, new puts and gets work.
        other.commit()
        other.put("Q2", b"np-after", persistent=False, syncpoint=False)
        assert [other.get("Q2", syncpoint=False).body for _ in range(2)] == [b"np-in-flight", b"np-after"]
        # The persistent unit of work in flight is backed out, but not by this member without a record: its get's
        # message stays locked until the member stops and a peer backs it out from its log.
        with pytest.raises(BackedOutError, match="cannot write its log"):
            holder.commit()
        conn = peer.connect()
        assert b"held" not in [m.body for m in conn.browse("Q1", limit=100_000)]
        # The member keeps its lease (no peer recovery fences it): still serving after three lease periods.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            other.put("Q2", b"np", persistent=False, syncpoint=False)
            assert other.get("Q2", syncpoint=False).body == b"np"
        assert proc.poll() is None
        for c in (holder, filler, other):
            c.close()

        # Stopped by the operator: exit 4; a peer recovers what the log on disk decided.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == EXIT_LOG_FAILED
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        assert "the record log cannot be written" in stderr and "is backed out: the log cannot be written" in stderr
        wait_until(lambda: peer.counters["peer_recoveries"] >= 1, 60, "the peer to recover QM2's work")
        bodies = []
        while True:
            try:
                bodies.append(conn.get("Q1").body)
            except NoMessageError:
                break
        conn.commit()
        # Exactly the acknowledged puts (and the one of unknown outcome if its COMMIT reached the disk), never one
        # refused; the held message once, its backout logged by the peer.
        assert bodies.count(b"held") == 1 and bodies.count(b"x" * 4096) in {committed, committed + unknown}

        # Restarted with room: persistent work again.
        proc = start_member(redis_url, logs, ready, limited=False)
        c = Client(("127.0.0.1", json.loads(ready.read_text())["port"]), token=TOKEN, reconnect_timeout=1.0)
        c.put("Q1", b"after", syncpoint=False)
        assert c.get("Q1", syncpoint=False).body == b"after"
        c.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if peer is not None:
            peer.stop()
