"""What the log and the restart tell the operator (seeds 000 and 002; docs/log-management.md): a restarted
member's restart initiated and completed around its phases (MQ's CSQR001I and CSQR002I around CSQR003I-006I); the
circular log's warning that space is low (AMQ7466's role), said once per episode before it refuses work; a
completed backup's log position recorded in the members' logs; a changed CPL size reconciled at restart."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from backup.run import run_backup
from cfemu.errors import ResourceProblemError
from sqm.core.clock import now_ms
from sqm.log.format import read_manifest, segment_name
from sqm.service.client import Client
from tests.support.group import define_group, start_qm
from tests.support.service_proc import TOKEN, TOKENS_ENV
from tests.support.waits import wait_until


def sqm_run(redis_url: str, logs: Path, ready: Path, *args: str, name: str = "QM2") -> subprocess.Popen[bytes]:
    ready.unlink(missing_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "sqm.cli", "run", "--name", name, "--port", "0", "--redis-url", redis_url,
         "--log-root", str(logs), "--lease-ms", "1000", "--ready-file", str(ready), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **TOKENS_ENV})


def wait_ready(proc: subprocess.Popen[bytes], ready: Path) -> int:
    wait_until(lambda: ready.exists() or proc.poll() is not None, 60, "the member to start")
    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
    return int(json.loads(ready.read_text())["port"])


def stopped(proc: subprocess.Popen[bytes]) -> str:
    """Stop the member with SIGTERM, as an operator does; what it said on stderr."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return proc.stderr.read().decode() if proc.stderr else ""


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill the member if it still runs (after a failed step), and wait for it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


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
        stderr = stopped(proc)
    finally:
        reap(proc)
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


