"""The CF's server module against a structure's keys written by hand (a member's user may write any of them): a key
of the wrong type, a descriptor the module cannot read. The module must never take the CF down, and must do what
the script does: refuse the call with nothing written (WRONGTYPE, as the script's first redis.call on that key),
or leave the call to the script (CFSCRIPT), never drop an entry it could not read."""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest
import redis

from cfemu import keys
from cfemu.admin import Admin
from cfemu.cf import CF, Caller, Structure
from cfemu.embedded import EmbeddedRedis
from cfemu.entry import Entry
from cfemu.errors import MQError
from tests.support.counting_clock import CountingClock as Clock

S, Q = "APP1", "Q1"
Factory = Callable[..., EmbeddedRedis]


def structure(srv: EmbeddedRedis) -> tuple[redis.Redis, Caller, Structure]:
    r = srv.client()
    admin = Admin(r)
    admin.ensure_structure(S, (Q,))
    caller = Caller("QM1", admin.join("QM1", {}, lease_ms=600_000), Clock())
    return r, caller, CF(srv.client()).structure(S)


def snapshot(r: redis.Redis) -> dict[bytes, object]:
    """Every key of the structure with its value (DUMP), the header's clock aside."""
    out: dict[bytes, object] = {}
    for k in r.scan_iter(match="{" + S + "}:*"):
        out[k] = r.hgetall(k) if k.endswith(b":meta") else r.dump(k)
    return out


def refused_whole(srv: EmbeddedRedis, r: redis.Redis, call: Callable[[], object]) -> None:
    before = snapshot(r)
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        call()
    assert r.ping() and srv.is_running()  # the CF is up
    assert snapshot(r) == before  # and the refused call wrote nothing


@pytest.fixture
def srv(redis_factory: Factory) -> EmbeddedRedis:
    s = redis_factory()
    assert s.module_loaded
    return s


def test_a_uow_set_of_the_wrong_type_is_refused_by_commit(srv: EmbeddedRedis) -> None:
    r, caller, s = structure(srv)
    r.set("{APP1}:uow:u1", "not a set")
    refused_whole(srv, r, lambda: s.commit(caller, "u1", gen=0, lrsn=caller.clock.now()))


def test_an_index_of_the_wrong_type_is_refused_by_a_get_by_message_id(srv: EmbeddedRedis) -> None:
    r, caller, s = structure(srv)
    r.set("{APP1}:ix:Q1:m:6d", "not a set")
    refused_whole(srv, r, lambda: s.get(caller, Q, uow="g", now_ms=1_000,
                                        match="m", value="6d"))


def test_an_index_of_the_wrong_type_is_refused_by_a_put_that_may_replace(srv: EmbeddedRedis) -> None:
    r, caller, s = structure(srv)
    r.hset("{APP1}:meta", "max_entries", 100)  # a bounded structure: a put looks for the get it replaces
    r.set("{APP1}:ix:Q1:m:m", "not a set")  # the put's message id index
    refused_whole(srv, r, lambda: s.put(caller, Entry(id="e1", queue=Q, msgid="m"),
                                        b"d", uow="u"))


@pytest.mark.parametrize("key", ["{APP1}:q:Q1:up", "{APP1}:uow:u", "{APP1}:ent", "{APP1}:queues"])
def test_a_key_of_the_wrong_type_is_refused_by_put_before_it_writes(srv: EmbeddedRedis, key: str) -> None:
    r, caller, s = structure(srv)
    if key.endswith(":queues"):
        r.delete(key)
    r.set(key, "not what the CF keeps here")
    refused_whole(srv, r, lambda: s.put(caller, Entry(id="e1", queue=Q), b"d", uow="u"))


def test_a_list_of_the_wrong_type_is_refused_by_commit_before_it_writes(srv: EmbeddedRedis) -> None:
    r, caller, s = structure(srv)
    s.put(caller, Entry(id="e1", queue=Q), b"d", uow="u")
    r.set(keys.queue_list(S, Q, "cp:0"), "not a list")
    refused_whole(srv, r, lambda: s.commit(caller, "u", gen=0, lrsn=caller.clock.now()))


def _committed(r: redis.Redis, caller: Caller, s: Structure, n: int) -> None:
    for i in range(n):
        s.put(caller, Entry(id=f"e{i}", queue=Q), b"d", uow=f"p{i}")
        s.commit(caller, f"p{i}", gen=0, lrsn=caller.clock.now())


def test_a_descriptor_with_many_fields_is_delivered_not_dropped(srv: EmbeddedRedis) -> None:
    """A stored descriptor the script reads (a msgpack map of more fields than the module's parser holds) is
    still delivered: the module leaves the call to the script rather than popping the entry as if it were gone."""
    r, caller, s = structure(srv)
    _committed(r, caller, s, 1)
    ent = keys.script_keys(S)[2]
    d = msgpack.unpackb(r.hget(ent, "e0"), raw=False)
    d.update({f"x{i}": i for i in range(60)})
    r.hset(ent, "e0", msgpack.packb(d, use_bin_type=False))
    got = s.get(caller, Q, uow="g", now_ms=1_000)
    assert got.entry is not None and got.entry.id == "e0" and got.data == b"d"


def test_a_malformed_descriptor_is_not_dropped_from_its_list(srv: EmbeddedRedis) -> None:
    """A descriptor that is not msgpack: the script fails on it with nothing written; the module must not pop the
    entry off its list as if it had no descriptor."""
    r, caller, s = structure(srv)
    _committed(r, caller, s, 1)
    r.hset(keys.script_keys(S)[2], "e0", b"\xc1 not msgpack")
    before = snapshot(r)
    with pytest.raises((redis.exceptions.ResponseError, MQError)):  # the script's failure, as without the module
        s.get(caller, Q, uow="g", now_ms=1_000)
    assert r.ping() and snapshot(r) == before
