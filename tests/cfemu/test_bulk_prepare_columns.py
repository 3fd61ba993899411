"""cfemu.bulk.prepare_columns (cfemu/_bulk.c's stage), differentially against bulk.prepare: the same Staged (its
commands' bytes, copies, lists, UOWs held, queues, bytes) from the same entries, given as columns (base descriptor
bytes, a mask and the fields it sets, whether the copy is a backup's) instead of decoded dicts; and None (the
caller's Python path) for every entry it does not take exactly, whatever prepare makes of it (a Staged or an
error). The batches it takes are written to a real redis-server."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from cfemu import bulk, keys, resp
from tests.support.survivor import Survivor

S = "APP1"
CONTROL = ".CTL"


@dataclass
class _Row:
    """An entry as the columnar plan gives it: its id, its base descriptor's bytes, the fold's mask and fields,
    where its copy came from, its data."""

    id: Any
    desc: bytes
    mask: int = 0
    fields: tuple[Any, ...] = (None,) * 6
    backup: bool = False
    data: bytes = b""


_unpack_args = {"raw": False, "unicode_errors": "surrogateescape", "strict_map_key": False}


def _settled(row: _Row) -> Survivor:
    """The entry as the plan's Python path reads it (restore.engine_columnar._survivors)."""
    entry = msgpack.unpackb(row.desc, **_unpack_args)
    if row.backup and not isinstance(entry.get("pr", {}), dict):
        entry["pr"] = {}
    for j, name in enumerate(bulk.OVERRIDES):
        if row.mask & (1 << j):
            entry[name] = row.fields[j]
    return Survivor(row.id, entry, row.data)


def _columns(rows: list[_Row], pad: int = 0) -> dict[str, Any]:
    """The rows as columns, after `pad` rows of padding (the C path reads [start, end) of longer columns)."""
    rows = [_Row("pad", b"\x80")] * pad + rows
    return {"ids": [r.id for r in rows], "descs": [r.desc for r in rows], "datas": [r.data for r in rows],
            "masks": [r.mask for r in rows], "backup": [r.backup for r in rows],
            "overrides": [[r.fields[j] for r in rows] for j in range(6)]}


def _in_c(rows: list[_Row], pad: int = 0) -> bulk.Staged | None:
    c = _columns(rows, pad)
    return bulk.prepare_columns(S, c["ids"], c["descs"], c["datas"], c["masks"], c["backup"], c["overrides"],
                                pad, pad + len(rows), aside_suffix=CONTROL)


def _same(a: bulk.Staged, b: bulk.Staged) -> None:
    assert a.commands.data() == b.commands.data()
    assert a.commands.count == b.commands.count
    assert (a.entries, a.copies, a.lists, a.held, a.queues, a.bytes) == (b.entries, b.copies, b.lists, b.held,
                                                                          b.queues, b.bytes)
    assert list(a.lists) == list(b.lists) and list(a.held) == list(b.held)


def _reference(rows: list[_Row]) -> bulk.Staged | Exception:
    try:
        return bulk.prepare(S, [_settled(r) for r in rows])
    except Exception as e:  # what the Python path makes of it: the C path must then step aside
        return e


def _check(rows: list[_Row], *, taken: bool, pad: int = 0) -> bulk.Staged | None:
    expected = _reference(rows)
    got = _in_c(rows, pad)
    if taken and not isinstance(expected, Exception):
        assert got is not None, rows
    if got is not None:
        assert not isinstance(expected, Exception), expected
        _same(got, expected)
    return got


# --- the descriptors a load meets, and more: every field's types, sizes and encodings ------------------------
_text = st.one_of(st.text(st.characters(exclude_categories=["Cs"]), max_size=8),
                  st.text(st.characters(exclude_categories=["Cs"]), max_size=8),
                  st.sampled_from(["", "é" * 20, "x" * 31, "y" * 32, "z" * 255, "w" * 256, "v" * 65535, "u" * 65536,
                                   "日本語" * 30]))
