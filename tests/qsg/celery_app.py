"""The Celery application of tests/qsg/test_kombu_celery.py: its broker is the group, through qsg.kombu_transport.

The worker runs it as ``celery -A tests.qsg.celery_app worker``; $CFEMU_CELERY_BROKER is the broker URL and
$CFEMU_CELERY_OPTIONS the transport options (JSON). ``record`` is idempotent by its task id: every run is
recorded in ``runs`` and the task's effect, once, in ``done`` (a task run again after its acknowledgement was
lost, which acks_late allows, adds a run and no effect).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time

from celery import Celery

import qsg.kombu_transport  # noqa: F401  (registers the cfemu:// scheme with kombu)

QUEUE = "cfemu_tasks"

app = Celery("cfemu_celery_test", broker=os.environ.get("CFEMU_CELERY_BROKER", "cfemu://127.0.0.1:1/APP1"))
app.conf.update(
    broker_transport_options=json.loads(os.environ.get("CFEMU_CELERY_OPTIONS", "{}")),
    broker_connection_retry_on_startup=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
)


def open_db(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=60)
    db.execute("CREATE TABLE IF NOT EXISTS runs (task_id TEXT, n INTEGER, pid INTEGER, at REAL)")
    db.execute("CREATE TABLE IF NOT EXISTS done (task_id TEXT PRIMARY KEY, n INTEGER)")
    return db


@app.task(bind=True, name="cfemu.record")
def record(self: object, n: int, db_path: str, seconds: float = 0.2) -> int:
    time.sleep(seconds)
    task_id = self.request.id  # type: ignore[attr-defined]
    with open_db(db_path) as db:
        db.execute("INSERT INTO runs VALUES (?, ?, ?, ?)", (task_id, n, os.getpid(), time.time()))
        db.execute("INSERT OR IGNORE INTO done VALUES (?, ?)", (task_id, n))
    return n
