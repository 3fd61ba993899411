"""Pipelined bulk reads and writes of a structure's CF format: the backup's fetch, and restore's wipe, load,
verify and purge.

The Lua scripts (cfemu/scripts/) change a structure one operation at a time, atomically; this module reads or
writes many entries at once in plain pipelines. Together they are the only code that knows the CF format (key
layout in cfemu/keys.py and docs/cf-layout.md, descriptors in cfemu/entry.py), so the rest of the house asks
here instead of spelling keys and fields again.

A pipeline is not atomic, and each use is safe for its own reason:
  * the backup's fetch reads ids that an atomic snapshot (snapshot.lua) took; an entry that changed or vanished
    between snapshot and fetch is copied as it is then, or reported gone (backup/protocol.py says why that copy
    is consistent);
  * the writes run while the structure's header says RECOVERING, and every script refuses work on it then, so
    nothing else changes the structure meanwhile; the header goes back to ACTIVE last, in one transaction
    (activate), and a crash before it leaves the structure RECOVERING for a re-run that starts from the wipe.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import msgpack
import redis

from cfemu import keys
from cfemu.admin import Admin, StructureDef
from cfemu.entry import Entry

BATCH = 1000  # writes: entries (or keys to delete) per pipeline
FETCH_BATCH = 2000  # reads: ids per pipelined fetch
Wire = dict[str, Any]  # an entry descriptor in wire form (cfemu.entry.Entry.wire())


# --- reads: the backup's fetch ---------------------------------------------------------------------------------
def read(client: redis.Redis, structure: str, ids: Sequence[str]) -> tuple[list[bytes | None], list[bytes | None]]:
    """The raw descriptors and data of `ids`, one round trip (None where the entry is gone)."""
    pipe = client.pipeline(transaction=False)
    pipe.hmget(keys.entries(structure), ids)
    pipe.hmget(keys.data(structure), ids)
    descs, datas = pipe.execute()
    return descs, datas


def fetch(client: redis.Redis, structure: str, ids: Iterable[str],
          batch: int = FETCH_BATCH) -> Iterator[tuple[str, Entry | None, bytes | None]]:
    """Current descriptor and data of each id (None when the entry is gone), read in pipelined batches."""
    chunk: list[str] = []

    def flush() -> Iterator[tuple[str, Entry | None, bytes | None]]:
        descs, datas = read(client, structure, chunk)
        for i, raw, d in zip(chunk, descs, datas, strict=True):
            yield i, (Entry.unpack(raw) if raw else None), d

    for i in ids:
        chunk.append(i)
        if len(chunk) >= batch:
            yield from flush()
            chunk = []
    if chunk:
        yield from flush()


def fetch_wire(client: redis.Redis, structure: str, ids: list[str],
               batch: int = FETCH_BATCH) -> Iterator[tuple[Wire | None, bytes | None]]:
    """Like fetch, but each descriptor comes as its wire-form dict straight from the CF's msgpack, without an
    Entry object in between, and the next batch is fetched while the caller handles this one (the backup's hot
    loop: a million entries)."""
    chunks = [ids[i:i + batch] for i in range(0, len(ids), batch)]
    if not chunks:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="backup-fetch") as pool:
        pending = pool.submit(read, client, structure, chunks[0])
        for k in range(len(chunks)):
            descs, datas = pending.result()
            if k + 1 < len(chunks):
                pending = pool.submit(read, client, structure, chunks[k + 1])
            for raw, d in zip(descs, datas, strict=True):
                if raw is None:
                    yield None, d
                    continue
                wire = msgpack.unpackb(raw, raw=False, unicode_errors="surrogateescape")
                if not isinstance(wire.get("pr"), dict):
                    wire["pr"] = {}  # Lua's msgpack writes an empty property table as an empty array
                yield wire, d


def count_nonpersistent(client: redis.Redis, structure: str) -> int:
    """Non-persistent entries the structure holds now (lost by a restore, which only has persistent ones)."""
    n = 0
    for _, raw in client.hscan_iter(keys.entries(structure), count=1000):
        if not msgpack.unpackb(raw, raw=False, unicode_errors="surrogateescape").get("per", 1):
            n += 1
    return n


def tombstones(client: redis.Redis, structure: str) -> dict[str, str]:
    """The structure's tombstones, UOW -> 'C' | 'B' (outcomes decided for their owners, who may still retry)."""
    return {keys.text(u): keys.text(o) for u, o in client.hgetall(keys.tomb(structure)).items()}


# --- writes: wipe, load, verify, activate, purge ---------------------------------------------------------------
class Survivor(Protocol):
    """An entry to load (restore.settle.Settled has this shape): its id, its final descriptor in wire form (None:
    not loaded) and its data."""

    @property
    def id(self) -> str: ...

    @property
    def entry(self) -> Wire | None: ...

    @property
    def data(self) -> bytes: ...


