"""The CF's server module against the Lua scripts it replaces (cfemu/_cfmodule.c, cfemu.server_module): the scripts
are the specification. One real server with the module loaded holds two copies of one structure, in database 0
(driven through the scripts, EVALSHA) and database 1 (the module's commands for the operations it has, the scripts
for the others). Random sequences of operations, refusals included (fences, members that never joined, unknown
queues, UOWs of other members, UOWs marked, tombstoned or lost with the CF, a disconnected persistent store, the
"no new units of work" state, capacity limits in entries and bytes, replacements of an entry the UOW took, a failed
structure, duplicate ids), run on both; every reply must be the same, and so must the whole structure after each
step: every key with its type and value, descriptors and UOW records compared decoded (msgpack maps have no key
order; cmsgpack packs an empty table as an empty array and drops nil values)."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import redis

from cfemu import keys, lua, server_module
from cfemu.admin import Admin
from cfemu.cf import CF, Caller
from cfemu.embedded import EmbeddedRedis
from cfemu.entry import Entry
from tests.support.counting_clock import CountingClock as Clock

S = "APP1"
QUEUES = ("Q1", "Q2")
MEMBERS = ("QM1", "QM2")
SEEDS = 24
STEPS = 70
DESCRIPTOR_ARG = 7  # put.lua's ARGV[8], from 0


def _normal(v: Any) -> Any:
    """A decoded msgpack value as cmsgpack would give it back: no nil map values, an empty map as an empty list."""
    if isinstance(v, dict):
        out = {k: _normal(x) for k, x in v.items() if x is not None}
        return out or []
    if isinstance(v, list):
        return [_normal(x) for x in v]
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _decoded(raw: bytes) -> Any:
    return _normal(msgpack.unpackb(raw, raw=True, strict_map_key=False))


def state(r: redis.Redis) -> dict[bytes, Any]:
    """Every key of the structure, typed: what a reader of it can see."""
    out: dict[bytes, Any] = {}
    packed = {keys.entries(S).encode(), keys.uows(S).encode()}
    for k in sorted(r.scan_iter(match=keys.all_structure_keys_pattern(S))):
        t = r.type(k)
        if t == b"hash":
            h = r.hgetall(k)
            # A packed value's length counts too: a get's bound counts the descriptor as stored.
            out[k] = ("hash", {f: (_decoded(v), len(v)) if k in packed else v for f, v in h.items()})
        elif t == b"list":
            out[k] = ("list", r.lrange(k, 0, -1))
        elif t == b"set":
            out[k] = ("set", r.smembers(k))
        elif t == b"zset":
            out[k] = ("zset", r.zrange(k, 0, -1, withscores=True))
        else:
            out[k] = (t, r.dump(k))
    return out


class Pair:
    """The structure in two databases: `scripts` runs every operation's script, `module` the module's command
    where it has one."""

    def __init__(self, server: EmbeddedRedis) -> None:
        self.scripts = server.client(db=0)
        self.module = server.client(db=1)
        for r in (self.scripts, self.module):
            r.flushdb()
            for op in lua.structure_operations():
                r.script_load(lua.source(op))
        self.shas = {op: CF(self.scripts).script(op).sha for op in lua.structure_operations()}
        self.structure = CF(self.scripts).structure(S)
        self.keys = keys.script_keys(S)
        self.epochs: dict[str, int] = {}
        self.native: dict[str, int] = {}  # calls the module's commands did, by operation
        self.scripted: dict[str, int] = {}  # calls they left to the script
        admins = [Admin(self.scripts), Admin(self.module)]
        for a in admins:
            a.ensure_structure(S, QUEUES)
        for m in MEMBERS:
            self.epochs[m] = admins[0].join(m, {}, lease_ms=600_000)
            admins[1].join_structures(m, self.epochs[m])

    def head(self, op: str, native: bool) -> tuple[Any, ...]:
        """What a call of ``op`` starts with: its module command (with its script's sha, which the command runs
        for a call it leaves to the script) on the module's copy where the module has it, else EVALSHA."""
        command = server_module.COMMANDS.get(op) if native else None
        return (command, self.shas[op]) if command else ("EVALSHA", self.shas[op], len(self.keys))

    def call(self, op: str, args: list[Any]) -> tuple[Any, Any]:
        """The operation on both; each reply, or the error's text."""
        out = []
        for r, native in ((self.scripts, False), (self.module, True)):
            head = self.head(op, native)
            try:
                try:
                    reply = r.execute_command(*head, *self.keys, *args)
                except redis.exceptions.ResponseError as e:
                    if not str(e).startswith(server_module.TO_SCRIPT):
                        raise
                    self.scripted[op] = self.scripted.get(op, 0) + 1  # left to the caller, who runs the script
                    reply = r.execute_command("EVALSHA", self.shas[op], len(self.keys), *self.keys, *args)
                else:
                    if native and head[0] != "EVALSHA":
                        self.native[op] = self.native.get(op, 0) + 1
                out.append(_comparable(op, reply))
            except redis.exceptions.ResponseError as e:
                out.append(("error", str(e)))
        return out[0], out[1]

    def pipelined(self, calls: list[tuple[str, list[Any]]]) -> tuple[list[Any], list[Any]]:
        """The calls in one pipeline on each copy, as CF.run_many sends them: each reply, or the error's text. A
        call the module's command left to the caller (CFSCRIPT) is run by its script once the pipeline is back,
        which is all a caller can do with it."""
        out = []
        for r, native in ((self.scripts, False), (self.module, True)):
            pipe = r.pipeline(transaction=False)
            for op, args in calls:
                pipe.execute_command(*self.head(op, native), *self.keys, *args)
            replies = pipe.execute(raise_on_error=False)
            for k, ((op, args), reply) in enumerate(zip(calls, replies, strict=True)):
                if isinstance(reply, redis.exceptions.ResponseError) and str(reply).startswith(
                        server_module.TO_SCRIPT):
                    self.scripted[op] = self.scripted.get(op, 0) + 1
                    try:
                        replies[k] = r.execute_command("EVALSHA", self.shas[op], len(self.keys), *self.keys, *args)
                    except redis.exceptions.ResponseError as e:
                        replies[k] = e
            out.append([("error", str(reply)) if isinstance(reply, redis.exceptions.ResponseError)
                        else _comparable(op, reply) for (op, _), reply in zip(calls, replies, strict=True)])
        return out[0], out[1]

    def both(self, fn: Callable[[redis.Redis], Any]) -> None:
        fn(self.scripts)
        fn(self.module)