def log_print(logs: Path, *args: str, member: str = "QM2") -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "sqm.cli", "log", "print", "--member", member, "--log-root",
                          str(logs), "--json", *args], capture_output=True, text=True, timeout=60, check=True)
    return [json.loads(line)["record"] for line in out.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_a_completed_backup_is_recorded_in_the_members_log_and_its_restart_says_it(redis_url: str,
                                                                                   tmp_path: Path) -> None:
    """A running member (a real process) notes a backup of its structure in its own log when the backup
    completes: a BACKUP record with the backup's id and log positions, which `sqm log print` shows. Killed by
    SIGKILL, the member's restart (which reads from its last checkpoint) still says the newest backup and where
    CF recovery from it starts, and a later backup is noted once more (one record per backup, not per pass)."""
    logs, backups, ready = tmp_path / "logs", tmp_path / "backups", tmp_path / "QM2.ready"
    define_group(redis_url, queues=("Q1",))
    proc = sqm_run(redis_url, logs, ready)
    try:
        client = Client(("127.0.0.1", wait_ready(proc, ready)), token=TOKEN, reconnect_timeout=1.0)
        client.put("Q1", b"kept", syncpoint=False)
        manifest = run_backup(redis.Redis.from_url(redis_url), "APP1", backups, log_root=logs)
        noted = wait_until(lambda: log_print(logs, "--kind", "BACKUP"), 30, "the member to note the backup")
        assert [(r["b"], r["s"], r["rf"], r["el"]) for r in noted] == [
            (manifest["id"], "APP1", manifest["replay_from"], manifest["end_lrsn"])]
        client.close()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc = sqm_run(redis_url, logs, ready)
        client = Client(("127.0.0.1", wait_ready(proc, ready)), token=TOKEN, reconnect_timeout=1.0)
        second = run_backup(redis.Redis.from_url(redis_url), "APP1", backups, log_root=logs)
        wait_until(lambda: len(log_print(logs, "--kind", "BACKUP")) == 2, 30, "the member to note the 2nd backup")
        client.close()
        stderr = stopped(proc)
    finally:
        reap(proc)
    said = [line for line in stderr.splitlines() if "last backup of APP1 recorded in the log" in line]
    assert len(said) == 1 and manifest["id"] in said[0] and f"from LRSN {manifest['replay_from']}" in said[0], said
    assert [r["b"] for r in log_print(logs, "--kind", "BACKUP")] == [manifest["id"], second["id"]]
    table = subprocess.run([sys.executable, "-m", "sqm.cli", "log", "print", "--member", "QM2", "--log-root",
                            str(logs)], capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"backup {second['id']} of APP1" in table


def restart_with_cpl_entries(redis_url: str, logs: Path, n: int) -> str:
    """Restart QM1 as a real process with --cpl-entries n and stop it at once without a checkpoint (SIGKILL, once
    it has served: its start checkpoint is on disk); its stderr."""
    ready = logs.parent / "QM1.ready"
    proc = sqm_run(redis_url, logs, ready, "--cpl-entries", str(n), name="QM1")
    try:
        wait_ready(proc, ready)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return proc.stderr.read().decode() if proc.stderr else ""
    finally:
        reap(proc)


@pytest.mark.slow
def test_a_changed_cpl_size_is_reconciled_at_restart(redis_url: str, tmp_path: Path) -> None:
    """Seed 000, Table 5: a member restarted with another CPL size n makes the CPL it carries n pairs long at
    restart cleanup (fewer: the oldest pairs dropped; more: the missing pairs take the most recent pair's values),
    says so, and its start checkpoint carries the reconciled CPL, even when it cannot relog at its start (here
    another member holds the structure's relog lock)."""
    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=3)
    c = qm.connect()
    for i in range(4):  # four passes of distinct [B, E] pairs
        c.put("Q1", b"m-%d" % i, syncpoint=False)
        qm.checkpoint("time")
    cpl = qm.relog_passes["APP1"]["cpl"]
    assert len(cpl) == 3 and len({tuple(p) for p in cpl}) == 3
    qm.stop(checkpoint=False)
    holder = start_qm(redis_url, logs, "QM9", cpl_entries=0)  # relogs nothing itself; holds APP1's relog lock
    holder.structure("APP1").relog_begin(holder.caller, now_ms=now_ms(), lease_ms=600_000)

    def carried() -> list[list[int]]:
        last = [r for r in log_print(logs, "--kind", "CHECKPOINT", member="QM1")][-1]
        assert last["why"] == "start"
        return list(last["rl"]["APP1"]["cpl"])

    try:
        reconcile(redis_url, logs, cpl, carried)
    finally:
        holder.stop()


def reconcile(redis_url: str, logs: Path, cpl: list[list[int]], carried: Callable[[], list[list[int]]]) -> None:
    stderr = restart_with_cpl_entries(redis_url, logs, 2)
    assert "QM1 restart: the CPL of APP1 had 3 entry pairs and 2 are defined now" in stderr, stderr[-2000:]
    assert carried() == cpl[-2:]  # the oldest excess pair dropped
    stderr = restart_with_cpl_entries(redis_url, logs, 4)
    assert "the CPL of APP1 had 2 entry pairs and 4 are defined now" in stderr, stderr[-2000:]
    assert carried() == [cpl[-1]] * 2 + cpl[-2:]  # the missing pairs take the most recent pair's values
    stderr = restart_with_cpl_entries(redis_url, logs, 4)
    assert "the CPL of APP1 had" not in stderr  # nothing changed, nothing said


@pytest.mark.slow
def test_a_damaged_active_segment_is_restored_from_its_archived_copy(redis_url: str, tmp_path: Path) -> None:
    """Media recovery (linear logging): a member (a real process) copies each sealed segment to the archive at the
    next checkpoint while the segment is still active. Killed by SIGKILL, one of its sealed active segments is
    damaged on disk (bytes overwritten in the middle); its restart restores the segment from the copy and says so,
    every committed message is still there, and the whole log reads again (`sqm log print`)."""
    logs, ready = tmp_path / "logs", tmp_path / "QM2.ready"
    define_group(redis_url, queues=("Q1",))
    proc = sqm_run(redis_url, logs, ready, "--log-segment-mb", "0.004", "--logload", "20")
    try:
        client = Client(("127.0.0.1", wait_ready(proc, ready)), token=TOKEN, reconnect_timeout=1.0)
        for i in range(120):
            client.put("Q1", b"m-%03d" % i + b"." * 300, syncpoint=False)

        def copied_active() -> list[int]:
            manifest = read_manifest(logs / "QM2") or {}
            sealed = {s["segment"] for s in manifest.get("segments", []) if s.get("sealed")}
            return sorted(sealed & {c["segment"] for c in manifest.get("copies", [])})
        copied = wait_until(copied_active, 30, "a sealed active segment with an archived copy")
        client.close()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        damaged = logs / "QM2" / segment_name(copied[-1])
        good = damaged.read_bytes()
        with open(damaged, "r+b") as f:  # a bad stretch in the middle of the segment's frames
            f.seek(len(good) // 2)
            f.write(b"\xff" * 64)
        assert damaged.read_bytes() != good
        proc = sqm_run(redis_url, logs, ready)
        client = Client(("127.0.0.1", wait_ready(proc, ready)), token=TOKEN, reconnect_timeout=1.0)
        bodies = [m.body[:5] for m in client.browse("Q1", limit=1000)]
        client.close()
        stderr = stopped(proc)
    finally:
        reap(proc)
    assert f"media recovery of log segment {copied[-1]}" in stderr, stderr[-3000:]
    archived = {a["segment"]: Path(a["path"]) for a in (read_manifest(logs / "QM2") or {}).get("archived", [])}
    assert (damaged if damaged.exists() else archived[copied[-1]]).read_bytes() == good  # archived since, maybe
    assert bodies == [b"m-%03d" % i for i in range(120)]
    assert len(log_print(logs, "--kind", "PUT")) >= 1  # the whole log reads: no damaged frame left
