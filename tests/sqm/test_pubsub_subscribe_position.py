"""A subscription receives every publication committed after its subscribe (docs/pubsub.md, "Commit order and
positions"), whatever the members' physical clocks: real redis-server, real logs, two members, one of whose clocks
runs ahead (the LRSN clock is a hybrid logical clock: sqm.core.clock)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.core.manager import QueueManager
from sqm.pubsub import pubsub as ps
from tests.support.group import start_qm

S, T = "APP1", "NEWS"
AHEAD_US = 5_000_000  # QM1's physical clock runs 5 s ahead of QM2's


@pytest.fixture
def skewed(redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, QueueManager]]:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    admin.define_queue(T, S, topic={})
    admin.define_queue("Q1", S)
    ahead = start_qm(redis_url, tmp_path / "logs", "QM1", background=False, clock_skew_us=AHEAD_US)
    behind = start_qm(redis_url, tmp_path / "logs", "QM2", background=False)
    try:
        yield ahead, behind
    finally:
        behind.stop()
        ahead.stop()


def test_a_publication_committed_after_a_subscribe_reaches_it_whatever_the_clocks(
        skewed: tuple[QueueManager, QueueManager]) -> None:
    """QM2 commits a publication; between its puts (the CF holds them uncommitted) and its COMMIT record (QM2 has
    asked the CF its last question), QM1, whose clock runs ahead and which is at work on the structure, subscribes.
    The subscribe returns before the publication's COMMIT is even logged, so the subscription must receive it.
    (The subscribe's position is the structure's clock, which QM1's calls moved past the LRSN QM2 observed last;
    QM2's COMMIT record counts at that LRSN + 1, below the position: the subscription never receives it, and the
    sweeper removes it as received. The position should not pass the first open put on <T>.PUB, which
    topic_next.lua already reads for its hold-back.)"""
    ahead, behind = skewed
    subscribed: list[str] = []

    def a_subscribe_lands(point: str) -> None:  # QM2 has asked the CF its last question before its COMMIT record
        if point == "before-log-force" and not subscribed:
            subscribed.append("late")  # first: the subscribes' own commits pass here too
            ahead.connect().put("Q1", b"QM1 at work", syncpoint=False)  # QM1's calls move the structure's clock
            ps.subscribe(ahead, T, "late")

    publisher = ps.PubSubSession(behind)
    publisher.publish(T, b"after the subscribe")
    with mock.patch("sqm.core.outcomes.failpoint", a_subscribe_lands):
        publisher.commit()
    assert subscribed, "the subscribe ran between the publication's puts and its COMMIT record"
    receiver = ps.PubSubSession(ahead)
    got: Any = None
    try:
        got = receiver.receive(T, "late", wait_ms=500).messages
    finally:
        receiver.backout()
    assert got == [b"after the subscribe"]