def _comparable(op: str, reply: Any) -> Any:
    """A reply as the comparison reads it: a get's descriptor decoded (msgpack maps have no key order)."""
    if op in ("get", "get_committed") and isinstance(reply, list) and len(reply) >= 4:
        reply[2] = (_decoded(reply[2]), len(reply[2]))  # the descriptor taken, as stored
    return reply


def _caller(rng: random.Random, pair: Pair, clock: Clock) -> Caller:
    member = rng.choice((*MEMBERS * 5, "QM9"))
    epoch = pair.epochs.get(member, 1)
    if rng.random() < 0.08:
        epoch -= 1  # a stale incarnation: fenced
    return Caller(member, epoch, clock)


def _entry(rng: random.Random, n: int) -> Entry:
    return Entry(id=f"e{rng.randrange(n)}", queue=rng.choice((*QUEUES * 4, "NOQ")), priority=rng.randrange(3),
                 persistent=rng.random() < 0.6, msgid=rng.choice(("", "", "m1", "m2")),
                 correlid=rng.choice(("", "", "c1")), expiry=rng.choice((0, 0, 10**13, 1_000, 1_000)),
                 put_time=rng.randrange(10**12), backout_count=rng.randrange(3),
                 properties=rng.choice(({}, {}, {"k": "v", "n": 3})))