_int = st.one_of(st.integers(-2**63, 2**64 - 1), st.sampled_from([0, 1, -1, -32, -33, 127, 128, 255, 256, 65535,
                                                                 65536, 2**32 - 1, 2**32, -128, -129, -32768,
                                                                 -32769, -2**31, -2**31 - 1, 2**63, -2**63]))
_prop_value = st.one_of(_text, _int, st.floats(), st.booleans(), st.none(), st.binary(max_size=4),
                        st.lists(_int, max_size=2), st.dictionaries(st.text(max_size=2), _int, max_size=2))
_props = st.one_of(st.just({}), st.dictionaries(st.one_of(_text, _int, st.binary(max_size=3)), _prop_value,
                                                max_size=6))
_packers = [msgpack.Packer(use_bin_type=True).pack, msgpack.Packer(use_bin_type=False).pack,
            msgpack.Packer(use_bin_type=True, use_single_float=True).pack]


def _packed(e: dict[str, Any], pack: Any) -> bytes:
    try:
        return bytes(pack(e))
    except OverflowError:  # a float beyond a float 32's range
        return bytes(_packers[0](e))


@st.composite
def _entries(draw: Any, n: int) -> list[_Row]:
    rows = []
    ids = draw(st.lists(_text, unique=True, min_size=n, max_size=n))
    for k, i in enumerate(ids):
        e: dict[str, Any] = {"id": i, "q": draw(st.sampled_from(["Q1", "Qé", "Q 2", "Q" * 40])),
                             "st": draw(st.sampled_from(["CP", "UP", "UG", "EX"]))}
        optional = {"p": st.integers(0, 9), "per": st.sampled_from([0, 1, True, False, None]), "u":
                    st.sampled_from(["", "QM1.1.1", "QMé.1.2", None]), "l": _int, "mid": _text,
                    "cid": st.one_of(_text, st.none()), "exp": st.one_of(st.sampled_from([0, -5, 1700000000000]), _int),
                    "pt": _int, "bc": st.integers(0, 3), "o1": _int, "o2": _int, "pr": _props,
                    "len": st.integers(0, 9), "xtra": _prop_value}
        for name, values in optional.items():
            if draw(st.booleans()):
                e[name] = draw(values)
        if e.get("u") and "l" not in e:
            e["l"] = 100 + k
        e = dict(draw(st.permutations(list(e.items()))))  # the keys in any order
        mask = draw(st.integers(0, 63))
        fields = (draw(st.sampled_from(["CP", "UP", "UG"])), draw(st.sampled_from(["", "QM2.7.7", None])),
                  draw(st.integers(-2**63, 2**63 - 1)), draw(st.integers(0, 2**40)), draw(st.integers(0, 2**40)),
                  draw(st.integers(0, 5)))
        if mask & 2 and fields[1] and not mask & 4 and "l" not in e:
            mask |= 4
        data = draw(st.one_of(st.binary(max_size=20), st.sampled_from([b"", bytes(70000)])))
        rows.append(_Row(i, _packed(e, draw(st.sampled_from(_packers))), mask, fields, draw(st.booleans()), data))
    return rows


@settings(max_examples=200, deadline=None, database=None)
@given(rows=st.integers(0, 8).flatmap(_entries), pad=st.integers(0, 2))
def test_the_c_path_stages_what_prepare_stages(rows: list[_Row], pad: int) -> None:
    """Every batch prepare stages whose entries have a str id, queue and state, int fields, str or nil ids and UOW,
    and properties of any kind (those kept: str names, str/int/float/bool values) is taken, and staged byte for
    byte as prepare stages it."""
    _check(rows, taken=True, pad=pad)


_any_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                                    st.text(max_size=4), st.binary(max_size=4)),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.text(max_size=2), inner, max_size=3)),
                          max_leaves=6)


