"""Commands encoded in RESP ahead of time, and sent as one write: the bulk load's batches (cfemu.bulk.Loader).

A restore writes a million entries in batches of a thousand. Through redis-py's pipeline each batch's ~2,000
commands are packed and each reply parsed by Python code on the sending thread, which also shares the GIL with
the thread preparing the next batch: that was the larger part of the load's time (BENCHMARKS.md, "restore in
bounded memory", "Speed, fourth pass"). Here a batch is encoded where it is prepared, and sent and answered with
the hiredis reader directly (as cfemu.cf._lean_exchange does for one script call; the connection's socket and
reader come from cfemu.redis_internals).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import redis
from hiredis import pack_command

from cfemu.redis_internals import NOT_ENOUGH, hiredis_io

_bulk: Any
try:
    from cfemu import _bulk  # type: ignore[attr-defined,no-redef]
except ImportError:  # built where no C compiler was: packed in Python
    _bulk = None

Arg = bytes | str | int
LONG = 16 << 10  # a part this long is sent (and pickled) by itself: what is joined is 16 MiB a batch at most


def _encode(a: Arg) -> bytes:
    if isinstance(a, bytes):
        return a
    if isinstance(a, str):
        return a.encode()
    if isinstance(a, int) and not isinstance(a, bool):
        return b"%d" % a
    raise TypeError(f"a command argument is bytes, str or int, not {type(a).__name__}")


def _header(head: Iterable[Arg], n: int) -> bytes:
    """A command's count line and its `head` arguments (its name and key), for `n` arguments more after them."""
    encoded = [_encode(a) for a in head]
    return b"*%d\r\n" % (len(encoded) + n) + b"".join(b"$%d\r\n%s\r\n" % (len(b), b) for b in encoded)


class Packed:
    """Commands in RESP, added one by one, kept as parts (a body is never copied until data() joins them)."""

    __slots__ = ("parts", "count")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.count = 0

    def add(self, *args: Arg) -> None:
        """One command, as redis-py would send it (str as UTF-8, int in decimal)."""
        self.add_items(args[:2], args[2:], len(args) - 2)

    def add_items(self, head: Iterable[Arg], items: Iterable[Arg], n: int) -> None:
        """One command: `head` (its name and key) then `n` arguments from `items` (HSET's fields and values,
        SADD's or RPUSH's members)."""
        parts = self.parts
        parts.append(_header(head, n))
        seen = 0
        for a in items:
            b = _encode(a)
            parts.append(b"$%d\r\n" % len(b))
            parts.append(b)
            parts.append(b"\r\n")
            seen += 1
        if seen != n:
            raise ValueError(f"a command said {n} arguments and had {seen}")
        self.count += 1

    def add_pairs(self, head: Sequence[Arg], fields: Sequence[Arg], values: Sequence[bytes]) -> None:
        """One command: `head` (HSET and its key) then each field followed by its value. Two parts a pair, the
        value by itself: never copied, and pickled once with the batch's copies of the same bytes (bulk.Staged),
        where add_items makes three parts an argument: a load batch is made and pickled in about a quarter of the
        time with add_pairs and add_commands (BENCHMARKS.md, "restore in bounded memory", "Sixth pass")."""
        if len(fields) != len(values):
            raise ValueError(f"a command had {len(fields)} fields and {len(values)} values")
        parts = self.parts
        parts.append(_header(head, 2 * len(fields)))
        # the same parts made in C (cfemu/_bulk.c pair_parts) where every field is str or bytes and every value bytes
        native = _bulk.pair_parts(fields, values) if _bulk is not None and type(fields) is type(values) is list else None
        if native is not None:
            parts += native
            self.count += 1
            return
        end = b""  # the end of the previous value, sent with the next field
        for f, v in zip(fields, values, strict=True):
            fb = f.encode() if type(f) is str else _encode(f)
            if type(v) is not bytes:
                v = bytes(v)  # a bytearray or memoryview: sent as its bytes, as redis-py would
            parts.append(b"%s$%d\r\n%s\r\n$%d\r\n" % (end, len(fb), fb, len(v)))
            parts.append(v)
            end = b"\r\n"
        parts.append(end)
        self.count += 1

    def add_commands(self, commands: Sequence[Sequence[str | bytes]]) -> None:
        """Commands of short str or bytes arguments (SADD's or RPUSH's key and members), encoded by hiredis (in C,
        the same bytes as redis-py's; it refuses a bool or None) and kept as one part: a load batch's thousand SADDs
        of one member each are one part, not four thousand."""
        # hiredis's stub types the argument as a tuple of one item
        self.parts.append(b"".join([pack_command(tuple(c)) for c in commands]))  # type: ignore[arg-type]
        self.count += len(commands)

    def add_groups(self, command: bytes, groups: Mapping[Any, list[Any]]) -> None:
        """One command (command, key, *members) for each key -> members of `groups`, in its order, kept as one
        part (add_commands): packed in C (cfemu/_bulk.c pack_groups) where every key and member is str or bytes."""
        packed = _bulk.pack_groups(command, groups) if _bulk is not None and type(groups) is dict else None
        if packed is None:
            self.add_commands([(command, k, *members) for k, members in groups.items()])
        else:
            self.parts.append(packed)
            self.count += len(groups)

    def data(self) -> bytes:
        return b"".join(self.parts)

    def chunks(self) -> list[bytes]:
        """The commands as a few strings, to send one after the other: each run of short parts joined, and a long
        part (a message's data) as it is, never copied (a batch of 1,000 messages of 1 MiB is 1 GiB: one copy
        more of it is a GiB more)."""
        parts = self.parts
        out: list[bytes] = []
        start = 0
        # The long parts found by one comprehension, the runs between them joined by slices: a batch has four parts
        # an entry, and a loop that handled each part cost the load about a microsecond an entry.
        for i in [i for i, p in enumerate(parts) if len(p) >= LONG]:
            if i > start:
                out.append(b"".join(parts[start:i]))
            out.append(parts[i])
            start = i + 1
        if start < len(parts):
            out.append(b"".join(parts[start:]))
        return out

    def __getstate__(self) -> tuple[list[bytes], int]:
        # Sent to another process as its parts: a message's data is a part, and the batch's copies of its entries
        # (bulk.Staged.copies) hold the same bytes objects, which pickle then writes once (joined, each message's
        # data crossed the pipe twice: BENCHMARKS.md, "restore in bounded memory", "Figures behind the restore's
        # constants").
        return self.parts, self.count

    def __setstate__(self, state: tuple[list[bytes], int]) -> None:
        self.parts, self.count = state


