"""Fixtures the backup tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from sqm.core.manager import QueueManager
from tests.support.group import define_group, start_qm


@pytest.fixture
def qsg(redis_url: str, tmp_path: Path) -> Iterator[tuple[redis.Redis, QueueManager]]:
    """A group of one member on a CF of the test's own, with queue Q1 (a module may define its own qsg)."""
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    yield client, qm
    qm.stop()
