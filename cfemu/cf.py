"""Python face of the CF: one method per CF operation, each one atomic Lua script (cfemu/scripts/<op>.lua)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import msgpack
import redis

from cfemu import bulk, duplex, keys, lua, rcluster, server_module
from cfemu.entry import Entry
from cfemu.errors import MQError, StructureFailedError, from_script_error
from cfemu.limits import CF_STEP, CF_STEP_BYTES
from cfemu.redis_internals import hiredis_io, one_attempt, pack, retry_errors
from cfemu.resp import exchange, receive, send
from cfemu.server_module import TO_SCRIPT


class Clock(Protocol):
    """The caller's LRSN clock (sqm.core.clock.LrsnClock): now() ticks, observe() adopts the CF's clock."""

    def now(self) -> int: ...

    def observe(self, lrsn: int) -> None: ...


@dataclass
class Caller:
    """Who calls the CF: a member of the group with its fencing epoch and LRSN clock."""

    member: str
    epoch: int
    clock: Clock


def with_epoch(call: tuple[str, str, list[Any]], caller: Caller) -> tuple[str, str, list[Any]]:
    """A call made by one of Structure's *_call builders (its arguments begin with the member and its epoch), with
    the caller's epoch of now: a call built before the member re-joined a CF that came back empty (a higher epoch)
    still carries the old one, and made again as it was it is refused FENCED, as if a peer had fenced the member."""
    op, structure, args = call
    if len(args) > 1 and args[0] == caller.member and args[1] != caller.epoch:
        return op, structure, [args[0], caller.epoch, *args[2:]]
    return call


# A pipeline's commands up to this many bytes in all go to the socket as one write (one system call, and one
# hand-off of the GIL, instead of one per command: a grouped round trip carries several requests' scripts, a batch
# of puts a hundred); a longer pipeline's commands (large messages) are written one by one, never copied.
JOINED_SEND = 256 << 10

# Structure handles a CF keeps (CF.structure): more names than a group defines, kept no further.
MAX_STRUCTURE_HANDLES = 1024


class CF:
    """A connection to the CF (a Redis server) with every structure script registered (the admin ones: Admin)."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._scripts = lua.register(client, lua.structure_operations())  # cfemu/scripts/<op>.lua
        self._keys: dict[str, list[str]] = {}  # structure -> its scripts' KEYS (keys.script_keys), built once
        self._pair = duplex.pair_of(client)  # a duplexed CF: every call waits for its copy (cfemu.duplex)
        self._cluster = rcluster.is_cluster(client)  # a Redis Cluster: each script goes to its slot's master
        # The operations the CF's server runs as module commands (cfemu.server_module), asked at the first call;
        # each operation's command head (the module's command, or EVALSHA of its script), made once.
        self._native: dict[str, str] | None = None
        self._heads: dict[str, tuple[Any, ...]] = {}
        # Structure handles by name, each made (and its name checked) once: a handle holds only this CF and the
        # name, and a member asks for one per CF call.
        self._structures: dict[str, Structure] = {}

    def structure(self, name: str) -> Structure:
        found = self._structures.get(name) if type(name) is str else None
        if found is None:
            found = Structure(self, keys.check_name("structure", name))
            if len(self._structures) < MAX_STRUCTURE_HANDLES:
                self._structures[name] = found
        return found

    def script(self, op: str) -> Any:
        """The registered script of an operation (a redis-py Script), for callers that pipeline many calls
        of it themselves (a benchmark's fill)."""
        return self._scripts[op]

    def run(self, op: str, structure: str, args: Sequence[Any]) -> Any:
        return self._run(op, structure, args, False)

    def _run(self, op: str, structure: str, args: Sequence[Any], script: bool) -> Any:
        """run, by the operation's script when `script` is set (a call the module's command left to it)."""
        try:
            script_keys = self._keys.get(structure)
            if script_keys is None:
                script_keys = self._keys[structure] = keys.script_keys(structure)
            return self._evalsha(op, script_keys, args, script)
        except redis.exceptions.ResponseError as e:
            msg = str(e)
            if self._lost_module(op, e):
                return self._run(op, structure, args, script)
            if msg.startswith(TO_SCRIPT):  # the module's command did nothing: the script does the call
                return self._run(op, structure, args, True)
            if msg.startswith(("NOSCRIPT", "ERR", "WRONGTYPE", "BUSY", "LOADING", "READONLY", "OOM")):
                raise
            raise from_script_error(msg, structure) from None

    def _head(self, op: str) -> tuple[Any, ...]:
        """The command an operation's call starts with: its module command where the server has it, else EVALSHA
        of its script (a duplexed CF and a Redis Cluster run the scripts)."""
        head = self._heads.get(op)
        if head is None:
            command = self._native_ops().get(op)
            # The module's command names the script's sha, which it runs itself for a call it leaves to the script.
            head = (command, self._scripts[op].sha) if command else self._script_head(op)
            self._heads[op] = head
        return head

    def _script_head(self, op: str) -> tuple[Any, ...]:
        return ("EVALSHA", self._scripts[op].sha, len(keys.SCRIPT_KEYS))

    def _native_ops(self) -> dict[str, str]:
        """The operations the server runs as module commands (op -> command), asked once."""
        if self._native is None:
            self._native = {} if self._pair is not None or self._cluster else server_module.loaded_ops(self.redis)
            self._load_module_scripts()
        return self._native

    def _load_module_scripts(self) -> None:
        """The scripts of the operations the module runs, loaded in the server: a module command runs its script
        itself, in its place, for a call it leaves to it (cfemu/_cfmodule.c), and a script the server has not
        loaded would come back NOSCRIPT, to be run after the calls behind it in a pipeline. Asked when the module
        is found, and again when such a call came back NOSCRIPT (the CF lost its scripts: restarted, or flushed).
        A user that may not load scripts leaves them to the calls (NOSCRIPT loads them one at a time)."""
        if not self._native:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for op in self._native:
                pipe.script_load(self._scripts[op].script)
            pipe.execute()
        except redis.exceptions.ResponseError:
            pass

    def _lost_module(self, op: str, error: Exception) -> bool:
        """Whether a call failed because the operation's module command cannot be used: the server no longer has
        it (a CF restarted without the module), or the caller's user may not run it (a server whose module API
        cannot give a module command an ACL category: cfemu/_cfmodule.c). The operations then go to the scripts
        from now on, and the call can be made again (nothing of it ran)."""
        msg = str(error)
        if not (self._native and op in self._native and (
                msg.startswith("unknown command") or "no permissions to run the 'cf." in msg)):
            return False
        self._native = {}
        self._heads.clear()
        return True

    def run_many(self, calls: Sequence[tuple[str, str, Sequence[Any]]]) -> list[Any]:
        """Several structure scripts (op, structure, args) in one round trip: a pipeline on one connection, never a
        transaction. Each script runs atomically, in the order given, and each one's refusal is its own: it comes
        back in its place as the exception object run would raise (the later calls still run). A connection that
        fails raises redis-py's ConnectionError or TimeoutError, and which calls ran is then unknown: nothing is
        retried. A duplexed CF or a Redis Cluster runs them one by one through run (each confirmed or routed as
        run does); so does a connection this cannot drive directly. A NOSCRIPT reply (the CF lost its scripts:
        that call did not run) loads the script and runs that call again through run. A call whose arguments no
        command can carry (redis-py's DataError) is refused in its place and nothing of it is sent: one caller's
        bad argument never fails another's call."""
        if not calls:
            return []
        if self._pair is not None or self._cluster:
            return [self._run_or_error(op, sname, args) for op, sname, args in calls]
        self._native_ops()  # asked before the pipeline takes its connection (which may be the pool's only one)
        pool = self.redis.connection_pool
        conn = pool.get_connection()
        out: list[Any] = [None] * len(calls)
        sent: list[int] = []  # the calls whose command is in the pipeline, in its order
        try:
            chunks: list[bytes] = []
            for i, (op, sname, args) in enumerate(calls):
                try:
                    chunks += self._command(conn, op, sname, args)
                except Exception as e:  # its own arguments (a type no command carries): its error
                    out[i] = e  # alone, as run raises it; nothing of it was sent, and the others still go
                else:
                    sent.append(i)
            if len(chunks) > 1 and sum(map(len, chunks)) <= JOINED_SEND:
                chunks = [b"".join(chunks)]
            replies = exchange(conn, chunks, len(sent)) if sent else []
        finally:
            try:
                if conn.should_reconnect():
                    conn.disconnect()
            finally:
                pool.release(conn)
        again: list[int] = []  # calls that did not run: their script was not loaded, or the module is gone
        scripted: list[int] = []  # calls the module's command left to the script
        for i, r in zip(sent, replies, strict=True):
            if isinstance(r, redis.exceptions.NoScriptError) or (
                    isinstance(r, redis.exceptions.ResponseError) and self._lost_module(calls[i][0], r)):
                again.append(i)
            elif isinstance(r, redis.exceptions.ResponseError) and str(r).startswith(TO_SCRIPT):
                scripted.append(i)
            else:
                out[i] = _script_reply(r, calls[i][1])
        if any(calls[i][0] in (self._native or {}) for i in again):
            self._load_module_scripts()
        for i in again:
            op, sname, args = calls[i]
            out[i] = self._run_or_error(op, sname, args)
        for i in scripted:
            op, sname, args = calls[i]
            out[i] = self._run_or_error(op, sname, args, script=True)
        return out

    def _command(self, conn: Any, op: str, structure: str, args: Sequence[Any]) -> list[bytes]:
        """The call of a structure operation as the connection sends it (its module command or its script's
        EVALSHA)."""
        script_keys = self._keys.get(structure)
        if script_keys is None:
            script_keys = self._keys[structure] = keys.script_keys(structure)
        return pack(conn, (*self._head(op), *script_keys, *args))

    def _run_or_error(self, op: str, structure: str, args: Sequence[Any], script: bool = False) -> Any:
        try:
            return self._run(op, structure, args, True) if script else self.run(op, structure, args)
        except (MQError, redis.exceptions.ResponseError, redis.exceptions.DataError) as e:
            return e

    def _evalsha(self, op: str, script_keys: list[str], args: Sequence[Any], by_script: bool = False) -> Any:
        """An operation's call (EVALSHA of its registered script, or its module command), as redis-py's Script call
        does it (the pool's connection, its retry
        policy with a disconnect before each retry, NOSCRIPT loads the script and runs it again) without the rest
        of redis-py's per-command path (observability records, argument filtering, wrappers): that path cost more
        CPU than the script itself, four times per message lifecycle (BENCHMARKS.md, "peers")."""
        script = self._scripts[op]
        if self._cluster:  # redis-py's cluster client routes EVALSHA by its keys (one hash tag: one slot)
            return script(keys=script_keys, args=list(args))
        cmd = (*(self._script_head(op) if by_script else self._head(op)), *script_keys, *args)
        pool = self.redis.connection_pool
        conn = pool.get_connection()
        try:
            packed = pack(conn, cmd)  # what redis-py's hiredis packer makes of them, without its per-argument checks
        except BaseException:  # an argument no command carries: the connection goes back, unused
            pool.release(conn)
            raise

        def send_and_read() -> Any:
            if self._pair is not None:
                return duplex.exchange(conn, self._pair, packed)
            lean = _lean_exchange(conn, packed)
            if lean is not _NOT_LEAN:
                return lean
            conn.send_packed_command(packed)
            return conn.read_response()

        retry = conn.retry
        try:
            try:
                if one_attempt(retry):  # what call_with_retry does with no retries, without its wrappers
                    try:
                        return send_and_read()
                    except retry_errors(retry):
                        conn.disconnect()
                        raise
                return retry.call_with_retry(send_and_read, lambda error, count: conn.disconnect(),
                                             with_failure_count=True)
            finally:
                try:
                    if conn.should_reconnect():
                        conn.disconnect()
                        conn.connect()
                finally:
                    pool.release(conn)
        except redis.exceptions.NoScriptError:  # the CF restarted or flushed its scripts: load it, run it again
            if self._pair is not None:  # on a connection of ours, so that the call is confirmed as any other
                self.redis.script_load(script.script)
                return self._evalsha(op, script_keys, args, True)
            return script(keys=script_keys, args=list(args))