def structure_keys(client: redis.Redis, structure: str) -> Iterator[bytes]:
    """Every key of the structure (SCAN: never blocks the server the way KEYS would)."""
    yield from client.scan_iter(match=keys.all_structure_keys_pattern(structure), count=1000)


def wipe(client: redis.Redis, structure: str, *, keep: tuple[str, ...] = (), batch: int = BATCH) -> int:
    """Delete every key of the structure except `keep`; returns how many were deleted."""
    kept = {k.encode() for k in keep}
    doomed = [k for k in structure_keys(client, structure) if k not in kept]
    for i in range(0, len(doomed), batch):
        client.unlink(*doomed[i:i + batch])
    return len(doomed)


def mark_recovering(client: redis.Redis, structure: str) -> None:
    """Set the header's state to RECOVERING, whether or not the structure is defined (after the loss of the CF
    the admin structure may not know it yet): from now on every script refuses work on it."""
    client.hset(keys.meta(structure), "state", "RECOVERING")


def reset(client: redis.Redis, sdef: StructureDef, *, batch: int = BATCH) -> int:
    """Empty a RECOVERING structure: delete every key but its header, then give it back its header fields and
    its fence (every member's current epoch). Returns the number of keys deleted."""
    deleted = wipe(client, sdef.name, keep=(keys.meta(sdef.name),), batch=batch)
    Admin(client).create_structure(sdef, state="RECOVERING")
    return deleted


def list_of(structure: str, wire: Wire) -> str:
    """The queue list an entry (wire form) sits on: by its state, and by its priority when committed."""
    return keys.state_list(structure, wire["q"], wire["st"], int(wire.get("p", 0)))


def descriptor(wire: Wire, data: bytes) -> bytes:
    """The descriptor as the CF scripts store it: cmsgpack-readable (str keys; properties only with str names and
    str/int/float/bool values, the ones Lua keeps intact), with the data's length."""
    d = dict(wire)
    d["len"] = len(data)
    d["pr"] = {k: v for k, v in (d.get("pr") or {}).items()
               if isinstance(k, str) and isinstance(v, str | int | float | bool)}
    return Entry.from_wire(d).pack()


def uow_record(owner: str, first_lrsn: int, gen: int) -> bytes:
    """A UOW's record in {S}:uows, as join_uow in _prelude.lua writes it: {o, f, g}."""
    return msgpack.packb({"o": owner, "f": first_lrsn, "g": gen}, use_bin_type=False)


class Loader:
    """Writes entries into an emptied, RECOVERING structure (after reset), batch by batch, then the records of the
    UOWs that hold them. The caller chooses the batches and the order (a list keeps the order it is written in),
    so that it can report progress between them."""

    def __init__(self, client: redis.Redis, structure: str, gen: int) -> None:
        self.client = client
        self.structure = structure
        self.gen = gen  # the generation a loaded UOW is recorded in
        self.bytes = 0
        self.held: dict[str, int] = {}  # UOW holding entries -> lowest LRSN of its entries
        self.queues: set[str] = set()

    def write(self, batch: Sequence[Survivor]) -> None:
        """One pipelined batch: descriptors, data, list places, UOW sets, expiry times and id indexes."""
        S = self.structure
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(keys.entries(S), mapping={s.id: descriptor(_wire(s), s.data) for s in batch})
        pipe.hset(keys.data(S), mapping={s.id: s.data for s in batch})
        lists: dict[str, list[str]] = defaultdict(list)
        expiry: dict[str, int] = {}
        for s in batch:
            e = _wire(s)
            lists[list_of(S, e)].append(s.id)
            self.queues.add(e["q"])
            if e.get("u"):
                pipe.sadd(keys.uow_set(S, e["u"]), s.id)
                self.held[e["u"]] = min(self.held.get(e["u"], int(e["l"])), int(e["l"]))
            if int(e.get("exp", 0)) > 0:
                expiry[s.id] = int(e["exp"])
            if e.get("cid"):
                pipe.sadd(keys.index_set(S, e["q"], "c", e["cid"]), s.id)
            if e.get("mid"):
                pipe.sadd(keys.index_set(S, e["q"], "m", e["mid"]), s.id)
            self.bytes += len(s.data)
        for k, ids in lists.items():
            pipe.rpush(k, *ids)
        if expiry:
            pipe.zadd(keys.expiry(S), expiry)
        pipe.execute()

    def finish(self, queues: Iterable[str], owner: Callable[[str], str], tomb: Mapping[str, str]) -> int:
        """After the last batch: the queue set (`queues` and every queue written to), a record for each UOW
        holding entries (its owner by `owner`), and the tombstones (UOW -> 'C' | 'B'). Returns the number of UOWs
        holding entries."""
        S = self.structure
        pipe = self.client.pipeline(transaction=False)
        all_queues = sorted(set(queues) | self.queues)
        if all_queues:
            pipe.sadd(keys.queues(S), *all_queues)
        if self.held:
            pipe.hset(keys.uows(S), mapping={u: uow_record(owner(u), f, self.gen) for u, f in self.held.items()})
        if tomb:
            pipe.hset(keys.tomb(S), mapping=dict(tomb))  # type: ignore[arg-type]
        pipe.execute()
        return len(self.held)