@st.composite
def _wild(draw: Any) -> _Row:
    names = st.sampled_from(["id", "q", "st", "p", "per", "u", "l", "mid", "cid", "exp", "pt", "bc", "o1", "o2",
                             "pr"])
    e = draw(st.dictionaries(names, _any_value, max_size=15))
    for name in ("id", "q", "st"):
        if draw(st.integers(0, 3)):
            e[name] = draw(st.sampled_from(["a", "CP", "Q1" + CONTROL, "\udcff", ""]))
    raw = msgpack.Packer(use_bin_type=draw(st.booleans()), unicode_errors="surrogateescape").pack(e)
    raw = draw(st.sampled_from([raw, raw, raw[:-1], raw + b"\x00", b"\x91" + raw]))
    mask = draw(st.integers(0, 63))
    fields = tuple(draw(st.one_of(st.none(), _any_value)) for _ in range(6))
    return _Row(draw(st.sampled_from(["e1", "e\udcff", 7])), raw, mask, fields, draw(st.booleans()),
                draw(st.sampled_from([b"", b"d"])))


@pytest.mark.slow
@settings(max_examples=300, deadline=None, database=None)
@given(rows=st.lists(_wild(), max_size=4))
def test_the_c_path_steps_aside_for_what_it_does_not_take_exactly(rows: list[_Row]) -> None:
    """Any descriptor bytes and fields at all: the C path gives prepare's Staged, or None (never another Staged,
    never one where prepare raises)."""
    _check(rows, taken=False)


_TYPE_BYTES = [0xc0, 0xc1, 0xc2, 0xc3, 0xc4, 0xc6, 0xca, 0xcb, 0xcc, 0xcf, 0xd0, 0xd3, 0xd4, 0xd9, 0xda, 0xdb, 0xdc,
               0xdd, 0xde, 0xdf, 0xff, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0x7f, 0xed, 0xf4]


@st.composite
def _mutated(draw: Any) -> _Row:
    """A descriptor prepare stages, its bytes then cut, flipped, overwritten by a msgpack type byte, spliced or
    grown: every length and count the C path reads may now run past the end of the bytes."""
    row = draw(_entries(1))[0]
    raw = bytearray(row.desc)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(raw)))
        how = draw(st.sampled_from(["cut", "flip", "type", "insert", "repeat"]))
        if how == "cut":
            del raw[at:]
        elif how == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=5))
        elif how == "repeat":
            raw[at:at] = raw[at:at + draw(st.integers(1, 9))]
        elif at < len(raw):
            raw[at] = raw[at] ^ (1 << draw(st.integers(0, 7))) if how == "flip" else draw(st.sampled_from(_TYPE_BYTES))
    row.desc = bytes(raw)
    return row


@pytest.mark.deep
@settings(max_examples=1500, deadline=None, database=None)
@given(rows=st.lists(_mutated(), min_size=1, max_size=3))
def test_descriptor_bytes_cut_or_corrupted_are_staged_as_prepare_stages_them_or_stepped_aside(rows: list[_Row]) -> None:
    """Any corruption of a descriptor's bytes: prepare's Staged, or None, never another Staged (nor a read past the
    bytes' end: run it against a -fsanitize=address,undefined build of cfemu/_bulk.c to see one)."""
    _check(rows, taken=False)


def _row(e: dict[str, Any], **kw: Any) -> _Row:
    return _Row(e.get("id", "x"), msgpack.packb(e, use_bin_type=True, unicode_errors="surrogateescape"), **kw)


GOOD = {"id": "a", "q": "Q1", "st": "CP", "l": 5}


