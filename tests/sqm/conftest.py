"""Fixtures the queue manager's tests share: ``qm``, one member (QM1, in this process, no background tasks) of a
group whose structure APP1 holds the queues Q1 and Q2; ``qms``, two members (QM1 and QM2) of a group whose
structure APP1 holds the service SVC (its units of work with a persistent status, kept 2 status lifetimes), for
the conversation tests. A module that needs other definitions has a ``qm`` or ``qms`` of its own
(tests.support.group.two_members)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.core.manager import QueueManager
from tests.support.group import define_group, start_qm, two_members

S, SVC = "APP1", "SVC"


@pytest.fixture
def qm(redis_url: str, tmp_path: Path) -> Iterator[QueueManager]:
    define_group(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    yield qm
    qm.stop()


@pytest.fixture
def qms(redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, QueueManager]]:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S, ())
    admin.define_queue(SVC, S, uow={"status_lifetime": 2})
    with two_members(redis_url, tmp_path / "logs") as pair:
        yield pair
