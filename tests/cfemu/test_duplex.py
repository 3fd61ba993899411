"""A duplexed CF at the CF's floor (cfemu.duplex, cfemu.duplex_control), on two real redis-servers: what a member
acknowledges is on both; a lost secondary holds an operation until the pair is degraded; a demoted primary or one of
an older generation is never used."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cfemu import duplex, duplex_control
from cfemu.admin import Admin
from cfemu.cf import CF, Caller
from cfemu.connection import ConnectionConfigError, connect
from cfemu.entry import Entry
from sqm.core.clock import LrsnClock
from tests.support.pair import Pair


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    try:
        p.start()
        admin = Admin(connect(p.url("operator")))
        admin.define_structure("APP1")
        admin.define_queue("Q1", "APP1")
        yield p
    finally:
        p.stop()


def _member(p: Pair, *, settle_s: float = duplex.SETTLE_S) -> tuple[CF, Caller]:
    client = connect(p.url("member"), max_connections=4, socket_timeout=5)
    state = duplex.pair_of(client)
    assert state is not None
    state.settle_s = settle_s
    cf = CF(client)
    epoch = Admin(client).join("QM1", {}, 60_000)
    return cf, Caller("QM1", epoch, LrsnClock())


def _put(cf: CF, caller: Caller, n: int) -> None:
    entry = Entry(id=f"{n:024x}", queue="Q1", priority=0, persistent=True, msgid="00", correlid="", expiry=0,
                  put_time=0)
    cf.structure("APP1").put(caller, entry, b"m%d" % n)


def test_url_names_both_servers_and_bad_ones_are_refused() -> None:
    plain, addresses = duplex.split_url("redis://u:p@127.0.0.1:7001/0?duplex=127.0.0.1:7002") or ("", [])
    assert plain == "redis://u:p@127.0.0.1:7001/0" and addresses == [("127.0.0.1", 7001), ("127.0.0.1", 7002)]
    assert duplex.split_url("redis://127.0.0.1:7001/0") is None
    with pytest.raises(ConnectionConfigError, match="bad duplex address"):
        connect("redis://127.0.0.1:7001/0?duplex=nohost")
    with pytest.raises(ConnectionConfigError, match="redis:// only"):
        connect("rediss://127.0.0.1:7001/0?duplex=127.0.0.1:7002")


def test_every_acknowledged_operation_is_on_the_secondary(pair: Pair) -> None:
    cf, caller = _member(pair)
    for n in range(50):
        _put(cf, caller, n)
        # acknowledged: the secondary has it now, not eventually
        assert pair.harness(1).hexists("{APP1}:ent", f"{n:024x}")
    assert pair.harness(1).hget("{ADMIN}:epochs", "QM1") == str(caller.epoch).encode()


def test_lost_secondary_holds_an_operation_until_the_pair_is_degraded(pair: Pair) -> None:
    cf, caller = _member(pair)
    _put(cf, caller, 1)
    pair.servers[1].kill()
    degraded_at: list[float] = []

    def degrade() -> None:
        degraded_at.append(time.monotonic())
        duplex_control.set_mode(pair.control(0), "SIMPLEX")

    timer = threading.Timer(0.5, degrade)
    timer.start()
    _put(cf, caller, 2)  # held until the controller degraded the pair, then acknowledged
    done = time.monotonic()
    timer.join()
    assert degraded_at and done >= degraded_at[0]
    t0 = time.monotonic()
    _put(cf, caller, 3)  # simplex now: no wait for the lost secondary
    assert time.monotonic() - t0 < 0.2
    assert pair.harness(0).hlen("{APP1}:ent") == 3


def test_lost_secondary_without_degrade_is_not_acknowledged(pair: Pair) -> None:
    cf, caller = _member(pair, settle_s=0.6)
    pair.servers[1].kill()
    with pytest.raises(duplex.DuplexUnconfirmedError, match="not acknowledged"):
        _put(cf, caller, 1)


def test_pair_made_duplex_again_is_waited_for(pair: Pair) -> None:
    """A member that saw the pair simplex notices, on the same connection as its next write, that it is duplex
    again, and waits for the secondary then."""
    cf, caller = _member(pair)
    pair.servers[1].kill()
    duplex_control.set_mode(pair.control(0), "SIMPLEX")
    _put(cf, caller, 1)
    state = duplex.pair_of(cf.redis)
    assert state is not None and state.duplex is False
    pair.servers[1].start()  # resync: the secondary comes back empty and replicates again
    pair.attach(1)
    assert pair.wait_in_sync(10)
    assert duplex_control.set_mode(pair.control(0), duplex.DUPLEX)
    _put(cf, caller, 2)
    assert state.duplex is True and pair.harness(1).hexists("{APP1}:ent", f"{2:024x}")


def test_a_secondary_made_again_is_in_sync_without_waiting_for_more_replicas(pair: Pair) -> None:
    """The CF's one replica is synchronised at once: Redis waits 5 s by default (repl-diskless-sync-delay) for
    more replicas to share a diskless transfer, and a pair made duplex again stayed simplex that long."""
    pair.servers[1].kill()
    pair.servers[1].start()
    t0 = time.monotonic()
    pair.attach(1)
    assert pair.wait_in_sync(30)
    assert time.monotonic() - t0 < 4.5  # well below the 5 s a sync cannot start before under the default
    assert pair.harness(0).config_get("repl-diskless-sync-delay") == {"repl-diskless-sync-delay": "0"}


def test_member_on_the_demoted_primary_cannot_act_and_finds_the_new_one(pair: Pair) -> None:
    cf, caller = _member(pair)
    _put(cf, caller, 1)
    pair.promote()  # the secondary is the primary, generation 2
    pair.attach(1 - pair.primary)  # the old primary demoted: a replica of the new one
    assert pair.wait_in_sync(10)
    with pytest.raises(duplex.NotPrimaryError, match="no longer the duplexed pair's primary"):
        _put(cf, caller, 2)  # the pooled connection still reaches the old primary: refused, nothing applied
    assert not pair.harness(pair.primary).hexists("{APP1}:ent", f"{2:024x}")
    _put(cf, caller, 3)  # a new connection finds the new primary
    assert pair.harness(pair.primary).hexists("{APP1}:ent", f"{3:024x}")
    assert duplex.pair_of(cf.redis).gen == 2  # type: ignore[union-attr]


def test_a_plain_write_on_the_demoted_primary_is_not_primary_too(pair: Pair) -> None:
    """Not a script: redis-py gives a plain command's READONLY as ReadOnlyError without the word in its text (a
    restore's load, a bulk write, went on as a bare ReadOnlyError)."""
    cf, caller = _member(pair)
    _put(cf, caller, 1)
    pair.promote()
    pair.attach(1 - pair.primary)
    assert pair.wait_in_sync(10)
    with pytest.raises(duplex.NotPrimaryError, match="no longer the duplexed pair's primary"):
        cf.redis.hset("{APP1}:plain", "k", "v")
    assert not pair.harness(pair.primary).hexists("{APP1}:plain", "k")


