"""A Celery worker (a real ``celery worker`` process, acks late, prefetch 1) runs tasks through the group with
qsg.kombu_transport while a member is killed (SIGKILL) and the CF is lost (SIGKILL of its redis-server: the
supervisor restarts it and a member restores the structure by itself, RECAUTO).

What is checked: every task completes, and its effect happens once. The transport delivers at least once: a task
whose acknowledgement (the commit of its delivery's unit of work) was lost with the member or the CF runs again,
so the task is idempotent by its task id (tests/qsg/celery_app.py): ``done`` holds one row per task, ``runs``
every run, and the runs past one are printed. Then a worker meeting an MQ application's message whose ``kombu``
property is not the transport's envelope: it deletes that one and runs the tasks behind it.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("celery")

import qsg.kombu_transport as kt  # noqa: E402
from backup.run import run_backup  # noqa: E402
from cfemu.connection import connect  # noqa: E402
from qsg.local_group import LocalGroup  # noqa: E402
from sqm.service.client import Client  # noqa: E402
from tests.qsg import celery_app  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
N = 60


def _count(db_path: Path, table: str) -> int:
    with celery_app.open_db(str(db_path)) as db:
        return int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def _wait(what: str, cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(0.2)


def test_a_celery_worker_completes_every_task_once_through_a_member_kill_and_a_cf_loss(tmp_path: Path) -> None:
    g = LocalGroup.up(tmp_path / "g", managers=2, backup_interval=None, lease_ms=2000, restart_cf=True)
    worker: subprocess.Popen[bytes] | None = None
    worker_log = tmp_path / "worker.log"
    try:
        client = connect(g.cf_url("backup"))
        try:
            run_backup(client, "APP1", g.backup_dir, log_root=g.log_root, backup_keys=g.backup_keys())
        finally:
            client.close()
        members = [(h, p) for _, h, p in g.endpoints]
        url = kt.members_url(members, g.token or "")
        options = {"operator_token": g.operator_token, "polling_interval": 0.1}
        db_path = tmp_path / "tasks.db"
        celery_app.open_db(str(db_path)).close()

        celery_app.app.conf.broker_url = url
        celery_app.app.conf.broker_transport_options = options
        for n in range(N):
            celery_app.record.apply_async((n, str(db_path)), kwargs={"seconds": 0.3}, retry=True)

        env = {**os.environ, "PYTHONPATH": str(ROOT), "CFEMU_CELERY_BROKER": url,
               "CFEMU_CELERY_OPTIONS": json.dumps(options)}
        with worker_log.open("wb") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.qsg.celery_app", "worker", "--pool", "prefork",
                 "--concurrency", "2", "--prefetch-multiplier", "1", "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "-Q", celery_app.QUEUE, "--loglevel", "INFO"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        _wait("a quarter of the tasks done", lambda: _count(db_path, "done") >= N // 4, 120)
        g.kill_manager("QM1")  # SIGKILL of the member the worker's URL names first
        done_at_member_kill = _count(db_path, "done")
        _wait("half of the tasks done", lambda: _count(db_path, "done") >= N // 2, 120)
        cf_restarts = g.cf_restarts
        os.kill(int(g.state["cf"]["pid"]), signal.SIGKILL)  # the CF lost; the supervisor restarts it, RECAUTO
        done_at_cf_loss = _count(db_path, "done")
        assert done_at_member_kill < done_at_cf_loss < N  # both mid-run
        _wait("the CF restarted", lambda: g.cf_restarts > cf_restarts, 60)
        _wait("every task done", lambda: _count(db_path, "done") >= N, 240)
        time.sleep(2)  # the last acknowledgements

        with sqlite3.connect(db_path) as db:
            done = db.execute("SELECT task_id, n FROM done").fetchall()
            runs = db.execute("SELECT n, COUNT(*) FROM runs GROUP BY n HAVING COUNT(*) > 1").fetchall()
        assert sorted(n for _, n in done) == list(range(N))  # every task's effect, once
        assert len({t for t, _ in done}) == N
        print(f"\ncelery: {N} tasks done once each; {len(runs)} ran more than once (at-least-once delivery, "
              f"the task idempotent): {runs}")
        with Client([members[1]], token=g.token) as c:
            assert list(c.browse(celery_app.QUEUE)) == []  # nothing left over, nothing in flight
        log = worker_log.read_text(errors="replace")
        assert "connection to QM1" in log  # the worker met the member's death
        print(f"outages the worker's polls met (the CF's loss): {log.count('polling on until the group answers')}")
    finally:
        if worker is not None:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)  # warm shutdown
                try:
                    worker.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(worker.pid, signal.SIGKILL)  # the pool's children, in the worker's own session
            except ProcessLookupError:
                pass
            worker.wait(timeout=10)
            print(worker_log.read_text(errors="replace")[-6000:])
        g.down()


def test_a_celery_worker_survives_a_message_with_a_bad_envelope(tmp_path: Path) -> None:
    """An MQ application's message on the worker's queue whose ``kombu`` user property is not the transport's
    envelope (a REST POST with the header ``ibm-mq-usr-kombu: notjson``): the worker deletes it as an unknown
    message and runs the tasks behind it (the poll raised JSONDecodeError, and the worker exited at every start)."""
    g = LocalGroup.up(tmp_path / "g", managers=1, backup_interval=None)
    worker: subprocess.Popen[bytes] | None = None
    worker_log = tmp_path / "worker.log"
    try:
        members = [(h, p) for _, h, p in g.endpoints]
        url = kt.members_url(members, g.token or "")
        options = {"operator_token": g.operator_token, "polling_interval": 0.1}
        db_path = tmp_path / "tasks.db"
        celery_app.open_db(str(db_path)).close()
        # A connection of its own: the app's producer pool may hold one to another test's group, since gone.
        with celery_app.app.connection_for_write(url, transport_options=options) as conn:
            conn.SimpleQueue(celery_app.QUEUE).close()  # declares the task queue (the operator token)
            with Client(members, token=g.token) as c:
                c.put(celery_app.QUEUE, b"from an MQ app", syncpoint=False, properties={"kombu": "notjson"})
            for n in range(5):
                celery_app.record.apply_async((n, str(db_path)), kwargs={"seconds": 0.05}, retry=True,
                                              connection=conn)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CFEMU_CELERY_BROKER": url,
               "CFEMU_CELERY_OPTIONS": json.dumps(options)}
        with worker_log.open("wb") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.qsg.celery_app", "worker", "--pool", "solo",
                 "--without-gossip", "--without-mingle", "--without-heartbeat", "-Q", celery_app.QUEUE,
                 "--loglevel", "INFO"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        _wait("the five tasks done", lambda: _count(db_path, "done") >= 5 or worker.poll() is not None, 120)
        assert worker.poll() is None, worker_log.read_text(errors="replace")[-3000:]
        assert _count(db_path, "done") == 5
        log = worker_log.read_text(errors="replace")
        assert "has a bad 'kombu' property" in log and "unknown message" in log
        with Client(members, token=g.token) as c:
            _wait("the queue empty", lambda: not list(c.browse(celery_app.QUEUE)), 10)
    finally:
        if worker is not None:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
                try:
                    worker.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            worker.wait(timeout=10)
        g.down()
