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
  * the writes (wipe, load, verify, activate; a purge's too) are made by an Owner: the restore or purge that
    claimed the structure (claim). Each batch is one transaction, WATCH on the header, a check that the header
    still carries the owner's restore token and says RECOVERING and that the CF is still the server the claim
    was made on (its INFO run_id), then MULTI/EXEC. A newer restore or a purge that claims the structure changes
    the token, so a stale owner's next batch writes nothing; the owner's connection never reconnects, so a CF
    restarted under it (empty, or from its own snapshot) gets nothing more from it. Every member script refuses
    work on a RECOVERING structure, so no one else changes it meanwhile; the header goes back to ACTIVE last,
    in one transaction (activate), and a crash before it leaves the structure RECOVERING for a re-run that
    starts from the wipe.
"""

from __future__ import annotations

import math
import socket
import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, Protocol, TypeVar, cast, overload

import msgpack
import redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.retry import Retry

from cfemu import duplex, keys, rcluster, resp, server_module
from cfemu.admin import EPOCHS, StructureDef, stage_structure
from cfemu.entry import Entry
from cfemu.redis_internals import hiredis_io, pack, packs_with_hiredis, plain_socket, reply_error, socket_of

_bulk: Any
try:
    from cfemu import _bulk  # type: ignore[attr-defined,no-redef]
except ImportError:  # installed where no C compiler was (the extension is optional): parts told in Python
    _bulk = None

BATCH = 1000  # writes: entries (or keys to delete) per pipeline
FETCH_BATCH = 2000  # reads: ids per pipelined fetch
FETCH_BYTES = 64 << 20  # reads: the most message data one read holds (a batch of large messages is read in parts)
Wire = dict[str, Any]  # an entry descriptor in wire form (cfemu.entry.Entry.wire())
Ids = Sequence[str] | Sequence[bytes]  # entry ids, as text or as the CF's bytes (Structure.snapshot_raw)


# --- reads: the backup's fetch ---------------------------------------------------------------------------------
FETCH_DEPTH = 2  # reads: fetches in flight at once, each on its own connection (fetch_raw)
READ_COMMANDS = 2  # the commands one read sends (a backup's pacing counts its own: backup.pacing)


def read(client: redis.Redis, structure: str, ids: Ids,
         max_bytes: int | None = None) -> tuple[list[bytes | None], list[bytes | None]]:
    """The raw descriptors and data of `ids` (None where the entry is gone): the descriptors, then the data in
    parts of at most `max_bytes` (each entry's size from its descriptor's `len`; a part holds one entry at least),
    READ_COMMANDS commands in all when the data fit in one part. A batch of two thousand messages of 4 MiB (a
    queue's default MAXMSGL) had been one reply of 8 GiB. The two reads were never atomic (a pipeline is not): an
    entry gone between them reads as gone (its data None), as one gone between a pipeline's two HMGETs did. The
    result holds every part: a caller that must not hold a whole batch of large messages reads as fetch_raw."""
    descs = _descriptors(client, structure, ids)
    datas: list[Any] = []
    for a, b in parts(descs, FETCH_BYTES if max_bytes is None else max_bytes):
        datas += _data(client, structure, ids[a:b])
    return descs, datas


def _descriptors(client: redis.Redis, structure: str, ids: Ids) -> list[Any]:
    return cast(list[Any], hmget(client, keys.entries(structure), ids))  # bytes or None: the client is binary-safe


def _data(client: redis.Redis, structure: str, ids: Ids, size_hint: int | None = None) -> Sequence[Any]:
    return hmget(client, keys.data(structure), ids, size_hint=size_hint)


def _pack_hmget(conn: Any, key: str, fields: Ids) -> list[bytes]:
    """HMGET key fields..., as the connection's packer packs it: its arguments packed by cfemu._bulk (C) where the
    packer is hiredis's (the same bytes; tests/cfemu/test_bulk_parts_native.py), else by pack."""
    if _bulk is None or not packs_with_hiredis(conn):
        return pack(conn, ("HMGET", key, *fields))
    k = key.encode()
    return [b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n" % (len(fields) + 2, len(k), k) + _bulk.pack_args(fields)]


def hmget(client: redis.Redis, key: str, fields: Ids, *, size_hint: int | None = None) -> Sequence[Any]:
    """client.hmget(key, fields), on a connection of the client's pool driven directly (cfemu.resp): redis-py's
    per-command path (its packer's check of every argument, its wrappers) had cost a backup more CPU than the
    parsing of the reply, about half a microsecond an entry. A connection this cannot drive (none of hiredis's
    parser, a health check due, a cluster client), or one that fails, leaves the read to client.hmget itself,
    with its own retry policy (a read may be made again). size_hint (the bytes the values are expected to hold):
    the reply is read as Bulks, from the socket past hiredis with the GIL let go (cfemu._bulk.read_bulks), where
    the connection's socket is a plain one (not TLS) and the extension was built."""
    if rcluster.is_cluster(client):
        return client.hmget(key, fields)
    pool = client.connection_pool
    conn = pool.get_connection()
    reply: Any = None
    try:
        if hiredis_io(conn) is not None and not (conn.health_check_interval
                                                 and time.monotonic() > conn.next_health_check):
            packed = _pack_hmget(conn, key, fields)
            sock = plain_socket(conn) if size_hint is not None and _bulk is not None else None
            if sock is not None:
                reply = _read_bulks(conn, sock, packed, len(fields), size_hint or 0)
            else:
                reply = resp.exchange(conn, packed, 1)[0]
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        reply = None  # the connection was dropped (resp.io_failure): redis-py's path connects again
    finally:
        pool.release(conn)
    if reply is None:
        return client.hmget(key, fields)
    if isinstance(reply, redis.exceptions.ResponseError):
        raise reply
    return reply if type(reply) is Bulks else list(reply)


def _read_bulks(conn: Any, sock: socket.socket, packed: list[bytes], count: int, size_hint: int) -> Any:
    """Send `packed` (one command answered by an array of `count` bulk strings) and read its reply by
    cfemu._bulk.read_bulks: Bulks, or the error reply as redis-py's exception object. A reply that fails or is
    not such an array drops the connection and raises redis-py's ConnectionError or TimeoutError."""
    resp.send(conn, sock, packed)
    timeout = sock.gettimeout()  # None: a blocking socket, timed out by the kernel (cfemu.sockets)
    try:
        said = _bulk.read_bulks(sock.fileno(), count, size_hint, -1 if timeout is None else math.ceil(timeout * 1000))
    except EOFError:
        conn.disconnect()
        raise redis.exceptions.ConnectionError("Connection closed by server.") from None
    except ValueError as e:  # out of step with the CF: what follows on the connection cannot be read
        conn.disconnect()
        raise redis.exceptions.ConnectionError(f"Protocol error: {e}") from None
    except OSError as e:
        raise resp.io_failure(conn, e, writing=False) from None
    except BaseException:  # interrupted within the reply (a signal's handler raised): its rest is still unread
        conn.disconnect()
        raise
    if isinstance(said, str):
        error = reply_error(conn, said)
        if isinstance(error, redis.exceptions.ConnectionError):  # as redis-py's read_response: dropped
            conn.disconnect()
            raise error
        return error
    return Bulks(*said)


class Bulks(Sequence[bytes | None]):
    """The strings of an array reply as cfemu._bulk.read_bulks read it, left in the reply's bytes: `blob`, and
    `spans`, each string's (offset, length) as two native 64-bit integers (length -1: null). Items are made as
    they are asked for: backup/_frames.c frames a backup's copies from the blob, and makes none."""

    __slots__ = ("blob", "spans", "_at")

    def __init__(self, blob: bytes, spans: bytes) -> None:
        self.blob = blob
        self.spans = spans
        self._at = memoryview(spans).cast("q")

    def __len__(self) -> int:
        return len(self._at) // 2

    @overload
    def __getitem__(self, i: int) -> bytes | None: ...

    @overload
    def __getitem__(self, i: slice) -> list[bytes | None]: ...

    def __getitem__(self, i: int | slice) -> bytes | None | list[bytes | None]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        k = range(len(self))[i]  # IndexError out of range; a negative index counts from the end
        at, n = self._at[2 * k], self._at[2 * k + 1]
        return None if n < 0 else self.blob[at:at + n]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


_NATIVE_LIMITS = 2**61  # the limits cfemu._bulk takes (its sums of sizes stay within 64 bits)


def parts(descs: Sequence[bytes | None], limit: int) -> list[tuple[int, int]]:
    """The parts, [a, b) index ranges, in which the data of entries with these descriptors is read: at most
    `limit` bytes each by the descriptors' `len` (data_length), one entry at least (None: gone, 0 bytes). Told
    by cfemu._bulk (C) where it was built, else by parts_in_python, the reference."""
    if _bulk is not None and type(descs) is list and 0 <= limit < _NATIVE_LIMITS:
        return cast(list[tuple[int, int]], _bulk.parts(descs, limit, data_length))
    return parts_in_python(descs, limit)


def parts_in_python(descs: Sequence[bytes | None], limit: int) -> list[tuple[int, int]]:
    """parts, one descriptor at a time in Python: the reference of cfemu/_bulk.c."""
    out: list[tuple[int, int]] = []
    start, held = 0, 0
    for k, raw in enumerate(descs):
        size = 0 if raw is None else data_length(raw)
        if k > start and held + size > limit:
            out.append((start, k))
            start, held = k, 0
        held += size
    if start < len(descs):
        out.append((start, len(descs)))
    return out


_LEN_KEY = b"\xa3len"  # msgpack's "len" (a fixstr of 3), the key of a descriptor's data length
# msgpack's unsigned integers after their first byte: uint 8, 16, 32, 64 (a positive fixint is the byte itself)
_UINT_WIDTH = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def data_length(raw: bytes) -> int:
    """The data length a descriptor (the CF's msgpack bytes) records: read at sight where its key appears once
    and an unsigned integer follows it (the descriptor is not decoded: a backup reads millions, and an Unpacker
    made for each one had cost a backup a microsecond an entry), else from the decoded map."""
    i = raw.find(_LEN_KEY)
    if i >= 0 and raw.find(_LEN_KEY, i + 4) < 0:
        j = i + 4
        if j < len(raw):
            first = raw[j]
            if first < 0x80:  # a positive fixint
                return first
            width = _UINT_WIDTH.get(first, 0)
            if width and j + 1 + width <= len(raw):
                return int.from_bytes(raw[j + 1:j + 1 + width], "big")
    return int(unpack_wire(raw).get("len", 0) or 0)


# The lists that hold a state's entries on each queue, in get order (cfemu/scripts/snapshot.lua's `lists`).
_SNAPSHOT_LISTS: dict[str, tuple[tuple[str, int], ...]] = {
    "UG": (("UG", 0),), "UP": (("UP", 0),), "EX": (("EX", 0),), "CP": tuple(("CP", p) for p in range(9, -1, -1))}
SNAPSHOT_TRIES = 3  # snapshots as a transaction whose queue set changed under them, before the script takes one


def _queue_names(client: redis.Redis, structure: str) -> set[str]:
    return {keys.text(q) for q in client.smembers(keys.queues(structure))}


def snapshot(client: redis.Redis, structure: str, state: str) -> list[bytes] | None:
    """The ids of every entry of the structure in `state` (UG, UP, CP, EX) on every queue, in get order per queue,
    as the CF's bytes: snapshot.lua's answer, taken as one transaction (MULTI/EXEC) of the queue set and an LRANGE
    of each of its queues' lists. The queue set is read first, to name the lists, and again inside the
    transaction: when both agree the transaction read every list of the state at one instant, as the script
    does; when a queue was defined or deleted in between, it is taken again. The CF serves LRANGE's reply
    natively, where the script made a Lua string of every id and converted each back (0.3 against 0.05 µs of the
    CF an id, with the CF held: BENCHMARKS.md, backup). None: the queue set changed under SNAPSHOT_TRIES
    transactions in a row, or the state is not one of the four: the caller asks the script, which takes the
    snapshot (or refuses the state) in one step."""
    lists = _SNAPSHOT_LISTS.get(state)
    if lists is None:
        return None
    node = rcluster.node_client(client, structure, fresh=False)  # every key of the structure is in one slot
    for _ in range(SNAPSHOT_TRIES):
        queues = _queue_names(node, structure)
        pipe = node.pipeline(transaction=True)
        pipe.smembers(keys.queues(structure))
        for q in sorted(queues):  # the script's order (a script reads a set sorted)
            for st, priority in lists:
                pipe.lrange(keys.state_list(structure, q, st, priority), 0, -1)
        now, *ranges = pipe.execute()
        if {keys.text(q) for q in now} == queues:
            return [i for ids in ranges for i in ids]
    return None


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


def fetch_raw(client: redis.Redis, structure: str, ids: Ids, batch: int | Callable[[], int] = FETCH_BATCH, *,
              before_read: Callable[[], None] | None = None, depth: int | Callable[[], int] = FETCH_DEPTH
              ) -> Iterator[tuple[list[bytes | None], Sequence[bytes | None]]]:
    """The raw descriptors and data of `ids`, part by part, as the CF holds them (None where an entry is gone): a
    batch's descriptors, then its data in parts of at most FETCH_BYTES (read's parts), each part handed over on
    its own (a batch of two thousand messages of 4 MiB held whole was 8 GiB, and the next one prefetched beside
    it). Up to `depth` reads are in flight, each on a connection of its own, while the caller handles the part
    before them: the CF serves one read while this process parses the other's reply (with one read in flight the
    CF sat idle for the parsing, and a backup ran at 0.4 of a raw read; BENCHMARKS.md). So at most depth + 1 parts
    are held, and one more while a caller still holds the part before when it asks for the next. `depth` may be a
    function, asked before reads are sent: a paced backup reads one at a time while the group works
    (backup.pacing). before_read(), when given, is called before each batch's read is sent (READ_COMMANDS commands
    when its data fit in one part), in the caller's thread, between two reads: a backup paces itself there
    (backup.pacing), so that a pause holds up neither a read in flight nor the part being handled. `batch` (ids a
    batch) may be a function too, asked after before_read for each batch: a paced backup reads larger batches on
    an idle CF (fewer reads, each one's cost spread over more entries) and smaller ones while the group works."""
    if not ids:
        return
    sized: Callable[[], int] = batch if callable(batch) else lambda: batch
    seen = [0, 0]  # bytes and entries of the data read so far: the next read's size hint

    def data(part: Ids) -> Sequence[Any]:
        """A part's data, read as Bulks where it can be (hmget's size_hint, within a part's bound: no object an
        entry)."""
        got = _data(client, structure, part, min(seen[0] * len(part) // seen[1], FETCH_BYTES) if seen[1] else 0)
        if type(got) is Bulks:
            seen[0] += len(got.blob)
            seen[1] += len(got)
        return got

    def first(chunk: Ids) -> tuple[list[Any], list[tuple[int, int]], Sequence[Any]]:
        """A batch's descriptors, its parts, and its first part's data (a batch has one part at least)."""
        descs = list(_descriptors(client, structure, chunk))
        bounds = parts(descs, FETCH_BYTES)
        a, b = bounds[0]
        return descs, bounds, data(chunk[a:b])

    deepest = depth if isinstance(depth, int) else FETCH_DEPTH
    # The first read runs in the caller's thread (it goes out alone, see below, and the caller waits for it); the
    # threads start with the second read: a fetch of one part (most of a small structure's, and each of a model
    # check's thousands of backups) starts none, where a pool's thread cost more than the read.
    pool: ThreadPoolExecutor | None = None
    # batches' first reads in flight (descriptors and first part), each with its ids
    firsts: deque[tuple[Ids, Future[Any]]] = deque()
    later: deque[Future[Any]] = deque()  # reads in flight of the batch being handed over: its later parts
    next_id = 0  # where the next batch starts in ids

    def submit(fn: Callable[..., Any], *args: Any) -> Future[Any]:
        nonlocal pool
        if pool is None:
            if not firsts and not later and next_id == 0:
                return _done(fn, *args)
            pool = ThreadPoolExecutor(max_workers=deepest, thread_name_prefix="backup-fetch")
        return pool.submit(fn, *args)

    try:
        def send_reads(chunk: Ids, unread: deque[tuple[int, int]], limit: int | None = None) -> None:
            """Fill the reads in flight up to `limit` (`depth`): the later parts of the batch being handed over
            first (they are handed over before the next batch), then the next batches."""
            nonlocal next_id
            if limit is None:
                limit = max(1, min(deepest, depth if isinstance(depth, int) else depth()))
            # The batch being handed over always has its next part in flight, even past the limit: when the depth
            # shrinks (a paced backup's group starts working), the next batches' reads may fill it.
            while len(firsts) + len(later) < limit or (unread and not later):
                if unread:
                    a, b = unread.popleft()
                    later.append(submit(data, chunk[a:b]))
                elif next_id < len(ids):
                    if before_read is not None:
                        before_read()
                    ahead = ids[next_id:next_id + max(1, sized())]
                    firsts.append((ahead, submit(first, ahead)))
                    next_id += len(ahead)
                else:
                    return

        # The first read goes out alone: a backup's pacer judges the CF by the commands it served between the first
        # two reads, and the set-up of a second connection (its handshake's commands) in that millisecond read as a
        # busy group (tests/backup/test_pacing.py); by the second read the first connection is set up and busy.
        send_reads((), deque(), limit=1)
        while firsts:
            chunk, read = firsts.popleft()
            descs, bounds, datas = read.result()
            del read  # it holds the first part: not kept past its hand-over
            unread = deque(bounds[1:])
            for j, (a, b) in enumerate(bounds):
                if j:
                    datas = later.popleft().result()
                send_reads(chunk, unread)
                yield descs[a:b], datas
                del datas  # handed on: not held while the reads after it are
    finally:
        if pool is not None:
            pool.shutdown()  # a caller that stopped early: the reads in flight end before the connections are reused


def _done(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """fn(*args) run now, in this thread, as a finished Future (its exception raised where the result is asked)."""
    future: Future[Any] = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to the Future's reader, as a pool's thread hands it
        future.set_exception(e)
    return future


def unpack_wire(raw: bytes) -> Wire:
    """A descriptor's wire-form dict from the CF's msgpack (Lua writes an empty property table as an empty
    array: read as an empty map)."""
    wire: Wire = msgpack.unpackb(raw, raw=False, unicode_errors="surrogateescape")
    if not isinstance(wire.get("pr"), dict):
        wire["pr"] = {}
    return wire


def fetch_wire(client: redis.Redis, structure: str, ids: list[str],
               batch: int = FETCH_BATCH) -> Iterator[tuple[Wire | None, bytes | None]]:
    """Like fetch, but each descriptor comes as its wire-form dict straight from the CF's msgpack, without an
    Entry object in between, and the next batch is fetched while the caller handles this one."""
    for descs, datas in fetch_raw(client, structure, ids, batch):
        for raw, d in zip(descs, datas, strict=True):
            yield (None if raw is None else unpack_wire(raw)), d


def count_nonpersistent(client: redis.Redis, structure: str) -> int:
    """Non-persistent entries the structure holds now (lost by a restore, which only has persistent ones)."""
    n = 0
    for _, raw in client.hscan_iter(keys.entries(structure), count=1000):
        if not msgpack.unpackb(raw, raw=False, unicode_errors="surrogateescape").get("per", 1):
            n += 1
    return n


# --- ownership: a restore's (or a purge's) hold on a structure -----------------------------------------------
TOKEN = "restore_token"  # header field: the token of the restore or purge that claimed the structure last
# A load's batches in flight at once where the CF checks each batch's owner itself (Owner.load): the next batch
# crosses the network and is read in while the CF applies this one.
LOAD_DEPTH = 2
# The most entries a batch sent by Owner.load may hold: its HSETs then have at most 4,096 arguments, LOAD's bound
# (cfemu/scripts/load.lua). A larger batch goes by Owner.send.
LOAD_MAX_ENTRIES = 2047

WATCH_RETRIES = 20  # a transaction whose header changed under it, though still the owner's, is tried again
_WATCH_CHANGED = "Watched variable changed."  # redis-py's WatchError when EXEC applied nothing
T = TypeVar("T")


class NotOwnerError(RuntimeError):
    """A restore or purge that does not own the structure (or no longer does) wrote nothing (more) into it; the
    message says why: a later restore or a purge took it over, another restore restored it, its state changed."""


class CFReplacedError(NotOwnerError):
    """The CF the structure was claimed on is gone: the connection to it broke, or the server that answers is
    another one (restarted: empty, or from its own snapshot). Nothing more was written."""


class Seen(NamedTuple):
    """What a restore saw of the structure at its start, for its claim to compare against."""

    cf: str  # the CF's identity: the server's INFO run_id (every start of a redis-server has a new one)
    token: int  # the header's restore token (0: none)
    state: str  # ACTIVE, FAILED or RECOVERING; "" when the structure has no header in the CF
    gen: int  # the generation (0: no header)
    restored_from: str  # the backup the last restore loaded ("" when none, or after a purge)


def cf_identity(client: redis.Redis) -> str:
    """The CF's identity: the run id of its redis-server process (a restarted server has a new one, even when it
    reloads its data from disk). A Redis Cluster's, through its cluster client: its masters' run ids (a restore
    compares the one master that holds its structure: observe and claim ask that master, rcluster.node_client)."""
    if rcluster.is_cluster(client):
        return "+".join(sorted(rcluster.master_run_ids(client)))
    return str(client.info("server")["run_id"])


_HEADER_FIELDS = (TOKEN, "state", "gen", "restored_from")  # what a restore's claim and its checks read of the header


def _header(client: redis.Redis, structure: str) -> Seen:
    """The CF's identity first, then the header: a CF replaced between the two reads shows as replaced."""
    cf = cf_identity(client)
    return _seen(cf, client.hmget(keys.meta(structure), _HEADER_FIELDS))


def _seen(cf: str, header: Sequence[Any]) -> Seen:
    """A Seen of the CF's identity and the header's _HEADER_FIELDS as HMGET answers them."""
    token, state, gen, restored = header
    return Seen(cf, int(token or 0), keys.text(state) if state else "", int(gen or 0),
                keys.text(restored) if restored else "")


def _run_id(info: bytes) -> str:
    """The run id in an INFO server reply's text (cf_identity of a single server)."""
    start = info.find(b"\r\nrun_id:")
    if start < 0:
        raise redis.exceptions.ResponseError("INFO server answered without a run_id")
    start += len(b"\r\nrun_id:")
    return info[start:info.find(b"\r\n", start)].decode()


def observe(client: redis.Redis, structure: str) -> Seen:
    """What the structure looks like now (read only): a restore observes it before it plans, and claims it after
    planning only if nothing has happened to it in between (claim). On a Redis Cluster: the master that holds the
    structure's slot now is the CF (its run id), cfemu.rcluster.'s node_client."""
    return _header(rcluster.node_client(client, structure), structure)


def changed_since(seen: Seen, now: Seen) -> NotOwnerError | None:
    """Why a restore that saw `seen` at its start may not take the structure over `now`; None when it may."""
    if now.cf != seen.cf:
        return CFReplacedError(f"the CF is another server now (run id {seen.cf[:12]} when the restore started, "
                               f"{now.cf[:12]} now): it was restarted")
    if now.gen != seen.gen and now.state == "RECOVERING":  # a restore or a purge defined it again, not finished
        return NotOwnerError(f"another restore or a purge took the structure over since this one started and has "
                             f"not finished (now RECOVERING, generation {now.gen})")
    if now.gen != seen.gen or (now.state == "ACTIVE" and seen.state != "ACTIVE"):
        by = "another restore restored" if now.restored_from else "a purge emptied"
        return NotOwnerError(f"{by} the structure since this one started (now {now.state or 'gone'}, generation "
                             f"{now.gen})")
    if now.token != seen.token:
        return NotOwnerError(f"another restore or a purge took the structure over since this one started (now "
                             f"{now.state or 'gone'}, restore token {now.token})")
    return None


def _transact(client: redis.Redis, watch: Sequence[str], check: Callable[[Pipeline], T],
              stage: Callable[[Pipeline, T], object] | resp.Packed) -> tuple[T, list[Any]]:
    """One guarded transaction: WATCH `watch`; check (reads on the watching connection; raises to refuse);
    stage's writes in MULTI/EXEC (or commands packed beforehand: _exec_packed). A watched key that changed between
    the check and EXEC made EXEC apply nothing: check again. A broken connection or a timeout is CFReplacedError:
    whether EXEC applied is unknown, and an owner's connection does not reconnect, so the owner stops (a re-run
    starts from the wipe)."""
    for _ in range(WATCH_RETRIES):
        pipe = client.pipeline(transaction=True)
        try:
            pipe.watch(*watch)
            value = check(pipe)
            if isinstance(stage, resp.Packed):
                return value, _exec_packed(pipe, stage)
            pipe.multi()
            stage(pipe, value)
            return value, pipe.execute()
        except redis.exceptions.WatchError as e:
            if str(e) != _WATCH_CHANGED:  # redis-py's word for a connection that broke while watching
                raise CFReplacedError("the connection to the CF broke") from e
        except redis.exceptions.MaxConnectionsError:
            raise  # two uses of an owner's one connection at once: a bug here, not a lost CF
        except redis.exceptions.ReadOnlyError as e:  # a replica now (demoted, or following another): not the CF
            raise CFReplacedError("the CF refused a write (READONLY): the server is a replica now") from e
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            raise CFReplacedError("the connection to the CF broke") from e
        finally:
            pipe.reset()
    raise NotOwnerError(f"the structure's header changed under {WATCH_RETRIES} transactions in a row")


_MULTI, _EXEC = b"*1\r\n$5\r\nMULTI\r\n", b"*1\r\n$4\r\nEXEC\r\n"
_UNWATCH = b"*1\r\n$7\r\nUNWATCH\r\n"


def _exec_packed(pipe: Pipeline, commands: resp.Packed) -> list[Any]:
    """MULTI, `commands`, EXEC, sent together on the watching pipeline's connection (_exec_on)."""
    try:
        return _exec_on(pipe.connection, commands)
    finally:
        pipe.watching = False  # EXEC (applied, aborted or refused by the WATCH) ended the WATCH on the server


def _unwatch(conn: Any) -> None:
    """Give a connection back unwatched (or disconnected, when it cannot say UNWATCH any more)."""
    try:
        resp.exchange(conn, _UNWATCH, 1)
    except Exception:  # noqa: BLE001 - the caller's own failure is what it raises
        conn.disconnect()


def _exec_on(conn: Any, commands: resp.Packed) -> list[Any]:
    """MULTI, `commands`, EXEC, sent together on a watching connection (cfemu.resp); EXEC's replies. As redis-py's
    pipeline: WatchError when a watched key changed (nothing applied), the first error reply raised (a command
    refused when queued aborts the whole EXEC)."""
    result, _ = _exec_then(conn, commands, [], 0)
    if result is None:
        raise redis.exceptions.WatchError(_WATCH_CHANGED)
    return result


def _exec_then(conn: Any, commands: resp.Packed, then: list[bytes], replies: int) -> tuple[list[Any] | None, list[Any]]:
    """MULTI, `commands`, EXEC, then the commands `then` (`replies` replies), sent together; EXEC's replies (None:
    a watched key changed, nothing applied) and the replies of `then`. The first error reply of the transaction is
    raised (a command refused when queued aborts the whole EXEC)."""
    # The batch's strings as they are (cfemu.resp.Packed.chunks), not joined to MULTI and EXEC: that took two
    # copies of the whole batch (its messages' data) while it was sent.
    out = resp.exchange(conn, [_MULTI, *commands.chunks(), _EXEC, *then], commands.count + 2 + replies)
    cut = len(out) - replies
    result = out[cut - 1]
    for r in (*out[:cut - 1], result, *(result if isinstance(result, list) else ())):
        if isinstance(r, redis.exceptions.ResponseError):
            raise r
    return (None if result is None else list(result)), out[cut:]


def _pinned(client: redis.Redis) -> redis.Redis:
    """A client with a single connection of its own to the server `client` names, which never reconnects: once
    that connection breaks, every command raises ConnectionError. (redis-py reconnects by itself and retries a
    whole pipeline on the new connection, which would carry the rest of a restore's load into an empty CF
    started on the same port: docs/architecture.md, "The group's durable history", ownership.)"""
    pool = client.connection_pool

    class Pinned(pool.connection_class):  # type: ignore[name-defined]
        connected_once = False

        def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
            if self.connected_once and socket_of(self) is None:
                raise redis.exceptions.ConnectionError("the connection to the CF broke (an owner's connection "
                                                       "does not reconnect)")
            super().connect_check_health(*args, **kwargs)
            self.connected_once = True

    kwargs = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0)}
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=Pinned, max_connections=1, **kwargs))


def reaches_directly(client: redis.Redis) -> bool:
    """Whether the connection of `client` (an owner's one connection) reaches the server with nothing in between:
    the server names the two ends of the connection (CLIENT INFO's addr and laddr) as this process's TCP socket
    does. Behind a proxy or a NAT they differ, and a proxy may keep this end of the connection open while it
    carries the commands to another server (a CF restarted or replaced behind it), whose connection has no WATCH
    of this one's. False also when it cannot be told (a Unix socket, a server without CLIENT INFO)."""
    pool = client.connection_pool
    try:
        info = client.client_info()
        conn = pool.get_connection()
    except redis.exceptions.RedisError:
        return False
    try:
        sock = socket_of(conn)
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        return (info.get("addr"), info.get("laddr")) == (_address(sock.getsockname()), _address(sock.getpeername()))
    finally:
        pool.release(conn)


def _address(name: tuple[Any, ...]) -> str:
    """A socket's address as Redis's CLIENT INFO writes it: host:port, [host]:port for IPv6."""
    host, port = name[0], name[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Owner:
    """A restore's (or a purge's) hold on one structure, from its claim to the end of its load. Its writes go
    through transaction(), so each lands only while the structure is still this owner's (the header carries its
    restore token and says RECOVERING) and only in the CF the claim was made on. `client` is the owner's own
    connection, which never reconnects: use it for anything else the owner writes (definitions). `direct`:
    whether that connection reaches the CF with nothing in between (reaches_directly): only then does a load's
    batch rely on a guard sent after the batch before it (send's watch_next)."""

    def __init__(self, client: redis.Redis, structure: str, token: int, cf: str,
                 admin: redis.Redis | None = None, *, direct: bool = False) -> None:
        self.client = client
        self.structure = structure
        self.token = token
        self.cf = cf
        self.direct = direct
        # Where the owner reads and writes the admin structure: its own connection on a single server; on a Redis
        # Cluster, {ADMIN} has a slot of its own, perhaps on another master: the cluster client (cfemu.rcluster).
        self.separate_admin = admin is not None
        self.admin = admin if admin is not None else client
        self._guard: list[bytes] | None = None  # send's first round trip, packed (_watch_and_read)
        # The replies of a guard sent after the last batch's EXEC (send(watch_next=True)): its WATCH is in force on
        # the owner's connection until the next batch is sent, or until another transaction of the owner judges
        # the header anew (check), which voids it.
        self._next_guard: list[Any] | None = None
        self._loads: bool | None = None  # whether load() may be used: asked once (loads_natively)
        self._loading: Any = None  # the connection held while batches sent by load() are in flight
        self._in_flight = 0

    def check(self, client: redis.Redis) -> None:
        """Raise NotOwnerError (CFReplacedError) unless the header, read through `client` (a watching pipeline),
        still says this owner's, in the same CF."""
        self._next_guard = None  # this transaction's EXEC ends every WATCH on the connection, the guard's too
        self.judge(_header(client, self.structure))

    def judge(self, now: Seen) -> None:
        """Raise NotOwnerError (CFReplacedError) unless `now`, the CF's identity and the header as read while
        watched, says this owner's, in the same CF."""
        if now.cf != self.cf:
            raise CFReplacedError(f"the CF is another server now (run id {self.cf[:12]} at the claim, "
                                  f"{now.cf[:12]} now)")
        if not now.state:
            raise CFReplacedError("the structure's header is gone from the CF (flushed, or a CF restarted empty)")
        if now.token != self.token:
            raise NotOwnerError(f"a later restore or a purge took the structure over (restore token {now.token}; "
                                f"this one's is {self.token})")
        if now.state != "RECOVERING":
            raise NotOwnerError(f"the structure is {now.state} now: someone else changed its state")

    def transaction(self, stage: Callable[[Pipeline], object], *, watch: Sequence[str] = ()) -> list[Any]:
        """stage's writes (or reads) as one transaction that applies only while this owner owns the structure;
        returns their replies. Raises NotOwnerError (or CFReplacedError) having applied nothing."""
        return _transact(self.client, (keys.meta(self.structure), *watch), self.check,
                         lambda pipe, _: stage(pipe))[1]

    def send(self, commands: resp.Packed, *, watch_next: bool = False) -> list[Any]:
        """transaction() of commands packed beforehand (a bulk load's batch, prepared in another thread), in two
        round trips: WATCH, the CF's identity and the header sent together and judged, then MULTI, the commands
        and EXEC. (redis-py's watching pipeline makes each of the first three a round trip of its own: a batch
        waited four times for the CF, each wait a scheduling delay on a busy machine.) watch_next: more batches
        follow, so the next one's WATCH, identity and header go out right after this EXEC, in the same round trip,
        and are judged when that batch is sent: a load's batch then waits for the CF once. That guard's WATCH holds
        only on the connection it was sent on, so watch_next is taken only on a connection that reaches the CF
        directly (`direct`): behind a proxy, the next batch could go out on the proxy's new connection to another
        server, unwatched, under a CF identity read before the switch. A connection this cannot drive (another
        parser than hiredis's) takes _transact."""
        watch_next = watch_next and self.direct
        pool = self.client.connection_pool
        for _ in range(WATCH_RETRIES):
            try:
                conn = pool.get_connection()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                raise CFReplacedError("the connection to the CF broke") from e
            try:
                if hiredis_io(conn) is None:
                    break
                replies = self._exec_guarded(conn, commands, watch_next)
                if replies is not None:
                    return replies
            finally:
                pool.release(conn)
        else:
            raise NotOwnerError(f"the structure's header changed under {WATCH_RETRIES} transactions in a row")
        return _transact(self.client, (keys.meta(self.structure),), self.check, commands)[1]

    def loads_natively(self) -> bool:
        """Whether this owner's batches may go by load(): the CF has LOAD (its server module), the owner's
        connection reaches it directly (`direct`), is read by hiredis's parser, and the CF lets this user run LOAD.
        Asked once, by an empty batch sent with the CF's identity read, which is judged: the owner's connection
        never reconnects and reaches the server directly, so every batch sent on it after reaches the server whose
        identity was judged here, and LOAD checks the rest (the header) itself. Raises as a batch would (a CF
        replaced, a replica now, the structure not this owner's)."""
        if self._loads is None:
            self._loads = False
            if self.direct and server_module.loads(self.client):
                pool = self.client.connection_pool
                conn = pool.get_connection()
                try:
                    if hiredis_io(conn) is not None:
                        self._loads = self._probe_load(conn)
                finally:
                    pool.release(conn)
        return self._loads

    def _probe_load(self, conn: Any) -> bool:
        """loads_natively's question on `conn`."""
        try:
            info, reply = resp.exchange(conn, [b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n",
                                               self._load_head(0)[0] + b"\r\n"], 2)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            raise CFReplacedError("the connection to the CF broke") from e
        if isinstance(info, redis.exceptions.ResponseError):
            raise info
        identity = _run_id(info)
        if identity != self.cf:
            raise CFReplacedError(f"the CF is another server now (run id {self.cf[:12]} at the claim, "
                                  f"{identity[:12]} now)")
        if isinstance(reply, redis.exceptions.ResponseError):
            self._refused(reply)  # the owner's own refusals raise; a user not allowed LOAD comes back
            return False
        return reply == 0

    def _refused(self, error: redis.exceptions.ResponseError) -> None:
        """Raise what a refusal of LOAD means for the owner: NotOwnerError (the structure is not its own: nothing
        written) or CFReplacedError (a replica now, or the header gone: the CF lost). Other refusals (no such
        command, a user not allowed it) are the caller's to judge."""
        text = str(error)
        if text.startswith("NOHEADER"):
            raise CFReplacedError("the structure's header is gone from the CF (flushed, or a CF restarted empty)")
        if text.startswith("NOTOWNER"):
            raise NotOwnerError(f"a later restore or a purge took the structure over, or changed its state: "
                                f"{text[len('NOTOWNER '):]}")
        if isinstance(error, redis.exceptions.ReadOnlyError) or text.startswith("READONLY"):
            raise CFReplacedError("the CF refused a write (READONLY): the server is a replica now")

    def _load_head(self, size: int) -> list[bytes]:
        """LOAD's name, the header's key and the restore token, and the header of a `size`-byte batch, in RESP."""
        meta, token = keys.meta(self.structure).encode(), str(self.token).encode()
        return [b"*4\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n" % (
            len(server_module.LOAD), server_module.LOAD.encode(), len(meta), meta, len(token), token, size)]

    def load(self, commands: resp.Packed) -> None:
        """Send a load's batch (its commands packed beforehand) as LOAD, without waiting for its reply (loaded()
        reads it): the CF applies it whole only while the structure is still this owner's, so the next batch may
        go out before this one is applied. Only where loads_natively(), with at most LOAD_MAX_ENTRIES entries a
        batch; no other transaction of the owner until every batch sent is loaded()."""
        if self._loading is None:
            try:
                self._loading = self.client.connection_pool.get_connection()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                raise CFReplacedError("the connection to the CF broke") from e
        io = hiredis_io(self._loading)
        assert io is not None, "load() where loads_natively() said no"
        chunks = commands.chunks()
        try:
            resp.send(self._loading, io[0], [*self._load_head(sum(map(len, chunks))), *chunks, b"\r\n"])
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            self._drop_loading()
            raise CFReplacedError("the connection to the CF broke") from e
        except BaseException:  # sent in part, or not: the connection cannot carry another batch
            self._drop_loading()
            raise
        self._in_flight += 1

    def loaded(self) -> None:
        """Wait for the oldest batch load() sent: it is in the CF. Raises NotOwnerError (the structure is not this
        owner's any more: the batch wrote nothing), CFReplacedError, or the CF's refusal of a batch it could not
        apply (nothing of it written); any of them ends the owner's loading: the connection is dropped. A batch sent
        after a refused one is checked on its own and may still have been applied (one refused for its owner is
        followed only by batches refused alike): the load has failed, and its structure stays RECOVERING until a
        restore runs again from its reset."""
        if self._loading is None or not self._in_flight:
            raise RuntimeError("loaded() with no batch in flight")
        conn = self._loading
        io = hiredis_io(conn)
        assert io is not None
        try:
            reply = resp.receive(conn, *io, 1)[0]
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            self._drop_loading()
            raise CFReplacedError("the connection to the CF broke") from e
        except BaseException:  # a reply read in part: the connection cannot be read on
            self._drop_loading()
            raise
        if isinstance(reply, redis.exceptions.ConnectionError):  # LOADING (a CF reloading its data), NOAUTH
            self._drop_loading()
            raise CFReplacedError(f"the CF answered as a server that lost its data or its users would ({reply})")
        if isinstance(reply, redis.exceptions.ResponseError):
            self._drop_loading()
            self._refused(reply)
            raise reply
        self._in_flight -= 1
        if not self._in_flight:
            self.client.connection_pool.release(self._loading)
            self._loading = None

    @property
    def in_flight(self) -> int:
        """Batches load() sent whose reply loaded() has not read."""
        return self._in_flight

    def _drop_loading(self) -> None:
        conn, self._loading, self._in_flight = self._loading, None, 0
        if conn is not None:
            conn.disconnect()
            self.client.connection_pool.release(conn)

    def _watch_and_read(self) -> list[bytes]:
        """WATCH of the header, INFO server and HMGET of the header's _HEADER_FIELDS, packed once."""
        if self._guard is None:
            meta = keys.meta(self.structure)
            guard = resp.Packed()
            guard.add("WATCH", meta)
            guard.add("INFO", "server")
            guard.add("HMGET", meta, *_HEADER_FIELDS)
            self._guard = [guard.data()]
        return self._guard

    def _exec_guarded(self, conn: Any, commands: resp.Packed, watch_next: bool) -> list[Any] | None:
        """One try of send on `conn`: EXEC's replies, or None when the header changed between the read and EXEC
        (nothing applied: try again). Raises as _transact does."""
        guard, self._next_guard = self._next_guard, None
        try:
            if guard is None:
                guard = resp.exchange(conn, self._watch_and_read(), 3)
            watched, info, header = guard
            try:
                for reply in (watched, info, header):
                    if isinstance(reply, redis.exceptions.ResponseError):
                        raise reply
                self.judge(_seen(_run_id(info), header))
            except BaseException:
                _unwatch(conn)
                raise
            if not watch_next:
                return _exec_on(conn, commands)
            result, self._next_guard = _exec_then(conn, commands, self._watch_and_read(), 3)
            return result  # None: aborted; the retry judges the guard sent after it
        except redis.exceptions.WatchError:
            return None
        except redis.exceptions.ReadOnlyError as e:  # a replica now (demoted, or following another): not the CF
            raise CFReplacedError("the CF refused a write (READONLY): the server is a replica now") from e
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            raise CFReplacedError("the connection to the CF broke") from e

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Owner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def claim(client: redis.Redis, structure: str, seen: Seen) -> Owner:
    """Take the structure over for a restore or a purge, when nothing has happened to it since `seen` (observe,
    at the restore's start): the same CF, the same restore token and generation, and not ACTIVE again. One
    transaction gives the header a new restore token (above the last one and the wall clock in ms, so tokens
    keep growing across CF losses) and state RECOVERING, under which every member script refuses work, and takes
    a running backup's mark away; a missing header is created so. Returns the Owner, on a connection of its own;
    raises NotOwnerError (CFReplacedError) having written nothing."""
    pinned = _pinned(rcluster.node_client(client, structure, fresh=False))  # observe read the slot map

    def check(pipe: Pipeline) -> int:
        now = _header(pipe, structure)
        why = changed_since(seen, now)
        if why is not None:
            raise why
        return max(now.token + 1, time.time_ns() // 1_000_000)

    def stage(pipe: Pipeline, token: int) -> None:
        pipe.hset(keys.meta(structure), mapping={TOKEN: token, "state": "RECOVERING"})
        # A backup running now would copy what the owner's wipe and load leave, not the structure it began on: its
        # mark goes, so that it cannot end ok (backup_end.lua) and become the base of the next restore (the owner's
        # run again once stopped), which would lack what the copy missed.
        pipe.hdel(keys.meta(structure), "backup", "backup_until")

    try:
        token, _ = _transact(pinned, (keys.meta(structure),), check, stage)
        direct = reaches_directly(pinned)
    except BaseException:
        pinned.close()
        raise
    return Owner(pinned, structure, token, seen.cf, client if rcluster.is_cluster(client) else None, direct=direct)


def tombstones(client: redis.Redis, structure: str) -> dict[str, str]:
    """The structure's tombstones, UOW -> 'C' | 'B' | 'P' (outcomes decided for their owners, who may still
    retry)."""
    return {keys.text(u): keys.text(o) for u, o in client.hgetall(keys.tomb(structure)).items()}


def registered(client: redis.Redis, structure: str) -> dict[str, int]:
    """The UOWs the structure holds a record of (in {S}:uows), UOW -> the first LRSN of its work here: those
    holding entries, and in-doubt ones a restore registered though none of their work here survived."""
    out: dict[str, int] = {}
    for u, raw in client.hgetall(keys.uows(structure)).items():
        rec = msgpack.unpackb(raw, raw=False)
        out[keys.text(u)] = int(rec.get("f") or 0)
    return out


# --- writes: wipe, load, verify, activate, purge (each batch a transaction of the Owner) -------------------
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


def wipe(owner: Owner, *, keep: tuple[str, ...] = (), batch: int = BATCH) -> int:
    """Delete every key of the owner's structure except `keep`; returns how many were deleted."""
    kept = {k.encode() for k in keep}
    doomed = [k for k in structure_keys(owner.client, owner.structure) if k not in kept]
    for i in range(0, len(doomed), batch):
        chunk = doomed[i:i + batch]

        def stage(pipe: Pipeline, chunk: list[bytes] = chunk) -> None:
            pipe.unlink(*chunk)

        owner.transaction(stage)
    return len(doomed)


def reset(owner: Owner, sdef: StructureDef, *, batch: int = BATCH) -> int:
    """Empty the owner's RECOVERING structure: delete every key but its header, then give it back its header
    fields and its fence (every member's current epoch). Returns the number of keys deleted."""
    S = sdef.name
    deleted = wipe(owner, keep=(keys.meta(S),), batch=batch)

    def check(pipe: Pipeline) -> Any:
        owner.check(pipe)
        # Read while the fence is watched: a fence raised meanwhile is read again (a member writes its epoch before
        # it raises the fences). On a cluster the epochs live in {ADMIN}'s slot: read there, after the WATCH.
        return owner.admin.hgetall(EPOCHS) if owner.separate_admin else pipe.hgetall(EPOCHS)

    def stage(pipe: Pipeline, epochs: Any) -> None:
        stage_structure(pipe, sdef, state="RECOVERING", gen=1, epochs=epochs)

    _transact(owner.client, (keys.meta(S), keys.fence(S)), check, stage)
    return deleted


def list_of(structure: str, wire: Wire) -> str:
    """The queue list an entry (wire form) sits on: by its state, and by its priority when committed."""
    return keys.state_list(structure, wire["q"], wire["st"], int(wire.get("p", 0)))


def descriptor(wire: Wire, data: bytes) -> bytes:
    """The descriptor as the CF scripts store it: cmsgpack-readable (str keys; properties only with str names and
    str/int/float/bool values, the ones Lua keeps intact), with the data's length. The same bytes as
    Entry.from_wire(...).pack() (cfemu.entry: same fields, order, defaults and types), built without the Entry in
    between: a restore packs a million of them (most with no properties: no filtered copy is made for those)."""
    d = wire.get
    pr = d("pr")
    props = ({k: v for k, v in pr.items() if isinstance(k, str) and isinstance(v, str | int | float | bool)}
             if pr else {})
    return _pack_descriptor({
        "id": wire["id"], "q": wire["q"], "p": int(d("p", 0)), "per": 1 if d("per", 1) else 0, "mid": d("mid", ""),
        "cid": d("cid", ""), "exp": int(d("exp", 0)), "pt": int(d("pt", 0)), "bc": int(d("bc", 0)), "pr": props,
        "st": d("st", ""), "l": int(d("l", 0)), "u": d("u", ""), "o1": int(d("o1", 0)), "o2": int(d("o2", 0)),
        "len": len(data)})


_pack_descriptor = msgpack.Packer(use_bin_type=False).pack  # Entry.pack's format


def uow_record(owner: str, first_lrsn: int, gen: int) -> bytes:
    """A UOW's record in {S}:uows, as join_uow in _prelude.lua writes it: {o, f, g}."""
    return msgpack.packb({"o": owner, "f": first_lrsn, "g": gen}, use_bin_type=False)


@dataclass
class Staged:
    """One batch of a Loader, prepared (Loader.prepare: its writes packed) and not yet sent (Loader.send)."""

    entries: int
    commands: resp.Packed = field(default_factory=resp.Packed)
    lists: dict[str, int] = field(default_factory=dict)  # list -> entries the batch appends to it
    held: dict[str, int] = field(default_factory=dict)
    queues: set[str] = field(default_factory=set)
    copies: list[tuple[bytes, bytes]] = field(default_factory=list)  # (descriptor as the CF holds it, data)
    bytes: int = 0


def sets_of(structure: str, e: Wire) -> list[str]:
    """The sets an entry is a member of: its UOW's (while a UOW holds it) and its queue's indexes by correlation id
    and by message id (SQM gives every message an id: most entries are in one set of their own)."""
    out = []
    if e.get("u"):
        out.append(keys.uow_set(structure, e["u"]))
    if e.get("cid"):
        out.append(keys.index_set(structure, e["q"], "c", e["cid"]))
    if e.get("mid"):
        out.append(keys.index_set(structure, e["q"], "m", e["mid"]))
    return out


def unloadable(entry_id: str, e: UnicodeEncodeError) -> ValueError:
    """The error for an entry whose descriptor holds a string that is not UTF-8: a raw byte a backup or a log kept
    by surrogateescape (cfemu.entry), which neither the CF's scripts nor redis-py's encoding (strict) can write.
    Named by its id (in ASCII: the id itself may be the string), where the encoder's own error named no entry."""
    text = e.object if isinstance(e.object, str) else ""
    shown = text if len(text) <= 80 else text[:80] + "..."  # a property's value may be long
    return ValueError(f"entry {entry_id!a} cannot be written to the CF: its descriptor holds a string that is not "
                      f"UTF-8 ({e.reason}: at {e.start} of {shown!a})")


def prepare(structure: str, batch: Sequence[Survivor]) -> Staged:
    """A batch of a load into `structure`: its writes computed and packed, not sent (touches no server: the next
    batch is prepared in another thread, or another process, while this one's is sent by Loader.send). An entry
    that cannot be encoded raises ValueError (unloadable) before anything of its batch is sent."""
    S = structure
    lists: dict[str, list[str]] = {}
    sets: dict[str | bytes, list[str]] = {}
    expiry: list[Any] = []
    ids: list[str] = []
    descriptors: list[bytes] = []
    datas: list[bytes] = []
    # The loop runs a million times in a restore: the list of each (queue, state, priority) is looked up once a
    # batch, and the sets an entry is in (sets_of) are named here inline, in sets_of's order.
    list_ids: dict[tuple[str, str, int], list[str]] = {}
    index_prefixes: dict[str, tuple[str, str]] = {}  # queue -> (its correlation id's, its message id's)
    held: dict[str, int] = {}
    for s in batch:
        e = _wire(s)
        i = s.id
        d = e.get
        q = e["q"]
        place = (q, e["st"], int(d("p", 0)))
        members = list_ids.get(place)
        if members is None:
            members = list_ids[place] = lists.setdefault(list_of(S, e), [])
        members.append(i)
        u = d("u")
        if u:
            first = int(e["l"])
            held[u] = min(held.get(u, first), first)
            sets.setdefault(keys.uow_set(S, u), []).append(i)
        exp = d("exp")
        if exp and int(exp) > 0:
            expiry += (int(exp), i)
        cid, mid = d("cid"), d("mid")
        if cid or mid:
            prefixes = index_prefixes.get(q)
            if prefixes is None:
                prefixes = index_prefixes[q] = _index_prefixes(S, q)
            if cid:
                sets.setdefault(prefixes[0] + cid, []).append(i)
            if mid:
                sets.setdefault(prefixes[1] + mid, []).append(i)
        try:
            descriptors.append(descriptor(e, s.data))
        except UnicodeEncodeError as x:  # the first of the entry's strings to be encoded: the rest are the same
            raise unloadable(i, x) from None
        ids.append(i)
        datas.append(s.data)
    return _staged(S, ids, descriptors, datas, lists, sets, expiry, held, {q for q, _, _ in list_ids})


def _staged(structure: str, ids: Sequence[str], descriptors: list[bytes], datas: Sequence[bytes],
            lists: Mapping[str, list[str]], sets: Mapping[str | bytes, list[str]], expiry: list[Any],
            held: dict[str, int], queues: set[str]) -> Staged:
    """A batch's Staged from its entries' ids, descriptors and data and their grouping in first-seen order (list
    name -> ids, set name -> ids, [exp, id, ...], UOW -> lowest LRSN, queues): its commands packed as redis-py's
    hset(mapping=...), sadd, rpush and zadd would send them."""
    S = structure
    st = Staged(len(ids), held=held, queues=queues, copies=list(zip(descriptors, datas, strict=True)),
                bytes=sum(map(len, datas)))
    if ids:
        c = st.commands
        c.add_pairs((b"HSET", keys.entries(S)), ids, descriptors)
        c.add_pairs((b"HSET", keys.data(S)), ids, datas)
        c.add_groups(b"SADD", sets)
        c.add_groups(b"RPUSH", lists)
        if expiry:
            c.add_items((b"ZADD", keys.expiry(S)), expiry, len(expiry))
    st.lists = {k: len(members) for k, members in lists.items()}
    return st


# The fields a mask given to prepare_columns sets, bit j field OVERRIDES[j] (cfemu/_bulk.c's order).
OVERRIDES = ("st", "u", "l", "o1", "o2", "bc")


def prepare_columns(structure: str, ids: list[str], descs: list[bytes], datas: list[bytes], masks: list[int],
                    backup: list[bool], overrides: Sequence[list[Any] | None], start: int, end: int, *,
                    aside_suffix: str = "") -> Staged | None:
    """prepare of the entries [start, end) of these columns, in C (cfemu/_bulk.c's stage: no Python an entry):
    entry k is ids[k], the base descriptor descs[k] (msgpack bytes) with field OVERRIDES[j] set to
    overrides[j][k] where bit j of masks[k] is set (a column no mask needs may be None), where a copy of a backup
    (backup[k]) with a property table that is not a map has the CF's empty one, and the data datas[k]. The same
    Staged, byte for byte, as prepare of those entries. None: the C path does not take these entries exactly
    (see cfemu/_bulk.c), or an entry's queue ends in aside_suffix, or the extension was not built: the caller
    prepares them with prepare."""
    if _bulk is None:
        return None
    said = _bulk.stage(ids, descs, datas, masks, backup, tuple(overrides), start, end,
                       partial(keys.state_list, structure), partial(_index_prefixes, structure),
                       keys.uow_set_prefix(structure), aside_suffix)
    if said is None:
        return None
    descriptors, lists, sets, expiry, held, queues, _ = said
    return _staged(structure, ids[start:end], descriptors, datas[start:end], lists, sets, expiry, held, queues)


def _index_prefixes(structure: str, queue: str) -> tuple[str, str]:
    return keys.index_set_prefix(structure, queue, "c"), keys.index_set_prefix(structure, queue, "m")


def batch_full(count: int, held: int, size: int, max_bytes: int) -> bool:
    """The load's batch rule: a batch of `count` entries (one at least) whose data hold `held` bytes ends there
    once it has `size` entries, or once its data reach `max_bytes` (0: no bound). restore.load.batches cuts a
    stream of survivors by it, batch_end a list of data (cfemu/_bulk.c's cut is the same rule in C)."""
    return count >= size or bool(max_bytes and held >= max_bytes)


def batch_end(datas: list[bytes], start: int, size: int, max_bytes: int) -> int:
    """Where the batch of `datas` that begins at `start` ends by batch_full; -1 where `datas` end first."""
    if _bulk is not None:
        return int(_bulk.cut(datas, start, size, max_bytes))
    held = 0
    for k in range(start, len(datas)):
        held += len(datas[k])
        if batch_full(k + 1 - start, held, size, max_bytes):
            return k + 1
    return -1


class Loader:
    """Writes entries into the owner's emptied, RECOVERING structure (after reset), batch by batch, each batch one
    transaction of the owner; then the records of the UOWs that hold them. The caller chooses the batches and the
    order (a list keeps the order it is written in), so that it can report progress between them."""

    def __init__(self, holder: Owner, gen: int) -> None:
        self.holder = holder
        self.structure = holder.structure
        self.gen = gen  # the generation a loaded UOW is recorded in
        self.bytes = 0
        self.held: dict[str, int] = {}  # UOW holding entries -> lowest LRSN of its entries
        self.queues: set[str] = set()
        self._sent: deque[Staged] = deque()  # batches sent by the owner's load() and not yet in (send, flush)

    def write(self, batch: Sequence[Survivor]) -> None:
        """One batch: descriptors, data, list places, UOW sets, expiry times and id indexes; in the CF when this
        returns."""
        self.send(self.prepare(batch))
        self.flush()

    def prepare(self, batch: Sequence[Survivor]) -> Staged:
        """A batch's writes, computed and packed but not sent (prepare)."""
        return prepare(self.structure, batch)

    def send(self, st: Staged) -> list[Staged]:
        """Write a prepared batch. Returns the batches now in the CF, oldest first: where the owner loads natively
        (Owner.load) up to LOAD_DEPTH batches are in flight, so this one may be in a later call's list, or
        flush()'s; else it is this one, written as one transaction of the owner (more batches are expected:
        Owner.send's watch_next; the owner's next transaction of another kind voids the guard sent after it)."""
        holder = self.holder
        if st.entries and st.entries <= LOAD_MAX_ENTRIES and holder.loads_natively():
            holder.load(st.commands)
            self._sent.append(st)
            landed = []
            while holder.in_flight >= LOAD_DEPTH:
                holder.loaded()
                landed.append(self._landed(self._sent.popleft()))
            return landed
        landed = self.flush()
        if st.entries:
            holder.send(st.commands, watch_next=not holder.loads_natively())
        return [*landed, self._landed(st)]

    def flush(self) -> list[Staged]:
        """Wait until every batch sent is in the CF; returns those that were not yet, oldest first."""
        landed = []
        while self._sent:
            self.holder.loaded()
            landed.append(self._landed(self._sent.popleft()))
        return landed

    def _landed(self, st: Staged) -> Staged:
        """Count a batch once it is in (a transaction tried again must not count it twice)."""
        for u, first in st.held.items():
            self.held[u] = min(self.held.get(u, first), first)
        self.queues.update(st.queues)
        self.bytes += st.bytes
        return st

    def finish(self, queues: Iterable[str], owner: Callable[[str], str], tomb: Mapping[str, str]) -> int:
        """After the last batch: the queue set (`queues` and every queue written to), a record for each UOW
        holding entries (its owner by `owner`), and the tombstones (UOW -> 'C' | 'B'). Returns the number of UOWs
        holding entries."""
        if self._sent:
            raise RuntimeError("finish() before the last batches are in (flush)")
        S = self.structure
        all_queues = sorted(set(queues) | self.queues)

        def stage(pipe: Pipeline) -> None:
            if all_queues:
                pipe.sadd(keys.queues(S), *all_queues)
            if self.held:
                pipe.hset(keys.uows(S), mapping={u: uow_record(owner(u), f, self.gen) for u, f in self.held.items()})
            if tomb:
                pipe.hset(keys.tomb(S), mapping=dict(tomb))  # type: ignore[arg-type]

        self.holder.transaction(stage)
        return len(self.held)


def _wire(s: Survivor) -> Wire:
    assert s.entry is not None, f"entry {s.id} is not to be loaded"
    return s.entry


def verify(owner: Owner, survivors: Sequence[Survivor], uows: Collection[str] | None = None) -> list[str]:
    """Compare the owner's structure with what was loaded: entry and data counts, UOW records (`uows`, by default
    those holding entries), and the length of every list (read in one transaction of the owner: a count from
    another CF is never compared). Returns the differences found (none: [])."""
    expected: dict[str, int] = defaultdict(int)
    holding: set[str] = set()
    for s in survivors:
        e = _wire(s)
        expected[list_of(owner.structure, e)] += 1
        if e.get("u"):
            holding.add(e["u"])
    return verify_counts(owner, len(survivors), expected, holding if uows is None else set(uows) | holding)


def verify_counts(owner: Owner, entries: int, lists: Mapping[str, int], uows: Collection[str]) -> list[str]:
    """verify, from counts kept while loading (a load that streams its survivors does not hold them): `entries`
    loaded, `lists` list -> entries written to it, `uows` the UOWs that must have a record."""
    structure = owner.structure
    names = sorted(lists)

    def stage(pipe: Pipeline) -> None:
        pipe.hlen(keys.entries(structure))
        pipe.hlen(keys.data(structure))
        pipe.hlen(keys.uows(structure))
        for k in names:
            pipe.llen(k)

    n_ent, n_data, n_uows, *lengths = owner.transaction(stage)
    problems = []
    if n_ent != entries:
        problems.append(f"{n_ent} descriptors, expected {entries}")
    if n_data != entries:
        problems.append(f"{n_data} data fields, expected {entries}")
    if n_uows != len(uows):
        problems.append(f"{n_uows} UOWs holding entries, expected {len(uows)}")
    for k, n in zip(names, lengths, strict=True):
        if n != lists[k]:
            problems.append(f"list {k} holds {n}, expected {lists[k]}")
    return problems


def activate(owner: Owner, sdef: StructureDef, *, gen: int, clock: int, floor: int, entries: int,
             nbytes: int, restored_from: str = "", last_backup: str = "",
             flags: Mapping[str, str] | None = None) -> None:
    """The switch back to ACTIVE, last and in one transaction of the owner: the whole header is replaced (no
    field of the RECOVERING one, such as a backup's running mark, survives) but the owner's restore token, which
    stays so that a restore that started before this one cannot claim the structure any more. last_backup: the
    restore point just written. flags: more header fields, set in the same switch (a WARM start's disconnected
    persistent store, docs/pstore.md: no persistent work may slip in between)."""
    header: dict[str, Any] = {**(flags or {}), "state": "ACTIVE", "gen": gen, "clock": clock, "floor": floor, "entries": entries,
                              "bytes": nbytes, "max_entries": sdef.max_entries, "max_bytes": sdef.max_bytes,
                              TOKEN: owner.token}
    if restored_from:
        header["restored_from"] = restored_from
    if last_backup:
        header["last_backup"] = last_backup
    meta = keys.meta(sdef.name)

    def stage(pipe: Pipeline) -> None:
        pipe.delete(meta)
        pipe.hset(meta, mapping=header)  # type: ignore[arg-type]

    owner.transaction(stage)
    # On a duplexed CF the switch counts once the secondary has it, and with it everything the owner wrote before
    # (one replication stream), as a member's operation counts: a promotion could otherwise bring back a
    # structure this restore had reported ACTIVE as it was before the restore.
    if duplex.pair_of(owner.client) is not None:
        try:
            duplex.run_confirmed(owner.client, [])
        except duplex.DuplexUnconfirmedError as e:
            raise duplex.DuplexUnconfirmedError(
                f"structure {sdef.name} is ACTIVE on the duplexed CF's primary, but its secondary did not acknowledge "
                "the switch and the pair was not degraded to simplex: should the primary be lost before the pair "
                "settles, the secondary promoted may hold the structure as it was before; check its state then "
                "(cfemu status), and restore it again if it is not ACTIVE") from e


class Purged(NamedTuple):
    discarded: int  # entries the structure held
    discarded_bytes: int  # their data bytes, by the header
    gen: int  # the structure's new generation


def purge(client: redis.Redis, sdef: StructureDef, queues: Sequence[str], *,
          before_activate: Callable[[int, dict[str, str]], str] | None = None,
          committed: Callable[[int], Iterable[str]] | None = None,
          flags: Mapping[str, str] | None = None, seen: Seen | None = None,
          claimed: Callable[[Owner], None] | None = None, above: int = 0) -> Purged:
    """Empty the structure and make it ACTIVE again in a new generation, above its clock and its old generation
    (so a unit of work from before that had no work here is backed out when it next touches it), and above `above`
    (the highest LRSN and generation its history outside the CF records: the caller reads its backups, which a CF
    lost took no record of); its queues stay defined, and the UOWs that held entries get a 'P' tombstone
    (purged_tombstones). The purge claims the structure first, so a restore loading it meanwhile stops at its next
    batch. before_activate(gen, tombstones), once nothing can change the structure any more and before it is
    usable again, makes the purge durable (restore.run writes an empty restore point with those tombstones) and
    returns the id it wrote.
    committed(gen): the UOWs whose commit took effect here in generation `gen` (the one purged) and whose owner may
    still retry it (restore.run.committed_before_base): they get a 'P' tombstone too, so that the retry is a no-op
    here instead of a "lost with the CF" that would make the owner back out a committed UOW. flags: header fields
    set as it becomes ACTIVE (activate). seen: what the caller saw when it decided to purge (observe; default:
    now): a restore or another purge that took the structure over since is refused by the claim (NotOwnerError),
    as a purge decided on a failed structure must not empty one restored meanwhile. claimed(owner): what the
    caller does as soon as it owns the structure, before it is emptied (a lost CF's definitions given back)."""
    S = sdef.name
    with claim(client, S, seen if seen is not None else observe(client, S)) as owner:
        if claimed is not None:
            claimed(owner)
        info = {keys.text(k): keys.text(v) for k, v in owner.client.hgetall(keys.meta(S)).items()}
        discarded = int(owner.client.hlen(keys.entries(S)))
        gen = max(time.time_ns() // 1000, int(info.get("clock", 0)) + 1, int(info.get("gen", 0)) + 1, above + 1)
        tomb = purged_tombstones(owner.client, S)
        if committed is not None:
            tomb = {**dict.fromkeys(committed(int(info.get("gen", 0))), "P"), **tomb}
        last = before_activate(gen, tomb) if before_activate is not None else ""
        reset(owner, sdef)
        if queues:
            owner.transaction(lambda pipe: pipe.sadd(keys.queues(S), *queues))
        marks = list(tomb.items())
        for i in range(0, len(marks), BATCH):  # a transaction of a bounded size each (cfemu.limits.CF_STEP)
            chunk = dict(marks[i:i + BATCH])
            owner.transaction(lambda pipe, chunk=chunk: pipe.hset(keys.tomb(S), mapping=chunk))  # type: ignore[misc]
        activate(owner, sdef, gen=gen, clock=gen + 1, floor=gen, entries=0, nbytes=0, last_backup=last, flags=flags)
    return Purged(discarded, int(info.get("bytes", 0)), gen)


def purged_tombstones(client: redis.Redis, structure: str) -> dict[str, str]:
    """The tombstones a purge leaves: those already there (outcomes decided for owners that may still retry), and
    'P' for every UOW holding entries: a purge discards messages, not outcomes, so the owner's commit or backout
    of such a UOW is a no-op here and goes on on its other structures (a commit refused here as "lost" would
    make the owner back out work that committed elsewhere, or that it already told its application committed),
    while more work of it here is refused as backed out."""
    held = {keys.text(u): "P" for u in client.hkeys(keys.uows(structure))}
    return {**held, **tombstones(client, structure)}
