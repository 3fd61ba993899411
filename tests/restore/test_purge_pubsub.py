"""Publish and subscribe across a purge of the topic's structure, then a CF loss and a restore from the purge's
restore point and the members' logs (the chaos suite's purge-then-cf-kill; its seed 8 `pub-lost` findings), on
real processes: two `sqm run` members, clients on real sockets, a real redis-server killed and restarted.

A topic's subscriptions are messages on its structure (`<T>.SUB`, docs/pubsub.md), so a purge (RECOVER CFSTRUCT
TYPE(PURGE): every message discarded) discards the durable subscriptions with the publications: a subscriber
finds no subscription until it subscribes again, and a publication committed in between has no subscriber to
reach. The restore after the purge loses nothing of what followed it: every publication committed after a
subscriber's new subscribe reaches it, exactly once, in commit order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import UnknownObjectError
from restore.run import run_purge, run_restore
from tests.sqm.test_pubsub_failures import Group, T, group, publish, receive_all, wait_for

__all__ = ["group"]  # the fixture, used by name

S = "APP1"


def test_a_purge_ends_durable_subscriptions_and_the_restore_after_it_keeps_later_publications(
        group: Group, fresh_redis: Any, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    c1, c2 = group.client("QM1"), group.client("QM2")
    c1.subscribe(T, "s1")
    c2.subscribe(T, "s2")
    before = publish(c1, T, "before")
    assert receive_all(c1, T, "s1") == [before]
    run_purge(connect(fresh_redis.url), S, backup_root=backups, log_root=logs, mark_failed=True)
    # The purge discarded the subscriptions (messages of NEWS.SUB on APP1) with the publications.
    assert c1.subscriptions(T) == []
    with pytest.raises(UnknownObjectError, match="no subscription s1"):
        c1.receive_pub(T, "s1")
    publish(c2, T, "gap")  # committed while neither subscription exists: nobody is to receive it
    c1.subscribe(T, "s1")
    p1 = publish(c2, T, "after-s1")
    c2.subscribe(T, "s2")
    p2 = publish(c1, T, "after-both")
    s1 = [c1.receive_pub(T, "s1")["messages"]]
    c1.pub_commit()
    # The CF goes before any backup after the purge: the restore starts at the purge's restore point and reads the
    # publications, subscriptions and positions from the members' logs (their UOWs of the purge's generation).
    fresh_redis.kill()
    fresh_redis.start()
    run_restore(connect(fresh_redis.url), S, backup_root=backups, log_root=logs)
    wait_for("members back on the restored CF",
             lambda: {"QM1", "QM2"} <= set(Admin(connect(fresh_redis.url)).members()))
    c1, c2 = group.client("QM1"), group.client("QM2")
    wait_for("QM1 serves the restored structure", lambda: c1.subscriptions(T))
    assert {x["name"] for x in c1.subscriptions(T)} == {"s1", "s2"}
    s1 += receive_all(c1, T, "s1")
    assert s1 == [p1, p2]
    assert receive_all(c2, T, "s2") == [p2]