def _step(rng: random.Random, pair: Pair, clock: Clock, ids: int) -> tuple[str, tuple[Any, Any]] | None:
    """One random operation on both copies: its name and both replies (None for a change made by hand)."""
    s = pair.structure
    uow = rng.choice(("", "", "U1", "U2", "U3", "U4"))
    gen = rng.choice((0, 0, 0, 0, 1, 2))
    roll = rng.random()
    if roll < 0.5:
        e = _entry(rng, ids)
        size = rng.choice((0, 10, 100, 300, 700))
        _, _, args = s.put_call(_caller(rng, pair, clock), e, bytes(rng.randrange(256) for _ in range(size)),
                                uow=uow, gen=gen)
        return "put", pair.call("put", args)
    if roll < 0.58:  # a replacement: a get, then a put of the same message id on the same queue in that UOW
        c = _caller(rng, pair, clock)
        u, queue = rng.choice(("U1", "U2")), rng.choice(QUEUES)
        _, _, args = s.get_call(c, queue, uow=u, gen=gen, now_ms=2_000)
        got = pair.call("get", args)
        if not (isinstance(got[0], list) and len(got[0]) >= 4):
            return "get", got
        taken = Entry.unpack(pair.scripts.hget(keys.entries(S), got[0][2][0][b"id"]) or b"")
        size = max(0, taken.length + rng.choice((-50, 100, 200, 300)))
        e = Entry(id=f"r{clock.now()}", queue=queue, msgid=rng.choice((taken.msgid, taken.msgid, "m2")),
                  persistent=taken.persistent)
        _, _, args = s.put_call(c, e, bytes(size), uow=u, gen=gen)
        return "put", pair.call("put", args)
    if roll < 0.61:  # expired messages at the head of a queue, met by a get with a small step
        c = Caller(MEMBERS[0], pair.epochs[MEMBERS[0]], clock)
        for _ in range(3):
            e = Entry(id=f"x{clock.now()}", queue=QUEUES[0], priority=2, expiry=1_000)
            _, _, args = s.put_call(c, e, b"expired", uow="")
            put = pair.call("put", args)
            if put[0] != put[1]:
                return "put", put
        _, _, args = s.get_call(c, QUEUES[0], uow="U1", now_ms=2_000, step=rng.choice((1, 2)))
        return "get", pair.call("get", args)
    if roll < 0.64:  # the best match is not the first the index lists: a put committed after a later put
        c = Caller(MEMBERS[0], pair.epochs[MEMBERS[0]], clock)
        u = f"W{clock.now()}"
        first = Entry(id=f"w{clock.now()}", queue=QUEUES[1], priority=1, msgid="m3")
        second = Entry(id=f"w{clock.now()}", queue=QUEUES[1], priority=1, msgid="m3")
        for call in (s.put_call(c, first, b"in a UOW", uow=u), s.put_call(c, second, b"outside", uow=""),
                     s.commit_call(c, u, gen=0, lrsn=10**6 * clock.now())):  # counts after the second put
            done = pair.call(call[0], call[2])
            if done[0] != done[1]:
                return call[0], done
        _, _, args = s.get_call(c, QUEUES[1], uow=f"G{clock.now()}", match="m", value="m3", now_ms=2_000)
        return "get", pair.call("get", args)
    if roll < 0.72:
        match = rng.choice(("", "", "m", "c"))
        _, _, args = s.get_call(_caller(rng, pair, clock), rng.choice((*QUEUES * 4, "NOQ")), uow=uow or "U1", gen=gen,
                                match=match, value={"m": rng.choice(("m1", "m2")), "c": "c1"}.get(match, ""),
                                now_ms=2_000, max_length=rng.choice((0, 0, 150, 400)), step=rng.choice((0, 1, 1, 2, 50)))
        return "get", pair.call("get", args)
    if roll < 0.79:
        _, _, args = s.commit_call(_caller(rng, pair, clock), uow or "U1", gen=gen,
                                   lrsn=rng.choice((0, clock.now(), clock.now())), at=rng.choice((0, 0, clock.now())))
        args[6] = rng.choice((0, 0, 1))  # the outcome recorded (a tombstone): as peer recovery decides it
        if rng.random() < 0.3:  # capacity's "no new units of work", which the commit's gets may end
            pair.both(lambda r: r.hset(keys.meta(S), "nonew", "FULL"))
        return "commit", pair.call("commit", args)
    if roll < 0.84:
        c = _caller(rng, pair, clock)
        args = [c.member, c.epoch, clock.now(), uow or "U2", gen, clock.now(), rng.randrange(2), 0, 0, 0, 0]
        return "backout", pair.call("backout", args)
    # The structure changed by hand, alike on both: the states a put is refused or let through in.
    meta, tomb, uows = keys.meta(S), keys.tomb(S), keys.uows(S)
    change = rng.randrange(9)
    if change == 0:
        value = rng.choice(("DISCONNECTED", None))
        pair.both(lambda r: r.hset(meta, "pstore", value) if value else r.hdel(meta, "pstore"))
    elif change == 1:
        value = rng.choice(("OPERATOR", "FULL", "FULL", None, None))
        pair.both(lambda r: r.hset(meta, "nonew", value) if value else r.hdel(meta, "nonew"))
    elif change == 2:
        n = rng.choice((0, 0, 3, 5, 8))
        pair.both(lambda r: r.hset(meta, "max_entries", n))
    elif change == 3:
        n = rng.choice((0, 0, 400, 1_500))
        pair.both(lambda r: r.hset(meta, "max_bytes", n))
    elif change == 4:
        value = rng.choice(("ACTIVE", "ACTIVE", "ACTIVE", "FAILED"))
        pair.both(lambda r: r.hset(meta, "state", value))
    elif change == 5:
        g = rng.choice((0, 1, 2))
        pair.both(lambda r: r.hset(meta, "gen", g))
    elif change == 6:
        u, t = rng.choice(("U1", "U2", "U3", "U4")), rng.choice(("A", "B", "C", "P", None, None))
        pair.both(lambda r: r.hset(tomb, u, t) if t else r.hdel(tomb, u))
    elif change == 7:
        u, mark = rng.choice(("U3", "U4")), rng.choice(("C", "B"))
        record = msgpack.packb({"o": rng.choice(MEMBERS), "f": 1, "g": 0, "s": mark}, use_bin_type=False)
        if rng.random() < 0.5:
            pair.both(lambda r: r.hset(uows, u, record))
    elif rng.random() < 0.3:
        pair.both(lambda r: r.hdel(meta, "state"))  # the structure is not in the CF (NOSTRUCT) until change 4
    return None


