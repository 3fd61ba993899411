"""The CF operations, one test class per script in cfemu/scripts/ (test_every_script_has_a_test_class keeps it so),
against a real redis-server. Each class checks the operation's semantics, its idempotency where its header claims
it, and its refusals as the exceptions cfemu/errors.py maps them to.

Adding a CF operation: its <op>.lua, its Structure.<op> (or Admin method), and a Test<Op> class here.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any

import msgpack
import pytest
import redis

from cfemu import bulk, keys, lua, resp
from cfemu.admin import Admin
from cfemu.cf import CF, Caller, CarriedCommit, OutcomeReply, Structure
from cfemu.connection import connect
from cfemu.entry import Entry
from cfemu.errors import (
    BackedOutError,
    BackupActiveError,
    BackupEndedError,
    BackupRunningError,
    BadRequestError,
    CompletedByRecoveryError,
    FencedError,
    FloorError,
    MQError,
    NoNewUowsError,
    NotJoinedError,
    PstoreUnavailableError,
    RelogBusyError,
    StructureFailedError,
    StructureFullError,
    UnknownObjectError,
)
from cfemu.limits import CF_STEP
from tests.support.counting_clock import CountingClock as Clock

S, Q, Q2 = "APP1", "Q1", "Q2"
LONG = 10**13  # an expiry time (ms) far in the future
NOW = 2_000  # the `now` (ms) the tests pass; an entry expiring at 1_000 has expired by then


@pytest.fixture
def admin(redis_url: str) -> Iterator[Admin]:
    client = connect(redis_url)
    try:
        a = Admin(client)
        a.ensure_structure(S, (Q, Q2))
        yield a
    finally:
        client.close()


@pytest.fixture
def s(admin: Admin) -> Structure:
    return CF(admin.redis).structure(S)


@pytest.fixture
def qm1(admin: Admin) -> Caller:
    return join(admin, "QM1")


def join(admin: Admin, member: str) -> Caller:
    return Caller(member, admin.join(member, {}, lease_ms=60_000), Clock())


def entry(eid: str, queue: str = Q, **kw: object) -> Entry:
    return Entry(id=eid, queue=queue, **kw)  # type: ignore[arg-type]


def available(s: Structure, caller: Caller, uow: str, queue: str = Q) -> list[str]:
    """Take every available message of the queue under `uow`: their ids in get order."""
    out = []
    while (got := s.get(caller, queue, uow=uow, now_ms=NOW)).entry is not None:
        out.append(got.entry.id)
    return out


def held_uows(s: Structure) -> set[str]:
    return {keys.text(u) for u in s.cf.redis.hkeys(keys.uows(S))}


def dump(s: Structure) -> dict[bytes, bytes]:
    """Every key of the structure with its value, serialised (to show that a refusal changed nothing)."""
    r = s.cf.redis
    return {k: r.dump(k) for k in sorted(r.scan_iter(match=keys.all_structure_keys_pattern(S)))}


def carried_length(s: Structure, eid: str) -> int:
    """What the get and browse bounds count: the data plus the descriptor as stored."""
    return int(s.cf.redis.hstrlen(keys.data(S), eid)) + int(s.cf.redis.hstrlen(keys.entries(S), eid))


def tombstone(s: Structure, uow: str) -> str | None:
    t = s.cf.redis.hget(keys.tomb(S), uow)
    return keys.text(t) if t is not None else None


# --- the registry of scripts and the key layout --------------------------------------------------------------
def _class_name(op: str) -> str:
    return "Test" + "".join(part.title() for part in op.split("_"))


def test_every_script_has_a_test_class() -> None:
    missing = [f"{op}.lua -> {_class_name(op)}" for op in lua.operations() if _class_name(op) not in globals()]
    assert not missing, f"CF scripts without a test class in {__name__}: {missing}"


def test_script_keys_follow_the_prelude_header() -> None:
    """keys.script_keys must hand the scripts their KEYS in the order _prelude.lua's header names and binds them."""
    prelude = (resources.files("cfemu") / "scripts" / "_prelude.lua").read_text()
    header = re.findall(r"^--\s+KEYS\[(\d+)\]\s+(\S+)", prelude, re.MULTILINE)
    assert [int(n) for n, _ in header] == list(range(1, len(header) + 1))
    assert [k for _, k in header] == keys.script_keys("S")
    binding = re.search(r"^local [A-Z_, ]+=\s*((?:KEYS\[\d+\],?\s*)+)", prelude, re.MULTILINE)
    assert binding is not None, "the prelude binds its KEYS to names in one local statement"
    assert re.findall(r"KEYS\[(\d+)\]", binding.group(1)) == [str(i) for i in range(1, len(header) + 1)]


def test_scripts_are_found_by_kind() -> None:
    assert {"put", "get", "commit", "backout"} <= set(lua.structure_operations())
    assert set(lua.admin_operations()) == {"admin_heartbeat", "admin_fence", "admin_raise_fence", "admin_hold_lock",
                                           "admin_forget"}
    assert lua.source("put").startswith("-- _prelude")  # a structure operation comes after the prelude
    assert lua.source("admin_fence").startswith("-- admin_fence")  # an admin one stands alone
    with pytest.raises(KeyError):
        lua.source("_prelude")


def test_a_script_gets_the_prelude_definitions_it_uses() -> None:
    """A call runs every definition it is given, so a structure operation gets the prelude's opening comment and
    the definitions it uses, with those they use in turn (every script's tests run them: one left out would be an
    error at its first call)."""
    standing = lua.source("standing")
    assert "local function check_ready(" in standing  # used by standing.lua
    assert "local function meta(" in standing  # used by check_ready
    assert "local function commit_puts(" not in standing and "local function tick(" not in standing
    assert "local function commit_puts(" in lua.source("commit")
    assert all(lua.source(op).count("\nlocal META, FENCE,") == 1 for op in lua.structure_operations())


