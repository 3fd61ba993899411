"""The admin structure's membership rules, against a real redis-server."""

from __future__ import annotations

import time

from cfemu import keys
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect


def test_a_member_that_restarted_after_it_was_seen_lapsed_is_not_fenced(redis_url: str) -> None:
    """Peer recovery lists lapsed members, then fences one; if the member restarted in between (a new epoch and
    lease), the fence must not hit the new incarnation (the crash tests once saw a restarted member fenced)."""
    admin = Admin(connect(redis_url))
    admin.define_structure("APP1")
    admin.join("QM2", {}, lease_ms=100)
    time.sleep(0.2)
    assert admin.lapsed_members() == ["QM2"]  # what a peer sees ...
    epoch = admin.join("QM2", {}, lease_ms=10_000)  # ... just before QM2 restarts
    assert admin.fence("QM2") == 0
    assert admin.epoch("QM2") == epoch
    assert admin.redis.hget(keys.fence("APP1"), "QM2") == str(epoch).encode()


def test_fencing_a_lapsed_member_raises_its_epoch_everywhere(redis_url: str) -> None:
    admin = Admin(connect(redis_url))
    admin.define_structure("APP1")
    old = admin.join("QM2", {}, lease_ms=100)
    time.sleep(0.2)
    new = admin.fence("QM2")
    assert new > old and admin.epoch("QM2") == new
    assert int(admin.redis.hget(keys.fence("APP1"), "QM2") or 0) == new
    assert CF(admin.redis).structure("APP1").exists()


def test_a_structure_fence_never_moves_down(redis_url: str) -> None:
    admin = Admin(connect(redis_url))
    admin.define_structure("APP1")
    admin.join_structures("QM2", 5)
    admin.join_structures("QM2", 3)  # a late write of an older epoch
    assert admin.redis.hget(keys.fence("APP1"), "QM2") == b"5"
