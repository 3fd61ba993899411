"""What does the CF spend on a restore's load, and would another form of the same writes cost it less? (BENCHMARKS.md,
restore, "The load's writes in other forms".)

A restore's load (restore/load.py, cfemu.bulk.Loader) writes batches of a thousand entries, each one transaction of
the restore's Owner: the guard (WATCH of the header, INFO server, HMGET of the header) and MULTI, one HSET of the
descriptors, one HSET of the data, one SADD an index set (SQM gives every message an id: one set a message), one
RPUSH a run of a list, EXEC. This benchmark writes the same entries into a fresh embedded CF in each form below and
reads the CF's CPU seconds (INFO cpu, used_cpu_sys + used_cpu_user) before and after:

  * raw: the batch's commands alone, pipelined (what the restore benchmark's same-data raw write sends);
  * transaction: the same inside MULTI/EXEC, no guard;
  * load: Loader.send as a load sends where the CF has no server module (guard, MULTI/EXEC, the next guard after
    EXEC);
  * load_native: Loader.send where the CF has it (each batch one CF.LOAD, which checks the owner itself, two
    batches in flight: cfemu.bulk.LOAD_DEPTH);
  * load_x10: the same with ten batches a transaction (the guard once for ten thousand entries);
  * restore_sets: the index sets as RESTORE of prebuilt serialized values (DUMP format: the set as a listpack,
    RDB type 20, then the server's RDB version, learned from its own DUMP, and the CRC64), in MULTI/EXEC;
  * lua_sets: the index sets by one script call a batch (a SADD each), in MULTI/EXEC.

Each round runs every form once, each on a CF of its own; the table gives each form's median CF CPU and its ratio
to raw's. Entries: ids of 16 characters, a descriptor as a restore writes it, 1 KiB of data (--body), 4 queues.
The CF's server starts with the environment's GLIBC_TUNABLES: GLIBC_TUNABLES=glibc.malloc.tcache_count=16384
measures it with glibc's thread cache enlarged (BENCHMARKS.md, "The CF's allocator").

    .venv/bin/python bench/bench_load_forms.py [--quick] [--entries 200000] [--rounds 3] [--body 1024] [--forms raw,load]
                                             [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cfemu import bulk, keys, resp  # noqa: E402
from cfemu.embedded import EmbeddedRedis  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "load_forms.jsonl"
S = "BENCH"
BATCH = 1000
MULTI, EXEC = b"*1\r\n$5\r\nMULTI\r\n", b"*1\r\n$4\r\nEXEC\r\n"
SADDS = "for i = 1, #KEYS do redis.call('SADD', KEYS[i], ARGV[i]) end return #KEYS"
SET_LISTPACK = 20  # the RDB type of a set held as a listpack


class Entry:
    __slots__ = ("id", "entry", "data")

    def __init__(self, k: int, body: int = 1024) -> None:
        self.id = f"{k:016x}"
        self.entry: dict[str, Any] = {"id": self.id, "q": f"Q{k % 4}", "st": "CP", "p": 0, "mid": f"{k:024x}", "l": k + 1}
        self.data = (os.urandom(8) * (body // 8 + 1))[:body]


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x95AC9329AC4BC9B5 if crc & 1 else crc >> 1  # Jones, reflected (the RDB's CRC64)
        table.append(crc)
    return table


_CRC = _crc_table()


def crc64(data: bytes) -> int:
    crc = 0
    for x in data:
        crc = _CRC[(crc ^ x) & 0xFF] ^ (crc >> 8)
    return crc


def set_payload(member: bytes, version: bytes) -> bytes:
    """A DUMP payload of a set of one member (under 64 bytes): a listpack of one string entry, uncompressed."""
    entry = bytes([0x80 | len(member)]) + member
    entry += bytes([len(entry)])  # the entry's back length
    lp = (7 + len(entry)).to_bytes(4, "little") + (1).to_bytes(2, "little") + entry + b"\xff"
    body = bytes([SET_LISTPACK, len(lp)]) + lp + version
    return body + crc64(body).to_bytes(8, "little")


def cf_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


class Batch:
    """One batch's entries, its Staged (as the load prepares it), and the parts other forms write differently."""

    def __init__(self, entries: list[Entry]) -> None:
        self.staged = bulk.prepare(S, entries)
        self.ids = [e.id for e in entries]
        self.set_keys = [keys.index_set(S, e.entry["q"], "m", e.entry["mid"]) for e in entries]
        lists: dict[str, list[str]] = {}
        for e in entries:
            lists.setdefault(bulk.list_of(S, e.entry), []).append(e.id)
        self.lists = lists

    def without_sets(self) -> resp.Packed:
        p = resp.Packed()
        p.add_pairs((b"HSET", keys.entries(S)), self.ids, [d for d, _ in self.staged.copies])
        p.add_pairs((b"HSET", keys.data(S)), self.ids, [d for _, d in self.staged.copies])
        return p