@pytest.mark.parametrize(("why", "row"), [
    ("a control queue's entry (the pseudo-clock floor reads its data)", _row({**GOOD, "q": "Q1" + CONTROL})),
    ("a log's copy whose property table is not a map", _row({**GOOD, "pr": [1, 2]})),
    ("a float where an int is wanted", _row({**GOOD, "p": 1.5})),
    ("a str where an int is wanted", _row({**GOOD, "exp": "12"})),
    ("nil where an int is wanted", _row({**GOOD, "o1": None})),
    ("a string that is not UTF-8 (prepare refuses it by name)", _row({**GOOD, "cid": "c\udca3"})),
    ("a property name that is not UTF-8", _row({**GOOD, "pr": {"k\udca3": 1}})),
    ("a property value that is not UTF-8", _row({**GOOD, "pr": {"k": "v\udca3"}})),
    ("more properties than the C path reads", _row({**GOOD, "pr": {f"k{i}": i for i in range(300)}})),
    ("no id", _row({k: v for k, v in GOOD.items() if k != "id"})),
    ("no queue", _row({k: v for k, v in GOOD.items() if k != "q"})),
    ("no state", _row({k: v for k, v in GOOD.items() if k != "st"})),
    ("a UOW and no LRSN", _row({"id": "a", "q": "Q1", "st": "UP", "u": "U1"})),
    ("an id that is bytes", _row({**GOOD, "id": b"a"})),
    ("a message id that is an int", _row({**GOOD, "mid": 5})),
    ("an ext type", _Row("a", msgpack.packb({**GOOD, "x": msgpack.ExtType(1, b"z")}))),
    ("a descriptor that is not a map", _Row("a", msgpack.packb([1, 2]))),
    ("a descriptor cut short", _Row("a", msgpack.packb(GOOD)[:-1])),
    ("bytes after the descriptor", _Row("a", msgpack.packb(GOOD) + b"\xc0")),
    ("a fold's state that is nil", _row(GOOD, mask=1)),
    ("a fold's LRSN that is nil", _row(GOOD, mask=4)),
    ("an entry id that is not UTF-8", _Row("a\udcff", msgpack.packb(GOOD))),
])
def test_each_case_the_c_path_does_not_take_goes_to_python(why: str, row: _Row) -> None:
    good = _row({**GOOD, "id": "g"})
    assert _in_c([good]) is not None
    assert _in_c([good, row]) is None, why


def test_a_backups_copy_with_a_property_table_that_is_not_a_map_has_the_empty_one() -> None:
    staged = _check([_row({**GOOD, "pr": [1, 2]}, backup=True)], taken=True)
    assert staged is not None and msgpack.unpackb(staged.copies[0][0])["pr"] == {}


def test_a_property_named_twice_keeps_its_first_place_and_its_last_value() -> None:
    """As msgpack's dict: {k: 1, j: 2, k: 3} is {k: 3, j: 2}; and {k: 1, k: None} has no k (None is not kept)."""
    head = b"\x85\xa2id\xa1a\xa1q\xa2Q1\xa2st\xa2CP\xa1l\x05\xa2pr"
    for pr in (b"\x83\xa1k\x01\xa1j\x02\xa1k\x03", b"\x82\xa1k\x01\xa1k\xc0", b"\x82\xa1k\xc0\xa1k\xc3"):
        _check([_Row("a", head + pr)], taken=True)


def test_the_batch_end_is_the_loads_rule() -> None:
    """batch_end cuts as restore.load.batches: `size` entries, or fewer once their data reach max_bytes."""
    datas = [b"x" * n for n in (1, 5, 2, 9, 1, 1)]
    assert bulk.batch_end(datas, 0, 3, 0) == 3
    assert bulk.batch_end(datas, 1, 10, 7) == 3
    assert bulk.batch_end(datas, 3, 10, 9) == 4
    assert bulk.batch_end(datas, 4, 10, 0) == -1
    assert bulk.batch_end(datas, 6, 1, 0) == -1


