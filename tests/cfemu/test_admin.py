"""The admin structure's membership rules, against a real redis-server (each admin script on its own:
tests/cfemu/test_scripts.py)."""

from __future__ import annotations

from cfemu import keys
from cfemu.admin import Admin
from cfemu.connection import connect
from tests.support.waits import wait_until


def test_a_member_that_restarted_after_it_was_seen_lapsed_is_not_fenced(redis_url: str) -> None:
    """Peer recovery lists lapsed members, then fences one; if the member restarted in between (a new epoch and
    lease), the fence must not hit the new incarnation (the crash tests once saw a restarted member fenced)."""
    admin = Admin(connect(redis_url))
    admin.define_structure("APP1")
    admin.join("QM2", {}, lease_ms=100)
    assert wait_until(lambda: admin.lapsed_members() == ["QM2"], 10, "QM2 lapsed")  # what a peer sees ...
    epoch = admin.join("QM2", {}, lease_ms=10_000)  # ... just before QM2 restarts
    assert admin.fence("QM2") == 0
    assert admin.epoch("QM2") == epoch
    assert admin.redis.hget(keys.fence("APP1"), "QM2") == str(epoch).encode()


def test_ensure_structure_defines_what_is_missing_and_keeps_what_is_there(redis_url: str) -> None:
    admin = Admin(connect(redis_url))
    admin.ensure_structure("APP1", ("Q1",), max_entries=10)
    admin.ensure_structure("APP1", ("Q1", "Q2"), max_entries=99)  # a second launch: no error, Q2 added
    assert admin.structure_def("APP1").max_entries == 10
    assert [(q.name, q.structure) for q in admin.queues()] == [("Q1", "APP1"), ("Q2", "APP1")]
    admin.ensure_structure("APP2", ("Q1",))  # Q1 is APP1's: left there
    assert admin.queue_def("Q1").structure == "APP1" and admin.structure_def("APP2").name == "APP2"


def test_a_member_that_left_after_it_was_listed_is_not_fenced(redis_url: str) -> None:
    """A peer lists the members, then the member leaves cleanly, then the peer reads its lease: gone. The peer's
    fence must see that it left (no longer listed) and change nothing: it has no work to recover."""
    admin = Admin(connect(redis_url))
    admin.define_structure("APP1")
    epoch = admin.join("QM2", {}, lease_ms=10_000)
    admin.leave("QM2")  # after a peer's HGETALL of the members, before its PTTL of QM2's lease
    assert admin.fence("QM2") == 0
    assert admin.epoch("QM2") == epoch
    assert admin.redis.hget(keys.fence("APP1"), "QM2") == str(epoch).encode()


def test_members_joining_and_leaving_are_never_seen_lapsed_and_fenced(redis_url: str) -> None:
    """The race a short-lived member (the CLI's OPS) ran into: a peer's recovery pass listing the members while the
    member left. Nothing that joins and leaves cleanly is ever fenced, whenever the peer looks."""
    import threading

    member, peer = Admin(connect(redis_url)), Admin(connect(redis_url))
    member.define_structure("APP1")
    done = threading.Event()
    fenced: list[int] = []

    def recovery_passes() -> None:
        while not done.is_set():
            fenced.extend(e for e in (peer.fence(m) for m in peer.lapsed_members()) if e)

    t = threading.Thread(target=recovery_passes)
    t.start()
    try:
        for _ in range(400):
            member.join("OPS", {}, lease_ms=10_000)
            member.leave("OPS")
    finally:
        done.set()
        t.join(timeout=10)
    assert fenced == []