Form = Callable[[redis.Redis, list[Batch]], Callable[[], None]]  # set up (untimed), then the timed writes


def _on_connection(client: redis.Redis, packed: list[resp.Packed], transaction: bool) -> Callable[[], None]:
    conn = client.connection_pool.get_connection()

    def write() -> None:
        for p in packed:
            chunks = [MULTI, *p.chunks(), EXEC] if transaction else list(p.chunks())
            resp.exchange(conn, chunks, p.count + (2 if transaction else 0))
    return write


def raw(client: redis.Redis, batches: list[Batch]) -> Callable[[], None]:
    return _on_connection(client, [b.staged.commands for b in batches], False)


def transaction(client: redis.Redis, batches: list[Batch]) -> Callable[[], None]:
    return _on_connection(client, [b.staged.commands for b in batches], True)


def _load(per: int) -> Form:
    def form(client: redis.Redis, batches: list[Batch]) -> Callable[[], None]:
        loader = bulk.Loader(bulk.claim(client, S, bulk.observe(client, S)), gen=1)
        groups = []
        for j in range(0, len(batches), per):
            p = resp.Packed()
            for b in batches[j:j + per]:
                p.parts += b.staged.commands.parts
                p.count += b.staged.commands.count
            groups.append(p)

        def write() -> None:
            for p in groups:
                loader.holder.send(p, watch_next=True)
        return write
    return form


def load_native(client: redis.Redis, batches: list[Batch]) -> Callable[[], None]:
    loader = bulk.Loader(bulk.claim(client, S, bulk.observe(client, S)), gen=1)
    if not loader.holder.loads_natively():
        raise SystemExit("load_native: this CF does not run CF.LOAD (no server module, or not reached directly)")

    def write() -> None:
        for b in batches:
            loader.send(b.staged)
        loader.flush()
    return write


def restore_sets(client: redis.Redis, batches: list[Batch]) -> Callable[[], None]:
    client.sadd("probe", "x")
    dumped = client.dump("probe")
    assert isinstance(dumped, bytes)
    version = dumped[-10:-8]  # the server's own RDB version
    # A server that does not take a listpack set at its own version refuses it here (ResponseError).
    client.restore("probe2", 0, set_payload(b"member", version))
    if client.smembers("probe2") != {b"member"}:
        raise SystemExit("RESTORE of a prebuilt set payload did not give the set it holds")
    client.delete("probe", "probe2")
    packed = []
    for b in batches:
        p = b.without_sets()
        for k, i in zip(b.set_keys, b.ids, strict=True):
            p.add("RESTORE", k, 0, set_payload(i.encode(), version))
        p.add_groups(b"RPUSH", b.lists)
        packed.append(p)
    return _on_connection(client, packed, True)


def lua_sets(client: redis.Redis, batches: list[Batch]) -> Callable[[], None]:
    sha = client.script_load(SADDS)
    packed = []
    for b in batches:
        p = b.without_sets()
        p.add_items((b"EVALSHA", sha), [len(b.set_keys), *b.set_keys, *b.ids], 1 + 2 * len(b.set_keys))
        p.add_groups(b"RPUSH", b.lists)
        packed.append(p)
    return _on_connection(client, packed, True)


