"""cfemu.bulk.prepare, the restore load's batches (add_pairs, add_commands), as an outside tester sees them: for
batches a load can meet, the bytes are what redis-py's hset(mapping=...), sadd, rpush and zadd send, and a real
redis-server holds what redis-py would have written; a message's data crosses a pipe once; an entry that cannot be
encoded is refused by name before anything of its batch is sent."""

from __future__ import annotations

import pickle
from collections import defaultdict
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cfemu import bulk, keys, resp
from tests.support.survivor import Survivor

S = "APP1"


def _expected(batch: list[Survivor]) -> list[tuple[Any, ...]]:
    """The commands redis-py would send for the batch (hset mapping, sadd, rpush, zadd), as prepare documents."""
    entries = {s.id: bulk.descriptor(s.entry, s.data) for s in batch if s.entry is not None}
    datas = {s.id: s.data for s in batch}
    sets: dict[str, list[str]] = defaultdict(list)
    lists: dict[str, list[str]] = defaultdict(list)
    expiry: list[Any] = []
    for s in batch:
        assert s.entry is not None
        lists[bulk.list_of(S, s.entry)].append(s.id)
        for k in bulk.sets_of(S, s.entry):
            sets[k].append(s.id)
        if int(s.entry.get("exp", 0)) > 0:
            expiry += (int(s.entry["exp"]), s.id)
    out: list[tuple[Any, ...]] = [
        ("HSET", keys.entries(S), *(x for i, d in entries.items() for x in (i, d))),
        ("HSET", keys.data(S), *(x for i, d in datas.items() for x in (i, d))),
        *(("SADD", k, *m) for k, m in sets.items()),
        *(("RPUSH", k, *m) for k, m in lists.items())]
    if expiry:
        out.append(("ZADD", keys.expiry(S), *expiry))
    return out


_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=6)  # any str but surrogates
_data = st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"\r\n", bytes(16 << 10), b"z" * (40 << 10)]))


@st.composite
def _batches(draw: Any) -> list[Survivor]:
    ids = draw(st.lists(_text, unique=True, max_size=25))
    out = []
    for n, i in enumerate(ids):
        e = {"id": i, "q": draw(st.sampled_from(["Q1", "Qé", "Q 2"])), "st": draw(st.sampled_from(["CP", "UP", "UG"])),
             "p": draw(st.integers(0, 9)), "u": draw(st.sampled_from(["", "QM1.1.1", "QMé.1.2"])), "l": 100 + n,
             "mid": draw(st.sampled_from(["", i, "m"])), "cid": draw(st.sampled_from(["", "c", "ç"])),
             "exp": draw(st.sampled_from([0, 0, 1700000000000])), "pr": draw(st.sampled_from([{}, {"k": "v", "n": 1}]))}
        out.append(Survivor(i, e, draw(_data)))
    return out


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=_batches())
def test_a_prepared_batch_is_what_redis_py_would_send(redis_url: str, batch: list[Survivor]) -> None:
    staged = bulk.prepare(S, batch)
    client = redis.Redis.from_url(redis_url)
    conn = client.connection_pool.get_connection()
    try:
        expected = _expected(batch) if batch else []
        assert staged.commands.data() == b"".join(conn.pack_commands(expected))
        assert staged.commands.count == len(expected)
        assert b"".join(staged.commands.chunks()) == staged.commands.data()
        long_parts = {id(p) for p in staged.commands.parts if len(p) >= resp.LONG}
        for _, d in staged.copies:  # a long message's data is a part of its own, the very object: never copied
            if len(d) >= resp.LONG:
                assert id(d) in long_parts
        copy = pickle.loads(pickle.dumps(staged))
        assert copy.commands.data() == staged.commands.data() and copy.copies == staged.copies
        if not batch:
            return
        old = list(client.scan_iter(match=keys.all_structure_keys_pattern(S)))
        if old:
            client.delete(*old)
        replies = resp.exchange(conn, staged.commands.chunks(), staged.commands.count)
        assert not any(isinstance(r, Exception) for r in replies), replies
        assert client.hgetall(keys.data(S)) == {s.id.encode(): s.data for s in batch}
        for k, n in staged.lists.items():
            assert client.llen(k) == n
    finally:
        client.connection_pool.release(conn)
        client.close()


def test_a_batch_of_large_messages_carries_each_ones_data_once_to_another_process() -> None:
    """The load's worker pickles each prepared batch with its copies (the restore point's): each message's data is
    one object in both, written once."""
    batch = [Survivor(f"id{i}", {"id": f"id{i}", "q": "Q1", "st": "CP", "l": i}, bytes([i]) * (64 << 10))
             for i in range(20)]
    staged = bulk.prepare(S, batch)
    assert len(pickle.dumps(staged)) < 1.05 * sum(len(s.data) for s in batch)


@pytest.mark.parametrize("field", ["id", "cid", "mid", "u", "pr"])
def test_an_entry_that_cannot_be_encoded_is_refused_by_name_before_its_batch_is_sent(field: str) -> None:
    """A raw byte a backup kept by surrogateescape (cfemu.entry reads descriptors so) cannot be written: neither
    the CF's scripts nor redis-py's strict encoding write it. prepare refuses the batch (it touches no server:
    nothing of it is sent) with a ValueError naming the entry, where the encoder's own error named none."""
    good = Survivor("ok", {"id": "ok", "q": "Q1", "st": "CP", "l": 1}, b"x")
    bad_id = "bad\udcff" if field == "id" else "bad"
    e: dict[str, Any] = {"id": bad_id, "q": "Q1", "st": "CP", "l": 2}
    e[field] = {"k": "v\udca3"} if field == "pr" else "x\udca3" if field != "id" else bad_id
    with pytest.raises(ValueError, match=r"^entry 'bad(\\udcff)?' cannot be written to the CF: .* not UTF-8") as err:
        bulk.prepare(S, [good, Survivor(bad_id, e, b"y")])
    assert err.value.__cause__ is None and ascii(str(err.value)) == repr(str(err.value))  # printable as it is