def io_failure(conn: Any, e: BaseException, *, writing: bool) -> BaseException:
    """The connection dropped, and the error redis-py would raise for ``e``, word for word where it matters:
    sqm.core.manager.reply_lost reads a failure while reading (the request went out: the script may have run) apart
    from one while writing. A timeout is Python's or the kernel's (EAGAIN: cfemu.sockets)."""
    conn.disconnect()
    if isinstance(e, TimeoutError | BlockingIOError):
        return redis.exceptions.TimeoutError(f"Timeout {'writing to' if writing else 'reading from'} socket")
    if isinstance(e, OSError):
        return redis.exceptions.ConnectionError(f"Error {e.errno} while writing to socket. {e.strerror}."
                                                if writing else f"Error while reading from socket: {e.args}")
    return e  # redis-py's own ConnectionError (closed by the server), or not an I/O failure at all


def read_reply(sock: Any, reader: Any, buf: Any) -> Any:
    """The next whole reply from hiredis's `reader`, fed from `sock` through `buf` as needed."""
    reply = reader.gets()
    while reply is NOT_ENOUGH:
        n = sock.recv_into(buf)
        if n == 0:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        reader.feed(buf, 0, n)
        reply = reader.gets()
    return reply


def _raise_mapped(conn: Any, e: BaseException, *, writing: bool) -> NoReturn:
    failure = io_failure(conn, e, writing=writing)
    if failure is e:
        raise e
    raise failure from None


def send(conn: Any, sock: Any, chunks: Iterable[bytes]) -> None:
    """Write `chunks` to the connection's socket; a failure disconnects it and is raised as redis-py would."""
    try:
        for chunk in chunks:
            sock.sendall(chunk)
    except BaseException as e:
        _raise_mapped(conn, e, writing=True)


def receive(conn: Any, sock: Any, reader: Any, buf: Any, replies: int) -> list[Any]:
    """The next `replies` replies (read_reply); a failure disconnects the connection and is raised as redis-py
    would."""
    try:
        return [read_reply(sock, reader, buf) for _ in range(replies)]
    except BaseException as e:
        _raise_mapped(conn, e, writing=False)


def exchange(conn: Any, data: bytes | Sequence[bytes], replies: int) -> list[Any]:
    """Send `data` (RESP commands: one string, or several sent one after the other, never joined) on a connected
    redis-py connection and read `replies` replies, unparsed by
    redis-py's callbacks (error replies come back as ResponseError objects, in place; one that redis-py reads as
    a ConnectionError is raised, the connection dropped). A connection without the hiredis parser is read by
    redis-py's read_response. A socket error or timeout disconnects the connection and
    raises redis-py's ConnectionError or TimeoutError (whether the commands ran is then unknown)."""
    io = hiredis_io(conn)
    chunks = [data] if isinstance(data, bytes) else data
    if io is None:
        conn.send_packed_command(list(chunks))
        out = []
        for _ in range(replies):
            try:
                out.append(conn.read_response())
            except redis.exceptions.ResponseError as e:
                out.append(e)
        return out
    sock, reader, buf = io
    send(conn, sock, chunks)
    out = receive(conn, sock, reader, buf, replies)
    for r in out:
        # An error reply whose code redis-py's parser makes a ConnectionError (LOADING: a CF reloading its data,
        # which still takes MULTI and then refuses each command; NOAUTH, WRONGPASS): its read_response raises it
        # and drops the connection, as here (the pipeline of the old load did so at the first such reply). In
        # place, it was no error to the caller: a transaction's EXECABORT stood for it, or its object as a reply.
        if isinstance(r, redis.exceptions.ConnectionError) or (
                type(r) is list and r and isinstance(r[0], redis.exceptions.ConnectionError)):
            conn.disconnect()
            raise r if isinstance(r, redis.exceptions.ConnectionError) else r[0]
    return out