def test_a_batch_staged_in_c_is_written_to_the_cf_as_prepare_writes_it(redis_url: str) -> None:
    rows = [_row({"id": f"e{k}", "q": f"Q{k % 3}", "st": "UP" if k % 4 else "CP", "p": k % 2, "u": f"U{k % 5}",
                  "l": 1000 - k, "mid": f"m{k}", "cid": "c" * (k % 2), "exp": 17e11 if k % 7 == 0 else 0,
                  "pr": {"k": k, "f": 0.5, "s": "é" * k}}, data=b"d" * k) for k in range(50)]
    for r in rows:
        r.desc = msgpack.packb({**msgpack.unpackb(r.desc), "exp": int(msgpack.unpackb(r.desc)["exp"])})
    staged = _check(rows, taken=True)
    assert staged is not None
    client = redis.Redis.from_url(redis_url)
    conn = client.connection_pool.get_connection()
    try:
        old = list(client.scan_iter(match=keys.all_structure_keys_pattern(S)))
        if old:
            client.delete(*old)
        replies = resp.exchange(conn, staged.commands.chunks(), staged.commands.count)
        assert not any(isinstance(r, Exception) for r in replies), replies
        assert client.hlen(keys.entries(S)) == 50 and client.zcard(keys.expiry(S)) == 8
        assert client.smembers(keys.uow_set(S, "U1")) == {f"e{k}".encode() for k in range(50) if k % 5 == 1}
        assert client.hget(keys.entries(S), "e3") == bulk.descriptor(_settled(rows[3]).entry or {}, b"ddd")
        for k, n in staged.lists.items():
            assert client.llen(k) == n
    finally:
        client.connection_pool.release(conn)
        client.close()


# A stage whose list_name (Python, called once a place) empties every column it was given, or replaces every
# item: the entry being staged keeps the items it was read from (its id, descriptor, override), and the next one is
# refused by name where its columns are too short now, never read from a freed item or past a list's end.
_CHANGED_BY_A_CALLBACK = """
import msgpack
from cfemu import _bulk, keys

def columns():
    descs = [msgpack.packb({"id": f"e{k}", "q": f"Q{k}", "st": "UP", "u": f"U{k}", "l": k, "mid": f"m{k}"})
             for k in range(4)]
    return ([f"e{k}" for k in range(4)], descs, [b"d" * k for k in range(4)], [1] * 4, [False] * 4,
            (["UG"] * 4, None, None, None, None, None))

def stage(cols, list_name):
    ids, descs, datas, masks, backup, overrides = cols
    return _bulk.stage(ids, descs, datas, masks, backup, overrides, 0, 4, list_name,
                       lambda q: (keys.index_set_prefix("S", q, "c"), keys.index_set_prefix("S", q, "m")),
                       keys.uow_set_prefix("S"), "")

expected = stage(columns(), lambda *a: keys.state_list("S", *a))
cols = columns()

def emptying(*a):
    ids, descs, datas, masks, backup, overrides = cols
    for column in (ids, descs, datas, masks, backup, overrides[0]):
        column.clear()
    return keys.state_list("S", *a)

def replacing(*a):
    ids, descs, datas, masks, backup, overrides = cols
    for column in (ids, descs, datas, masks, backup, overrides[0]):
        column[:] = [column[-1]] * len(column)
    return keys.state_list("S", *a)

try:
    stage(cols, emptying)
except RuntimeError as e:
    print(e)
cols = columns()
staged = stage(cols, replacing)
assert staged[0][0] == expected[0][0] and staged[0][1:] == [expected[0][3]] * 3, staged[0]
print("kept")
"""


def test_a_callback_that_changes_the_columns_leaves_each_entry_staged_from_the_items_it_was_read_from() -> None:
    done = subprocess.run([sys.executable, "-c", _CHANGED_BY_A_CALLBACK], capture_output=True, text=True,
                          timeout=120, check=False)
    assert (done.returncode, done.stdout.split("\n")) == (0, ["the columns changed while their entries were staged",
                                                               "kept", ""]), done.stderr[-2000:]


class _Refused:
    def __bool__(self) -> bool:
        raise ZeroDivisionError("no truth")


def test_a_backup_flag_whose_truth_raises_raises_as_prepares_caller_would() -> None:
    """Its error, as the Python path's `if backup` raises it: never a result with an exception still set (here
    the step aside for a log's property table that is not a map, None, had been returned so: a SystemError)."""
    c = _columns([_row({**GOOD, "pr": [1, 2]})])
    c["backup"] = [_Refused()]
    with pytest.raises(ZeroDivisionError, match="no truth"):
        bulk.prepare_columns(S, c["ids"], c["descs"], c["datas"], c["masks"], c["backup"], c["overrides"], 0, 1)