def _wire(s: Survivor) -> Wire:
    assert s.entry is not None, f"entry {s.id} is not to be loaded"
    return s.entry


def verify(client: redis.Redis, structure: str, survivors: Sequence[Survivor]) -> list[str]:
    """Compare the structure's content with what was loaded: entry and data counts, UOWs holding entries, and
    the length of every list. Returns the differences found (none: an empty list)."""
    expected: dict[str, int] = defaultdict(int)
    uows: set[str] = set()
    for s in survivors:
        e = _wire(s)
        expected[list_of(structure, e)] += 1
        if e.get("u"):
            uows.add(e["u"])
    pipe = client.pipeline(transaction=False)
    pipe.hlen(keys.entries(structure))
    pipe.hlen(keys.data(structure))
    pipe.hlen(keys.uows(structure))
    names = sorted(expected)
    for k in names:
        pipe.llen(k)
    n_ent, n_data, n_uows, *lengths = pipe.execute()
    problems = []
    if n_ent != len(survivors):
        problems.append(f"{n_ent} descriptors, expected {len(survivors)}")
    if n_data != len(survivors):
        problems.append(f"{n_data} data fields, expected {len(survivors)}")
    if n_uows != len(uows):
        problems.append(f"{n_uows} UOWs holding entries, expected {len(uows)}")
    for k, n in zip(names, lengths, strict=True):
        if n != expected[k]:
            problems.append(f"list {k} holds {n}, expected {expected[k]}")
    return problems


def activate(client: redis.Redis, sdef: StructureDef, *, gen: int, clock: int, floor: int, entries: int,
             nbytes: int, restored_from: str = "", last_backup: str = "") -> None:
    """The switch back to ACTIVE, last and in one transaction: the whole header is replaced (no field of the
    RECOVERING one, such as a backup's running mark, survives). last_backup: the restore point just written."""
    header: dict[str, Any] = {"state": "ACTIVE", "gen": gen, "clock": clock, "floor": floor, "entries": entries,
                              "bytes": nbytes, "max_entries": sdef.max_entries, "max_bytes": sdef.max_bytes}
    if restored_from:
        header["restored_from"] = restored_from
    if last_backup:
        header["last_backup"] = last_backup
    meta = keys.meta(sdef.name)
    tx = client.pipeline(transaction=True)
    tx.delete(meta)
    tx.hset(meta, mapping=header)  # type: ignore[arg-type]
    tx.execute()


class Purged(NamedTuple):
    discarded: int  # entries the structure held
    discarded_bytes: int  # their data bytes, by the header
    gen: int  # the structure's new generation


def purge(client: redis.Redis, sdef: StructureDef, queues: Sequence[str], *,
          before_activate: Callable[[int, dict[str, str]], str] | None = None) -> Purged:
    """Empty the structure and make it ACTIVE again in a new generation, above its clock and its old generation
    (so a unit of work from before that had no work here is backed out when it next touches it); its queues stay
    defined, and the UOWs that held entries get a 'P' tombstone (purged_tombstones). before_activate(gen,
    tombstones), once nothing can change the structure any more and before it is usable again, makes the purge
    durable (restore.run writes an empty restore point with those tombstones) and returns the id it wrote."""
    S = sdef.name
    mark_recovering(client, S)  # first: from here on no member changes what the purge discards
    meta = keys.meta(S)
    info = {keys.text(k): keys.text(v) for k, v in client.hgetall(meta).items()}
    discarded = int(client.hlen(keys.entries(S)))
    gen = max(time.time_ns() // 1000, int(info.get("clock", 0)) + 1, int(info.get("gen", 0)) + 1)
    tomb = purged_tombstones(client, S)
    last = before_activate(gen, tomb) if before_activate is not None else ""
    reset(client, sdef)
    if queues:
        client.sadd(keys.queues(S), *queues)
    if tomb:
        client.hset(keys.tomb(S), mapping=tomb)  # type: ignore[arg-type]
    activate(client, sdef, gen=gen, clock=gen + 1, floor=gen, entries=0, nbytes=0, last_backup=last)
    return Purged(discarded, int(info.get("bytes", 0)), gen)


def purged_tombstones(client: redis.Redis, structure: str) -> dict[str, str]:
    """The tombstones a purge leaves: those already there (outcomes decided for owners that may still retry), and
    'P' for every UOW holding entries: a purge discards messages, not outcomes, so the owner's commit or backout
    of such a UOW is a no-op here and goes on on its other structures (a commit refused here as "lost" would
    make the owner back out work that committed elsewhere, or that it already told its application committed),
    while more work of it here is refused as backed out."""
    held = {keys.text(u): "P" for u in client.hkeys(keys.uows(structure))}
    return {**held, **tombstones(client, structure)}
