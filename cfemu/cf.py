"""Python face of the CF: one method per CF operation, each one atomic Lua script (cfemu/scripts/<op>.lua)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import redis

from cfemu import keys, lua
from cfemu.entry import Entry
from cfemu.errors import from_script_error


class Clock(Protocol):
    """The caller's LRSN clock (sqm.clock.LrsnClock): now() ticks, observe() adopts the CF's clock."""

    def now(self) -> int: ...

    def observe(self, lrsn: int) -> None: ...


@dataclass
class Caller:
    """Who calls the CF: a member of the group with its fencing epoch and LRSN clock."""

    member: str
    epoch: int
    clock: Clock


class CF:
    """A connection to the CF (a Redis server) with every structure script registered (the admin ones: Admin)."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._scripts = lua.register(client, lua.structure_operations())  # cfemu/scripts/<op>.lua

    def structure(self, name: str) -> Structure:
        return Structure(self, keys.check_name("structure", name))

    def run(self, op: str, structure: str, args: Sequence[Any]) -> Any:
        try:
            return self._scripts[op](keys=keys.script_keys(structure), args=list(args))
        except redis.exceptions.ResponseError as e:
            msg = str(e)
            if msg.startswith(("NOSCRIPT", "ERR", "WRONGTYPE", "BUSY", "LOADING", "READONLY", "OOM")):
                raise
            raise from_script_error(msg, structure) from None


def _pairs(flat: list[Any]) -> list[tuple[Entry, bytes]]:
    return [(Entry.unpack(flat[i]), flat[i + 1] or b"") for i in range(0, len(flat), 2)]


class Structure:
    """One CF list structure (e.g. APP1): its queues, entries and state."""

    def __init__(self, cf: CF, name: str) -> None:
        self.cf = cf
        self.name = name

    def _call(self, op: str, caller: Caller | None, args: Sequence[Any]) -> Any:
        head: list[Any] = [caller.member, caller.epoch, caller.clock.now()] if caller else []
        return self.cf.run(op, self.name, head + list(args))

    def put(self, caller: Caller, entry: Entry, data: bytes, *, uow: str = "", gen: int = 0) -> tuple[int, int, bool]:
        """Returns (cf clock, structure gen, created)."""
        desc = msgpack.packb({"p": entry.priority, "per": 1 if entry.persistent else 0, "mid": entry.msgid,
                              "cid": entry.correlid, "exp": entry.expiry, "pt": entry.put_time,
                              "bc": entry.backout_count, "pr": entry.properties}, use_bin_type=False)
        cf, g, created = self._call("put", caller, [uow, gen, entry.id, entry.queue, desc, data])
        caller.clock.observe(int(cf))
        return int(cf), int(g), bool(created)

    def get(self, caller: Caller, queue: str, *, uow: str, gen: int = 0, match: str = "", value: str = "",
            now_ms: int) -> tuple[int, int, Entry | None, bytes | None]:
        """Returns (cf clock, gen, entry, data); entry is None when no message is available."""
        out = self._call("get", caller, [uow, gen, queue, match, value, now_ms])
        caller.clock.observe(int(out[0]))
        if len(out) == 2:
            return int(out[0]), int(out[1]), None, None
        return int(out[0]), int(out[1]), Entry.unpack(out[2]), out[3] or b""

    def browse(self, queue: str, limit: int, now_ms: int) -> list[tuple[Entry, bytes]]:
        return _pairs(self._call("browse", None, [queue, limit, now_ms]))

    def commit(self, caller: Caller, uow: str, *, gen: int, lrsn: int,
               decided_by_recovery: bool = False) -> tuple[int, int, int]:
        cf, puts, gets = self._call("commit", caller, [uow, gen, lrsn, 1 if decided_by_recovery else 0])
        caller.clock.observe(int(cf))
        return int(cf), int(puts), int(gets)

    def backout(self, caller: Caller, uow: str, *, gen: int, lrsn: int, has_data: bool,
                decided_by_recovery: bool = False) -> tuple[int, int, int]:
        cf, puts, gets = self._call("backout", caller, [uow, gen, lrsn, 1 if has_data else 0,
                                                        1 if decided_by_recovery else 0])
        caller.clock.observe(int(cf))
        return int(cf), int(puts), int(gets)

    def uow_entries(self, uow: str) -> list[tuple[Entry, bytes]]:
        return _pairs(self._call("uow_entries", None, [uow]))

    def member_uows(self, member: str) -> dict[str, dict[str, Any]]:
        flat = self._call("member_uows", None, [member])
        return {flat[i].decode(): msgpack.unpackb(flat[i + 1], raw=False) for i in range(0, len(flat), 2)}

    def expire(self, now_ms: int, limit: int = 1000) -> tuple[list[str], int]:
        """Moves expired messages to the expired list and purges those already there: (persistent ids, purged)."""
        out = self._call("expire", None, [now_ms, limit])
        return [x.decode() for x in out[:-2]], int(out[-1])

    def backup_begin(self, backup_id: str, caller_lrsn: int) -> tuple[int, int]:
        start, floor = self._call("backup_begin", None, [backup_id, caller_lrsn])
        return int(start), int(floor)

    def backup_end(self, backup_id: str, caller_lrsn: int, ok: bool) -> int:
        return int(self._call("backup_end", None, [backup_id, caller_lrsn, "ok" if ok else "failed"]))

    def snapshot(self, state: str) -> list[str]:
        return [x.decode() for x in self._call("snapshot", None, [state])]

    def fetch(self, ids: Iterable[str], batch: int = 2000) -> Iterable[tuple[str, Entry | None, bytes | None]]:
        """Current descriptor and data of each id (None when the entry is gone), read in pipelined batches."""
        ent, data = keys.script_keys(self.name)[2:4]
        chunk: list[str] = []
        r = self.cf.redis

        def flush() -> Iterable[tuple[str, Entry | None, bytes | None]]:
            pipe = r.pipeline(transaction=False)
            pipe.hmget(ent, chunk)
            pipe.hmget(data, chunk)
            descs, datas = pipe.execute()
            for i, raw, d in zip(chunk, descs, datas, strict=True):
                yield i, (Entry.unpack(raw) if raw else None), d

        for i in ids:
            chunk.append(i)
            if len(chunk) >= batch:
                yield from flush()
                chunk = []
        if chunk:
            yield from flush()

    # --- structure metadata -------------------------------------------------------------------------------
    def info(self) -> dict[str, str]:
        raw = self.cf.redis.hgetall(keys.meta(self.name))
        return {keys.text(k): keys.text(v) for k, v in raw.items()}

    def exists(self) -> bool:
        return bool(self.cf.redis.exists(keys.meta(self.name)))

    def queues(self) -> list[str]:
        return sorted(keys.text(q) for q in self.cf.redis.smembers(keys.script_keys(self.name)[6]))

    def depths(self) -> dict[str, dict[str, int]]:
        """Per queue: number of entries in each state (CP summed over priorities)."""
        r = self.cf.redis
        out: dict[str, dict[str, int]] = {}
        for q in self.queues():
            pipe = r.pipeline(transaction=False)
            for s in ("up", "ug", "ex"):
                pipe.llen(keys.queue_list(self.name, q, s))
            for p in keys.PRIORITIES:
                pipe.llen(keys.queue_list(self.name, q, f"cp:{p}"))
            n = pipe.execute()
            out[q] = {"UP": n[0], "UG": n[1], "EX": n[2], "CP": sum(n[3:])}
        return out
