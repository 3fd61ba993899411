"""The running persistent store report (seed 004's PSTORE-REPORT=YES; docs/pstore.md, "The running store report"),
from a real `sqm run` process: every persistent record created or deleted in normal operation, one JSON line each,
nothing for non-persistent messages or units of work backed out; the file named as the seed names it (the flag,
else the environment variable, else PSTORE.REPORT in the current directory)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sqm.core.storereport import REPORT_ENV
from sqm.service.client import Client
from tests.support.group import define_group
from tests.support.service_proc import TOKEN, TOKENS_ENV
from tests.support.waits import wait_until

ROOT = Path(__file__).resolve().parents[2]


def run_member(redis_url: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None,
               work: Any = None) -> None:
    """Start QM2 in tmp_path/cwd with args, run work(client) against it, stop it with SIGTERM."""
    cwd, ready = tmp_path / "cwd", tmp_path / "QM2.ready"
    cwd.mkdir(exist_ok=True)
    ready.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if k != REPORT_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sqm.cli", "run", "--name", "QM2", "--port", "0", "--redis-url", redis_url,
         "--log-root", str(tmp_path / "logs"), "--lease-ms", "1000", "--ready-file", str(ready), *args],
        cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**base, **TOKENS_ENV, "PYTHONPATH": str(ROOT), **(env or {})})
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 60, "QM2 to start")
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        if work is not None:
            c = Client(("127.0.0.1", json.loads(ready.read_text())["port"]), token=TOKEN, reconnect_timeout=1.0)
            work(c)
            c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_persistent_record_created_or_deleted_is_reported(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url, queues=("Q1", "Q2"))
    report = tmp_path / "store.report"
    seen: dict[str, list[bytes]] = {}

    def work(c: Client) -> None:
        seen["put"] = [c.put("Q1", b"p-%d" % i + b"." * i).msgid for i in range(3)]
        c.commit()
        c.put("Q2", b"not persistent", persistent=False, syncpoint=False)  # not in the store: not reported
        c.put("Q1", b"backed out")
        c.backout()  # created nothing
        seen["got"] = [c.get("Q1").msgid for _ in range(2)]
        c.commit()
        c.get("Q1")
        c.backout()  # deleted nothing

    run_member(redis_url, tmp_path, "--pstore-report", "YES", env={REPORT_ENV: str(report)}, work=work)
    head, *records = lines(report)
    assert head["report"] == "pstore" and head["member"] == "QM2"
    created = [r for r in records if r["action"] == "created"]
    deleted = [r for r in records if r["action"] == "deleted"]
    assert len(records) == 5 and len(created) == 3 and len(deleted) == 2, records
    assert [(r["queue"], r["type"], r["elements"], r["length"]) for r in created] == [
        ("Q1", "message", 1, 3), ("Q1", "message", 1, 4), ("Q1", "message", 1, 5)]
    assert [r["id"] for r in deleted] == [r["id"] for r in created[:2]]  # the first two, taken in order
    assert all(r["date"] and r["time"] and r["length"] == 0 for r in deleted)
    assert os.stat(report).st_mode & 0o077 == 0


@pytest.mark.slow
def test_the_report_is_named_as_the_seed_names_it(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url, queues=("Q1",))
    cwd = tmp_path / "cwd"
    run_member(redis_url, tmp_path)  # PSTORE-REPORT=NO (the default): no report
    assert not (cwd / "PSTORE.REPORT").exists()
    run_member(redis_url, tmp_path, "--pstore-report", "YES")  # neither flag nor variable: PSTORE.REPORT in cwd
    assert lines(cwd / "PSTORE.REPORT")[0]["report"] == "pstore"
    flagged = tmp_path / "flagged.report"
    run_member(redis_url, tmp_path, "--pstore-report", "YES", "--pstore-report-file", str(flagged),
               env={REPORT_ENV: str(tmp_path / "env.report")})  # the flag wins over the variable
    assert flagged.exists() and not (tmp_path / "env.report").exists()
    run_member(redis_url, tmp_path, "--pstore-report", "YES", env={REPORT_ENV: str(tmp_path / "env.report")},
               work=lambda c: c.put("Q1", b"x", syncpoint=False))
    assert [r["action"] for r in lines(tmp_path / "env.report")[1:]] == ["created"]