def test_primary_of_an_older_generation_is_never_used(pair: Pair) -> None:
    cf, caller = _member(pair)
    _put(cf, caller, 1)
    pair.servers[0].kill()  # the primary is lost; the secondary is promoted
    pair.promote()
    _put(cf, caller, 2)
    # the old primary comes back as a primary (an operator started it by hand, from its files or empty): members
    # know generation 2 and never take it, although it answers as a master
    pair.servers[0].start()
    duplex_control.set_mode(pair.control(0), "SIMPLEX", gen=1)
    cf.redis.connection_pool.disconnect()
    _put(cf, caller, 3)
    assert pair.harness(1).hexists("{APP1}:ent", f"{3:024x}")
    assert not pair.harness(0).hexists("{APP1}:ent", f"{3:024x}")


def test_server_without_a_generation_is_not_a_primary(tmp_path: Path) -> None:
    p = Pair(tmp_path)
    try:
        for srv in p.servers:
            srv.start()  # two masters, neither given a generation by a controller
        client = connect(p.url("member"), socket_timeout=2)
        with pytest.raises(redis.exceptions.ConnectionError, match="no primary of the duplexed CF"):
            client.ping()
    finally:
        p.stop()


def test_a_wait_reply_is_never_read_as_the_mode_when_another_thread_changed_the_pool_state(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's view of the mode is shared by its threads: a call that sent a WAIT must read a WAIT's reply,
    even when another thread saw the pair simplex meanwhile (a 0 read as 'not DUPLEX' acknowledged the call)."""
    cf, caller = _member(pair, settle_s=0.5)
    _put(cf, caller, 1)
    pair.servers[1].kill()  # the copy is lost; the pair is still DUPLEX (not degraded)
    real = duplex.confirm_after

    def racing(state: duplex.PairState) -> tuple[bool, list[object]]:
        chosen = real(state)
        state.duplex = False  # another thread read SIMPLEX between this call's send and its reply
        return chosen

    monkeypatch.setattr(duplex, "confirm_after", racing)
    with pytest.raises(duplex.DuplexUnconfirmedError):
        _put(cf, caller, 2)


def test_a_restores_switch_to_active_counts_only_once_the_secondary_has_it(pair: Pair) -> None:
    """A restore's (or a purge's) last write, the structure ACTIVE again, is confirmed as a member's operation is:
    with the secondary lost and the pair not degraded, the restore is not reported done (a promotion could bring
    back the structure as it was before the restore); with the pair degraded, it is."""
    from cfemu import bulk

    client = connect(pair.url("operator"), socket_timeout=5)
    state = duplex.pair_of(client)
    assert state is not None
    state.settle_s = 0.6
    sdef = Admin(client).structure_def("APP1")
    with bulk.claim(client, "APP1", bulk.observe(client, "APP1")) as owner:
        pair.servers[1].kill()
        with pytest.raises(duplex.DuplexUnconfirmedError, match="APP1 is ACTIVE on the duplexed CF's primary, but"):
            bulk.activate(owner, sdef, gen=5, clock=6, floor=5, entries=0, nbytes=0)
    duplex_control.set_mode(pair.control(0), "SIMPLEX")  # the controller degrades the pair
    with bulk.claim(client, "APP1", bulk.observe(client, "APP1")) as owner:
        bulk.activate(owner, sdef, gen=7, clock=8, floor=7, entries=0, nbytes=0)
    assert pair.harness(0).hget("{APP1}:meta", "state") == b"ACTIVE"
