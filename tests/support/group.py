"""Test helpers: a queue-sharing group of in-process queue managers over one real redis-server."""

from __future__ import annotations

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