def test_a_scripts_source_is_made_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CF object registers its scripts (a member's start, each command): each source is cut from the prelude
    once, not again for each CF."""
    lua.source("get")
    cut: list[str] = []
    real = lua.prelude_for
    monkeypatch.setattr(lua, "prelude_for", lambda body: cut.append(body) or real(body))
    assert lua.source("get") is lua.source("get")
    assert cut == []


# --- the structure operations ------------------------------------------------------------------------------------
class TestPut:
    def test_the_depths_of_every_queue_are_read_in_one_pipeline(self, s: Structure, qm1: Caller,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
        s.put(qm1, entry("e1"), b"data", uow="U1")
        s.put(qm1, entry("e2", queue=Q2, priority=7), b"data")  # no UOW: committed
        s.put(qm1, entry("e3", queue=Q2, priority=2), b"data")
        pipelines: list[object] = []
        real = s.cf.redis.pipeline
        monkeypatch.setattr(s.cf.redis, "pipeline", lambda *a, **kw: pipelines.append(1) or real(*a, **kw))
        assert s.depths() == {Q: {"UP": 1, "CP": 0, "UG": 0, "EX": 0}, Q2: {"UP": 0, "CP": 2, "UG": 0, "EX": 0}}
        assert len(pipelines) == 1

    def test_an_uncommitted_put_is_held_by_its_uow(self, s: Structure, qm1: Caller) -> None:
        reply = s.put(qm1, entry("e1"), b"data", uow="U1")
        assert reply.created and reply.gen == 1
        assert s.depths()[Q] == {"UP": 1, "CP": 0, "UG": 0, "EX": 0}
        [(held, data)] = s.uow_entries("U1")
        assert (held.id, held.state, held.uow, held.lrsn, held.length, data) == ("e1", "UP", "U1", reply.clock, 4,
                                                                                  b"data")
        assert s.member_uows("QM1") == {"U1": {"o": "QM1", "f": reply.clock, "g": 1}}
        assert s.browse(Q, 10, NOW) == []
        assert s.info()["entries"] == "1" and s.info()["bytes"] == "4"

    def test_a_put_outside_syncpoint_is_available_at_once(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("e1", correlid="0a", msgid="0b", expiry=LONG), b"x")
        [(e, data)] = s.browse(Q, 10, NOW)
        assert (e.id, e.state, e.uow, data) == ("e1", "CP", "", b"x")
        r = s.cf.redis
        assert r.sismember(keys.index_set(S, Q, "c", "0a"), "e1") and r.sismember(keys.index_set(S, Q, "m", "0b"), "e1")
        assert r.zscore(keys.expiry(S), "e1") == LONG
        assert held_uows(s) == set()

    def test_puts_are_idempotent_by_id(self, s: Structure, qm1: Caller) -> None:
        assert s.put(qm1, entry("e1"), b"first", uow="U1").created
        again = s.put(qm1, entry("e1"), b"second", uow="U1")
        assert not again.created
        assert s.depths()[Q]["UP"] == 1 and s.info()["entries"] == "1"
        assert [d for _, d in s.uow_entries("U1")] == [b"first"]

    def test_the_cf_clock_merges_the_callers(self, s: Structure, admin: Admin) -> None:
        clock = Clock(start=1_000)
        reply = s.put(Caller("QM1", admin.join("QM1", {}, lease_ms=60_000), clock), entry("e1"), b"x")
        assert reply.clock == 1_002  # max(cf, caller's 1_001) + 1
        assert clock.t == reply.clock  # the caller adopts it
        assert s.put(join(admin, "QM2"), entry("e2"), b"x").clock == 1_003  # a caller behind the CF moves it on

    def test_refuses_a_structure_that_is_not_in_the_cf_or_not_active(self, admin: Admin, s: Structure,
                                                                      qm1: Caller) -> None:
        with pytest.raises(StructureFailedError, match="not in the CF"):
            CF(admin.redis).structure("NOPE").put(qm1, entry("e1"), b"x")
        admin.set_state(S, "FAILED")
        with pytest.raises(StructureFailedError, match="FAILED"):
            s.put(qm1, entry("e1"), b"x")

    def test_refuses_a_member_that_has_not_joined_or_is_fenced(self, admin: Admin, s: Structure,
                                                               qm1: Caller) -> None:
        with pytest.raises(NotJoinedError):
            s.put(Caller("QM9", 1, Clock()), entry("e1"), b"x")
        with pytest.raises(FencedError):
            s.put(Caller("QM1", qm1.epoch - 1, Clock()), entry("e1"), b"x")

    def test_refuses_an_unknown_queue(self, s: Structure, qm1: Caller) -> None:
        with pytest.raises(UnknownObjectError, match="NOQ"):
            s.put(qm1, entry("e1", queue="NOQ"), b"x")

    def test_refuses_beyond_the_structures_capacity(self, admin: Admin) -> None:
        admin.ensure_structure("SMALL", ("QS",), max_entries=1)  # a queue name is unique in the group
        small, caller = CF(admin.redis).structure("SMALL"), join(admin, "QM1")
        small.put(caller, entry("e1", queue="QS"), b"x")
        with pytest.raises(StructureFullError):
            small.put(caller, entry("e2", queue="QS"), b"x")

    def test_refuses_another_members_uow(self, admin: Admin, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("e1"), b"x", uow="U1")
        with pytest.raises(BadRequestError, match="belongs to QM1"):
            s.put(join(admin, "QM2"), entry("e2"), b"x", uow="U1")

    def test_refuses_a_uow_decided_by_recovery_or_lost_with_the_cf(self, s: Structure, qm1: Caller) -> None:
        s.cf.redis.hset(keys.tomb(S), mapping={"UB": "B", "UC": "C"})
        with pytest.raises(BackedOutError, match="backed out by recovery"):
            s.put(qm1, entry("e1"), b"x", uow="UB", gen=1)
        with pytest.raises(CompletedByRecoveryError):
            s.put(qm1, entry("e1"), b"x", uow="UC", gen=1)
        with pytest.raises(BackedOutError, match="lost with the CF"):
            s.put(qm1, entry("e1"), b"x", uow="U1", gen=7)  # started in generation 7, the structure is in 1
        s.cf.redis.hset(keys.tomb(S), "UP", "P")
        with pytest.raises(BackedOutError, match="its work on this structure was purged"):
            s.put(qm1, entry("e1"), b"x", uow="UP", gen=7)


class TestPutCommitted:
    """A persistent put outside syncpoint and its commit in one call, after its PUT and COMMIT records."""

    def test_the_message_is_available_at_once_in_the_order_of_its_records(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("before"), b"x", uow="U0")
        s.commit(qm1, "U0", gen=1, lrsn=400)  # counts at 400
        reply = s.put_committed(qm1, entry("e1", msgid="0b", correlid="0a", expiry=LONG), b"data", uow="U1", gen=1,
                                put_lrsn=300, lrsn=350)
        assert reply.created and reply.gen == 1 and reply.clock > 350 and qm1.clock.now() > reply.clock
        # Its commit counts at 350, before U0's at 400: it comes first, as restore's fold places it.
        assert [(e.id, e.state, e.uow, e.lrsn, e.order) for e, _ in s.browse(Q, 10, NOW)] == [
            ("e1", "CP", "", 350, (350, 300)), ("before", "CP", "", 400, (400, 2))]
        r = s.cf.redis
        assert r.sismember(keys.index_set(S, Q, "c", "0a"), "e1") and r.sismember(keys.index_set(S, Q, "m", "0b"), "e1")
        assert r.zscore(keys.expiry(S), "e1") == LONG
        assert held_uows(s) == set() and s.info()["entries"] == "2" and tombstone(s, "U1") == "A"

    def test_a_redo_cannot_bring_back_a_consumed_message(self, admin: Admin, s: Structure, qm1: Caller) -> None:
        s.put_committed(qm1, entry("e1"), b"x", uow="U1", gen=1, put_lrsn=10, lrsn=11)
        again = s.put_committed(qm1, entry("e1"), b"x", uow="U1", gen=1, put_lrsn=10, lrsn=11)  # still there
        assert not again.created and s.info()["entries"] == "1"
        assert available(s, qm1, "G1") == ["e1"]
        s.commit(qm1, "G1", gen=1, lrsn=500)  # consumed
        peer = join(admin, "QM2")  # peer recovery finds U1's COMMIT without an END and redoes it
        redo = s.put_committed(peer, entry("e1"), b"x", uow="U1", gen=1, put_lrsn=10, lrsn=11, redo=True)
        assert not redo.created and s.browse(Q, 10, NOW) == [] and s.info()["entries"] == "0"

    def test_the_owner_forgets_the_tombstones_of_uows_whose_end_is_on_disk(self, s: Structure, qm1: Caller) -> None:
        s.put_committed(qm1, entry("e1"), b"x", uow="U1", gen=1, put_lrsn=10, lrsn=11)
        s.cf.redis.hset(keys.tomb(S), "UC", "C")
        s.put_committed(qm1, entry("e2"), b"x", uow="U2", gen=1, put_lrsn=20, lrsn=21, forget=["U1", "UC"])
        assert tombstone(s, "U1") is None and tombstone(s, "U2") == "A"
        assert tombstone(s, "UC") == "C"  # only its own kind goes: another outcome's tombstone stays for its owner

    def test_other_outcomes_of_an_applied_put_are_no_ops_or_refused(self, s: Structure, qm1: Caller) -> None:
        s.put_committed(qm1, entry("e1"), b"x", uow="U1", gen=1, put_lrsn=10, lrsn=11)
        done = s.commit(qm1, "U1", gen=1, lrsn=11)
        assert (done.puts, done.gets) == (0, 0) and s.info()["entries"] == "1"
        assert tombstone(s, "U1") == "A"  # a commit of it is a no-op that keeps the tombstone
        with pytest.raises(CompletedByRecoveryError, match="put and committed"):
            s.backout(qm1, "U1", gen=1, lrsn=12, has_data=False)
        with pytest.raises(CompletedByRecoveryError):
            s.put(qm1, entry("e9"), b"x", uow="U1", gen=1)

    def test_refusals_change_nothing(self, admin: Admin, s: Structure, qm1: Caller) -> None:
        s.cf.redis.hset(keys.meta(S), "floor", 100)
        before = dump(s)
        with pytest.raises(FloorError):
            s.put_committed(qm1, entry("e1"), b"x", uow="U1", gen=1, put_lrsn=99, lrsn=101)
        with pytest.raises(BackedOutError, match="generation 7"):
            s.put_committed(qm1, entry("e1"), b"x", uow="U1", gen=7, put_lrsn=200, lrsn=201)
        with pytest.raises(UnknownObjectError):
            s.put_committed(qm1, entry("e1", queue="NOQ"), b"x", uow="U1", gen=1, put_lrsn=200, lrsn=201)
        with pytest.raises(FencedError):
            s.put_committed(Caller("QM1", qm1.epoch - 1, Clock()), entry("e1"), b"x", uow="U1", gen=1,
                            put_lrsn=200, lrsn=201)
        s.cf.redis.hset(keys.tomb(S), "UB", "B")
        before = dump(s)
        with pytest.raises(BackedOutError, match="by recovery"):
            s.put_committed(qm1, entry("e1"), b"x", uow="UB", gen=1, put_lrsn=200, lrsn=201)
        assert {k: v for k, v in dump(s).items() if not k.endswith(b":meta")} == {
            k: v for k, v in before.items() if not k.endswith(b":meta")}
        assert s.browse(Q, 10, NOW) == []

    def test_a_redo_completes_what_the_owner_would_have_been_refused(self, admin: Admin, qm1: Caller) -> None:
        admin.ensure_structure("SMALL", ("QS",), max_entries=1)
        small = CF(admin.redis).structure("SMALL")
        small.put(qm1, entry("e1", queue="QS"), b"x")
        with pytest.raises(StructureFullError):
            small.put_committed(qm1, entry("e2", queue="QS"), b"x", uow="U2", gen=1, put_lrsn=500, lrsn=501)
        small.pstore("disconnect")
        with pytest.raises(PstoreUnavailableError):
            small.put_committed(qm1, entry("e2", queue="QS"), b"x", uow="U2", gen=1, put_lrsn=500, lrsn=501)
        assert small.put_committed(qm1, entry("e2", queue="QS"), b"x", uow="U2", gen=1, put_lrsn=500, lrsn=501,
                                   redo=True).created  # a decided commit completes
        assert small.info()["entries"] == "2"

    def test_a_disconnected_persistent_store_refuses_the_first_call(self, s: Structure, qm1: Caller) -> None:
        s.pstore("disconnect")
        with pytest.raises(PstoreUnavailableError):
            s.put_committed(qm1, entry("e1"), b"x", uow="U1", gen=1, put_lrsn=10, lrsn=11)
        assert s.browse(Q, 10, NOW) == [] and tombstone(s, "U1") is None


class TestGet:
    def test_takes_the_highest_priority_first_then_fifo(self, s: Structure, qm1: Caller) -> None:
        for eid, p in (("a", 0), ("b", 5), ("c", 5), ("d", 0), ("e", 9)):
            s.put(qm1, entry(eid, priority=p), eid.encode())
        assert available(s, qm1, "U1") == ["e", "b", "c", "a", "d"]

    def test_a_get_is_held_by_its_uow(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("e1"), b"data")
        got = s.get(qm1, Q, uow="U1", now_ms=NOW)
        assert got.entry is not None and got.data == b"data" and got.gen == 1
        assert (got.entry.state, got.entry.uow, got.entry.lrsn) == ("UG", "U1", got.clock)
        assert s.depths()[Q] == {"UP": 0, "CP": 0, "UG": 1, "EX": 0}
        assert [e.id for e, _ in s.uow_entries("U1")] == ["e1"]
        assert s.member_uows("QM1") == {"U1": {"o": "QM1", "f": got.clock, "g": 1}}

    def test_no_message_available(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("e1"), b"x", uow="U0")  # uncommitted: not available
        got = s.get(qm1, Q, uow="U1", now_ms=NOW)
        assert (got.entry, got.data, got.gen) == (None, None, 1)
        assert "U1" not in held_uows(s)  # a get that found nothing does not join the UOW

    def test_gets_by_message_id_or_correlation_id(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a", msgid="01", correlid="0c"), b"a")
        s.put(qm1, entry("b", msgid="02", correlid="0c", priority=3), b"b")
        s.put(qm1, entry("c", msgid="03", correlid="0c"), b"c")
        got = s.get(qm1, Q, uow="U1", match="m", value="03", now_ms=NOW)
        assert got.entry is not None and got.entry.id == "c"
        by_correlid = [s.get(qm1, Q, uow="U1", match="c", value="0c", now_ms=NOW).entry for _ in range(3)]
        assert [e.id if e else None for e in by_correlid] == ["b", "a", None]  # priority, then FIFO
        assert s.get(qm1, Q, uow="U1", match="m", value="ff", now_ms=NOW).entry is None

    def test_expired_messages_are_never_returned(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("old", expiry=1_000), b"x")
        s.put(qm1, entry("old2", expiry=1_000, correlid="0c"), b"x")
        assert s.get(qm1, Q, uow="U1", match="c", value="0c", now_ms=NOW).entry is None  # moves old2
        assert s.get(qm1, Q, uow="U1", now_ms=NOW).entry is None  # moves old
        assert s.depths()[Q] == {"UP": 0, "CP": 0, "UG": 0, "EX": 2}

    def test_refuses_an_unknown_queue_and_a_lost_uow(self, s: Structure, qm1: Caller) -> None:
        with pytest.raises(UnknownObjectError):
            s.get(qm1, "NOQ", uow="U1", now_ms=NOW)
        with pytest.raises(BackedOutError, match="lost with the CF"):
            s.get(qm1, Q, uow="U1", gen=7, now_ms=NOW)

    def test_refuses_a_fenced_member(self, s: Structure, qm1: Caller) -> None:
        with pytest.raises(FencedError):
            s.get(Caller("QM1", qm1.epoch + 1, Clock()), Q, uow="U1", now_ms=NOW)

    @pytest.mark.parametrize("match", ["", "m"])
    def test_refuses_a_message_longer_than_the_caller_can_take_and_changes_nothing(
            self, s: Structure, qm1: Caller, match: str) -> None:
        """A get that cannot deliver must not consume (docs/architecture.md, "Size limits"). The message stays where
        it was (MQ's MQRC_TRUNCATED_MSG_FAILED): no UOW joined, no backout count, not even the clock moves."""
        s.put(qm1, entry("big", msgid="0b"), b"x" * 1000)
        length = carried_length(s, "big")
        before = dump(s)
        with pytest.raises(MQError) as e:
            s.get(qm1, Q, uow="U1", match=match, value="0b", now_ms=NOW, max_length=length - 1)
        assert e.value.reason == 2080 and f"is {length} bytes" in str(e.value), e.value
        assert dump(s) == before
        got = s.get(qm1, Q, uow="U1", match=match, value="0b", now_ms=NOW, max_length=length)
        assert got.entry is not None and got.entry.id == "big" and got.entry.backout_count == 0

    def test_refuses_another_members_uow_before_taking_anything(self, admin: Admin, s: Structure,
                                                                qm1: Caller) -> None:
        """The UOW's owner is checked before the message leaves its list: Redis does not roll a script back, so a
        refusal after the pop lost the message from every list."""
        s.put(qm1, entry("e1"), b"x")
        s.put(join(admin, "QM2"), entry("theirs"), b"y", uow="U1")
        before = dump(s)
        with pytest.raises(BadRequestError, match="belongs to QM2"):
            s.get(qm1, Q, uow="U1", now_ms=NOW)
        assert dump(s) == before
        assert available(s, qm1, "U2") == ["e1"]


    # --- expired messages at the head, in bounded steps (the prelude's "Outcomes in bounded steps") ---------------
    def test_a_call_moves_at_most_a_step_of_expired_messages_and_takes_nothing_then(self, s: Structure,
                                                                                   qm1: Caller) -> None:
        """Its step spent among expired messages, a call answers 'again': the expired ones it met are on the
        expired list, and nothing else changed (no UOW joined, the clock not moved)."""
        for i in range(6):
            s.put(qm1, entry(f"x{i}", expiry=1_000), b"x")
        s.put(qm1, entry("live"), b"y")
        clock = s.cf.redis.hget(keys.meta(S), "clock")
        raw = s.cf.script("get")
        out = raw(keys=keys.script_keys(S), args=[qm1.member, qm1.epoch, 0, "U1", 0, Q, "", "", NOW, 0, 4])
        assert out == [int(clock), 1, 1]  # {cf clock, gen, again}
        assert s.cf.redis.hget(keys.meta(S), "clock") == clock and "U1" not in held_uows(s)
        assert s.cf.redis.lrange(keys.state_list(S, Q, "EX"), 0, -1) == [f"x{i}".encode() for i in range(4)]
        got = s.get(qm1, Q, uow="U1", now_ms=NOW, step=2)  # a step that ends right before the live one: taken
        assert got.entry is not None and got.entry.id == "live" and not got.again
        assert s.depths()[Q] == {"UP": 0, "CP": 0, "UG": 1, "EX": 6}

    def test_more_expired_messages_than_a_call_s_step_are_moved_in_bounded_calls(
            self, s: Structure, qm1: Caller, monkeypatch: pytest.MonkeyPatch) -> None:
        """Structure.get calls again until it takes the live message behind them; each call moves at most
        CF_STEP of them."""
        n = 2 * CF_STEP + 10
        put = s.cf.script("put")
        desc = Entry(id="x", queue=Q, expiry=1_000).pack()
        pipe = s.cf.redis.pipeline(transaction=False)
        for j in range(n):
            put(keys=keys.script_keys(S), args=[qm1.member, qm1.epoch, 0, "", 0, f"x{j:05d}", Q, desc, b"x"],
                client=pipe)
        pipe.execute()
        s.put(qm1, entry("live", expiry=LONG), b"y")
        replies: list[Any] = []
        run = s.cf.run

        def counted(op: str, name: str, args: list[object]) -> Any:
            out = run(op, name, args)
            replies.append(out)
            return out

        monkeypatch.setattr(s.cf, "run", counted)
        got = s.get(qm1, Q, uow="U1", now_ms=NOW)
        assert got.entry is not None and got.entry.id == "live" and got.data == b"y"
        assert [len(r) for r in replies] == [3, 3, 4]  # again, again, the message
        assert s.cf.redis.lrange(keys.state_list(S, Q, "EX"), 0, -1) == [f"x{j:05d}".encode() for j in range(n)]
        assert s.depths()[Q] == {"UP": 0, "CP": 0, "UG": 1, "EX": n}
        assert s.get(qm1, Q, uow="U1", now_ms=NOW).entry is None

    @pytest.mark.timed
    @pytest.mark.slow
    def test_200000_expired_messages_at_the_head_while_other_clients_keep_working(self, admin: Admin,
                                                                                   s: Structure,
                                                                                   qm1: Caller) -> None:
        """One get behind 200,000 expired messages: it moves them in bounded calls, and another member's CF calls
        (a get on another queue, a lease renewal) are answered within 250 ms at the 99th percentile all along."""
        n = 200_000
        _put_many(s, qm1, n, uow="", prefix="x", desc=Entry(id="x", queue=Q, expiry=1_000).pack())
        s.put(qm1, entry("live"), b"y")
        with another_member_probing(admin) as waits:
            t0 = time.perf_counter()
            got = s.get(qm1, Q, uow="U1", now_ms=NOW)
            took = time.perf_counter() - t0
        assert got.entry is not None and got.entry.id == "live"
        assert s.depths()[Q]["EX"] == n
        p99 = _p99(waits, took)
        assert p99 < 0.25, f"another client's p99 wait {p99 * 1000:.1f} ms during a get of {took:.1f} s"


class TestGetCommitted:
    """A get, and the commits of the caller's earlier gets it carries, in one call."""

    def test_applies_the_carried_commits_then_takes_the_next_message(self, s: Structure, qm1: Caller) -> None:
        for eid in ("a", "b", "c"):
            s.put(qm1, entry(eid), b"x")
        first = s.get_committed(qm1, Q, uow="G1", now_ms=NOW)
        assert first.got is not None and first.got.entry is not None and first.got.entry.id == "a"
        assert first.error is None and first.commits == []
        assert s.depths()[Q]["UG"] == 1  # taken, its commit not applied yet
        second = s.get_committed(qm1, Q, uow="G2", now_ms=NOW, commits=[CarriedCommit("G1", 1, 500)])
        assert second.commits == [None] and second.got is not None and second.got.entry is not None
        assert second.got.entry.id == "b" and second.got.clock > 500
        assert s.uow_entries("G1") == [] and s.info()["entries"] == "2"  # a consumed, b held by G2
        assert {e.id for e, _ in s.uow_entries("G2")} == {"b"}

    def test_carried_commits_are_applied_when_the_get_finds_nothing(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a"), b"x")
        s.get_committed(qm1, Q, uow="G1", now_ms=NOW)
        reply = s.get_committed(qm1, Q, uow="G2", now_ms=NOW, commits=[CarriedCommit("G1", 1, 500)])
        assert reply.commits == [None] and reply.got is not None and reply.got.entry is None
        assert s.info()["entries"] == "0" and held_uows(s) == set()

    def test_a_refused_get_keeps_the_commits_it_applied(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a"), b"x")
        s.get_committed(qm1, Q, uow="G1", now_ms=NOW)
        reply = s.get_committed(qm1, "NOQ", uow="G2", now_ms=NOW, commits=[CarriedCommit("G1", 1, 500)])
        assert reply.got is None and isinstance(reply.error, UnknownObjectError) and reply.commits == [None]
        assert s.info()["entries"] == "0"

    def test_a_carried_commit_below_the_floor_is_refused_alone(self, s: Structure, qm1: Caller) -> None:
        for eid in ("a", "b"):
            s.put(qm1, entry(eid), b"x")
        s.get_committed(qm1, Q, uow="G1", now_ms=NOW)
        s.cf.redis.hset(keys.meta(S), "floor", 1000)
        reply = s.get_committed(qm1, Q, uow="G2", now_ms=NOW, commits=[CarriedCommit("G1", 1, 500)])
        [refusal] = reply.commits
        assert isinstance(refusal, FloorError) and refusal.floor == 1000  # the caller logs it again
        assert reply.got is not None and reply.got.entry is not None and reply.got.entry.id == "b"
        assert {e.id for e, _ in s.uow_entries("G1")} == {"a"}  # still held: commit() finishes it
        assert s.commit(qm1, "G1", gen=1, lrsn=1001).gets == 1

    def test_a_fenced_caller_changes_nothing(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a"), b"x")
        s.get_committed(qm1, Q, uow="G1", now_ms=NOW)
        before = dump(s)
        with pytest.raises(FencedError):
            s.get_committed(Caller("QM1", qm1.epoch - 1, Clock()), Q, uow="G2", now_ms=NOW,
                            commits=[CarriedCommit("G1", 1, 500)])
        assert dump(s) == before


class TestBrowse:
    def test_reads_available_messages_in_get_order_without_taking_them(self, s: Structure, qm1: Caller) -> None:
        for eid, p in (("a", 0), ("b", 5), ("c", 0)):
            s.put(qm1, entry(eid, priority=p), eid.encode())
        s.put(qm1, entry("held"), b"x", uow="U1")
        s.put(qm1, entry("old", expiry=1_000), b"x")
        assert [(e.id, d) for e, d in s.browse(Q, 10, NOW)] == [("b", b"b"), ("a", b"a"), ("c", b"c")]
        assert [e.id for e, _ in s.browse(Q, 2, NOW)] == ["b", "a"]
        assert s.depths()[Q]["CP"] == 4  # nothing taken, nothing moved (the expired one included)

    def test_says_when_it_left_messages_out(self, s: Structure, qm1: Caller) -> None:
        for eid in ("a", "b", "c"):
            s.put(qm1, entry(eid), eid.encode() * 100)
        s.put(qm1, entry("old", expiry=1_000), b"x")  # expired: never counted, never "more"
        assert (len(s.browse(Q, 3, NOW)), s.browse(Q, 3, NOW).more) == (3, False)
        assert (len(s.browse(Q, 2, NOW)), s.browse(Q, 2, NOW).more) == (2, True)
        two = sum(carried_length(s, eid) + 10 for eid in ("a", "b"))
        bounded = s.browse(Q, 10, NOW, max_bytes=two, each=10)  # by bytes: what fits, and "more"
        assert [e.id for e, _ in bounded] == ["a", "b"] and bounded.more
        assert not s.browse(Q, 10, NOW, max_bytes=two + carried_length(s, "c") + 10, each=10).more

    def test_refuses_when_not_even_the_first_message_fits(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("big"), b"x" * 1000)
        with pytest.raises(MQError) as e:
            s.browse(Q, 10, NOW, max_bytes=500)
        assert e.value.reason == 2080 and "message big is" in str(e.value)

    # --- a page at a time: one call's cost is bounded however long the queue or large the limit ---------------
    def test_one_call_visits_at_most_a_step_of_entries(self, s: Structure, qm1: Caller) -> None:
        for i in range(1000):
            s.put(qm1, entry(f"x{i:04d}", expiry=1_000), b"x")  # expired by NOW
        s.put(qm1, entry("live"), b"live")
        first = s.browse_page(Q, 10, NOW)
        assert (first.found, first.more) == ([], False) and first.cursor.startswith(f"0:{CF_STEP}:")
        cursor, calls, found = first.cursor, 1, []
        while cursor:
            page = s.browse_page(Q, 10, NOW, cursor=cursor)
            found += [e.id for e, _ in page.found]
            cursor, calls = page.cursor, calls + 1
        assert found == ["live"] and calls == 1001 // CF_STEP + 1
        assert [e.id for e, _ in s.browse(Q, 10, NOW)] == ["live"]

    def test_a_browse_reads_past_its_limit_only_to_tell_more(self, s: Structure, qm1: Caller,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
        s.put(qm1, entry("live"), b"live")
        for i in range(1000):
            s.put(qm1, entry(f"x{i:04d}", expiry=1_000), b"x")  # expired by NOW, behind the live one
        calls, real = [], s.browse_page
        monkeypatch.setattr(s, "browse_page", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        exact = s.browse(Q, 1, NOW)  # another available message? only the whole queue says: none
        assert ([e.id for e, _ in exact], exact.more, len(calls)) == (["live"], False, 1001 // CF_STEP + 1)
        calls.clear()
        quick = s.browse(Q, 1, NOW, exact_more=False)  # stops at its limit: "more" says only that it stopped
        assert ([e.id for e, _ in quick], quick.more, len(calls)) == (["live"], True, 1)

    def test_paging_returns_the_messages_in_get_order(self, s: Structure, qm1: Caller) -> None:
        want: dict[int, list[str]] = {p: [] for p in range(10)}
        for i in range(700):
            p = (i * 7) % 10
            expired = i % 5 == 0
            s.put(qm1, entry(f"m{i:03d}", priority=p, **({"expiry": 1_000} if expired else {})), b"d%d" % i)
            if not expired:
                want[p].append(f"m{i:03d}")
        order = [eid for p in range(9, -1, -1) for eid in want[p]]
        assert [e.id for e, _ in s.browse(Q, 1000, NOW)] == order  # 700 entries: three calls of a step
        for step in (1, 7, 100):
            assert [e.id for e, _ in s.browse(Q, 1000, NOW, step=step)] == order
        some = s.browse(Q, 300, NOW, step=7)
        assert [e.id for e, _ in some] == order[:300] and some.more
        every = s.browse(Q, len(order), NOW, step=7)
        assert [e.id for e, _ in every] == order and not every.more
        each = 10  # by bytes across calls: what fits, "more", and no refusal for a later call's first message
        room = sum(carried_length(s, eid) + each for eid in order[:50])
        bounded = s.browse(Q, 1000, NOW, max_bytes=room, each=each, step=7)
        assert [e.id for e, _ in bounded] == order[:50] and bounded.more

    def test_a_call_carries_at_most_its_bytes_but_always_one_message(self, s: Structure, qm1: Caller) -> None:
        for eid in ("a", "b", "c"):
            s.put(qm1, entry(eid), eid.encode() * 1000)
        page = s.browse_page(Q, 10, NOW, step_bytes=1)
        assert [e.id for e, _ in page.found] == ["a"] and page.cursor and not page.more
        two = carried_length(s, "a") + carried_length(s, "b")
        assert [e.id for e, _ in s.browse_page(Q, 10, NOW, step_bytes=two).found] == ["a", "b"]
        assert [e.id for e, _ in s.browse(Q, 10, NOW, step_bytes=1)] == ["a", "b", "c"]

    def test_a_cursor_goes_on_after_messages_were_taken_or_made_available(self, s: Structure,
                                                                          qm1: Caller) -> None:
        for i in range(20):
            s.put(qm1, entry(f"m{i:02d}"), b"x")
        page = s.browse_page(Q, 100, NOW, step=8)
        assert [e.id for e, _ in page.found] == [f"m{i:02d}" for i in range(8)]
        for _ in range(5):  # the five oldest taken: the positions after them move down by five
            s.get(qm1, Q, uow="T1", now_ms=NOW)
        s.put(qm1, entry("late"), b"x")  # after the cursor in get order: the browse sees it
        rest = []
        cursor = page.cursor
        while cursor:
            nxt = s.browse_page(Q, 100, NOW, cursor=cursor, held=len(page.found), step=8)
            rest += [e.id for e, _ in nxt.found]
            cursor = nxt.cursor
        assert rest == [f"m{i:02d}" for i in range(8, 20)] + ["late"]

    def test_a_page_that_ends_between_entries_of_equal_order_skips_neither(self, admin: Admin, s: Structure,
                                                                          qm1: Caller) -> None:
        """Two members' puts committed in one operation can share an order (commit LRSN, put LRSN): a page that
        ended between them resumed by the order alone, past both, and the second was never shown. The cursor
        names the last entry visited, and the next page goes on right after it."""
        qm2 = join(admin, "QM2")
        for caller, eid, commit, put in ((qm1, "a", 150, 50), (qm1, "b", 200, 100), (qm2, "c", 200, 100),
                                         (qm2, "d", 300, 250)):
            s.put_committed(caller, entry(eid), eid.encode(), uow=f"U{eid}", gen=1, put_lrsn=put, lrsn=commit)
        whole = [e.id for e, _ in s.browse(Q, 10, NOW)]
        assert sorted(whole) == ["a", "b", "c", "d"]
        for step in (1, 2, 3):
            assert [e.id for e, _ in s.browse(Q, 10, NOW, step=step)] == whole, step

    def test_refusals(self, admin: Admin, s: Structure) -> None:
        with pytest.raises(UnknownObjectError):
            s.browse("NOQ", 10, NOW)
        with pytest.raises(BadRequestError, match="cursor"):
            s.browse_page(Q, 10, NOW, cursor="x")
        with pytest.raises(StructureFailedError, match="not in the CF"):
            CF(admin.redis).structure("NOPE").browse(Q, 10, NOW)
        admin.set_state(S, "RECOVERING")
        with pytest.raises(StructureFailedError, match="RECOVERING"):
            s.browse(Q, 10, NOW)


class TestPeek:
    def test_finds_committed_and_held_entries_by_id_in_get_order(self, s: Structure, qm1: Caller) -> None:
        for eid, p in (("a", 0), ("b", 5), ("c", 0)):
            s.put(qm1, entry(eid, priority=p, correlid="ab"), eid.encode())
        s.put(qm1, entry("other", correlid="cd"), b"x")
        s.put(qm1, entry("uncommitted", correlid="ab"), b"x", uow="U1")  # an uncommitted put is not there yet
        assert [(e.id, d) for e, d in s.peek(Q, "c", "ab")] == [("b", b"b"), ("a", b"a"), ("c", b"c")]
        taken = s.get(qm1, Q, uow="U2", match="c", value="ab", now_ms=NOW).entry
        assert taken is not None and taken.id == "b"
        peeked = s.peek(Q, "c", "ab")
        assert [e.id for e, _ in peeked] == ["b", "a", "c"]  # a held one is still seen, as it was committed
        assert peeked[0][0].state == "UG" and s.peek(Q, "c", "ab", limit=1)[0][0].id == "b"
        s.put(qm1, entry("m1", msgid="0101"), b"m")
        assert [e.id for e, _ in s.peek(Q, "m", "0101")] == ["m1"]

    def test_changes_nothing(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a", correlid="ab"), b"a")
        before = dump(s)
        s.peek(Q, "c", "ab")
        assert dump(s) == before

    def test_refusals(self, admin: Admin, s: Structure) -> None:
        with pytest.raises(UnknownObjectError):
            s.peek("NOQ", "c", "ab")
        with pytest.raises(BadRequestError, match="match"):
            s.peek(Q, "x", "ab")
        admin.set_state(S, "RECOVERING")
        with pytest.raises(StructureFailedError, match="RECOVERING"):
            s.peek(Q, "c", "ab")


class TestPeekMany:
    def test_gives_each_values_first_entry_in_get_order_or_none(self, s: Structure, qm1: Caller) -> None:
        for eid, p in (("a", 0), ("b", 5), ("c", 0)):
            s.put(qm1, entry(eid, priority=p, msgid="0101"), eid.encode())
        s.put(qm1, entry("d", msgid="0202"), b"d")
        s.put(qm1, entry("uncommitted", msgid="0303"), b"x", uow="U1")  # an uncommitted put is not there yet
        def found(*values: str) -> list[tuple[str, bytes] | None]:
            return [(one[0].id, one[1]) if one else None for one in s.peek_many(Q, "m", list(values))]

        assert found("0202", "0404", "0101", "0303") == [("d", b"d"), None, ("b", b"b"), None]
        taken = s.get(qm1, Q, uow="U2", match="m", value="0101", now_ms=NOW).entry
        assert taken is not None and taken.id == "b"
        held = s.peek_many(Q, "m", ["0101"])[0]
        assert held is not None and (held[0].id, held[0].state) == ("b", "UG")  # held: seen as committed, as peek
        assert s.peek_many(Q, "c", ["ab"]) == [None]
        for value in ("0101", "0202", "0303"):  # the same answers as peek's first
            assert [(e.id, d) for e, d in s.peek(Q, "m", value, 1)] == [one for one in found(value) if one]

    def test_changes_nothing(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a", msgid="0101"), b"a")
        before = dump(s)
        s.peek_many(Q, "m", ["0101", "0202"])
        assert dump(s) == before

    def test_refusals(self, admin: Admin, s: Structure) -> None:
        with pytest.raises(UnknownObjectError):
            s.peek_many("NOQ", "m", ["ab"])
        with pytest.raises(BadRequestError, match="match"):
            s.peek_many(Q, "x", ["ab"])
        with pytest.raises(BadRequestError, match="1-1000 values"):
            s.peek_many(Q, "m", [])
        with pytest.raises(BadRequestError, match="1-1000 values"):
            s.peek_many(Q, "m", ["ab"] * 1001)
        admin.set_state(S, "RECOVERING")
        with pytest.raises(StructureFailedError, match="RECOVERING"):
            s.peek_many(Q, "m", ["ab"])


class TestQueueMark:
    """A mark of a queue's committed entries: the same while nothing is made available or taken, another after."""

    def test_changes_when_an_entry_is_made_available_or_taken_and_not_otherwise(self, s: Structure,
                                                                                 qm1: Caller) -> None:
        marks = [s.queue_mark(Q)]
        assert marks[0] == ""  # nothing committed
        s.put(qm1, entry("a"), b"a")
        marks.append(s.queue_mark(Q))
        s.put(qm1, entry("b", priority=3), b"b")  # another priority
        marks.append(s.queue_mark(Q))
        s.put(qm1, entry("c"), b"c", uow="U1")
        assert s.queue_mark(Q) == marks[-1]  # an uncommitted put: nothing made available yet
        s.put(qm1, entry("other", queue=Q2), b"x")
        assert s.queue_mark(Q) == marks[-1]  # another queue's
        s.commit(qm1, "U1", gen=1, lrsn=0)
        marks.append(s.queue_mark(Q))  # committed
        taken = s.get(qm1, Q, uow="U2", now_ms=NOW).entry
        assert taken is not None
        marks.append(s.queue_mark(Q))  # taken (held by an uncommitted get)
        assert len(set(marks)) == len(marks), marks
        s.backout(qm1, "U2", gen=1, lrsn=0, has_data=False)
        assert s.queue_mark(Q) == marks[-2]  # given back: the queue's committed entries are as they were

    def test_a_replacement_committed_changes_it(self, s: Structure, qm1: Caller) -> None:
        """A status change: the get of an entry and the put of its successor with the same message id, committed
        (the list's length is the same after as before)."""
        s.put(qm1, entry("a", msgid="0101"), b"a")
        s.put(qm1, entry("b", msgid="0202"), b"b")
        before = s.queue_mark(Q)
        assert s.get(qm1, Q, uow="U1", match="m", value="0101", now_ms=NOW).entry is not None
        s.put(qm1, entry("a2", msgid="0101"), b"a2", uow="U1", gen=1)
        s.commit(qm1, "U1", gen=1, lrsn=0)
        assert s.queue_mark(Q) != before

    def test_changes_nothing(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a"), b"a")
        before = dump(s)
        s.queue_mark(Q)
        assert dump(s) == before

    def test_refusals(self, admin: Admin, s: Structure) -> None:
        with pytest.raises(UnknownObjectError):
            s.queue_mark("NOQ")
        admin.set_state(S, "RECOVERING")
        with pytest.raises(StructureFailedError, match="RECOVERING"):
            s.queue_mark(Q)


class TestTopicNext:
    """The next publication after a position: whole, in commit order, never past an open publication."""

    @staticmethod
    def publish(s: Structure, caller: Caller, uow: str, pub: str, n: int, *, commit: bool = True) -> None:
        for i in range(n):
            s.put(caller, entry(f"{pub}-{i}", correlid=pub, properties={"pub.count": n, "pub.index": i}),
                  f"{pub}{i}".encode(), uow=uow)
        if commit:
            s.commit(caller, uow, gen=1, lrsn=0)

    def test_walks_publications_in_commit_order_whole(self, s: Structure, qm1: Caller) -> None:
        start = s.topic_next(Q, 0).clock
        self.publish(s, qm1, "U1", "aa", 1, commit=False)
        self.publish(s, qm1, "U2", "bb", 3)  # committed first though its puts came later
        s.commit(qm1, "U1", gen=1, lrsn=0)
        pos, pub, seen = start, "", []
        while (nxt := s.topic_next(Q, pos, pub)).state == "P":
            seen.append((nxt.pub, [d for _, d in nxt.messages]))
            pos, pub = nxt.lrsn, nxt.pub
        assert nxt.state == "N"
        assert seen == [("bb", [b"bb0", b"bb1", b"bb2"]), ("aa", [b"aa0"])]
        assert s.topic_next(Q, nxt.clock, "~").state == "N"  # after everything at the clock (a subscribe's)

    def test_same_commit_lrsn_ordered_by_publication_id(self, s: Structure, qm1: Caller, admin: Admin) -> None:
        qm2 = join(admin, "QM2")
        self.publish(s, qm1, "U1", "cc", 2, commit=False)
        self.publish(s, qm2, "U2", "bb", 1, commit=False)
        at = s.topic_next(Q, 0).clock + 5
        s.commit(qm1, "U1", gen=1, lrsn=at)
        s.commit(qm2, "U2", gen=1, lrsn=at)
        first = s.topic_next(Q, 0)
        assert (first.lrsn, first.pub) == (at, "bb")
        second = s.topic_next(Q, first.lrsn, first.pub)
        assert (second.lrsn, second.pub, len(second.messages)) == (at, "cc", 2)
        assert s.topic_next(Q, second.lrsn, second.pub).state == "N"

    def test_waits_for_an_open_publication_that_could_commit_below(self, s: Structure, qm1: Caller) -> None:
        self.publish(s, qm1, "U1", "aa", 1, commit=False)  # open: its commit could still count below bb's
        self.publish(s, qm1, "U2", "bb", 1)
        assert s.topic_next(Q, 0).state == "W"
        s.backout(qm1, "U1", gen=1, lrsn=0, has_data=False)
        assert s.topic_next(Q, 0).pub == "bb"

    def test_says_where_the_open_publications_begin(self, s: Structure, qm1: Caller) -> None:
        """A subscribe starts below an open publication (sqm.pubsub.structure_clock): its commit may count below
        the clock."""
        assert s.topic_head(Q, 2**53).open_from is None and s.topic_next(Q, 0).open_from is None
        before = s.topic_next(Q, 0).clock
        self.publish(s, qm1, "U1", "aa", 2, commit=False)
        opened = s.topic_next(Q, 0)
        self.publish(s, qm1, "U2", "bb", 1)
        assert opened.open_from is not None and before < opened.open_from <= opened.clock
        waits = s.topic_next(Q, 0)
        assert (waits.state, waits.open_from) == ("W", opened.open_from)
        after = s.topic_head(Q, 2**53)  # past everything: none after it, and where the open one began
        assert (after.state, after.open_from) == ("N", opened.open_from) and after.clock > opened.clock
        s.backout(qm1, "U1", gen=1, lrsn=0, has_data=False)
        assert s.topic_head(Q, 2**53).open_from is None

    def test_skips_a_publication_being_removed(self, s: Structure, qm1: Caller) -> None:
        self.publish(s, qm1, "U1", "aa", 2)
        self.publish(s, qm1, "U2", "bb", 1)
        assert s.get(qm1, Q, uow="U3", match="c", value="aa", now_ms=NOW).entry is not None  # the sweeper's take
        assert s.topic_next(Q, 0).pub == "bb"

    def test_changes_nothing(self, s: Structure, qm1: Caller) -> None:
        self.publish(s, qm1, "U1", "aa", 2)
        before = dump(s)
        s.topic_next(Q, 0)
        s.topic_head(Q, 0)
        assert dump(s) == before

    def test_head_form_names_the_same_publication_without_its_data(self, s: Structure, qm1: Caller) -> None:
        self.publish(s, qm1, "U1", "aa", 3)
        s.put(qm1, entry("big", correlid="bb", properties={"pub.count": 1, "pub.index": 0, "pub.created": 7}),
              b"x" * 2_000_000, uow="U2")
        s.commit(qm1, "U2", gen=1, lrsn=0)
        pos: tuple[int, str] = (0, "")
        while (whole := s.topic_next(Q, *pos)).state == "P":
            head = s.topic_head(Q, *pos)
            assert (head.clock, head.state, head.lrsn, head.pub, head.messages) == \
                (whole.clock, "P", whole.lrsn, whole.pub, len(whole.messages))
            assert head.first == whole.messages[0][0]
            pos = (whole.lrsn, whole.pub)
        assert head.first is not None and head.first.properties["pub.created"] == 7
        assert s.topic_head(Q, *pos) == (whole.clock, "N", 0, "", 0, None, None)
        # Its reply carries no data: the head of a 2 MB publication is a descriptor's few hundred bytes.
        start = s.cf.redis.info("stats")["total_net_output_bytes"]
        s.topic_head(Q, *pos[:1], "")  # at the LRSN of the big one, before its id: the big one
        assert s.cf.redis.info("stats")["total_net_output_bytes"] - start < 20_000
        self.publish(s, qm1, "U3", "cc", 1, commit=False)  # open: the next one waits, in the head form too
        self.publish(s, qm1, "U4", "dd", 1)
        assert s.topic_head(Q, *pos).state == "W"

    def test_refusals(self, admin: Admin, s: Structure) -> None:
        with pytest.raises(UnknownObjectError):
            s.topic_next("NOQ", 0)
        with pytest.raises(UnknownObjectError):
            s.topic_head("NOQ", 0)
        admin.set_state(S, "RECOVERING")
        with pytest.raises(StructureFailedError, match="RECOVERING"):
            s.topic_next(Q, 0)
        with pytest.raises(StructureFailedError, match="RECOVERING"):
            s.topic_head(Q, 0)


class TestEntryData:
    def test_gives_each_available_entry_or_none_in_the_order_asked(self, s: Structure, qm1: Caller) -> None:
        for eid in ("a", "b", "c"):
            s.put(qm1, entry(eid, correlid="ab"), eid.encode() * 3)
        s.put(qm1, entry("uncommitted"), b"x", uow="U1")  # not available yet
        taken = s.get(qm1, Q, uow="U2", match="c", value="ab", now_ms=NOW).entry
        assert taken is not None and taken.id == "a"  # held by a get: not available
        got = s.entry_data(Q, ["c", "a", "nothing", "uncommitted", "b"])
        assert [(one[0].id, one[1]) if one else None for one in got] == [
            ("c", b"ccc"), None, None, None, ("b", b"bbb")]

    def test_an_entry_of_another_queue_is_not_given(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a", queue=Q2), b"a")
        assert s.entry_data(Q, ["a"]) == [None]

    def test_changes_nothing(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a"), b"a")
        before = dump(s)
        s.entry_data(Q, ["a", "b"])
        assert dump(s) == before

    def test_refusals(self, s: Structure) -> None:
        with pytest.raises(UnknownObjectError):
            s.entry_data("NOQ", ["a"])
        with pytest.raises(BadRequestError, match="1-1000 entry ids"):
            s.entry_data(Q, [])
        with pytest.raises(BadRequestError, match="1-1000 entry ids"):
            s.entry_data(Q, ["a"] * 1001)


class TestPeekScan:
    def test_a_pass_returns_every_match_in_bounded_batches(self, s: Structure, qm1: Caller) -> None:
        # More entries than a set keeps compact (set-max-listpack-entries, 128): a compact set is scanned whole in
        # one call whatever COUNT says (Redis 7.2 and Valkey), a larger one in batches of about COUNT.
        for i in range(200):
            s.put(qm1, entry(f"e{i}", correlid="ab"), b"%d" % i)
        s.put(qm1, entry("other", correlid="cd"), b"x")
        s.put(qm1, entry("uncommitted", correlid="ab"), b"x", uow="U1")
        assert s.get(qm1, Q, uow="U2", match="c", value="ab", now_ms=NOW).entry is not None  # one held: still seen
        seen: list[str] = []
        cursor, calls = "0", 0
        while True:
            cursor, batch = s.peek_scan(Q, "c", "ab", cursor, count=10)
            seen += [e.id for e, _ in batch]
            calls += 1
            if cursor == "0":
                break
        assert sorted(set(seen)) == sorted(f"e{i}" for i in range(200)) and calls > 1
        _, heads = s.peek_scan(Q, "c", "cd", "0", count=10, heads=True)  # descriptors alone
        assert [(e.id, e.length, d) for e, d in heads] == [("other", 1, b"")]

    def test_changes_nothing(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a", correlid="ab"), b"a")
        before = dump(s)
        s.peek_scan(Q, "c", "ab")
        assert dump(s) == before

    def test_refusals(self, admin: Admin, s: Structure) -> None:
        with pytest.raises(UnknownObjectError):
            s.peek_scan("NOQ", "c", "ab")
        with pytest.raises(BadRequestError, match="count"):
            s.peek_scan(Q, "c", "ab", count=0)
        admin.set_state(S, "RECOVERING")
        with pytest.raises(StructureFailedError, match="RECOVERING"):
            s.peek_scan(Q, "c", "ab")


class TestPclock:
    def test_counts_up_time_and_not_a_gap_longer_than_allowed(self, s: Structure) -> None:
        start = s.pclock(max_gap_ms=60_000).value
        time.sleep(0.2)
        ran = s.pclock(max_gap_ms=60_000).value - start
        assert 150 <= ran <= 2_000  # the CF's time between the ticks
        time.sleep(0.2)
        assert s.pclock(max_gap_ms=50).value == start + ran  # a gap over the limit is downtime: nothing added

    def test_two_ticks_at_once_count_the_time_once(self, s: Structure) -> None:
        s.pclock(max_gap_ms=60_000)
        time.sleep(0.1)
        a = s.pclock(max_gap_ms=60_000).value
        b = s.pclock(max_gap_ms=60_000).value
        assert 0 <= b - a < 50

    def test_gives_the_cf_s_own_time(self, s: Structure) -> None:
        server_ms = int(s.cf.redis.time()[0]) * 1000
        assert abs(s.pclock(max_gap_ms=1).cf_ms - server_ms) < 2_000

    def test_a_floor_raises_it_and_never_lowers_it(self, s: Structure) -> None:
        assert s.pclock(max_gap_ms=1, floor=10_000_000).value == 10_000_000
        assert s.pclock(max_gap_ms=1, floor=5).value >= 10_000_000

    def test_does_not_run_while_the_structure_is_unavailable(self, admin: Admin, s: Structure) -> None:
        before = s.pclock(max_gap_ms=10_000).value
        admin.set_state(S, "RECOVERING")
        with pytest.raises(StructureFailedError, match="RECOVERING"):
            s.pclock(max_gap_ms=10_000)
        time.sleep(0.3)
        admin.set_state(S, "ACTIVE")
        assert s.pclock(max_gap_ms=10_000).value - before < 100  # the RECOVERING time is not counted afterwards


class TestCommit:
    def test_puts_become_available_in_put_order_and_gets_are_deleted(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("got"), b"x")
        s.get(qm1, Q, uow="U1", now_ms=NOW)
        for eid in ("p1", "p2", "p3"):
            s.put(qm1, entry(eid), b"x", uow="U1")
        reply = s.commit(qm1, "U1", gen=1, lrsn=500)
        assert (reply.puts, reply.gets) == (3, 1) and reply.clock > 500
        assert [(e.id, e.state, e.lrsn, e.order[0]) for e, _ in s.browse(Q, 10, NOW)] == [
            ("p1", "CP", 500, 500), ("p2", "CP", 500, 500), ("p3", "CP", 500, 500)]
        assert s.info()["entries"] == "3" and held_uows(s) == set() and s.uow_entries("U1") == []

    def test_without_a_log_record_the_cf_clock_stamps_the_entries(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("p1", persistent=False), b"x", uow="U1")
        reply = s.commit(qm1, "U1", gen=1, lrsn=0)
        [(e, _)] = s.browse(Q, 10, NOW)
        assert e.lrsn == reply.clock

    def test_is_idempotent(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("p1"), b"x", uow="U1")
        s.commit(qm1, "U1", gen=1, lrsn=500)
        before = s.browse(Q, 10, NOW)
        again = s.commit(qm1, "U1", gen=1, lrsn=500)
        assert (again.puts, again.gets) == (0, 0) and s.browse(Q, 10, NOW) == before

    def test_an_outcome_decided_by_recovery_is_kept_for_the_owner(self, admin: Admin, s: Structure,
                                                                   qm1: Caller) -> None:
        s.put(qm1, entry("p1"), b"x", uow="U1")
        peer = join(admin, "QM2")
        assert s.commit(peer, "U1", gen=1, lrsn=500, decided_by_recovery=True).puts == 1
        assert tombstone(s, "U1") == "C"
        with pytest.raises(CompletedByRecoveryError):
            s.backout(qm1, "U1", gen=1, lrsn=600, has_data=False)
        owner = s.commit(qm1, "U1", gen=1, lrsn=600)  # the owner's retry: a no-op that learns the outcome
        assert (owner.puts, owner.gets) == (0, 0) and tombstone(s, "U1") is None

    def test_refuses_a_uow_backed_out_by_recovery_or_lost_with_the_cf(self, s: Structure, qm1: Caller) -> None:
        s.cf.redis.hset(keys.tomb(S), "UB", "B")
        with pytest.raises(BackedOutError, match="by recovery"):
            s.commit(qm1, "UB", gen=1, lrsn=500)
        assert tombstone(s, "UB") == "B"  # kept: the owner's backout learns it
        with pytest.raises(BackedOutError, match="lost with the CF"):
            s.commit(qm1, "U1", gen=7, lrsn=500)

    def test_a_uow_whose_work_here_was_purged_commits_as_a_no_op(self, s: Structure, qm1: Caller) -> None:
        """A purge discards messages, not outcomes: the owner's commit goes on on its other structures."""
        s.cf.redis.hset(keys.tomb(S), "UP", "P")
        again = s.commit(qm1, "UP", gen=7, lrsn=500)  # its generation is older than the purge's
        assert (again.puts, again.gets) == (0, 0) and tombstone(s, "UP") == "P"

    def test_refuses_a_record_below_the_recovery_floor(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("p1"), b"x", uow="U1")
        floor = s.backup_begin("B1", 1_000).floor
        with pytest.raises(FloorError) as refused:
            s.commit(qm1, "U1", gen=1, lrsn=floor - 1)
        assert refused.value.floor == floor
        assert s.commit(qm1, "U1", gen=1, lrsn=floor + 1).puts == 1

    def test_refuses_a_fenced_member(self, s: Structure, qm1: Caller) -> None:
        with pytest.raises(FencedError):
            s.commit(Caller("QM1", qm1.epoch - 1, Clock()), "U1", gen=1, lrsn=500)

    def test_stamps_the_lrsn_the_commit_counts_at_and_checks_the_floor_against_the_record(
            self, s: Structure, qm1: Caller) -> None:
        """A re-log (or a peer's RECOVERY record) counts at the first record of the decision: the entries get that
        LRSN, in get order before a commit that counts later, though the re-log itself lies above the floor."""
        s.put(qm1, entry("early"), b"x", uow="U1")
        s.put(qm1, entry("later"), b"x", uow="U2")
        floor = 1_000
        s.cf.redis.hset(keys.meta(S), "floor", floor)  # as a backup that began at 1000 leaves it
        s.commit(qm1, "U2", gen=1, lrsn=floor + 10)
        with pytest.raises(FloorError):
            s.commit(qm1, "U1", gen=1, lrsn=floor - 5)
        s.commit(qm1, "U1", gen=1, lrsn=floor + 20, at=floor - 5)
        assert [(e.id, e.lrsn, e.order[0]) for e, _ in s.browse(Q, 10, NOW)] == [
            ("early", floor - 5, floor - 5), ("later", floor + 10, floor + 10)]

    def test_a_uow_carried_over_by_a_restore_leaves_a_tombstone_for_every_retry(self, s: Structure,
                                                                                qm1: Caller) -> None:
        """A UOW held in an older generation and loaded by a restore (record in {S}:uows, new generation): after
        its commit, a retry from the owner (its old generation) is a no-op, not 'lost with the CF', however often."""
        s.cf.redis.hset(keys.meta(S), "gen", 9)
        s.put(qm1, entry("p1"), b"x", uow="U1", gen=0)  # joins in generation 9, as restore's load writes it
        assert s.commit(qm1, "U1", gen=1, lrsn=500).puts == 1
        assert tombstone(s, "U1") == "C"
        for _ in range(2):
            assert s.commit(qm1, "U1", gen=1, lrsn=600).puts == 0
        assert tombstone(s, "U1") == "C"


    # --- in bounded steps (the prelude's "Outcomes in bounded steps") ---------------------------------------------
    def test_a_large_uow_commits_in_steps_puts_in_put_order(self, s: Structure, qm1: Caller) -> None:
        for i in range(3):
            s.put(qm1, entry(f"g{i}"), b"x")
        for _ in range(3):
            s.get(qm1, Q, uow="U1", now_ms=NOW)
        for i in range(7):
            s.put(qm1, entry(f"p{i}", priority=i % 2), b"x", uow="U1")
        steps = []
        later = False
        while True:
            r = s.commit_step(qm1, "U1", gen=1, lrsn=500, later=later, step=2)
            steps.append(r)
            if not r.more:
                break
            later = True
            made = [e.id for e, _ in s.browse(Q, 20, NOW)]
            # every call leaves a prefix of the puts (per priority, in put order) available, and nothing else
            for p in (0, 1):
                mine = [x for x in made if int(x[1:]) % 2 == p]
                assert mine == [f"p{i}" for i in range(p, 7, 2)][:len(mine)]
            assert held_uows(s) == {"U1"}
        assert len(steps) > 4 and all(r.puts + r.gets <= 2 for r in steps)
        assert sum(r.puts for r in steps) == 7 and sum(r.gets for r in steps) == 3
        assert [e.id for e, _ in s.browse(Q, 20, NOW)] == ["p1", "p3", "p5", "p0", "p2", "p4", "p6"]
        assert {e.order[0] for e, _ in s.browse(Q, 20, NOW)} == {500}
        assert held_uows(s) == set() and s.info()["entries"] == "7"
        assert [k for k in s.cf.redis.scan_iter(match="{APP1}:uow*")] == []  # the work sets are gone

    @pytest.mark.timed
    @pytest.mark.slow
    def test_a_200000_entry_uow_commits_while_other_clients_keep_working(self, admin: Admin, s: Structure,
                                                                          qm1: Caller) -> None:
        """The case that fenced two members: one UOW of 200,000 puts. Its commit runs in bounded steps, and another
        member's CF calls (a get on another queue, a lease renewal) are answered within 250 ms at the 99th
        percentile all along (they had waited about 16 s)."""
        n = 200_000
        _put_many(s, qm1, n, uow="BIG", prefix="b", desc=Entry(id="x", queue=Q).pack())
        with another_member_probing(admin) as waits:
            t0 = time.perf_counter()
            reply = s.commit(qm1, "BIG", gen=1, lrsn=10**9)
            took = time.perf_counter() - t0
        assert reply.puts == n and s.depths()[Q]["CP"] == n
        p99 = _p99(waits, took)
        # A bound far below a lease (one call holds the CF for a few ms; one unbounded call held it 16-19 s),
        # with room for a loaded 2-core machine's scheduling of the probing thread itself.
        assert p99 < 0.25, f"another client's p99 wait {p99 * 1000:.1f} ms during a commit of {took:.1f} s"

    def test_the_stepped_result_is_the_whole_result(self, admin: Admin, s: Structure, qm1: Caller) -> None:
        """The same UOW committed in one call and in steps of one entry leaves the same structure."""
        def run(name: str, step: int) -> dict[bytes, object]:
            qa, qb = f"{name}A", f"{name}B"
            admin.ensure_structure(name, (qa, qb))
            caller = join(admin, "QM1")
            caller.clock.t = 100
            st = CF(admin.redis).structure(name)
            for i in range(4):
                st.put(caller, entry(f"c{i}", queue=qa, priority=3), b"c")
            st.get(caller, qa, uow="U1", now_ms=NOW)
            st.get(caller, qa, uow="U1", now_ms=NOW)
            for i in range(5):
                st.put(caller, entry(f"p{i}", queue=(qa, qb)[i % 2], priority=3), b"p", uow="U1")
            reply = st.commit(caller, "U1", gen=1, lrsn=900, step=step)
            assert (reply.puts, reply.gets) == (5, 2)
            r = admin.redis
            out: dict[bytes, object] = {}
            for k in r.scan_iter(match=keys.all_structure_keys_pattern(name)):
                kind = keys.text(r.type(k))
                if k.endswith((b":meta", b":fence")):
                    continue
                value = (r.lrange(k, 0, -1) if kind == "list" else sorted(r.smembers(k)) if kind == "set"
                         else r.hgetall(k) if kind == "hash" else kind)
                if k.endswith(b":ent"):  # descriptors decoded: the CF's module packs a map's keys in its own order
                    value = {f: sorted(msgpack.unpackb(v).items()) for f, v in r.hgetall(k).items()}
                out[k.replace(name.encode(), b"S")] = repr(value).replace(name, "S")
            return out
        assert run("APPW", 0) == run("APPS", 1)

    def test_a_half_applied_commit_is_finished_by_the_next_commit(self, admin: Admin, s: Structure,
                                                                 qm1: Caller) -> None:
        """The owner dies after two steps; a peer's commit (recovery) finishes it, keeps the first call's LRSN
        for the puts, and leaves a 'C' tombstone for the owner's retry."""
        for i in range(5):
            s.put(qm1, entry(f"p{i}"), b"x", uow="U1")
        assert s.commit_step(qm1, "U1", gen=1, lrsn=500, step=3).more
        assert s.commit_step(qm1, "U1", gen=1, lrsn=500, later=True, step=3).more
        done_early = [e.id for e, _ in s.browse(Q, 10, NOW)]
        assert 0 < len(done_early) < 5
        with pytest.raises(CompletedByRecoveryError, match="being committed"):  # no more work joins it
            s.put(qm1, entry("late"), b"x", uow="U1")
        peer = join(admin, "QM2")
        reply = s.commit(peer, "U1", gen=1, lrsn=700, decided_by_recovery=True, step=3)
        assert reply.puts == 5 - len(done_early)
        assert [(e.id, e.order[0]) for e, _ in s.browse(Q, 10, NOW)] == [(f"p{i}", 500) for i in range(5)]
        assert tombstone(s, "U1") == "C" and held_uows(s) == set()
        assert s.commit(qm1, "U1", gen=1, lrsn=500).puts == 0 and tombstone(s, "U1") is None

    def test_a_fenced_owner_finishes_the_commit_it_began(self, admin: Admin, s: Structure, qm1: Caller) -> None:
        """The commit is decided on the structure by its first call: a peer fencing the owner does not stop it
        (the peer's recovery would finish it the same way); once another caller finished it, the owner's next
        step answers done."""
        for i in range(4):
            s.put(qm1, entry(f"p{i}"), b"x", uow="U1")
        assert s.commit_step(qm1, "U1", gen=1, lrsn=500, step=2).more
        s.cf.redis.hset(keys.fence(S), "QM1", qm1.epoch + 1)  # as a peer's fence leaves it
        stale = Caller("QM1", qm1.epoch, qm1.clock)
        assert s.commit_step(stale, "U1", gen=1, lrsn=500, later=True, step=2).more
        s.commit(join(admin, "QM2"), "U1", gen=1, lrsn=500, decided_by_recovery=True)
        last = s.commit_step(stale, "U1", gen=1, lrsn=500, later=True, step=2)
        assert not last.more and (last.puts, last.gets) == (0, 0)
        assert len(s.browse(Q, 10, NOW)) == 4
        with pytest.raises(FencedError):  # a new commit of the fenced member is refused as ever
            s.commit(stale, "U2", gen=1, lrsn=600)

    def test_a_commit_of_a_uow_being_backed_out_is_refused(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("c"), b"x")
        s.get(qm1, Q, uow="U1", now_ms=NOW)
        for i in range(3):
            s.put(qm1, entry(f"p{i}"), b"x", uow="U1")
        assert s.backout_step(qm1, "U1", gen=1, lrsn=500, has_data=False, step=2).more
        with pytest.raises(BackedOutError, match="being backed out"):
            s.commit(qm1, "U1", gen=1, lrsn=600)
        assert s.backout(qm1, "U1", gen=1, lrsn=500, has_data=False, step=2).puts >= 0
        assert [(e.id, e.backout_count) for e, _ in s.browse(Q, 10, NOW)] == [("c", 1)]
        assert held_uows(s) == set()

    def test_a_failure_after_the_first_step_says_the_commit_may_be_applied(self, admin: Admin, s: Structure,
                                                                          qm1: Caller) -> None:
        for i in range(4):
            s.put(qm1, entry(f"p{i}"), b"x", uow="U1")
        calls = []
        real = s._step

        def failing(op: str, *args: object, **kw: object) -> object:
            calls.append(op)
            if len(calls) == 2:
                admin.set_state(S, "FAILED")
            return real(op, *args, **kw)  # type: ignore[arg-type]

        s._step = failing  # type: ignore[method-assign]
        with pytest.raises(StructureFailedError) as failed:
            s.commit(qm1, "U1", gen=1, lrsn=500, step=2)
        assert failed.value.maybe_applied
        admin.set_state(S, "ACTIVE")
        s._step = real  # type: ignore[method-assign]
        s.commit(qm1, "U1", gen=1, lrsn=500, step=2)
        assert len(s.browse(Q, 10, NOW)) == 4


class TestStanding:
    def test_tells_how_a_uow_stands(self, s: Structure, qm1: Caller) -> None:
        clock = s.put(qm1, entry("p1"), b"x", uow="UH").clock
        s.cf.redis.hset(keys.tomb(S), mapping={"UB": "B", "UC": "C"})
        assert [s.standing(qm1, u, gen=1) for u in ("UH", "UB", "UC", "UN")] == ["H", "B", "C", "N"]
        assert s.standing(qm1, "UN", gen=7) == "L"  # unknown, from another generation: lost with the CF
        assert s.info()["clock"] == str(clock)  # read only: no tick of its own

    def test_refuses_a_structure_that_is_not_active_and_a_fenced_member(self, admin: Admin, s: Structure,
                                                                        qm1: Caller) -> None:
        with pytest.raises(FencedError):
            s.standing(Caller("QM1", qm1.epoch - 1, Clock()), "U1", gen=1)
        admin.set_state(S, "FAILED")
        with pytest.raises(StructureFailedError):
            s.standing(qm1, "U1", gen=1)


class TestBackout:
    def test_puts_are_deleted_and_gets_return_to_their_place(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a"), b"a")
        b_lrsn = s.put(qm1, entry("b"), b"b").clock
        s.get(qm1, Q, uow="U1", now_ms=NOW)
        s.put(qm1, entry("p1"), b"x", uow="U1")
        reply = s.backout(qm1, "U1", gen=1, lrsn=500, has_data=False)
        assert (reply.puts, reply.gets) == (1, 1)
        assert [(e.id, e.backout_count, e.lrsn) for e, _ in s.browse(Q, 10, NOW)] == [("a", 1, 500),
                                                                                      ("b", 0, b_lrsn)]
        assert s.info()["entries"] == "2" and held_uows(s) == set()

    def test_while_a_backup_runs_persistent_gets_need_their_data_logged(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a"), b"a")
        s.put(qm1, entry("np", persistent=False), b"np")
        s.get(qm1, Q, uow="U1", now_ms=NOW)
        s.get(qm1, Q, uow="U2", now_ms=NOW)
        start = s.backup_begin("B1", 0).start
        with pytest.raises(BackupActiveError):
            s.backout(qm1, "U1", gen=1, lrsn=start + 1, has_data=False)
        assert s.backout(qm1, "U1", gen=1, lrsn=start + 2, has_data=True).gets == 1
        assert s.backout(qm1, "U2", gen=1, lrsn=0, has_data=False).gets == 1  # a non-persistent get: no data

    def test_a_stale_backup_mark_is_no_backup_running(self, s: Structure, qm1: Caller) -> None:
        """A mark whose lease has ended asks for no data, and stays stale: its backup can no longer end well."""
        s.put(qm1, entry("a"), b"a")
        s.get(qm1, Q, uow="U1", now_ms=NOW)
        s.backup_begin("B1", 0, lease_ms=1)
        time.sleep(0.01)
        assert s.backout(qm1, "U1", gen=1, lrsn=0, has_data=False).gets == 1
        assert s.info()["backup"] == "B1" and s.info()["backup_until"] == "0"
        with pytest.raises(BackupEndedError, match="lease ended"):
            s.backup_end("B1", 0, ok=True)

    def test_an_outcome_decided_by_recovery_is_kept_for_the_owner(self, admin: Admin, s: Structure,
                                                                   qm1: Caller) -> None:
        s.put(qm1, entry("p1"), b"x", uow="U1")
        assert s.backout(join(admin, "QM2"), "U1", gen=1, lrsn=500, has_data=True,
                         decided_by_recovery=True).puts == 1
        assert tombstone(s, "U1") == "B"
        owner = s.backout(qm1, "U1", gen=1, lrsn=600, has_data=False)  # the owner's retry learns it
        assert owner == OutcomeReply(owner.clock, 0, 0) and tombstone(s, "U1") is None

    def test_refuses_a_uow_committed_by_recovery(self, s: Structure, qm1: Caller) -> None:
        s.cf.redis.hset(keys.tomb(S), "UC", "C")
        with pytest.raises(CompletedByRecoveryError):
            s.backout(qm1, "UC", gen=1, lrsn=500, has_data=False)

    def test_a_uow_whose_work_here_was_purged_backs_out_as_a_no_op(self, s: Structure, qm1: Caller) -> None:
        s.cf.redis.hset(keys.tomb(S), "UP", "P")
        again = s.backout(qm1, "UP", gen=7, lrsn=500, has_data=False)
        assert (again.puts, again.gets) == (0, 0) and tombstone(s, "UP") == "P"

    def test_refuses_a_record_below_the_recovery_floor(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("p1"), b"x", uow="U1")
        floor = s.backup_begin("B1", 1_000).floor
        with pytest.raises(FloorError):
            s.backout(qm1, "U1", gen=1, lrsn=floor - 1, has_data=True)


    # --- in bounded steps (the prelude's "Outcomes in bounded steps") ---------------------------------------------
    def test_a_large_uow_backs_out_in_steps_gets_back_at_their_place(self, s: Structure, qm1: Caller) -> None:
        for i in range(6):
            s.put(qm1, entry(f"c{i}"), b"x")
        for _ in range(4):
            s.get(qm1, Q, uow="U1", now_ms=NOW)
        for i in range(3):
            s.put(qm1, entry(f"p{i}"), b"x", uow="U1")
        later, steps = False, 0
        while True:
            r = s.backout_step(qm1, "U1", gen=1, lrsn=500, has_data=False, later=later, step=2)
            steps += 1
            back = [e.id for e, _ in s.browse(Q, 20, NOW)]
            assert back == sorted(back)  # in get order at every step: gets still held are just not there yet
            if not r.more:
                break
            later = True
        assert steps > 3
        assert [(e.id, e.backout_count) for e, _ in s.browse(Q, 20, NOW)] == [
            (f"c{i}", 1 if i < 4 else 0) for i in range(6)]
        assert held_uows(s) == set() and s.info()["entries"] == "6"

    def test_a_backout_of_a_uow_whose_commit_began_finishes_the_commit(self, admin: Admin, s: Structure,
                                                                      qm1: Caller) -> None:
        """A peer backing out a UOW it finds in the CF only (nothing logged) after the owner's commit began there:
        puts made available cannot be taken back, so the commit is finished, and the owner learns it."""
        s.put(qm1, entry("c"), b"x")
        s.get(qm1, Q, uow="U1", now_ms=NOW)
        for i in range(4):
            s.put(qm1, entry(f"p{i}", persistent=False), b"x", uow="U1")
        assert s.commit_step(qm1, "U1", gen=1, lrsn=0, step=2).more
        peer = join(admin, "QM2")
        reply = s.backout(peer, "U1", gen=1, lrsn=0, has_data=True, decided_by_recovery=True, step=2)
        assert (reply.puts, reply.gets) == (0, 0)
        assert [e.id for e, _ in s.browse(Q, 10, NOW)] == [f"p{i}" for i in range(4)]
        assert tombstone(s, "U1") == "C" and held_uows(s) == set()
        with pytest.raises(CompletedByRecoveryError):
            s.backout(qm1, "U1", gen=1, lrsn=0, has_data=False)

    def test_refuses_at_a_later_step_when_a_backup_began_and_the_gets_need_their_data(
            self, s: Structure, qm1: Caller) -> None:
        for i in range(3):
            s.put(qm1, entry(f"c{i}"), b"x")
        for _ in range(3):
            s.get(qm1, Q, uow="U1", now_ms=NOW)
        assert s.backout_step(qm1, "U1", gen=1, lrsn=500, has_data=False, step=2).more
        s.backup_begin("B1", 0)
        with pytest.raises(BackupActiveError):
            s.backout(qm1, "U1", gen=1, lrsn=600, has_data=False, step=2)
        assert s.backout(qm1, "U1", gen=1, lrsn=700, has_data=True, step=2).gets == 3
        assert held_uows(s) == set()


class TestExpire:
    def test_moves_expired_messages_then_purges_them(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("p", expiry=1_000), b"x")
        s.put(qm1, entry("np", expiry=1_000, persistent=False), b"x")
        s.put(qm1, entry("live", expiry=LONG), b"x")
        first = s.expire(NOW)
        assert first.ids == ["p"] and first.purged == 0  # only persistent ones are for the caller to log
        assert s.depths()[Q] == {"UP": 0, "CP": 1, "UG": 0, "EX": 2}
        second = s.expire(NOW)
        assert second.ids == [] and second.purged == 2
        assert s.depths()[Q]["EX"] == 0 and s.info()["entries"] == "1"

    def test_a_held_message_expires_once_it_is_available_again(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("held", expiry=1_000), b"x", uow="U1")
        assert s.expire(NOW).ids == []
        assert s.depths()[Q]["UP"] == 1
        assert s.cf.redis.zscore(keys.expiry(S), "held") == NOW + 1_000  # looked at again later

    def test_sweeps_in_bounded_steps(self, s: Structure, qm1: Caller) -> None:
        for i in range(7):
            s.put(qm1, entry(f"e{i}", expiry=1_000), b"x")
        s.put(qm1, entry("live", expiry=LONG), b"x")
        raw = s.cf.script("expire")
        first = raw(keys=keys.script_keys(S), args=[NOW, 1000, 3])
        assert first[-1] == 1 and first[-2] == 3  # three looked at, more to do
        swept = s.expire(NOW, step=3)  # called again until every message due is moved
        assert sorted(swept.ids) == [f"e{i}" for i in range(3, 7)]
        assert swept.purged + s.expire(NOW, step=2).purged == 7
        assert s.info()["entries"] == "1"

    def test_refuses_a_structure_that_is_not_active(self, admin: Admin, s: Structure) -> None:
        admin.set_state(S, "FAILED")
        with pytest.raises(StructureFailedError):
            s.expire(NOW)
        with pytest.raises(StructureFailedError):
            CF(admin.redis).structure("NOPE").expire(NOW)


class TestUowEntries:
    def test_the_entries_a_uow_holds_with_their_data(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("g"), b"got")
        s.get(qm1, Q, uow="U1", now_ms=NOW)
        s.put(qm1, entry("p"), b"put", uow="U1")
        s.put(qm1, entry("other"), b"x", uow="U2")
        depths = s.depths()
        assert sorted((e.id, e.state, d) for e, d in s.uow_entries("U1")) == [("g", "UG", b"got"),
                                                                               ("p", "UP", b"put")]
        assert s.depths() == depths  # read only
        assert s.uow_entries("NOSUCH") == []


class TestMemberUows:
    def test_the_uows_a_member_holds(self, admin: Admin, s: Structure, qm1: Caller) -> None:
        first = s.put(qm1, entry("a"), b"x", uow="U1").clock
        s.put(qm1, entry("b"), b"x", uow="U1")
        s.put(join(admin, "QM2"), entry("c"), b"x", uow="U2")
        assert s.member_uows("QM1") == {"U1": {"o": "QM1", "f": first, "g": 1}}  # f: its first LRSN here
        assert set(s.member_uows("QM2")) == {"U2"}
        assert s.member_uows("QM3") == {}


class TestBackupBegin:
    def test_marks_the_backup_and_sets_the_floor(self, s: Structure) -> None:
        begun = s.backup_begin("B1", 1_000)
        assert begun.start == 1_001 and begun.floor == begun.start
        assert s.info()["backup"] == "B1" and s.info()["floor"] == str(begun.floor)

    def test_the_floor_goes_down_to_the_first_lrsn_of_a_uow_holding_entries(self, s: Structure,
                                                                            qm1: Caller) -> None:
        first = s.put(qm1, entry("a"), b"x", uow="U1").clock
        begun = s.backup_begin("B1", 1_000)
        assert begun.floor == first < begun.start

    def test_refuses_a_second_backup_and_a_structure_not_active(self, admin: Admin, s: Structure) -> None:
        s.backup_begin("B1", 0)
        with pytest.raises(BackupRunningError, match="B1"):
            s.backup_begin("B2", 0)
        admin.set_state(S, "FAILED")
        with pytest.raises(StructureFailedError):
            s.backup_begin("B3", 0)
        with pytest.raises(StructureFailedError, match="not in the CF"):
            CF(admin.redis).structure("NOPE").backup_begin("B4", 0)

    def test_the_mark_carries_a_lease_in_the_cf_time(self, s: Structure) -> None:
        before = s.cf.redis.time()
        s.backup_begin("B1", 0, lease_ms=60_000)
        until = int(s.info()["backup_until"])
        assert before[0] * 1000 + 60_000 <= until <= (before[0] + 5) * 1000 + 60_000
        mark = s.backup_mark()
        assert mark is not None and mark.backup == "B1" and not mark.stale and 55_000 < (mark.left_ms or 0) <= 60_000

    def test_refuses_while_the_lease_runs_and_names_the_way_out(self, s: Structure) -> None:
        s.backup_begin("B1", 0, lease_ms=60_000)
        with pytest.raises(BackupRunningError, match=r"B1 of this structure is running \(its lease ends in .* s "
                                                     r"unless it renews it\); cfbackup cancel ends it"):
            s.backup_begin("B2", 0)
        assert s.info()["backup"] == "B1"

    def test_takes_over_a_stale_mark_and_names_it(self, s: Structure) -> None:
        s.backup_begin("B1", 0, lease_ms=1)
        time.sleep(0.01)
        mark = s.backup_mark()
        assert mark is not None and mark.backup == "B1" and mark.stale
        begun = s.backup_begin("B2", 0, lease_ms=60_000)
        assert begun.took_over == "B1" and s.info()["backup"] == "B2"
        with pytest.raises(BackupEndedError):
            s.backup_end("B1", 0, ok=False)  # the stale backup, come back, ends nothing of B2's
        assert s.info()["backup"] == "B2"

    def test_a_take_over_never_lowers_the_floor(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("a"), b"x", uow="U1")  # a UOW with a low first LRSN: B2's own floor is below B1's stored
        s.backup_begin("B1", 0, lease_ms=1)
        s.cf.redis.hset(keys.meta(S), "floor", 5_000)  # as a relog pass raises it
        time.sleep(0.01)
        begun = s.backup_begin("B2", 10, lease_ms=60_000)
        assert begun.took_over == "B1" and begun.floor < 5_000 and s.info()["floor"] == "5000"

    def test_a_mark_without_a_lease_lasts_until_it_is_cleared(self, s: Structure) -> None:
        s.cf.redis.hset(keys.meta(S), "backup", "B0")
        with pytest.raises(BackupRunningError, match="B0"):
            s.backup_begin("B1", 0)
        mark = s.backup_mark()
        assert mark is not None and mark.left_ms is None and not mark.stale

    def test_refuses_a_lease_that_is_not_positive(self, s: Structure) -> None:
        with pytest.raises(BadRequestError, match="lease must be a positive number"):
            s.backup_begin("B1", 0, lease_ms=0)
        assert "backup" not in s.info() and s.info()["clock"] == "0"

    def test_refuses_a_structure_running_from_a_warm_start(self, admin: Admin, s: Structure) -> None:
        """No backup of a WARM structure (empty of its persistent content): it would become the base of the later
        HOT start, which replays the logs only from its floor, and everything committed before the loss would be
        lost."""
        admin.redis.hset(keys.meta(S), mapping={"pstore": "DISCONNECTED", "started": "WARM"})
        with pytest.raises(StructureFailedError, match="runs from a WARM start"):
            s.backup_begin("B1", 0)
        info = s.info()
        assert "backup" not in info and info["floor"] == "0" and info["clock"] == "0"  # nothing changed


class TestRelogBegin:
    def test_takes_the_lock_raises_the_floor_and_reads_the_cpl(self, s: Structure, qm1: Caller, admin: Admin) -> None:
        first = s.put(qm1, entry("a"), b"x", uow="U1").clock
        begun = s.relog_begin(qm1, now_ms=NOW, lease_ms=1_000)
        assert begun.cpl is None and begun.gen == 1 and begun.first == first < begun.begin
        assert s.info()["floor"] == str(begun.begin) and s.info()["relog_owner"] == "QM1"
        qm2 = join(admin, "QM2")
        with pytest.raises(RelogBusyError, match="QM1"):
            s.relog_begin(qm2, now_ms=NOW, lease_ms=1_000)
        assert s.relog_begin(qm2, now_ms=NOW + 1_000, lease_ms=1_000).begin > begun.begin  # the lease ran out

    def test_never_lowers_the_floor_and_a_backup_keeps_it(self, s: Structure, qm1: Caller) -> None:
        s.cf.redis.hset(keys.meta(S), "floor", 10**12)
        s.relog_begin(qm1, now_ms=NOW, lease_ms=1_000)
        assert s.info()["floor"] == str(10**12)
        begun = s.backup_begin("B1", 1)
        assert begun.floor < 10**12 and s.info()["floor"] == str(10**12)

    def test_refuses_a_fenced_member(self, s: Structure, qm1: Caller) -> None:
        with pytest.raises(FencedError):
            s.relog_begin(Caller("QM1", qm1.epoch + 1, Clock()), now_ms=NOW, lease_ms=1_000)
        assert "relog_owner" not in s.info()

    def test_no_pass_while_the_structure_runs_from_a_warm_start(self, s: Structure, qm1: Caller) -> None:
        """A pass over the empty WARM structure would be a newer restore base than its backups: log retention
        released the segments the HOT start needs (found by helper SX)."""
        s.cf.redis.hset(keys.meta(S), "started", "WARM")
        before = dump(s)
        with pytest.raises(RelogBusyError, match="WARM"):
            s.relog_begin(qm1, now_ms=NOW, lease_ms=1_000)
        assert dump(s) == before


class TestRelogScan:
    def test_returns_the_persistent_entries_whose_newest_copy_is_old(self, s: Structure, qm1: Caller) -> None:
        old = s.put(qm1, entry("old"), b"o", uow="U1").clock
        s.commit(qm1, "U1", gen=1, lrsn=0)
        s.put(qm1, entry("np", persistent=False), b"n")
        new = s.put(qm1, entry("new"), b"n2", uow="U2").clock
        batch = s.relog_scan(qm1, threshold=old, count=100)
        assert batch.cursor == "0" and batch.scanned == 3
        assert [(e.id, d) for e, d, _ in batch.copies] == [("old", b"o")]
        assert {e.id for e, _, _ in s.relog_scan(qm1, threshold=-1).copies} == {"old", "new"}
        held = [raw for e, _, raw in s.relog_scan(qm1, threshold=new).copies if e.id == "new"]
        assert held[0]["st"] == "UP" and held[0]["u"] == "U2"  # copied as held, with its UOW

    def test_a_marked_entry_is_old_only_below_its_mark(self, s: Structure, qm1: Caller) -> None:
        put = s.put(qm1, entry("a"), b"x", uow="U1").clock
        assert s.relog_end(qm1, relog_lrsn=put + 100, ids=["a", "gone"]) == 1
        assert s.relog_scan(qm1, threshold=put + 99).copies == []
        assert len(s.relog_scan(qm1, threshold=put + 100).copies) == 1


class TestRelogEnd:
    def test_marks_only_grow_and_the_cpl_is_stored_by_the_lock_holder(self, s: Structure, qm1: Caller,
                                                                      admin: Admin) -> None:
        s.put(qm1, entry("a"), b"x", uow="U1")
        s.relog_end(qm1, relog_lrsn=500, ids=["a"])
        assert s.relog_end(qm1, relog_lrsn=400, ids=["a"]) == 0  # a stale pass never hides a newer copy
        qm2 = join(admin, "QM2")
        s.relog_begin(qm1, now_ms=NOW, lease_ms=1_000)
        s.relog_end(qm2, relog_lrsn=0, ids=(), cpl={"g": 1, "p": [[1, 2]]})
        assert "relog_cpl" not in s.info() and s.info()["relog_owner"] == "QM1"  # not the holder: nothing
        s.relog_end(qm1, relog_lrsn=0, ids=(), cpl={"g": 1, "p": [[1, 2]]})
        assert "relog_owner" not in s.info() and s.relog_begin(qm2, now_ms=NOW, lease_ms=1).cpl == {
            "g": 1, "p": [[1, 2]]}


class TestBackupEnd:
    def test_clears_the_mark_and_records_a_good_backup(self, s: Structure) -> None:
        start = s.backup_begin("B1", 0).start
        assert s.backup_end("B1", 0, ok=True) > start
        assert "backup" not in s.info() and s.info()["last_backup"] == "B1"
        s.backup_begin("B2", 0)
        s.backup_end("B2", 0, ok=False)
        assert "backup" not in s.info() and s.info()["last_backup"] == "B1"

    def test_refuses_a_backup_that_is_not_the_one_running(self, s: Structure) -> None:
        with pytest.raises(BadRequestError, match="not the one running"):
            s.backup_end("B1", 0, ok=True)
        s.backup_begin("B1", 0)
        with pytest.raises(BadRequestError):
            s.backup_end("B2", 0, ok=True)
        assert s.info()["backup"] == "B1"

    def test_ends_ok_only_while_its_lease_runs_and_failed_whenever_the_mark_is_its_own(self, s: Structure) -> None:
        s.backup_begin("B1", 0, lease_ms=1)
        time.sleep(0.01)
        clock = s.info()["clock"]
        with pytest.raises(BackupEndedError, match="lease ended .* it cannot end ok"):
            s.backup_end("B1", 0, ok=True)
        assert s.info()["backup"] == "B1" and s.info()["clock"] == clock  # the refusal changed nothing
        s.backup_end("B1", 0, ok=False)
        info = s.info()
        assert "backup" not in info and "backup_until" not in info and "last_backup" not in info


class TestBackupRenew:
    def test_moves_the_lease_on(self, s: Structure) -> None:
        s.backup_begin("B1", 0, lease_ms=1_000)
        first = int(s.info()["backup_until"])
        assert s.backup_renew("B1", lease_ms=60_000) == 60_000
        assert int(s.info()["backup_until"]) >= first + 59_000

    def test_refuses_a_mark_that_is_not_its_own_and_changes_nothing(self, s: Structure) -> None:
        with pytest.raises(BackupEndedError, match="B1 is not the one running"):
            s.backup_renew("B1")
        s.backup_begin("B2", 0, lease_ms=60_000)
        until = s.info()["backup_until"]
        with pytest.raises(BackupEndedError, match="cancelled, or a later backup took its place"):
            s.backup_renew("B1")
        assert s.info()["backup"] == "B2" and s.info()["backup_until"] == until

    def test_refuses_once_the_lease_has_ended(self, s: Structure) -> None:
        s.backup_begin("B1", 0, lease_ms=1)
        time.sleep(0.01)
        with pytest.raises(BackupEndedError, match="its lease ended .* s ago"):
            s.backup_renew("B1", lease_ms=60_000)
        mark = s.backup_mark()
        assert mark is not None and mark.stale  # nothing changed: still stale

    def test_refuses_a_lease_that_is_not_positive(self, s: Structure) -> None:
        s.backup_begin("B1", 0)
        with pytest.raises(BadRequestError, match="lease must be a positive number"):
            s.backup_renew("B1", lease_ms=-5)


class TestBackupCancel:
    def test_ends_a_running_backup_whose_renewal_and_end_are_then_refused(self, s: Structure) -> None:
        s.backup_begin("B0", 0)
        s.backup_end("B0", 0, ok=True)
        floor = s.backup_begin("B1", 0, lease_ms=60_000).floor
        cancelled = s.backup_cancel()
        assert cancelled.backup == "B1" and cancelled.left_ms is not None and cancelled.left_ms > 50_000
        info = s.info()
        assert "backup" not in info and "backup_until" not in info
        assert info["floor"] == str(floor) and info["last_backup"] == "B0"  # the floor never goes down
        with pytest.raises(BackupEndedError):
            s.backup_renew("B1")
        with pytest.raises(BackupEndedError):
            s.backup_end("B1", 0, ok=True)
        assert s.backup_begin("B2", 0).took_over == ""

    def test_ends_a_stale_mark(self, s: Structure) -> None:
        s.backup_begin("B1", 0, lease_ms=1)
        time.sleep(0.01)
        cancelled = s.backup_cancel()
        assert cancelled.backup == "B1" and cancelled.left_ms is not None and cancelled.left_ms <= 0

    def test_nothing_to_cancel_and_only_the_named_backup(self, s: Structure) -> None:
        assert s.backup_cancel() == ("", None)
        s.cf.redis.hset(keys.meta(S), "backup", "B0")  # a mark without a lease
        assert s.backup_cancel("B0") == ("B0", None)
        s.backup_begin("B1", 0)
        with pytest.raises(BackupEndedError, match="B2 is not the one running"):
            s.backup_cancel("B2")
        assert s.info()["backup"] == "B1"

    def test_refuses_a_structure_not_in_the_cf(self, admin: Admin) -> None:
        with pytest.raises(StructureFailedError, match="not in the CF"):
            CF(admin.redis).structure("NOPE").backup_cancel()


class TestBackupWithdraw:
    def test_sets_last_backup_back_only_while_it_names_the_withdrawn_backup(self, s: Structure) -> None:
        """A backup that ended ok and could not be kept is withdrawn: last_backup names the one before it again
        (or none); a last_backup that has moved on (a later backup, a restore's point) is left as it is."""
        s.backup_begin("B1", 0)
        s.backup_end("B1", 0, ok=True)
        s.backup_begin("B2", 0)
        s.backup_end("B2", 0, ok=True)
        assert s.backup_withdraw("B2", "B1") is True
        assert s.info()["last_backup"] == "B1"
        assert s.backup_withdraw("B2", "B0") is False  # names B1 now: not touched
        assert s.info()["last_backup"] == "B1"
        assert s.backup_withdraw("B1", "") is True
        assert "last_backup" not in s.info()
        assert s.backup_withdraw("B1", "") is False


class TestSnapshot:
    def test_the_ids_in_one_state(self, s: Structure, qm1: Caller) -> None:
        for eid, p in (("a", 0), ("b", 9), ("c", 0)):
            s.put(qm1, entry(eid, priority=p), b"x")
        s.put(qm1, entry("d"), b"x")
        s.put(qm1, entry("other", queue=Q2), b"x")
        s.get(qm1, Q2, uow="U1", now_ms=NOW)
        s.put(qm1, entry("up"), b"x", uow="U1")
        s.put(qm1, entry("old", expiry=1_000), b"x")
        s.expire(NOW)
        assert s.snapshot("CP") == ["b", "a", "c", "d"]  # get order
        assert (s.snapshot("UP"), s.snapshot("UG"), s.snapshot("EX")) == (["up"], ["other"], ["old"])
        assert s.snapshot_raw("CP") == [b"b", b"a", b"c", b"d"]  # the same ids as the CF's bytes (a backup's fetch)

    def test_refuses_an_unknown_state(self, s: Structure) -> None:
        with pytest.raises(BadRequestError, match="unknown state"):
            s.snapshot("XX")

    STATES = ("UG", "UP", "CP", "EX")

    @staticmethod
    def calls(s: Structure, command: str) -> int:
        """How many times the CF has run `command` (INFO commandstats)."""
        return int(s.cf.redis.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))

    @staticmethod
    def scripts_run(s: Structure, monkeypatch: pytest.MonkeyPatch) -> list[str]:
        """The operations whose script the structure's CF runs from now on, in order."""
        ran: list[str] = []
        run = s.cf.run

        def recorded(op: str, structure: str, args: Any) -> Any:
            ran.append(op)
            return run(op, structure, args)

        monkeypatch.setattr(s.cf, "run", recorded)
        return ran

    def fill(self, s: Structure, qm1: Caller) -> None:
        for k, p in enumerate((0, 9, 4, 0, 9)):
            s.put(qm1, entry(f"c{k}", priority=p), b"x")
            s.put(qm1, entry(f"d{k}", queue=Q2, priority=p), b"x")
        s.get(qm1, Q, uow="U1", now_ms=NOW)
        s.put(qm1, entry("up", queue=Q2), b"x", uow="U1")
        s.put(qm1, entry("old", expiry=1_000), b"x")
        s.expire(NOW)

    def test_is_one_transaction_of_the_cf_with_the_scripts_answer(self, s: Structure, qm1: Caller) -> None:
        """The snapshot is taken as a transaction of LRANGEs (the CF serves their replies natively), not by the
        script, and answers what the script answers in every state: every queue, every priority, get order."""
        self.fill(s, qm1)
        evals, execs = self.calls(s, "evalsha"), self.calls(s, "exec")
        got = {st: s.snapshot_raw(st) for st in self.STATES}
        assert (self.calls(s, "evalsha"), self.calls(s, "exec")) == (evals, execs + len(self.STATES))
        assert got == {st: list(s.cf.run("snapshot", S, [st])) for st in self.STATES}
        assert got["CP"] == [b"c4", b"c2", b"c0", b"c3", b"d1", b"d4", b"d2", b"d0", b"d3"]  # Q1 then Q2
        assert (got["UG"], got["UP"], got["EX"]) == ([b"c1"], [b"up"], [b"old"])

    def test_a_queue_defined_between_the_transactions_two_reads_is_taken_again(
            self, s: Structure, qm1: Caller, admin: Admin, monkeypatch: pytest.MonkeyPatch) -> None:
        """The queue set is read to name the lists, and read again in the transaction: a queue defined in between
        (its entries not in the lists named) makes the snapshot be taken again, with that queue's entries."""
        self.fill(s, qm1)
        read = bulk._queue_names
        reads: list[int] = []

        def queue_names(client: Any, structure: str) -> set[str]:
            names = read(client, structure)
            if not reads:
                admin.define_queue("Q3", S)
                s.put(qm1, entry("new", queue="Q3"), b"x")
            reads.append(len(names))
            return names

        monkeypatch.setattr(bulk, "_queue_names", queue_names)
        scripts = self.scripts_run(s, monkeypatch)
        got = s.snapshot_raw("CP")
        assert reads == [2, 3] and "snapshot" not in scripts
        assert b"new" in got and sorted(got) == sorted(s.cf.run("snapshot", S, ["CP"]))

    def test_a_queue_set_that_keeps_changing_leaves_the_snapshot_to_the_script(
            self, s: Structure, qm1: Caller, monkeypatch: pytest.MonkeyPatch) -> None:
        """A queue set that changes under every transaction tried: after SNAPSHOT_TRIES, the script takes the
        snapshot in one step (it always can)."""
        self.fill(s, qm1)
        read = bulk._queue_names
        reads: list[int] = []

        def queue_names(client: Any, structure: str) -> set[str]:
            names = read(client, structure)
            reads.append(len(names))
            client.sadd(keys.queues(S), f"QX{len(reads)}")
            return names

        monkeypatch.setattr(bulk, "_queue_names", queue_names)
        scripts = self.scripts_run(s, monkeypatch)
        got = s.snapshot_raw("CP")
        assert len(reads) == bulk.SNAPSHOT_TRIES and scripts == ["snapshot"]
        monkeypatch.setattr(bulk, "_queue_names", read)
        assert got == s.snapshot_raw("CP") and len(got) == 9


# --- the admin operations ----------------------------------------------------------------------------------------
class TestAdminHeartbeat:
    def test_renews_the_lease_of_a_current_member(self, admin: Admin) -> None:
        epoch = admin.join("QM1", {}, lease_ms=1_000)
        assert admin.heartbeat("QM1", epoch, 60_000) == 1
        assert admin.redis.pttl(keys.lease("QM1")) > 1_000

    def test_a_fenced_member_is_told_so_and_keeps_no_lease(self, admin: Admin) -> None:
        epoch = admin.join("QM1", {}, lease_ms=60_000)
        admin.redis.delete(keys.lease("QM1"))  # its lease lapsed ...
        assert admin.fence("QM1") > epoch  # ... and a peer fenced it
        assert admin.heartbeat("QM1", epoch, 60_000) == 0
        assert not admin.redis.exists(keys.lease("QM1"))

    def test_an_unknown_member_must_join_again(self, admin: Admin) -> None:
        assert admin.heartbeat("QM9", 1, 60_000) == -1  # e.g. the admin structure was lost with the CF
        assert not admin.redis.exists(keys.lease("QM9"))


class TestAdminFence:
    def test_a_lapsed_member_gets_a_new_epoch_everywhere(self, admin: Admin) -> None:
        old = admin.join("QM1", {}, lease_ms=60_000)
        admin.redis.delete(keys.lease("QM1"))
        before = int(time.time() * 1000)
        new = admin.fence("QM1")
        assert new > old and new >= before
        assert admin.epoch("QM1") == new
        assert int(admin.redis.hget(keys.fence(S), "QM1") or 0) == new

    def test_a_member_holding_a_lease_is_left_alone(self, admin: Admin) -> None:
        epoch = admin.join("QM1", {}, lease_ms=60_000)
        assert admin.fence("QM1") == 0
        assert admin.epoch("QM1") == epoch and admin.redis.hget(keys.fence(S), "QM1") == str(epoch).encode()


    @pytest.mark.parametrize("value", ["hash", "list", "set", "string without a time to live"])
    def test_a_lease_key_holding_no_lease_fences_nobody_and_is_repaired(self, admin: Admin, value: str) -> None:
        """Whoever can write the key (a holder of a CF password) cannot fence a live member by putting another
        type, or a value with no time to live, at its lease key; a dead member's repaired lease lapses and it
        is fenced then."""
        epoch = admin.join("QM1", {}, lease_ms=60_000)
        lease = keys.lease("QM1")
        admin.redis.delete(lease)
        {"hash": lambda: admin.redis.hset(lease, "x", "y"), "list": lambda: admin.redis.rpush(lease, "x"),
         "set": lambda: admin.redis.sadd(lease, "x"),
         "string without a time to live": lambda: admin.redis.set(lease, str(epoch))}[value]()
        assert admin.fence("QM1", repair_ms=300) == 0
        assert admin.epoch("QM1") == epoch and admin.redis.type(lease) == b"string"
        assert 0 < admin.redis.pttl(lease) <= 300
        assert admin.heartbeat("QM1", epoch, 60_000) == 1  # the live member renews it
        assert admin.redis.pttl(lease) > 1_000 and admin.fence("QM1") == 0
        admin.redis.delete(lease)
        admin.redis.hset(lease, "x", "y")
        assert admin.fence("QM1", repair_ms=100) == 0
        time.sleep(0.2)  # a dead member renews nothing: the repaired lease lapses
        assert admin.fence("QM1") > epoch


class TestAdminForget:
    def test_a_recovered_member_is_forgotten_unless_it_joined_again(self, admin: Admin) -> None:
        old = admin.join("QM1", {}, lease_ms=60_000)
        admin.redis.delete(keys.lease("QM1"))
        fenced = admin.fence("QM1")
        assert fenced > old
        newer = admin.join("QM1", {}, lease_ms=60_000)  # it restarted while a peer recovered it
        assert not admin.forget_member("QM1", fenced)
        assert "QM1" in admin.members() and admin.epoch("QM1") == newer
        assert admin.forget_member("QM1", newer)
        assert "QM1" not in admin.members()
        assert admin.forget_member("QM1", newer)  # idempotent


class TestAdminRaiseFence:
    def test_a_fence_only_moves_up(self, admin: Admin) -> None:
        admin.join_structures("QM1", 5)
        admin.join_structures("QM1", 3)  # a late write of an older epoch
        assert admin.redis.hget(keys.fence(S), "QM1") == b"5"
        admin.join_structures("QM1", 5)  # idempotent
        assert admin.redis.hget(keys.fence(S), "QM1") == b"5"
        admin.join_structures("QM1", 8)
        assert admin.redis.hget(keys.fence(S), "QM1") == b"8"


class TestAdminHoldLock:
    def test_the_holder_renews_and_releases_its_own_lock_only(self, admin: Admin) -> None:
        assert admin.try_structure_recovery_lock(S, "QM1@5", 1_000)
        assert not admin.try_structure_recovery_lock(S, "QM2@7", 1_000)  # one recoverer at a time
        assert admin.renew_structure_recovery_lock(S, "QM1@5", 60_000)
        assert admin.redis.pttl(keys.structure_recovery_lock(S)) > 1_000
        assert not admin.renew_structure_recovery_lock(S, "QM2@7", 60_000)  # not another's
        assert not admin.renew_structure_recovery_lock(S, "QM1@4", 60_000)  # not an older incarnation's
        assert not admin.release_structure_recovery_lock(S, "QM2@7")
        assert admin.structure_recovery_holder(S) == "QM1@5"
        assert admin.release_structure_recovery_lock(S, "QM1@5")
        assert admin.structure_recovery_holder(S) is None
        assert not admin.release_structure_recovery_lock(S, "QM1@5")  # idempotent: gone is gone

    def test_a_lapsed_lock_taken_by_another_stays_the_others(self, admin: Admin) -> None:
        assert admin.try_structure_recovery_lock(S, "QM1@5", 1_000)
        admin.redis.delete(keys.structure_recovery_lock(S))  # QM1's lock lapsed (it stalled) ...
        assert admin.try_structure_recovery_lock(S, "QM2@7", 60_000)  # ... and QM2 took it
        assert not admin.renew_structure_recovery_lock(S, "QM1@5", 60_000)
        assert not admin.release_structure_recovery_lock(S, "QM1@5")
        assert admin.structure_recovery_holder(S) == "QM2@7"

    def test_a_conversation_lock_is_one_sends_and_released_by_it_only(self, admin: Admin) -> None:
        assert admin.try_conversation_lock(S, "SVC", "ab12", "uow-1", 60_000)
        assert not admin.try_conversation_lock(S, "SVC", "ab12", "uow-2", 60_000)  # one first send at a time
        assert admin.try_conversation_lock(S, "SVC", "cd34", "uow-2", 60_000)  # another conversation's is apart
        assert 0 < admin.redis.pttl(keys.conversation_lock(S, "SVC", "ab12")) <= 60_000  # lapses if never released
        assert not admin.release_conversation_lock(S, "SVC", "ab12", "uow-2")  # not another's
        assert admin.release_conversation_lock(S, "SVC", "ab12", "uow-1")
        assert admin.try_conversation_lock(S, "SVC", "ab12", "uow-2", 60_000)


class TestFail:
    """An operator's restore or purge of a live structure fails it before its claim (fail.lua), only while it is the
    structure the restore saw: ACTIVE, with the restore token and generation given."""

    def test_fails_the_structure_it_was_given_and_members_write_nothing_after(self, admin: Admin, s: Structure,
                                                                            qm1: Caller) -> None:
        head = admin.redis.hmget(keys.meta(S), "restore_token", "gen")
        token, gen = int(head[0] or 0), int(head[1] or 0)
        s.put(qm1, entry("m1"), b"x")
        assert s.fail(token=token, gen=gen) is None
        assert admin.state(S) == "FAILED"
        before = admin.redis.hgetall(keys.meta(S))
        with pytest.raises(StructureFailedError):
            s.put(qm1, entry("m2"), b"x")
        assert admin.redis.hgetall(keys.meta(S)) == before  # a member's refused call leaves the header as it is

    def test_leaves_a_structure_that_is_not_the_one_seen(self, admin: Admin, s: Structure) -> None:
        head = admin.redis.hmget(keys.meta(S), "restore_token", "gen")
        token, gen = int(head[0] or 0), int(head[1] or 0)
        assert s.fail(token=token + 1, gen=gen) == f"now ACTIVE, restore token {token}, generation {gen}"
        assert s.fail(token=token, gen=gen + 1) == f"now ACTIVE, restore token {token}, generation {gen}"
        admin.redis.hset(keys.meta(S), "state", "RECOVERING")  # another restore's claim
        assert s.fail(token=token, gen=gen) == f"now RECOVERING, restore token {token}, generation {gen}"
        assert admin.state(S) == "RECOVERING"

    def test_a_structure_the_cf_lost_is_refused(self, admin: Admin, s: Structure) -> None:
        admin.redis.delete(keys.meta(S))
        with pytest.raises(StructureFailedError):
            s.fail(token=0, gen=1)


class TestPstore:
    """The persistent store's availability (docs/pstore.md): disconnect / connect and the "no new units of work"
    state, as pstore.lua sets them and put, get, commit, standing and pclock honour them."""

    def test_disconnected_refuses_persistent_work_and_lets_the_rest_go_on(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("p1"), b"x")  # a persistent message, committed
        s.put(qm1, entry("held", queue=Q2), b"y", uow="U1")  # persistent work in progress
        assert s.pstore("disconnect") == ("ACTIVE", False, "", "")
        assert s.pstore("disconnect").connected is False  # idempotent
        with pytest.raises(PstoreUnavailableError, match="persistent message cannot be put") as e:
            s.put(qm1, entry("p2"), b"x", uow="U2")
        assert e.value.reason_name == "MQRC_RESOURCE_PROBLEM"
        with pytest.raises(PstoreUnavailableError, match="p1 on Q1 is persistent"):
            s.get(qm1, Q, uow="U3", now_ms=NOW)
        assert s.depths()[Q]["CP"] == 1 and held_uows(s) == {"U1"}  # refusals changed nothing
        s.put(qm1, entry("n1", queue=Q2, persistent=False), b"z", uow="U4")  # non-persistent work goes on
        s.commit(qm1, "U4", gen=1, lrsn=0)
        assert s.standing(qm1, "U1", gen=1) == "D"  # its member backs it out instead of forcing its COMMIT
        s.backout(qm1, "U1", gen=1, lrsn=qm1.clock.now(), has_data=False)
        assert s.pstore("connect") == ("ACTIVE", True, "", "")
        got = s.get(qm1, Q, uow="U5", now_ms=NOW)  # everything resumes
        assert got.entry is not None and got.entry.id == "p1"

    def test_a_decided_commit_goes_on_while_disconnected(self, s: Structure, qm1: Caller) -> None:
        """A logged COMMIT is decided: refusing it here would back out on one structure what another had
        committed. The refusal is the member's, before the force (standing.lua's 'D')."""
        s.put(qm1, entry("p1"), b"x", uow="U1")
        s.put(qm1, entry("p2"), b"y", uow="U2")
        s.pstore("disconnect")
        assert s.commit(qm1, "U1", gen=1, lrsn=qm1.clock.now(), decided_by_recovery=True).puts == 1
        assert s.commit(qm1, "U2", gen=1, lrsn=qm1.clock.now()).puts == 1  # the owner's own logged commit
        assert s.depths()[Q]["CP"] == 2

    def test_the_pseudo_clock_stands_still_while_disconnected(self, s: Structure) -> None:
        s.pclock(max_gap_ms=10_000)  # the first tick starts the clock
        s.pstore("disconnect")
        before = s.pclock(max_gap_ms=10_000).value
        time.sleep(0.3)
        assert s.pclock(max_gap_ms=10_000).value == before
        s.pstore("connect")
        time.sleep(0.05)
        assert 40 <= s.pclock(max_gap_ms=10_000).value - before < 250  # the connected time counts, not the 0.3 s before

    def test_no_new_uows_allows_only_consuming_work(self, s: Structure, qm1: Caller) -> None:
        s.put(qm1, entry("c1", msgid="0c"), b"ctl")
        assert s.pstore("nonew-on").no_new_uows == "OPERATOR"
        with pytest.raises(NoNewUowsError, match="set by an operator"):
            s.put(qm1, entry("n1", persistent=False), b"x")
        got = s.get(qm1, Q, uow="U1", now_ms=NOW)  # consuming goes on
        assert got.entry is not None
        s.put(qm1, entry("c2", msgid="0c"), b"ctl2", uow="U1")  # the replacement of the entry U1 takes
        with pytest.raises(NoNewUowsError):
            s.put(qm1, entry("c3", msgid="0d"), b"new", uow="U1")
        with pytest.raises(NoNewUowsError):  # one replacement per entry taken
            s.put(qm1, entry("c4", msgid="0c"), b"ctl3", uow="U1")
        s.commit(qm1, "U1", gen=1, lrsn=0)
        assert [d for _, d in s.browse(Q, 10, NOW)] == [b"ctl2"]
        assert s.pstore("nonew-off").no_new_uows == ""
        s.put(qm1, entry("n2"), b"x")

    def test_capacity_sets_it_and_the_low_water_mark_clears_it(self, admin: Admin) -> None:
        admin.ensure_structure("SMALL", ("QS",), max_entries=10)
        small, caller = CF(admin.redis).structure("SMALL"), join(admin, "QM1")
        for i in range(10):
            small.put(caller, entry(f"e{i}", queue="QS"), b"x")
        with pytest.raises(StructureFullError):
            small.put(caller, entry("e10", queue="QS"), b"x")
        assert small.pstore().no_new_uows == "FULL"
        with pytest.raises(NoNewUowsError, match="reached its capacity"):
            small.put(caller, entry("e11", queue="QS"), b"x")
        for n in range(1, 3):  # 9 entries: above the mark (80% of 10); 8: at it
            small.get(caller, "QS", uow=f"G{n}", now_ms=NOW)
            small.commit(caller, f"G{n}", gen=1, lrsn=0)
            assert small.pstore().no_new_uows == ("FULL" if n == 1 else "")
        small.put(caller, entry("e7", queue="QS"), b"x")

    def test_a_put_too_big_for_the_room_left_does_not_stop_new_work(self, admin: Admin) -> None:
        """One put larger than the room left, in a structure below its low-water mark, is refused and does not set
        FULL; a put below the mark clears a FULL left behind: no client locks every application out with one bad
        put."""
        admin.ensure_structure("SMALL3", ("QU",), max_bytes=1_000_000)
        small, caller = CF(admin.redis).structure("SMALL3"), join(admin, "QM1")
        with pytest.raises(StructureFullError):
            small.put(caller, entry("big", queue="QU", persistent=False), b"x" * 1_500_000)
        assert small.pstore().no_new_uows == ""
        small.put(caller, entry("small", queue="QU"), b"x")
        admin.redis.hset(keys.meta("SMALL3"), "nonew", "FULL")  # a state from before the rule, or left behind
        small.put(caller, entry("small2", queue="QU"), b"x")  # below the mark: a put clears it
        assert small.pstore().no_new_uows == ""
        for i in range(4):  # 800 000 bytes of 1 000 000: at the mark, not above it
            small.put(caller, entry(f"f{i}", queue="QU"), b"x" * 199_999)
        with pytest.raises(StructureFullError):
            small.put(caller, entry("big2", queue="QU"), b"x" * 300_000)
        assert small.pstore().no_new_uows == ""
        small.put(caller, entry("f4", queue="QU"), b"x" * 10_000)  # above the mark now
        with pytest.raises(StructureFullError):
            small.put(caller, entry("big3", queue="QU"), b"x" * 300_000)
        assert small.pstore().no_new_uows == "FULL"

    def test_replacements_are_bounded(self, admin: Admin) -> None:
        """A put whose message id is that of an entry its UOW takes (a replacement) passes the capacity check and
        the no-new-UOWs state only once per entry taken, and only if not much longer than it (a status may grow by
        a user status): any client can put with a message id."""
        admin.ensure_structure("SMALL4", ("QV",), max_entries=10, max_bytes=10_000)
        small, caller = CF(admin.redis).structure("SMALL4"), join(admin, "QM1")
        small.put(caller, entry("k", queue="QV", msgid="4b"), b"x")
        small.get(caller, "QV", uow="U1", now_ms=NOW)
        small.pstore("nonew-on")
        with pytest.raises(NoNewUowsError):  # longer than the entry taken, past the slack
            small.put(caller, entry("r1", queue="QV", msgid="4b"), b"y" * 1000, uow="U1")
        small.put(caller, entry("r2", queue="QV", msgid="4b"), b"y" * 200, uow="U1")  # a status grown a little
        with pytest.raises(NoNewUowsError):  # a second one for the same entry
            small.put(caller, entry("r3", queue="QV", msgid="4b"), b"y", uow="U1")
        small.pstore("nonew-off")
        for i in range(12):  # past the capacity: what is not a replacement is checked, and refused
            try:
                small.put(caller, entry(f"r{i + 4}", queue="QV", msgid="4b"), b"y" * 500, uow="U1")
            except (StructureFullError, NoNewUowsError):
                pass
        info = small.info()
        assert int(info["entries"]) <= 10 and int(info["bytes"]) <= 10_000, info

    def test_an_operators_state_is_not_cleared_by_the_low_water_mark(self, admin: Admin) -> None:
        admin.ensure_structure("SMALL2", ("QT",), max_entries=2)
        small, caller = CF(admin.redis).structure("SMALL2"), join(admin, "QM1")
        small.put(caller, entry("e1", queue="QT"), b"x")
        small.pstore("nonew-on")
        small.get(caller, "QT", uow="G1", now_ms=NOW)
        small.commit(caller, "G1", gen=1, lrsn=0)
        assert small.pstore().no_new_uows == "OPERATOR"

    def test_refusals(self, admin: Admin, s: Structure) -> None:
        with pytest.raises(BadRequestError, match="pstore action must be"):
            s.pstore("sideways")
        admin.set_state(S, "FAILED")
        assert s.pstore().state == "FAILED"  # read in any state
        with pytest.raises(StructureFailedError, match="structure is FAILED"):
            s.pstore("disconnect")
        with pytest.raises(StructureFailedError, match="not in the CF"):
            CF(admin.redis).structure("NOPE").pstore()
        admin.set_state(S, "ACTIVE")
        admin.redis.hset(keys.meta(S), "started", "WARM")
        with pytest.raises(BadRequestError, match="started WARM"):
            s.pstore("connect")


def _put_many(s: Structure, qm1: Caller, n: int, *, uow: str, prefix: str, desc: bytes) -> None:
    """``n`` puts of 64 bytes in pipelines of 5,000 calls of the put script (ids ``prefix`` + a 7-digit number)."""
    put = s.cf.script("put")
    sk = keys.script_keys(S)
    for i in range(0, n, 5000):
        pipe = s.cf.redis.pipeline(transaction=False)
        for j in range(i, min(n, i + 5000)):
            put(keys=sk, args=[qm1.member, qm1.epoch, 0, uow, 0, f"{prefix}{j:07d}", Q, desc, b"x" * 64],
                client=pipe)
        pipe.execute()


@contextmanager
def another_member_probing(admin: Admin) -> Iterator[list[float]]:
    """While the block runs, another member (QM2) keeps making CF calls on a connection of its own (a get on
    another queue, a lease renewal, every 2 ms); yields the list of how long each pair waited."""
    other = join(admin, "QM2")
    waits: list[float] = []
    stop = threading.Event()

    def another_client() -> None:
        st = CF(admin.redis).structure(S)  # the pool gives this thread a connection of its own
        while not stop.is_set():
            t0 = time.perf_counter()
            st.get(other, Q2, uow="", now_ms=NOW)
            admin.heartbeat("QM2", other.epoch, 60_000)
            waits.append(time.perf_counter() - t0)
            time.sleep(0.002)

    probe = threading.Thread(target=another_client)
    probe.start()
    try:
        yield waits
    finally:
        stop.set()
        probe.join()


def _p99(waits: list[float], took: float) -> float:
    """The 99th percentile of the probe's waits, which must be more than 100 (else the probe barely ran)."""
    waits.sort()
    assert len(waits) > 100, (len(waits), took)
    return waits[int(len(waits) * 0.99)]


class TestLoad:
    """A restore's load batch (load.lua; run as the module's CF.LOAD by cfemu.bulk.Owner.load, held to the script by
    tests/cfemu/test_load_command.py): applied whole while the structure is the owner's, refused whole after a
    later claim."""

    @staticmethod
    def batch(value: str) -> bytes:
        p = resp.Packed()
        p.add("HSET", keys.data(S), "e1", value)
        p.add("RPUSH", f"{keys.tag(S)}:q:{Q}:cp:0", "e1")
        return p.data()

    def test_the_owners_batch_is_applied_and_a_superseded_owners_refused(self, admin: Admin) -> None:
        r = admin.redis
        load = r.register_script(lua.source("load"))
        owner = bulk.claim(r, S, bulk.observe(r, S))
        assert load(keys=[keys.meta(S)], args=[owner.token, self.batch("first")]) == 2
        later = bulk.claim(r, S, bulk.observe(r, S))
        with pytest.raises(redis.exceptions.ResponseError, match="NOTOWNER the structure's restore token is"):
            load(keys=[keys.meta(S)], args=[owner.token, self.batch("stale")])
        assert r.hget(keys.data(S), "e1") == b"first" and r.llen(f"{keys.tag(S)}:q:{Q}:cp:0") == 1
        owner.close()
        later.close()