_NOT_LEAN = object()


def _lean_exchange(conn: Any, packed: list[bytes]) -> Any:
    """One EVALSHA's send and reply on a connected redis-py connection with the hiredis parser, by the socket and
    the parser's reader directly: what send_packed_command and read_response do for it without their per-call
    health-check clock, error-context strings and wrappers (a CF call's client side is Python work the member
    pays four times per message lifecycle: BENCHMARKS.md, "peers"). The socket, reader and buffer come from
    cfemu.redis_internals. The connection's own failure rules are kept: a timeout or a
    socket error disconnects it and raises redis-py's TimeoutError or ConnectionError (cfemu.resp.io_failure); a reply error
    is raised as the parser's class for it (NOSCRIPT included). A connection this does not know how to drive (no
    socket yet, a health check due, another parser) returns _NOT_LEAN and takes redis-py's own path."""
    io = hiredis_io(conn)
    if (io is None or len(packed) != 1
            or (conn.health_check_interval and time.monotonic() > conn.next_health_check)):
        return _NOT_LEAN
    sock, reader, buf = io
    send(conn, sock, packed)
    reply = receive(conn, sock, reader, buf, 1)[0]
    if isinstance(reply, redis.exceptions.ConnectionError) or (
            type(reply) is list and reply and isinstance(reply[0], redis.exceptions.ConnectionError)):
        # An error reply whose code the parser makes a ConnectionError (LOADING: a CF restarted that is still
        # loading its data; NOAUTH, WRONGPASS): redis-py's parser raises it (or a table led by one) and its
        # read_response drops the connection, as here: nothing ran. Returned, the caller unpacked the error object
        # as the script's reply. A ResponseError (below) leaves the connection in step: its reply was read.
        conn.disconnect()
        raise reply if isinstance(reply, redis.exceptions.ConnectionError) else reply[0]
    if conn.health_check_interval:
        conn.next_health_check = time.monotonic() + conn.health_check_interval
    if isinstance(reply, redis.exceptions.ResponseError):
        raise reply
    return reply