def test_the_module_is_loaded_for_the_comparison(server: EmbeddedRedis) -> None:
    """The comparison below compares something: the server runs the module's commands."""
    assert server.module_loaded, "the package's build made no server module (cfemu/_cfmodule.c)"
    assert set(server_module.loaded_ops(server.client())) == set(server_module.COMMANDS)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_module_and_scripts_give_the_same_replies_and_structure(server: EmbeddedRedis, seed: int) -> None:
    pair = Pair(server)
    rng = random.Random(seed)
    clock = Clock()
    ids = rng.choice((6, 12, 40))
    seen: dict[str, set[str]] = {}
    for step in range(STEPS):
        done = _step(rng, pair, clock, ids)
        if done is not None:
            op, (by_script, by_module) = done
            assert by_module == by_script, f"seed {seed} step {step}: {op} replied differently"
            kind = by_script[1].split()[0] if isinstance(by_script, tuple) else "ok"
            seen.setdefault(op, set()).add(kind)
        assert state(pair.module) == state(pair.scripts), f"seed {seed} step {step}: the structures differ"
    assert "put" in seen


def test_the_sequences_reach_every_refusal_of_the_module_operations(server: EmbeddedRedis) -> None:
    """The random sequences above are worth their name: over all seeds, puts and gets are refused for every
    reason their scripts have, and some go through (a put created, and repeated by id; a get that took a message,
    found none, or ran out of its step among expired messages)."""
    kinds: dict[str, set[str]] = {"put": set(), "get": set()}
    native: dict[str, int] = {}
    for seed in range(SEEDS):
        pair = Pair(server)
        rng = random.Random(seed)
        clock = Clock()
        ids = rng.choice((6, 12, 40))
        for _ in range(STEPS):
            done = _step(rng, pair, clock, ids)
            if done is None or done[0] not in kinds:
                continue
            op, reply = done[0], done[1][0]
            if isinstance(reply, tuple):
                kinds[op].add(reply[1].split()[0])
            elif op == "put":
                kinds[op].add(f"created={reply[2]}")
            else:
                kinds[op].add({2: "none", 3: "again", 4: "taken"}[len(reply)])
        for op, n in pair.native.items():
            native[op] = native.get(op, 0) + n
    refusals = {"FENCED", "NOTJOINED", "NOQUEUE", "BADUOW", "BACKEDOUT", "COMPLETED", "PSTORE", "CFSTATE",
                "NOSTRUCT"}
    assert kinds["put"] >= refusals | {"NONEW", "FULL", "created=1", "created=0"}, kinds["put"]
    assert kinds["get"] >= refusals | {"TOOLONG", "none", "again", "taken"}, kinds["get"]
    # Every module command did calls itself (not only leave them to its script).
    assert all(native.get(op, 0) > 20 for op in server_module.COMMANDS), native
    # A call a command leaves to its script is run there by the command itself, never left to the caller.
    assert not pair.scripted, pair.scripted


