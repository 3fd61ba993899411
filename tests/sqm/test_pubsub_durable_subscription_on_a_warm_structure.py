"""A durable subscription of a structure that runs from a WARM start is unavailable, not unknown (docs/pubsub.md,
docs/pstore.md): its entry is in the structure's backups and logs, and comes back with the HOT start, its position
with it. Real redis-server lost with FLUSHALL, a real member, a real backup and the start modes themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from cfemu.errors import PstoreUnavailableError, UnknownObjectError
from restore.start_modes import start
from sqm.pubsub import pubsub as ps
from tests.support.group import rejoin, start_qm
from tests.support.harness import lose_cf

S, T = "APP1", "NEWS"


def test_a_durable_subscription_is_unavailable_while_warm_and_back_with_the_hot_start(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    admin = Admin(connect(fresh_redis.url))
    admin.ensure_structure(S)
    admin.define_queue(T, S, topic={})
    qm = start_qm(fresh_redis.url, logs, "QM1", background=False)
    try:
        ps.subscribe(qm, T, "alice")
        run_backup(connect(fresh_redis.url), S, backups, log_root=logs)
        ps.publish(qm, T, [b"p0"])
        lose_cf(fresh_redis.client())
        start(connect(fresh_redis.url), S, "WARM", backup_root=backups, log_root=logs)
        rejoin(qm)
        session = ps.PubSubSession(qm)
        with pytest.raises(PstoreUnavailableError, match="runs from a WARM start: .* come back with its HOT start"):
            session.receive(T, "alice")
        with pytest.raises(PstoreUnavailableError, match="runs from a WARM start"):
            ps.unsubscribe(qm, T, "alice")
        start(connect(fresh_redis.url), S, "HOT", backup_root=backups, log_root=logs)
        rejoin(qm)
        session = ps.PubSubSession(qm)
        assert session.receive(T, "alice").messages == [b"p0"]
        session.commit()
        with pytest.raises(UnknownObjectError, match="has no subscription bob"):  # an active structure: unknown
            ps.PubSubSession(qm).receive(T, "bob")
    finally:
        qm.stop()