def _script_reply(reply: Any, structure: str) -> Any:
    """A reply of a pipelined script call: the value, or the error run would raise for it (as an object)."""
    if isinstance(reply, redis.exceptions.NoScriptError):
        return reply
    if isinstance(reply, redis.exceptions.ResponseError):
        msg = str(reply)
        if msg.startswith(("NOSCRIPT", "ERR", "WRONGTYPE", "BUSY", "LOADING", "READONLY", "OOM")):
            return reply
        return from_script_error(msg, structure)
    return reply


class PutReply(NamedTuple):
    clock: int  # the CF clock after the put: the LRSN of the put (its PUT record's)
    gen: int  # the structure's generation
    created: bool  # False when an entry with this id was there already (puts are idempotent by id)


class GetReply(NamedTuple):
    clock: int  # the CF clock after the get: the LRSN of the get
    gen: int  # the structure's generation
    entry: Entry | None  # None when no message is available (or again)
    data: bytes | None
    again: bool = False  # the call's step ran out among expired messages: it took nothing, call again


class CarriedCommit(NamedTuple):
    """The commit of an earlier get, carried by get_committed (its COMMIT record forced): commit.lua's arguments."""

    uow: str
    gen: int  # the generation the UOW started in on the structure
    lrsn: int  # the COMMIT record's LRSN
    at: int = 0  # the LRSN the commit counts at (0: lrsn)


class GetCommittedReply(NamedTuple):
    """What get_committed did: the get, and per commit carried (in order) None when it was applied, else the error
    commit.lua gave (FloorError: log it again) or a StructureFailedError saying it was begun and needs commit()."""

    got: GetReply | None  # None when the get was refused: error says why
    error: MQError | None
    commits: list[MQError | None]


class OutcomeReply(NamedTuple):
    """What a commit or a backout did to the entries the UOW held on the structure."""

    clock: int  # the CF clock after the call
    puts: int  # uncommitted puts made available (commit) or deleted (backout)
    gets: int  # uncommitted gets deleted (commit) or made available again (backout)


class OutcomeStep(NamedTuple):
    """One call of a commit or a backout done in steps (commit.lua, backout.lua)."""

    clock: int
    puts: int  # in this call, as OutcomeReply
    gets: int
    more: bool  # the outcome is not done: call again (with later=True)


class TopicNext(NamedTuple):
    clock: int  # the structure's LRSN clock when it was read
    state: str  # 'P' a publication, 'W' the next one waits for an open publication, 'N' none after the position
    lrsn: int  # the publication's commit LRSN (o1): with pub, the subscriber's position after it
    pub: str  # the publication id (hex)
    messages: list[tuple[Entry, bytes]]
    open_from: int | None = None  # state 'W' or 'N': the LRSN of the first put of the open publications, if any


class TopicHead(NamedTuple):
    """The head of the next publication (Structure.topic_head): what a sweep needs of it, never its data."""

    clock: int  # as TopicNext
    state: str  # as TopicNext
    lrsn: int
    pub: str
    messages: int  # how many it has (0 unless state 'P')
    first: Entry | None  # its first message's descriptor (its properties: pub.created, pub.count)
    open_from: int | None = None  # as TopicNext


class PstoreStatus(NamedTuple):
    """The availability of a structure's persistent store (pstore.lua)."""

    state: str  # ACTIVE, FAILED or RECOVERING
    connected: bool  # False while persistent work is refused (disconnected)
    no_new_uows: str  # "" (off), "OPERATOR" or "FULL" (set by the structure reaching its capacity)
    started: str  # "WARM" while the structure runs from a WARM start, else ""


BACKUP_LEASE_MS = 30_000  # a backup mark's lease when the caller names none (backup.run renews it well before)


class BackupBegun(NamedTuple):
    start: int  # the backup's start LRSN
    floor: int  # the recovery floor: restore replays the logs from here
    took_over: str = ""  # the backup whose stale mark (its lease ended) this one replaced ("" when none)