def _held_work(pair: Pair, clock: Clock) -> Caller:
    """Committed messages on Q1 and a UOW U1 holding a put and a get, alike on both copies."""
    s, c = pair.structure, Caller(MEMBERS[0], pair.epochs[MEMBERS[0]], clock)
    for i in range(3):
        pair.call("put", s.put_call(c, Entry(id=f"c{i}", queue=QUEUES[0], msgid="m1", expiry=1_000 * i), b"x")[2])
    pair.call("put", s.put_call(c, Entry(id="p1", queue=QUEUES[0]), b"held", uow="U1")[2])
    pair.call("get", s.get_call(c, QUEUES[0], uow="U1", now_ms=500)[2])
    return c


# Arguments the scripts read as numbers (by operation: ARGV index from 0), and what a caller may send in them.
NUMERIC_ARGS = {"put": (2, 4), "get": (2, 4, 8, 9, 10), "commit": (2, 4, 5, 7, 9)}
ODD_NUMBERS = ("abc", "", "5 ", " 7", "0x10", "-1", "1e400", "12.5")


def _usual_call(pair: Pair, clock: Clock, op: str) -> list[Any]:
    """The arguments of a usual call of `op` on the work _held_work leaves."""
    s, c = pair.structure, _held_work(pair, clock)
    if op == "put":
        return list(s.put_call(c, Entry(id="n1", queue=QUEUES[0], msgid="m1"), b"new", uow="U1")[2])
    if op == "get":
        return list(s.get_call(c, QUEUES[0], uow="U1", now_ms=2_000, max_length=0, step=5)[2])
    return list(s.commit_call(c, "U1", gen=0, lrsn=clock.now())[2])


@pytest.mark.parametrize("op", sorted(NUMERIC_ARGS))
def test_arguments_that_are_odd_numbers_give_the_same_replies_and_structure(server: EmbeddedRedis, op: str) -> None:
    """What the random sequences never send: a number argument that is no number, or one Lua reads otherwise than
    C's strtod (trailing blanks, hex, out of range, a fraction)."""
    for index in NUMERIC_ARGS[op]:
        for odd in ODD_NUMBERS:
            pair, clock = Pair(server), Clock()
            args = _usual_call(pair, clock, op)
            args[index] = odd
            by_script, by_module = pair.call(op, args)
            assert by_module == by_script, f"{op} argument {index} = {odd!r}"
            assert state(pair.module) == state(pair.scripts), f"{op} argument {index} = {odd!r}"


