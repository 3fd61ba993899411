"""Test helpers: a queue-sharing group of in-process queue managers over one real redis-server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.wings import WINGS


def define_group(url: str, *, structure: str = "APP1", queues: tuple[str, ...] = ("Q1", "Q2"),
                 max_entries: int = 0, max_bytes: int = 0) -> redis.Redis:
    client = connect(url)
    Admin(client).ensure_structure(structure, queues, max_entries=max_entries, max_bytes=max_bytes)
    return client


def start_qm(url: str, log_root: Path, name: str, **cfg: object) -> QueueManager:
    qm = QueueManager(QueueManagerConfig(name=name, log_root=log_root, redis_url=url, **cfg),  # type: ignore[arg-type]
                      wings=WINGS)
    qm.start()
    return qm


@contextmanager
def two_members(url: str, log_root: Path) -> Iterator[tuple[QueueManager, QueueManager]]:
    """QM1 and QM2 started on the CF at url with their logs under log_root (no housekeeping thread: the test
    drives it), and stopped again."""
    a = start_qm(url, log_root, "QM1", background=False)
    try:
        b = start_qm(url, log_root, "QM2", background=False)
        try:
            yield a, b
        finally:
            b.stop()
    finally:
        a.stop()


def warm(qm: QueueManager) -> None:
    """One put outside syncpoint, got: the queue is empty again, the member's first CF calls made."""
    conn = qm.connect()
    conn.put("Q1", b"warm", syncpoint=False)
    assert conn.get("Q1", syncpoint=False).body == b"warm"


def rejoin(qm: QueueManager) -> None:
    """What QueueManager._heartbeat_loop does when the CF was lost and rebuilt (background=False here)."""
    for attempt in range(2):
        try:
            rc = qm.admin.heartbeat(qm.name, qm.caller.epoch, qm.config.lease_ms)
            break
        except redis.exceptions.ConnectionError:
            if attempt:
                raise
    if rc < 0:
        qm.caller.epoch = qm.admin.join(qm.name, {"pid": os.getpid(), "log": str(qm.log_dir),
                                                  "min_epoch": qm.caller.epoch + 1}, qm.config.lease_ms)
        qm._queue_cache.clear()