def cf_time_ms(cf_time: tuple[int, int]) -> int:
    """The CF's TIME reply (seconds, microseconds) in milliseconds: the clock leases and marks are kept in, so that
    every member and tool compares them against the one clock they were written in."""
    return int(cf_time[0]) * 1000 + int(cf_time[1]) // 1000


class BackupMark(NamedTuple):
    """The structure's backup mark as a reader sees it (backup_begin.lua, the prelude's backup_mark)."""

    backup: str  # the id of the backup that set it
    left_ms: int | None  # the lease's remaining ms at the CF's time (0 or less: stale); None: a mark with no lease

    @property
    def stale(self) -> bool:
        """Its lease has ended: the backup died or stalled, no backup of it can end well, and every reader treats
        the structure as having no backup running."""
        return self.left_ms is not None and self.left_ms <= 0

    @classmethod
    def read(cls, backup: bytes | str | None, until: bytes | str | None,
             cf_time: tuple[int, int] | None) -> BackupMark | None:
        """From the header's 'backup' and 'backup_until' fields and the CF's TIME reply (seconds, microseconds):
        None when there is no mark."""
        if backup is None:
            return None
        if until is None or cf_time is None:
            return cls(keys.text(backup), None)
        return cls(keys.text(backup), int(keys.text(until)) - cf_time_ms(cf_time))


class BackupCancelled(NamedTuple):
    backup: str  # the backup whose mark was cleared ("" when there was none)
    left_ms: int | None  # its lease's remaining ms when cleared (0 or less: it was stale); None: no lease


class RelogBegun(NamedTuple):
    begin: int  # B: the pass's begin, the CF clock, and the recovery floor from now on
    gen: int  # the structure's generation
    cpl: dict[str, Any] | None  # the stored CPL {"g": gen, "p": [[begin, end], ...]} (None: no pass yet)
    first: int  # the lowest first LRSN of the UOWs holding entries (begin when none)
    carried: list[str]  # UOWs holding entries that started in an older generation


class RelogBatch(NamedTuple):
    clock: int
    cursor: str  # "0" when the scan is done
    scanned: int  # entries looked at
    copies: list[tuple[Entry, bytes, dict[str, Any]]]  # (entry, data, the descriptor as stored) that qualify


class Expired(NamedTuple):
    ids: list[str]  # persistent entries moved to the expired list by this call (the caller logs EXPIRE)
    purged: int  # entries that were on the expired list and are now deleted


T = TypeVar("T")


class PClockReply(NamedTuple):
    value: int  # the pseudo-clock: ms of up-time
    cf_ms: int  # the CF's own time, ms since the epoch


class BrowsePage(NamedTuple):
    """One call of a browse (browse.lua)."""

    found: list[tuple[Entry, bytes]]  # in get order
    more: bool  # an available message was left out by the count or the bytes: the browse is over
    cursor: str  # where the next call goes on; "" once the queue's end was reached
    carried: int  # the bytes ``found`` took of the browse's byte bound (data, descriptor and ``each`` per message)


class Browsed(list[T]):
    """The messages a browse returned, in get order; ``more`` when an available message was left out (by the count
    or by the byte bound of a caller that must carry the reply: browse again with room, or after taking some)."""

    def __init__(self, items: Iterable[T] = (), *, more: bool = False) -> None:
        super().__init__(items)
        self.more = more


def _open_from(out: list[Any]) -> int | None:
    """topic_next.lua's LRSN of the first put of the open publications, after a 'W' or 'N' (None: none open)."""
    return int(out[2]) if len(out) > 2 else None


def _pairs(flat: list[Any]) -> list[tuple[Entry, bytes]]:
    return [(Entry.unpack(flat[i]), flat[i + 1] or b"") for i in range(0, len(flat), 2)]


def _descriptor(entry: Entry) -> bytes:
    """The descriptor a put hands the CF (msgpack; the script adds the fields the CF keeps)."""
    return msgpack.packb({"p": entry.priority, "per": 1 if entry.persistent else 0, "mid": entry.msgid,
                          "cid": entry.correlid, "exp": entry.expiry, "pt": entry.put_time,
                          "bc": entry.backout_count, "pr": entry.properties}, use_bin_type=False)


def _carried_error(reply: str, structure: str, uow: str) -> MQError:
    """A carried commit not applied in full by get_committed: its refusal, or (MORE) a commit begun and too large
    for one call, to be finished by commit()."""
    if reply == "MORE":
        return StructureFailedError(f"structure {structure}: the commit of unit of work {uow} was begun and needs "
                                    "more calls")
    return from_script_error(reply, structure)