def hashes_apart(client: redis.Redis, batches: list[Batch]) -> Callable[[], None]:
    """The candidate's cost: each batch's two HSETs pipelined without a transaction into keys of the owner's own
    (a stale owner's late batch would land there, never in the structure), the index sets and the lists in the
    owner's guarded transaction as today, and the two hashes renamed into place in one guarded transaction at the
    end. (Not the load's protocol: a measurement of what it would save.)"""
    owner = bulk.claim(client, S, bulk.observe(client, S))
    staging = {keys.entries(S): f"{keys.tag(S)}:staging:{owner.token}:ent",
               keys.data(S): f"{keys.tag(S)}:staging:{owner.token}:data"}
    apart, guarded = [], []
    for b in batches:
        h = resp.Packed()
        h.add_pairs((b"HSET", staging[keys.entries(S)]), b.ids, [d for d, _ in b.staged.copies])
        h.add_pairs((b"HSET", staging[keys.data(S)]), b.ids, [d for _, d in b.staged.copies])
        apart.append(h)
        g = resp.Packed()
        g.add_groups(b"SADD", {k: [i] for k, i in zip(b.set_keys, b.ids, strict=True)})
        g.add_groups(b"RPUSH", b.lists)
        guarded.append(g)
    conn = client.connection_pool.get_connection()

    def write() -> None:
        for h, g in zip(apart, guarded, strict=True):
            resp.exchange(conn, list(h.chunks()), h.count)
            owner.send(g, watch_next=True)
        owner.transaction(lambda pipe: [pipe.rename(src, dst) for dst, src in staging.items()])
    return write


FORMS: dict[str, Form] = {"hashes_apart": hashes_apart, "raw": raw, "transaction": transaction, "load": _load(1), "load_x10": _load(10),
                          "load_native": load_native,
                          "restore_sets": restore_sets, "lua_sets": lua_sets}


def measure(form: Form, batches: list[Batch], entries: int) -> dict[str, Any]:
    server = EmbeddedRedis()
    server.start()
    try:
        client = server.client()
        write = form(client, batches)
        c0, t0 = cf_cpu(client), time.perf_counter()
        write()
        wall, cpu = time.perf_counter() - t0, cf_cpu(client) - c0
        loaded, index_sets = client.hlen(keys.entries(S)), len(list(client.scan_iter(match=f"{keys.tag(S)}:ix:*",
                                                                                           count=10000)))
        if (loaded, index_sets) != (entries, entries):
            raise SystemExit(f"a form wrote {loaded} entries and {index_sets} index sets, not {entries}")
        return {"cf_cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20k entries, one round")
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--body", type=int, default=1024, help="bytes of data a message (the restore benchmark's 10M: 64)")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"of {', '.join(FORMS)}")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    entries, rounds = (20_000, 1) if args.quick else (args.entries, args.rounds)
    names = [n for n in args.forms.split(",") if n]
    unknown = [n for n in names if n not in FORMS]
    if unknown:
        ap.error(f"unknown form(s): {', '.join(unknown)} (known: {', '.join(FORMS)})")
    batches = [Batch([Entry(k, args.body) for k in range(a, min(entries, a + BATCH))])
               for a in range(0, entries, BATCH)]
    load0 = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            runs[n].append(measure(FORMS[n], batches, entries))
    medians = {n: statistics.median(r["cf_cpu_s"] for r in runs[n]) for n in names}
    base = medians.get("raw")
    out = {"at": datetime.now(UTC).isoformat(timespec="seconds"), "entries": entries, "rounds": rounds,
           "body": args.body, "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
           "load_avg": [round(load0, 1), round(os.getloadavg()[0], 1)], "runs": runs, "median_cf_cpu_s": medians,
           "over_raw": {n: round(m / base, 3) for n, m in medians.items()} if base else {}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(out) + "\n")
    if args.json:
        print(json.dumps(out))
        return 0
    table = Table(title=f"CF CPU of loading {entries} entries ({rounds} rounds, load {out['load_avg']})")
    for col in ("form", "CF CPU s (each round)", "median", "/ raw", "wall s (median)"):
        table.add_column(col)
    for n in names:
        table.add_row(n, " ".join(f"{r['cf_cpu_s']:.2f}" for r in runs[n]), f"{medians[n]:.2f}",
                      f"{medians[n] / base:.2f}" if base else "",
                      f"{statistics.median(r['wall_s'] for r in runs[n]):.2f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