def test_binary_ids_priorities_large_values_and_many_properties_give_the_same_replies_and_structure(
        server: EmbeddedRedis) -> None:
    """What the random sequences never send: ids and message ids of any bytes, every priority, a data of a MiB,
    many properties, every expiry, and a commit of them in one UOW."""
    pair, clock = Pair(server), Clock()
    s, c = pair.structure, Caller(MEMBERS[0], pair.epochs[MEMBERS[0]], clock)
    rng = random.Random(7)
    for i in range(24):
        e = Entry(id=f"b\x00\xff{i}", queue=QUEUES[i % 2], priority=i % 10, persistent=bool(i % 3),
                  msgid=rng.choice(("", "\x00m\xff", "m" * 300)), correlid=rng.choice(("", "c\n1")),
                  expiry=rng.choice((0, 1_000, 10**13, 2**40)), put_time=rng.randrange(2**53),
                  properties={f"p{j}": rng.choice(("v" * j, j, -j * 1.5, True)) for j in range(rng.choice((0, 40)))})
        data = bytes(rng.randrange(256) for _ in range(rng.choice((0, 70_000)))) + (b"\x00" * (2**20 if i == 5 else 0))
        for op, _, args in (s.put_call(c, e, data, uow=rng.choice(("", "U1", "U2"))),):
            done = pair.call(op, args)
            assert done[0] == done[1], f"put {i}"
    for u in ("U1", "U2"):
        done = pair.call("commit", s.commit_call(c, u, gen=0, lrsn=clock.now())[2])
        assert done[0] == done[1], f"commit {u}"
    for i in range(30):
        q = QUEUES[i % 2]
        match, value = rng.choice((("", ""), ("m", "\x00m\xff"), ("m", "m" * 300), ("c", "c\n1")))
        done = pair.call("get", s.get_call(c, q, uow="G1", match=match, value=value, now_ms=2_000,
                                           max_length=rng.choice((0, 2**21)), step=rng.choice((0, 1)))[2])
        assert done[0] == done[1], f"get {i}"
    done = pair.call("commit", s.commit_call(c, "G1", gen=0, lrsn=clock.now())[2])
    assert done[0] == done[1]
    assert state(pair.module) == state(pair.scripts)
    assert pair.native.get("get", 0) > 10 and pair.native.get("put", 0) > 10


def test_refusals_naming_long_names_give_the_same_replies(server: EmbeddedRedis) -> None:
    """A refusal names the queue, member or UOW it is about, however long the name (the script's error reply
    holds the whole of it)."""
    pair, clock = Pair(server), Clock()
    s, c = pair.structure, Caller(MEMBERS[0], pair.epochs[MEMBERS[0]], clock)
    long = "q" * 2_000
    replies = [pair.call("put", s.put_call(c, Entry(id="e1", queue=long), b"x")[2]),
               pair.call("get", s.get_call(c, long, uow="U1", now_ms=1)[2]),
               pair.call("put", s.put_call(Caller("M" * 2_000, 1, clock), Entry(id="e2", queue=QUEUES[0]), b"x")[2])]
    pair.call("put", s.put_call(c, Entry(id="e3", queue=QUEUES[0]), b"x", uow="U" * 2_000)[2])
    other = Caller(MEMBERS[1], pair.epochs[MEMBERS[1]], clock)
    replies.append(pair.call("put", s.put_call(other, Entry(id="e4", queue=QUEUES[0]), b"x", uow="U" * 2_000)[2]))
    for by_script, by_module in replies:
        assert isinstance(by_script, tuple) and len(by_script[1]) > 2_000
        assert by_module == by_script


def test_a_call_left_to_the_script_applies_in_its_place_in_a_pipeline(server: EmbeddedRedis) -> None:
    """A pipeline (CF.run_many) whose first call the module's command leaves to its script (the last step of a
    commit in steps) and whose later calls depend on it (gets of the messages it commits): the module applies
    every call in the order sent, as the scripts do. A caller that ran the left call after the pipeline applied
    the gets first, which found nothing."""
    _left_call_in_place(server)