class Structure:
    """One CF list structure (e.g. APP1): its queues, entries and state."""

    def __init__(self, cf: CF, name: str) -> None:
        self.cf = cf
        self.name = name

    def _call(self, op: str, caller: Caller | None, args: Sequence[Any]) -> Any:
        head: list[Any] = [caller.member, caller.epoch, caller.clock.now()] if caller else []
        return self.cf.run(op, self.name, head + list(args))

    def put(self, caller: Caller, entry: Entry, data: bytes, *, uow: str = "", gen: int = 0) -> PutReply:
        op, name, args = self.put_call(caller, entry, data, uow=uow, gen=gen)
        return self.put_reply(caller, self.cf.run(op, name, args))

    def put_call(self, caller: Caller, entry: Entry, data: bytes, *, uow: str = "",
                 gen: int = 0) -> tuple[str, str, list[Any]]:
        """The put as a call for CF.run_many (op, structure, args); its reply read by put_reply."""
        return "put", self.name, [caller.member, caller.epoch, caller.clock.now(), uow, gen, entry.id, entry.queue,
                                  _descriptor(entry), data]

    @staticmethod
    def put_reply(caller: Caller, out: Any) -> PutReply:
        cf, g, created = out
        caller.clock.observe(int(cf))
        return PutReply(int(cf), int(g), bool(created))

    def get(self, caller: Caller, queue: str, *, uow: str, gen: int = 0, match: str = "", value: str = "",
            now_ms: int, max_length: int = 0, step: int = CF_STEP) -> GetReply:
        """Take the next message under ``uow``. ``max_length``: the longest message (data plus stored descriptor)
        the caller can carry, 0 for any; a longer one is refused (TruncatedMessageError) and left untouched. Each
        call moves at most ``step`` expired messages from the head of the queue (get.lua); called again until it
        takes a message or finds none, so the reply is never ``again``."""
        while True:
            op, name, args = self.get_call(caller, queue, uow=uow, gen=gen, match=match, value=value, now_ms=now_ms,
                                           max_length=max_length, step=step)
            reply = self.get_reply(caller, self.cf.run(op, name, args))
            if not reply.again:
                return reply

    def get_call(self, caller: Caller, queue: str, *, uow: str, gen: int = 0, match: str = "", value: str = "",
                 now_ms: int, max_length: int = 0, step: int = CF_STEP) -> tuple[str, str, list[Any]]:
        """The get as a call for CF.run_many (op, structure, args); its reply read by get_reply, which may be
        ``again`` (nothing taken: make the call again)."""
        return "get", self.name, [caller.member, caller.epoch, caller.clock.now(), uow, gen, queue, match, value,
                                  now_ms, max_length, step]

    @staticmethod
    def get_reply(caller: Caller, out: Any) -> GetReply:
        caller.clock.observe(int(out[0]))
        if len(out) == 2:
            return GetReply(int(out[0]), int(out[1]), None, None)
        if len(out) == 3:
            return GetReply(int(out[0]), int(out[1]), None, None, again=True)
        return GetReply(int(out[0]), int(out[1]), Entry.unpack(out[2]), out[3] or b"")

    def put_committed(self, caller: Caller, entry: Entry, data: bytes, *, uow: str, gen: int, put_lrsn: int,
                      lrsn: int, at: int = 0, redo: bool = False, forget: Iterable[str] = ()) -> PutReply:
        """A persistent put and its commit in one call (put_committed.lua), after its PUT record (``put_lrsn``) and
        forced COMMIT (``lrsn``, counting at ``at``) of its own UOW ``uow``, which name generation ``gen`` of the
        structure. ``redo``: peer recovery or a restart completing it from the log (no refusal for capacity or the
        persistent store). ``forget``: UOWs of this caller's earlier calls whose END records are on disk.
        ``created`` is False when the put was applied already (by an earlier call, or a redo)."""
        out = self._call("put_committed", caller, [uow, gen, entry.id, entry.queue, _descriptor(entry), data,
                                                   put_lrsn, lrsn, at, 1 if redo else 0, " ".join(forget)])
        return self.put_reply(caller, out)

    def get_committed(self, caller: Caller, queue: str, *, uow: str, gen: int = 0, match: str = "",
                      value: str = "", now_ms: int, max_length: int = 0, step: int = CF_STEP,
                      commits: Sequence[CarriedCommit] = ()) -> GetCommittedReply:
        """Apply the commits of earlier gets (their COMMIT records forced), then take the next message under
        ``uow`` as get does (get_committed.lua): a lifecycle of gets in one call per message. A get answered
        ``again`` (its step ran out among expired messages) is made again, with no commits left to carry."""
        carried = [x for c in commits for x in (c.uow, c.gen, c.lrsn, c.at)]
        done: list[MQError | None] = []
        while True:
            out = self._call("get_committed", caller, [uow, gen, queue, match, value, now_ms, max_length, step,
                                                       *carried])
            if not done:
                done = [None if keys.text(r) == "OK" else _carried_error(keys.text(r), self.name, c.uow)
                        for r, c in zip(out[0], commits, strict=True)]
            carried = []
            if not isinstance(out[1], list):
                return GetCommittedReply(None, from_script_error(keys.text(out[1]), self.name), done)
            got = self.get_reply(caller, out[1])
            if not got.again:
                return GetCommittedReply(got, None, done)

    def browse(self, queue: str, limit: int, now_ms: int, *, max_bytes: int = 0, each: int = 0,
               gate: Callable[[], AbstractContextManager[object]] = nullcontext, step: int = CF_STEP,
               step_bytes: int = CF_STEP_BYTES, exact_more: bool = True) -> Browsed[tuple[Entry, bytes]]:
        """Up to ``limit`` available messages without taking them, in get order. ``max_bytes`` (0: any) bounds the
        sum of their lengths (data plus stored descriptor, plus ``each`` per message): as many as fit, ``more`` set
        when one was left out; TruncatedMessageError when not even the first fits.

        A run of browse_page calls, each going on from the last one's cursor: one call visits at most ``step``
        entries and carries at most ``step_bytes``, so that a long queue (of expired messages, say) or a large
        ``limit`` never holds the CF in one call. Each call runs inside ``gate()`` (a member's scan slots:
        sqm.core.scans). An entry there for the whole browse is returned once; one that comes or goes meanwhile
        may or may not be. To tell whether another available message was left out, a browse that has its ``limit``
        reads on to the next one, past every expired message between; a caller that does not use ``more`` passes
        ``exact_more`` False and the browse stops at its ``limit``, ``more`` then saying only that it stopped before
        the queue's end."""
        found: list[tuple[Entry, bytes]] = []
        cursor, used = "", 0
        while True:
            with gate():
                page = self.browse_page(queue, limit, now_ms, max_bytes=max_bytes, each=each, cursor=cursor,
                                        held=len(found), used=used, step=step, step_bytes=step_bytes)
            found.extend(page.found)
            used += page.carried
            if page.more or not page.cursor or (len(found) >= limit and not exact_more):
                return Browsed(found, more=page.more or bool(page.cursor))
            cursor = page.cursor

    def browse_page(self, queue: str, limit: int, now_ms: int, *, max_bytes: int = 0, each: int = 0,
                    cursor: str = "", held: int = 0, used: int = 0, step: int = CF_STEP,
                    step_bytes: int = CF_STEP_BYTES) -> BrowsePage:
        """One call of a browse (browse.lua), from ``cursor`` ("": the queue's head): ``held`` messages and ``used``
        bytes of ``max_bytes`` are what the browse's earlier calls returned. It visits at most ``step`` entries,
        expired ones included, and carries at most ``step_bytes`` (its first message whatever its length)."""
        out = self._call("browse", None, [queue, limit, now_ms, max_bytes, each, cursor, held, used, step,
                                          step_bytes])
        flat = out[2:]
        carried = sum(len(flat[i]) + len(flat[i + 1] or b"") + each for i in range(0, len(flat), 2))
        return BrowsePage(_pairs(flat), bool(int(out[0])), keys.text(out[1]), carried)

    def peek(self, queue: str, match: str, value: str, limit: int = 100) -> list[tuple[Entry, bytes]]:
        """Entries of ``queue`` whose message id (match 'm') or correlation id ('c') is ``value`` (hex), committed or
        held by an uncommitted get, without taking them (peek.lua), in get order."""
        return _pairs(self._call("peek", None, [queue, match, value, limit]))

    def peek_many(self, queue: str, match: str, values: Sequence[str]) -> list[tuple[Entry, bytes] | None]:
        """For each value (hex; 1-1000 of them), the first entry ``peek`` would return for it, or None: one call
        (peek_many.lua). In the order of ``values``."""
        out = self._call("peek_many", None, [queue, match, *values])
        return [(Entry.unpack(out[i]), out[i + 1] or b"") if out[i] else None for i in range(0, len(out), 2)]

    def queue_mark(self, queue: str) -> str:
        """A mark of the queue's committed entries that changes when one is made available or taken
        (queue_mark.lua): equal marks, read at two moments, say that nothing was seen to change in between."""
        return keys.text(self._call("queue_mark", None, [queue]))

    def topic_next(self, queue: str, after_lrsn: int, after_pub: str = "") -> TopicNext:
        """The next publication on a topic's publication queue after the position (``after_lrsn``, ``after_pub``):
        every message of it in put order, without taking them (topic_next.lua); state 'W' when it waits for an
        open publication that could still commit below it, 'N' when there is none."""
        out = self._call("topic_next", None, [queue, after_lrsn, after_pub])
        state = keys.text(out[1])
        if state != "P":
            return TopicNext(int(out[0]), state, 0, "", [], _open_from(out))
        return TopicNext(int(out[0]), state, int(out[2]), keys.text(out[3]), _pairs(out[4:]))

    def topic_head(self, queue: str, after_lrsn: int, after_pub: str = "") -> TopicHead:
        """The publication topic_next would return, by its head only: its commit LRSN, id, message count and first
        message's descriptor, none of its data (topic_next.lua's 'H' form). Its cost in the CF and on the wire does
        not grow with the publication's bytes: the sweeper's look at every topic's oldest publication."""
        out = self._call("topic_next", None, [queue, after_lrsn, after_pub, "H"])
        state = keys.text(out[1])
        if state != "P":
            return TopicHead(int(out[0]), state, 0, "", 0, None, _open_from(out))
        return TopicHead(int(out[0]), state, int(out[2]), keys.text(out[3]), int(out[4]), Entry.unpack(out[5]))

    def peek_scan(self, queue: str, match: str, value: str, cursor: str = "0",
                  count: int = 500, *, heads: bool = False) -> tuple[str, list[tuple[Entry, bytes]]]:
        """A batch of the entries ``peek`` would return, in no order, and the cursor of the next batch ("0": the
        pass is over): peek_scan.lua, a bounded cost per call however many entries match. ``heads``: their
        descriptors alone (each data b""), for a caller that reads the data of those it chooses (entry_data)."""
        out = self._call("peek_scan", None, [queue, match, value, cursor, count, *(["H"] if heads else [])])
        return keys.text(out[0]), _pairs(out[1:])

    def entry_data(self, queue: str, ids: Sequence[str]) -> list[tuple[Entry, bytes] | None]:
        """For each entry id (1-1000 of them), its descriptor and data while it is an available (committed) entry of
        ``queue``, else None: one call (entry_data.lua), in the order of ``ids``. The caller bounds the bytes."""
        out = self._call("entry_data", None, [queue, *ids])
        return [(Entry.unpack(out[i]), out[i + 1] or b"") if out[i] else None for i in range(0, len(out), 2)]

    def pclock(self, *, max_gap_ms: int, floor: int = 0) -> PClockReply:
        """The structure's pseudo-clock (ms of up-time), advanced by the CF's time since the last tick when that gap
        is at most ``max_gap_ms``, and raised to ``floor``; with the CF's time (pclock.lua)."""
        value, cf_ms = self._call("pclock", None, [max_gap_ms, floor])
        return PClockReply(int(value), int(cf_ms))

    def fail(self, *, token: int, gen: int) -> str | None:
        """Fail the ACTIVE structure if its restore token and generation are still ``token`` and ``gen`` (fail.lua):
        an operator's restore or purge of a live structure, before its claim. None when it failed it, else why not
        (its state, token and generation now)."""
        out = self._call("fail", None, [token, gen])
        if out == 1:
            return None
        state, now_token, now_gen = (keys.text(v) for v in out)
        return f"now {state}, restore token {now_token}, generation {now_gen}"

    def pstore(self, action: str = "status") -> PstoreStatus:
        """Read or change the availability of the structure's persistent store (pstore.lua; docs/pstore.md):
        action status, disconnect, connect, nonew-on or nonew-off."""
        state, pstore, nonew, started = self._call("pstore", None, [action])
        return PstoreStatus(keys.text(state), keys.text(pstore) == "CONNECTED", keys.text(nonew), keys.text(started))

    def commit(self, caller: Caller, uow: str, *, gen: int, lrsn: int, at: int = 0,
               decided_by_recovery: bool = False, step: int = CF_STEP) -> OutcomeReply:
        """lrsn: the deciding record's LRSN (0: nothing logged), checked against the floor; at: the LRSN the
        commit counts at, when it is not lrsn (sqm.core.records.counts_at). Done in calls of at most `step` units of
        work (commit.lua), called again until the commit is done: see _outcome for a failure between them."""
        return self._outcome("commit", caller, uow, [gen, lrsn, 1 if decided_by_recovery else 0, at], step)

    def backout(self, caller: Caller, uow: str, *, gen: int, lrsn: int, has_data: bool, at: int = 0,
                decided_by_recovery: bool = False, step: int = CF_STEP) -> OutcomeReply:
        """As commit (backout.lua); a UOW whose commit has begun on the structure is committed instead."""
        return self._outcome("backout", caller, uow, [gen, lrsn, 1 if has_data else 0,
                                                      1 if decided_by_recovery else 0, at], step)

    def commit_call(self, caller: Caller, uow: str, *, gen: int, lrsn: int, at: int = 0,
                    step: int = CF_STEP) -> tuple[str, str, list[Any]]:
        """The first call of commit() as a call for CF.run_many (op, structure, args); its reply read by
        step_more."""
        return "commit", self.name, [caller.member, caller.epoch, caller.clock.now(), uow, gen, lrsn, 0, at, 0, step]

    @staticmethod
    def step_more(caller: Caller, out: Any) -> bool:
        """The reply of one call of commit.lua or backout.lua: whether more is to be done (call it again)."""
        caller.clock.observe(int(out[0]))
        return bool(int(out[3]))

    def commit_step(self, caller: Caller, uow: str, *, gen: int, lrsn: int, at: int = 0,
                    decided_by_recovery: bool = False, later: bool = False, step: int = CF_STEP) -> OutcomeStep:
        """One call of commit.lua: at most `step` units of work. later: this caller's previous call of this commit
        answered more. For a caller that steps on its own (the model check); commit() loops over it."""
        return self._step("commit", caller, uow, [gen, lrsn, 1 if decided_by_recovery else 0, at], later, step)

    def backout_step(self, caller: Caller, uow: str, *, gen: int, lrsn: int, has_data: bool, at: int = 0,
                     decided_by_recovery: bool = False, later: bool = False, step: int = CF_STEP) -> OutcomeStep:
        """One call of backout.lua, as commit_step."""
        return self._step("backout", caller, uow, [gen, lrsn, 1 if has_data else 0,
                                                   1 if decided_by_recovery else 0, at], later, step)

    def _step(self, op: str, caller: Caller, uow: str, args: list[Any], later: bool, step: int) -> OutcomeStep:
        cf, p, g, more = self._call(op, caller, [uow, *args, 1 if later else 0, step])
        caller.clock.observe(int(cf))
        return OutcomeStep(int(cf), int(p), int(g), bool(int(more)))

    def _outcome(self, op: str, caller: Caller, uow: str, args: list[Any], step: int) -> OutcomeReply:
        """Call commit.lua or backout.lua until it answers that nothing more is to be done. Once a call went
        through, the outcome has begun here and is finished by whoever calls next (the scripts' headers): a later
        call that fails raises a StructureFailedError that says the outcome may have been applied (maybe_applied),
        so that a caller never takes a commit begun here for one that did not happen."""
        puts = gets = 0
        later = False
        while True:
            try:
                reply = self._step(op, caller, uow, args, later, step)
            except MQError as e:
                if later and isinstance(e, StructureFailedError):
                    e.maybe_applied = True
                raise
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                if not later:
                    raise
                failed = StructureFailedError(f"the CF is unavailable during the {op} of unit of work {uow}, begun "
                                              f"on structure {self.name}: {e}")
                failed.maybe_applied = True
                failed.no_answer = True
                raise failed from e
            puts += reply.puts
            gets += reply.gets
            if not reply.more:
                return OutcomeReply(reply.clock, puts, gets)
            later = True

    def standing(self, caller: Caller, uow: str, *, gen: int) -> str:
        """How the UOW stands here (standing.lua): 'H' held, 'C' / 'B' decided by recovery, 'L' lost with the
        CF, 'N' nothing here. Raises as commit would for a structure that is not ACTIVE or a fenced member."""
        return keys.text(self.cf.run(*self.standing_call(caller, uow, gen=gen)))

    def standing_call(self, caller: Caller, uow: str, *, gen: int) -> tuple[str, str, list[Any]]:
        """standing() as a call for CF.run_many (op, structure, args); its reply read by keys.text."""
        return "standing", self.name, [caller.member, caller.epoch, uow, gen]

    def uow_entries(self, uow: str) -> list[tuple[Entry, bytes]]:
        return _pairs(self._call("uow_entries", None, [uow]))

    def member_uows(self, member: str) -> dict[str, dict[str, Any]]:
        flat = self._call("member_uows", None, [member])
        return {flat[i].decode(): msgpack.unpackb(flat[i + 1], raw=False) for i in range(0, len(flat), 2)}

    def expire(self, now_ms: int, limit: int = 1000, *, step: int = CF_STEP) -> Expired:
        """Moves up to `limit` expired messages to the expired list and purges those already there, in calls of at
        most `step` units of work (expire.lua), called again until that is done."""
        ids: list[str] = []
        purged = 0
        left = limit
        while True:
            out = self._call("expire", None, [now_ms, min(left, step), step])
            bar = out.index(b"|")
            ids += [x.decode() for x in out[:bar]]
            purged += int(out[bar + 1])
            left -= int(out[bar + 2])
            if not int(out[bar + 3]) or left <= 0:
                return Expired(ids, purged)

    def backup_begin(self, backup_id: str, caller_lrsn: int, *, lease_ms: int = BACKUP_LEASE_MS) -> BackupBegun:
        """Mark the backup running with a lease of lease_ms (CF time); a stale mark is replaced (took_over)."""
        start, floor, stale = self._call("backup_begin", None, [backup_id, caller_lrsn, lease_ms])
        return BackupBegun(int(start), int(floor), keys.text(stale))

    def backup_renew(self, backup_id: str, *, lease_ms: int = BACKUP_LEASE_MS) -> int:
        """Move the backup's lease on to now + lease_ms; BackupEndedError when the mark is no longer its own."""
        return int(self._call("backup_renew", None, [backup_id, lease_ms]))

    def backup_end(self, backup_id: str, caller_lrsn: int, ok: bool) -> int:
        return int(self._call("backup_end", None, [backup_id, caller_lrsn, "ok" if ok else "failed"]))

    def backup_withdraw(self, backup_id: str, previous: str) -> bool:
        """Set the header's last_backup back to `previous` ('' none) while it names backup_id, a backup that ended
        ok and could not be kept; False when it names another."""
        return bool(int(self._call("backup_withdraw", None, [backup_id, previous])))

    def backup_cancel(self, backup_id: str = "") -> BackupCancelled:
        """Clear the backup mark, running or stale (only backup_id's when given): an operator's cfbackup cancel."""
        cancelled, left = self._call("backup_cancel", None, [backup_id])
        left_text = keys.text(left)
        return BackupCancelled(keys.text(cancelled), int(left_text) if left_text else None)

    def backup_mark(self) -> BackupMark | None:
        """The backup mark and its lease at the CF's time (None when no backup has one)."""
        node = rcluster.node_client(self.cf.redis, self.name, fresh=False)  # TIME of the server holding it
        pipe = node.pipeline(transaction=False)
        pipe.hmget(keys.meta(self.name), "backup", "backup_until")
        pipe.time()
        (backup, until), now = pipe.execute()
        return BackupMark.read(backup, until, now)

    # --- relogging (docs/log-management.md) -----------------------------------------------------------------
    def relog_begin(self, caller: Caller, *, now_ms: int, lease_ms: int) -> RelogBegun:
        b, gen, cpl, first, carried = self._call("relog_begin", caller, [now_ms, lease_ms])
        caller.clock.observe(int(b))
        return RelogBegun(int(b), int(gen), json.loads(cpl) if cpl else None, int(first),
                          [keys.text(u) for u in carried])

    def relog_scan(self, caller: Caller, *, threshold: int, cursor: str = "0", count: int = 500) -> RelogBatch:
        """One batch of the entries whose newest copy is at or below `threshold` (-1: every entry): `count` entries
        looked at, at most CF_STEP (one call's bound, cfemu.limits)."""
        out = self._call("relog_scan", caller, [threshold, cursor, min(count, CF_STEP)])
        caller.clock.observe(int(out[0]))
        copies = [(Entry.unpack(out[i]), out[i + 1] or b"",
                   msgpack.unpackb(out[i], raw=False, unicode_errors="surrogateescape"))
                  for i in range(3, len(out), 2)]
        return RelogBatch(int(out[0]), keys.text(out[1]), int(out[2]), copies)

    def relog_end(self, caller: Caller, *, relog_lrsn: int, ids: Sequence[str],
                  cpl: dict[str, Any] | None = None) -> int:
        """Mark `ids` as copied at relog_lrsn; with cpl, store it and release the lock. Returns entries marked."""
        packed = json.dumps(cpl, separators=(",", ":")) if cpl is not None else ""
        cf, marked = self._call("relog_end", caller, [relog_lrsn, packed, *ids])
        caller.clock.observe(int(cf))
        return int(marked)

    def snapshot(self, state: str) -> list[str]:
        return [x.decode() for x in self.snapshot_raw(state)]

    def snapshot_raw(self, state: str) -> list[bytes]:
        """snapshot's ids as the CF's bytes: what a backup's fetch sends back to it (no decoding an id to encode it
        again). Taken as one transaction of LRANGEs (cfemu.bulk.snapshot), or by the script where that cannot take it."""
        ids = bulk.snapshot(self.cf.redis, self.name, state)
        return list(self._call("snapshot", None, [state])) if ids is None else ids

    def fetch(self, ids: Iterable[str],
              batch: int = bulk.FETCH_BATCH) -> Iterable[tuple[str, Entry | None, bytes | None]]:
        """Current descriptor and data of each id (None when the entry is gone), read in pipelined batches."""
        return bulk.fetch(self.cf.redis, self.name, ids, batch)

    # --- structure metadata -------------------------------------------------------------------------------
    def info(self) -> dict[str, str]:
        raw = self.cf.redis.hgetall(keys.meta(self.name))
        return {keys.text(k): keys.text(v) for k, v in raw.items()}

    def exists(self) -> bool:
        return bool(self.cf.redis.exists(keys.meta(self.name)))

    def queues(self) -> list[str]:
        return sorted(keys.text(q) for q in self.cf.redis.smembers(keys.queues(self.name)))

    def index_count(self, queue: str, kind: str, value: str) -> int:
        """How many entries of ``queue`` (in any state) carry message id (kind 'm') or correlation id ('c') ``value``:
        a read of the index set, for a limit that counts (a service's MAX-UOWS)."""
        return int(self.cf.redis.scard(keys.index_set(self.name, queue, kind, value)))

    def oldest_put_time(self, queue: str) -> int | None:
        """The put time (ms since the epoch) of the oldest message on ``queue``, committed or held by an uncommitted
        get; None when it holds none. Each priority's list of committed messages is in put order, so its head is
        its oldest: one pipelined read of the heads, then their descriptors (DISPLAY QSTATUS's MSGAGE)."""
        r = self.cf.redis
        pipe = r.pipeline(transaction=False)
        for p in keys.PRIORITIES:
            pipe.lindex(keys.state_list(self.name, queue, "CP", p), 0)
        pipe.lindex(keys.state_list(self.name, queue, "UG"), 0)
        heads = [h for h in pipe.execute() if h is not None]
        if not heads:
            return None
        descs = r.hmget(keys.entries(self.name), heads)
        times = [Entry.unpack(d).put_time for d in descs if isinstance(d, bytes)]
        return min(times) if times else None

    def depths(self) -> dict[str, dict[str, int]]:
        """Per queue: number of entries in each state (CP summed over priorities), every queue's lists read in one
        pipeline."""
        queues = self.queues()
        pipe = self.cf.redis.pipeline(transaction=False)
        for q in queues:
            for st in ("UP", "UG", "EX"):
                pipe.llen(keys.state_list(self.name, q, st))
            for p in keys.PRIORITIES:
                pipe.llen(keys.state_list(self.name, q, "CP", p))
        n = pipe.execute() if queues else []
        width = 3 + len(keys.PRIORITIES)
        out: dict[str, dict[str, int]] = {}
        for i, q in enumerate(queues):
            one = n[i * width:(i + 1) * width]
            out[q] = {"UP": one[0], "UG": one[1], "EX": one[2], "CP": sum(one[3:])}
        return out
