"""A publication leaves the CF whole or not at all (docs/pubsub.md, "Removal"): two members' sweeps that race to
remove it, one of them killed part way, leave it whole for the next sweep, never a part of it that no sweep can see
again (a publication with fewer messages than its count is invisible to the sweeper's look, topic_head, and to
every receive). Real redis-server, real logs; the member dies as kill -9 leaves it (tests/support/crash.py) and its
peer recovers it."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

from cfemu import keys
from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.core.recovery import recover_peer
from sqm.pubsub import pubsub as ps
from sqm.pubsub.pubsub_sweeper import PubSubSweeper
from tests.support.crash import crash
from tests.support.group import start_qm

S, T = "APP1", "NEWS"


def test_a_sweep_racing_one_killed_part_way_leaves_the_publication_whole(redis_url: str, tmp_path: Path) -> None:
    admin = Admin(connect(redis_url))
    admin.ensure_structure(S)
    admin.define_queue(T, S, topic={})
    qm1 = start_qm(redis_url, tmp_path / "logs", "QM1", background=False, lease_ms=1000)
    qm2 = start_qm(redis_url, tmp_path / "logs", "QM2", background=False, lease_ms=1000)
    try:
        pub = ps.publish(qm1, T, [b"1", b"2", b"3", b"4"])  # no subscription: every sweep removes it
        look = ps.next_publication_head
        qm1_removal = qm1.connect()

        def qm1_takes_two_meanwhile(qm: Any, t: ps.Topic, position: tuple[int, str]) -> Any:
            head = look(qm, t, position)  # QM2's sweep has seen it whole; QM1's sweep takes two of its four
            if head.state == "P" and not qm1_removal.uow:
                for _ in range(2):
                    qm1_removal.get(t.pub_queue, syncpoint=True, correlid=bytes.fromhex(pub), counted=False)
            return head

        with mock.patch.object(ps, "next_publication_head", qm1_takes_two_meanwhile):
            PubSubSweeper(qm2).sweep()
        crash(qm1)  # part way through its removal
        qm2.redis.delete(keys.lease("QM1"))  # its lease has lapsed
        recover_peer(qm2, "QM1")
        assert qm2.structure(S).depths()[f"{T}.PUB"]["CP"] == 4, "a part of the publication was removed"
        assert PubSubSweeper(qm2).sweep()["publications-received"] == 1
        assert qm2.structure(S).depths()[f"{T}.PUB"]["CP"] == 0
    finally:
        qm2.stop()