def _left_call_in_place(server: EmbeddedRedis) -> None:
    pair, clock = Pair(server), Clock()
    s, c = pair.structure, Caller(MEMBERS[0], pair.epochs[MEMBERS[0]], clock)
    for i in range(3):
        done = pair.call("put", s.put_call(c, Entry(id=f"p{i}", queue=QUEUES[0]), b"x", uow="U1")[2])
        assert done[0] == done[1]
    lrsn = clock.now()
    first = pair.call("commit", s.commit_call(c, "U1", gen=0, lrsn=lrsn, step=2)[2])  # more to do: in steps
    assert first[0] == first[1] and first[0][3] == 1, first
    last = [c.member, c.epoch, clock.now(), "U1", 0, lrsn, 0, 0, 1, 2]  # the next step: left to the script
    gets = [("get", s.get_call(c, QUEUES[0], uow=f"G{k}", now_ms=1_000)[2]) for k in range(3)]
    by_script, by_module = pair.pipelined([("commit", last), *gets])
    assert by_module == by_script
    assert any(len(reply) >= 4 for reply in by_script[1:]), by_script  # a get took what the commit committed
    assert state(pair.module) == state(pair.scripts)
    assert not pair.scripted, pair.scripted


def _descriptor(**fields: Any) -> bytes:
    return msgpack.packb({"id": "h1", "q": QUEUES[0], "p": 0, "per": 1, "mid": "", "cid": "", "exp": 0, "pt": 1,
                          "bc": 0, "pr": {}, "st": "", "l": 0, "u": "", "o1": 0, "o2": 0, "len": 0, **fields},
                         use_bin_type=False)


HAND_MADE_DESCRIPTORS = {
    "an extension type": _descriptor(x=msgpack.ExtType(5, b"ab")),
    "an extension type in a list": _descriptor(x=[1, msgpack.ExtType(5, b"ab")]),
    "an extension type in the properties": _descriptor(pr={"k": msgpack.ExtType(5, b"ab")}),
    "a priority as a string": _descriptor(p="3"),
    "a priority out of range": _descriptor(p=123456789012345),
    "a fractional expiry": _descriptor(exp=1234567890123.456),
    "a message id as a number": _descriptor(mid=7),
    "integer keys": _descriptor(x={1: "a", 2: "b"}),
    "deep nesting": _descriptor(x=functools.reduce(lambda v, _: [v], range(20), 1)),
    "a key given twice": b"\x82\xa1p\x00\xa1p\x01",
    # {"pr": {"k": 1, "k": 2}}: the properties' map written by hand in place of the empty one ("pr" then 0x80)
    "a property given twice": _descriptor().replace(b"\xa2pr\x80", b"\xa2pr\x82\xa1k\x01\xa1k\x02"),
    "a property of -2**63 as a float": _descriptor(pr={"f": -2.0**63, "g": -9.21e18, "h": 2.0**63}),
    # Map headers the product does not write for so few items (its 16 fields are a map16): each reader of a map in
    # the module reads its header in one place (map_header), a descriptor's map32 left to the script.
    "a descriptor as a map32": b"\xdf\x00\x00\x00\x10" + _descriptor()[3:],
    "the properties as a map16": _descriptor().replace(b"\xa2pr\x80", b"\xa2pr\xde\x00\x01\xa1k\x01"),
    "the properties as a map32": _descriptor().replace(b"\xa2pr\x80", b"\xa2pr\xdf\x00\x00\x00\x01\xa1k\x01"),
    "a cut map32 header": b"\xdf\x00\x00",
}


