"""The bulk load: write a settled restore plan into the CF, once, pipelined.

Recovery owns the structure while it is RECOVERING (every CF script refuses work on it), so the load does not
keep the structure correct step by step (prior art IPCOM000013422): it deletes every key of the structure
except its header, writes only the survivors in pipelined batches, checks the counts, and only then rewrites
the header with state ACTIVE. A crash anywhere before that last step leaves the structure RECOVERING, and a
re-run starts again from the wipe: the load is idempotent.

Key layout: cfemu/scripts/_prelude.lua. Descriptors are packed the way the Lua cmsgpack reads them (str keys,
str/int/float/bool values).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import redis

from cfemu import keys
from cfemu.admin import Admin, StructureDef
from cfemu.entry import Entry
from restore.engine import LOAD, Progress, no_progress
from restore.plan import RestorePlan, owner_of
from restore.settle import BACKOUT, Settled, fifo_key
from sqm.failpoints import failpoint

BATCH = 1000


class LoadVerifyError(RuntimeError):
    """The structure does not hold what the plan says after the load (it stays RECOVERING)."""


@dataclass
class LoadResult:
    entries: int = 0
    bytes: int = 0
    keys_deleted: int = 0
    batches: int = 0
    uows_in_doubt: int = 0
    seconds: float = 0.0


def structure_keys(client: redis.Redis, structure: str) -> Iterator[bytes]:
    """Every key of the structure (SCAN: never blocks the server the way KEYS would)."""
    yield from client.scan_iter(match=keys.all_structure_keys_pattern(structure), count=1000)


def count_nonpersistent(client: redis.Redis, structure: str) -> int:
    """Non-persistent entries the structure holds now (lost by a restore, which only has persistent ones)."""
    ent = keys.script_keys(structure)[2]
    n = 0
    for _, raw in client.hscan_iter(ent, count=1000):
        if not msgpack.unpackb(raw, raw=False, unicode_errors="surrogateescape").get("per", 1):
            n += 1
    return n


def wipe(client: redis.Redis, structure: str, *, keep: tuple[str, ...] = (), batch: int = BATCH) -> int:
    """Delete every key of the structure except `keep`; returns how many were deleted."""
    kept = {k.encode() for k in keep}
    doomed = [k for k in structure_keys(client, structure) if k not in kept]
    for i in range(0, len(doomed), batch):
        client.unlink(*doomed[i:i + batch])
    return len(doomed)


def descriptor(s: Settled) -> bytes:
    """The descriptor as the CF scripts store it (cmsgpack-readable)."""
    assert s.entry is not None
    d = dict(s.entry)
    d["len"] = len(s.data)
    d["pr"] = {k: v for k, v in (d.get("pr") or {}).items()
               if isinstance(k, str) and isinstance(v, str | int | float | bool)}
    return Entry.from_wire(d).pack()


def list_suffix(entry: dict[str, Any]) -> str:
    st = entry["st"]
    return f"cp:{int(entry.get('p', 0))}" if st == "CP" else st.lower()


def load_order(settled: list[Settled]) -> list[Settled]:
    """Loaded entries grouped by the list they go on, each list in the CF's order: committed puts by priority
    then FIFO (settle.fifo_key), uncommitted puts in put order, uncommitted gets in get order."""
    def key(s: Settled) -> tuple[Any, ...]:
        e = s.entry
        assert e is not None
        if e["st"] == "CP":
            return (e["q"], 0, *fifo_key(e), s.id)
        if e["st"] == "UP":
            return (e["q"], 1, int(e.get("o2", 0)), 0, 0, s.id)
        return (e["q"], 2, int(e["l"]), 0, 0, s.id)
    return sorted((s for s in settled if s.entry is not None), key=key)


def restore_owned_uows(plan: RestorePlan) -> dict[str, str]:
    """Tombstones: 'C' for committed UOWs whose owner may still be completing them (its retry is then a
    no-op), 'B' for in-flight UOWs restore backed out (now or in an earlier run: a re-run writes the same)."""
    tomb = {u: "C" for u in plan.in_commit}
    for u, o in plan.outcomes.items():
        if o.kind == BACKOUT and o.decided_by == "restore":
            tomb[u] = "B"
    return tomb


def load_plan(client: redis.Redis, plan: RestorePlan, sdef: StructureDef, queues: list[str], *,
              batch: int = BATCH, progress: Progress = no_progress, restored_from: str = "") -> LoadResult:
    """Replace the structure's content with the plan's survivors and make it ACTIVE (see the module doc).
    The header must already say RECOVERING."""
    t0 = time.monotonic()
    S = plan.structure
    meta, _, ent_key, data_key, uows_key, tomb_key, queues_key, expiry_key = keys.script_keys(S)
    result = LoadResult()
    result.keys_deleted = wipe(client, S, keep=(meta,), batch=batch)
    Admin(client).create_structure(sdef, state="RECOVERING")  # the fence: every member's current epoch

    ordered = load_order(plan.settled)
    gen = plan.restore_lrsn
    held: dict[str, int] = {}  # in-doubt UOW -> lowest LRSN of its entries
    progress(LOAD, 0, len(ordered))
    for start in range(0, len(ordered), batch):
        chunk = ordered[start:start + batch]
        pipe = client.pipeline(transaction=False)
        pipe.hset(ent_key, mapping={s.id: descriptor(s) for s in chunk})
        pipe.hset(data_key, mapping={s.id: s.data for s in chunk})
        lists: dict[str, list[str]] = defaultdict(list)
        expiry: dict[str, int] = {}
        for s in chunk:
            e = s.entry
            assert e is not None
            lists[keys.queue_list(S, e["q"], list_suffix(e))].append(s.id)
            if e.get("u"):
                pipe.sadd(keys.uow_set(S, e["u"]), s.id)
                held[e["u"]] = min(held.get(e["u"], int(e["l"])), int(e["l"]))
            if int(e.get("exp", 0)) > 0:
                expiry[s.id] = int(e["exp"])
            if e.get("cid"):
                pipe.sadd(keys.index_set(S, e["q"], "c", e["cid"]), s.id)
            if e.get("mid"):
                pipe.sadd(keys.index_set(S, e["q"], "m", e["mid"]), s.id)
            result.bytes += len(s.data)
        for k, ids in lists.items():
            pipe.rpush(k, *ids)
        if expiry:
            pipe.zadd(expiry_key, expiry)
        pipe.execute()
        result.entries += len(chunk)
        result.batches += 1
        progress(LOAD, result.entries, len(ordered))
        failpoint("restore-load-batch")  # tests: SQM_FAILPOINTS=restore-load-batch=N dies after batch N

    pipe = client.pipeline(transaction=False)
    all_queues = sorted(set(queues) | {s.entry["q"] for s in ordered if s.entry is not None})
    if all_queues:
        pipe.sadd(queues_key, *all_queues)
    if held:
        pipe.hset(uows_key, mapping={u: msgpack.packb({"o": uow_owner(plan, u), "f": f, "g": gen}, use_bin_type=False)
                                     for u, f in held.items()})
    tomb = restore_owned_uows(plan)
    if tomb:
        pipe.hset(tomb_key, mapping=tomb)  # type: ignore[arg-type]
    pipe.execute()
    result.uows_in_doubt = len(held)

    problems = verify(client, plan, ordered)
    if problems:
        raise LoadVerifyError(f"structure {S} after the load: {'; '.join(problems)} (left RECOVERING)")

    header = {"state": "ACTIVE", "gen": gen, "clock": plan.restore_lrsn + 1, "floor": plan.restore_lrsn,
              "entries": result.entries, "bytes": result.bytes, "max_entries": sdef.max_entries,
              "max_bytes": sdef.max_bytes}
    if restored_from:
        header["restored_from"] = restored_from
    tx = client.pipeline(transaction=True)  # the switch to ACTIVE: one atomic step, last
    tx.delete(meta)
    tx.hset(meta, mapping=header)  # type: ignore[arg-type]
    tx.execute()
    result.seconds = time.monotonic() - t0
    return result


def uow_owner(plan: RestorePlan, uow: str) -> str:
    """The member that owns an in-doubt UOW: the one that logged its PREPARE (UOW ids start with it too)."""
    o = plan.outcomes.get(uow)
    return o.decided_by if o is not None and o.decided_by else owner_of(uow)


def verify(client: redis.Redis, plan: RestorePlan, ordered: list[Settled] | None = None) -> list[str]:
    """Compare the structure's content with the plan: entry and data counts, list lengths per queue and state."""
    S = plan.structure
    ordered = ordered if ordered is not None else load_order(plan.settled)
    _, _, ent_key, data_key, uows_key, _, _, _ = keys.script_keys(S)
    expected: dict[str, int] = defaultdict(int)
    uows: set[str] = set()
    for s in ordered:
        assert s.entry is not None
        expected[keys.queue_list(S, s.entry["q"], list_suffix(s.entry))] += 1
        if s.entry.get("u"):
            uows.add(s.entry["u"])
    pipe = client.pipeline(transaction=False)
    pipe.hlen(ent_key)
    pipe.hlen(data_key)
    pipe.hlen(uows_key)
    names = sorted(expected)
    for k in names:
        pipe.llen(k)
    n_ent, n_data, n_uows, *lengths = pipe.execute()
    problems = []
    if n_ent != len(ordered):
        problems.append(f"{n_ent} descriptors, expected {len(ordered)}")
    if n_data != len(ordered):
        problems.append(f"{n_data} data fields, expected {len(ordered)}")
    if n_uows != len(uows):
        problems.append(f"{n_uows} UOWs holding entries, expected {len(uows)}")
    for k, n in zip(names, lengths, strict=True):
        if n != expected[k]:
            problems.append(f"list {k} holds {n}, expected {expected[k]}")
    return problems
