"""Fixtures the queue manager's tests share: ``qms``, two members (QM1 and QM2) of a group whose structure APP1
holds the service SVC (its units of work with a persistent status, kept 2 status lifetimes), for the conversation
tests. A module that needs other definitions has a ``qms`` of its own (tests.support.group.two_members)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.core.manager import QueueManager
from tests.support.group import two_members

S, SVC = "APP1", "SVC"


@pytest.fixture
def qms(redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, QueueManager]]:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S, ())
    admin.define_queue(SVC, S, uow={"status_lifetime": 2})
    with two_members(redis_url, tmp_path / "logs") as pair:
        yield pair