@pytest.mark.parametrize("what", sorted(HAND_MADE_DESCRIPTORS))
def test_a_hand_made_descriptor_gives_the_same_replies_and_structure(server: EmbeddedRedis, what: str) -> None:
    """A put whose descriptor the product never makes (sent by hand to the CF): the module writes it as the script
    does, or leaves it to the script; never a descriptor the script cannot read back (a backout or the expiry
    task that fails on it for good). A get then takes the same entry on both (it packs such a descriptor, which
    only the script stored, in its own way: both read it back)."""
    pair, clock = Pair(server), Clock()
    s, c = pair.structure, Caller(MEMBERS[0], pair.epochs[MEMBERS[0]], clock)
    for uow in ("", "U1"):
        args = list(s.put_call(c, Entry(id=f"h-{uow}", queue=QUEUES[0]), b"x", uow=uow)[2])
        args[DESCRIPTOR_ARG] = HAND_MADE_DESCRIPTORS[what]
        by_script, by_module = pair.call("put", args)
        assert by_module == by_script, what
        assert state(pair.module) == state(pair.scripts), what
    by_script, by_module = pair.call("get", s.get_call(c, QUEUES[0], uow="G1", now_ms=1)[2])
    taken = [r[2][0].get(b"id") if isinstance(r, list) and len(r) >= 4 else r for r in (by_script, by_module)]
    assert taken[0] == taken[1], what


def test_a_get_matching_by_another_index_gives_the_same_reply(server: EmbeddedRedis) -> None:
    pair, clock = Pair(server), Clock()
    s, c = pair.structure, Caller(MEMBERS[0], pair.epochs[MEMBERS[0]], clock)
    pair.call("put", s.put_call(c, Entry(id="e1", queue=QUEUES[0], msgid="m1"), b"x")[2])
    by_script, by_module = pair.call("get", s.get_call(c, QUEUES[0], uow="G1", match="mid", value="m1", now_ms=1)[2])
    assert by_module == by_script
    assert state(pair.module) == state(pair.scripts)


@pytest.mark.slow
def test_a_commit_of_more_entries_than_the_module_orders_quickly_is_the_script_s(server: EmbeddedRedis) -> None:
    """A commit with no step (0: the whole unit of work in one call) of more entries than the module orders in a
    few milliseconds (its ordering is quadratic in them): left to the script, with the same reply and structure,
    and in about the script's time (the module's own ordering took 6x the script's at 12,000 entries, blocking the
    CF all the while)."""
    pair, clock = Pair(server), Clock()
    s, c = pair.structure, Caller(MEMBERS[0], pair.epochs[MEMBERS[0]], clock)
    puts = [s.put_call(c, Entry(id=f"u{i}", queue=QUEUES[i % 2]), b"x", uow="U1")[2] for i in range(12_000)]
    for r in (pair.scripts, pair.module):
        pipe = r.pipeline(transaction=False)
        for args in puts:
            pipe.execute_command(*pair.head("put", r is pair.module), *pair.keys, *args)
        pipe.execute()
    args = s.commit_call(c, "U1", gen=0, lrsn=clock.now(), step=0)[2]
    took = []
    for r in (pair.scripts, pair.module):
        started = time.perf_counter()
        r.execute_command(*pair.head("commit", r is pair.module), *pair.keys, *args)
        took.append(time.perf_counter() - started)
    assert state(pair.module) == state(pair.scripts)
    assert took[1] < 3 * took[0] + 0.05, took


def test_a_put_with_many_properties_is_the_module_s_own(server: EmbeddedRedis) -> None:
    """A message with as many properties as the product lets it have (their packed bytes, not their count, are
    bounded) is put by the module itself, not left to the script: the same reply and structure, and no script run
    on the module's copy."""
    pair, clock = Pair(server), Clock()
    s, c = pair.structure, Caller(MEMBERS[0], pair.epochs[MEMBERS[0]], clock)
    props = {f"k{i}": (i, f"v{i}", i * 0.5, i % 2 == 0)[i % 4] for i in range(500)}
    args = s.put_call(c, Entry(id="many", queue=QUEUES[0], properties=props), b"x")[2]
    before = pair.module.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    by_script, by_module = pair.call("put", args)
    after = pair.module.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert by_module == by_script
    assert state(pair.module) == state(pair.scripts)
    assert after - before == 1  # the scripts' copy's own call alone (one server holds both copies)
