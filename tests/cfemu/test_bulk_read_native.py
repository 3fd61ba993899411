"""cfemu._bulk.read_bulks reads an array reply of bulk strings from a socket with the GIL let go, into one blob
and its spans (cfemu.bulk.Bulks), where hiredis makes a bytes object of each string: the backup's fetch reads its
data so. hiredis is the reference: the same strings from the same bytes, however the bytes arrive; a reply cut
short, or one that is not such an array, raises a clear error and never crashes the process."""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import hiredis
import pytest
import redis

from cfemu import bulk, keys
from cfemu.bulk import Bulks
from cfemu.connection import connect
from cfemu.sockets import set_kernel_timeout
from tests.support.bulks import bulks_of

read_bulks = bulk._bulk.read_bulks


def _reply(items: list[bytes | None], rng: random.Random) -> bytes:
    """An HMGET reply holding `items`, its nulls as RESP2's $-1 or RESP3's _."""
    out = [b"*%d\r\n" % len(items)]
    for item in items:
        if item is None:
            out.append(rng.choice([b"$-1\r\n", b"_\r\n"]))
        else:
            out.append(b"$%d\r\n%s\r\n" % (len(item), item))
    return b"".join(out)


@pytest.fixture(params=["blocking, kernel timeout", "Python timeout (non-blocking)"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[socket.socket, socket.socket]]:
    """(reader, writer): the reader as cfemu.connection makes a CF socket (blocking, the kernel's timeout), or as
    a redis-py socket with a Python timeout (the file descriptor non-blocking)."""
    a, b = socket.socketpair()
    if request.param.startswith("blocking"):
        set_kernel_timeout(a, 5.0)
    else:
        a.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


def _timeout_ms(sock: socket.socket) -> int:
    t = sock.gettimeout()
    return -1 if t is None else int(t * 1000)


def _send_in_pieces(sock: socket.socket, data: bytes, rng: random.Random, close: bool = False) -> threading.Thread:
    """Send `data` in pieces of random sizes (1 byte to 64 KiB), from a thread; then close when asked."""
    def run() -> None:
        i = 0
        while i < len(data):
            n = rng.choice([1, 2, 7, 100, 4096, 65536])
            sock.sendall(data[i:i + n])
            i += n
        if close:
            sock.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_reads_what_hiredis_reads_however_the_bytes_arrive(pair: tuple[socket.socket, socket.socket]) -> None:
    """Random replies (nulls of both protocols, empty strings, strings holding CRLF and RESP's own bytes, strings
    up to 300 KB, empty arrays), each sent in random pieces, with size hints too small, exact and too large: the
    same strings as hiredis parses from the same bytes, and the socket left at the next reply."""
    reader, writer = pair
    rng = random.Random(5)
    for round_ in range(60):
        items: list[bytes | None] = []
        for _ in range(rng.choice([0, 1, 3, 50, 500])):
            kind = rng.randrange(6)
            items.append(None if kind == 0 else b"" if kind == 1 else b"\r\n$3\r\n*1\r\n_\r\n" if kind == 2
                         else rng.randbytes(rng.choice([1, 9, 1024, 300_000]) if kind == 3 else rng.randrange(200)))
        data = _reply(items, rng)
        expected = hiredis.Reader()
        expected.feed(data)
        hint = rng.choice([0, len(data) // 3, len(data), 10 * len(data)])
        sender = _send_in_pieces(writer, data, rng)
        got = read_bulks(reader.fileno(), len(items), hint, _timeout_ms(reader))
        sender.join()
        assert type(got) is tuple, round_
        assert list(Bulks(*got)) == expected.gets() == items, round_


def test_an_error_reply_is_its_text(pair: tuple[socket.socket, socket.socket]) -> None:
    reader, writer = pair
    writer.sendall(b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n")
    assert read_bulks(reader.fileno(), 3, 0, _timeout_ms(reader)) == (
        "WRONGTYPE Operation against a key holding the wrong kind of value")


@pytest.mark.parametrize("reply", [
    b"+OK\r\n", b":1\r\n", b"*3\r\n$1\r\na\r\n$1\r\nb\r\n", b"*2\r\n:5\r\n$1\r\na\r\n", b"*2\r\n$x\r\n",
    b"*2\r\n$3\r\nabcXY", b"*2\r\n$-2\r\n", b"*2\r\n$99999999999999999999\r\n", b"*2\r\n$1\r\na\r\n$1\r\nb\r\n+OK\r\n",
    b"*2\r\n$" + b"1" * 40 + b"\r\n", b"*2\r\n$1\ra\r\n", b"*-1\r\n", b"*2\r\n$536870913\r\n",
], ids=["not an array", "an integer", "fewer items", "an integer item", "a length not a number",
        "no CRLF after the bytes", "a negative length", "a length past 64 bits", "more than the reply",
        "a header line without its end", "CR without LF", "a null array", "longer than a bulk may be"])
def test_a_reply_that_is_not_an_array_of_strings_is_refused(pair: tuple[socket.socket, socket.socket],
                                                             reply: bytes) -> None:
    """What HMGET of two fields never answers: a ValueError that says what is wrong (the caller drops the
    connection, out of step with the CF)."""
    reader, writer = pair
    writer.sendall(reply)
    with pytest.raises(ValueError, match="the CF('s reply is not an array of bulk strings| sent more than the reply)"):
        read_bulks(reader.fileno(), 2, 0, _timeout_ms(reader))


def test_a_reply_cut_short_by_a_closed_connection_raises_eof_at_every_cut(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """The CF gone within a reply, cut at each byte of it (in a count, in a length, in a string, before its CRLF):
    EOFError, never a reply."""
    reader, _ = pair
    data = _reply([b"abc", None, b"x" * 300], random.Random(1))
    for cut in range(len(data)):
        a, b = socket.socketpair()
        a.settimeout(5.0)
        try:
            b.sendall(data[:cut])
            b.shutdown(socket.SHUT_WR)
            with pytest.raises(EOFError, match="closed the connection within a reply"):
                read_bulks(a.fileno(), 3, 0, _timeout_ms(a))
        finally:
            a.close()
            b.close()


@pytest.mark.parametrize("hint", [sys.maxsize, sys.maxsize - 100, sys.maxsize // 2])
def test_a_size_hint_beyond_any_reply_is_only_a_first_size(pair: tuple[socket.socket, socket.socket],
                                                            hint: int) -> None:
    """The size hint sizes the blob at first and nothing else: one however large (a descriptor's recorded length
    gone wrong) neither overflows the blob's size (a SystemError, undefined behaviour in C) nor asks for memory no
    reply of that many strings could fill (a MemoryError): the reply is read as with an exact hint."""
    reader, writer = pair
    writer.sendall(b"*0\r\n")
    assert read_bulks(reader.fileno(), 0, hint, _timeout_ms(reader)) == (b"*0\r\n", b"")
    writer.sendall(b"*0\r\n")  # and the socket was left at the next reply
    assert read_bulks(reader.fileno(), 0, 0, _timeout_ms(reader)) == (b"*0\r\n", b"")


def test_a_cf_that_does_not_answer_times_out(pair: tuple[socket.socket, socket.socket]) -> None:
    """Nothing comes within the socket's timeout: an OSError of the timeout (EAGAIN from the kernel's timeout of
    a blocking socket, TimeoutError from the wait on a non-blocking one)."""
    reader, writer = pair
    if reader.gettimeout() is None:
        set_kernel_timeout(reader, 0.2)
    else:
        reader.settimeout(0.2)
    writer.sendall(b"*2\r\n$1\r\na")
    with pytest.raises((BlockingIOError, TimeoutError)):
        read_bulks(reader.fileno(), 2, 0, _timeout_ms(reader))


@contextlib.contextmanager
def _signals_every(interval: float, most: int) -> Iterator[list[int]]:
    """SIGALRM every `interval` seconds, its Python handler doing nothing (as a child's SIGCHLD or a timer's would)
    until it has run `most` times; then it raises, so that a read that never ends fails instead of hanging."""
    runs = [0]

    def handler(signum: int, frame: Any) -> None:
        runs[0] += 1
        if runs[0] > most:
            raise RuntimeError(f"still reading after {most} signals")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        yield runs
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_signals_within_the_wait_neither_cut_the_reply_nor_lengthen_the_timeout() -> None:
    """Signals whose handlers return (EINTR in recv or poll) leave the read going on where it was: a reply sent in
    slow pieces is read whole. And the timeout of a Python-timeout socket is kept across them, as Python's own
    recv keeps it (PEP 475): a CF that does not answer times out though a signal comes more often than the
    timeout (each one had started the wait over: the read never ended)."""
    reader, writer = socket.socketpair()
    try:
        reader.settimeout(0.5)
        items: list[bytes | None] = [b"x" * 50, None, b"", b"y\r\n" * 10]
        data = _reply(items, random.Random(1))

        def slowly() -> None:
            for i in range(0, len(data), 20):
                time.sleep(0.03)
                writer.sendall(data[i:i + 20])

        sender = threading.Thread(target=slowly)
        with _signals_every(0.01, 2000):
            sender.start()
            try:
                assert list(Bulks(*read_bulks(reader.fileno(), len(items), 0, _timeout_ms(reader)))) == items
            finally:
                sender.join()
        with _signals_every(0.1, 100) as runs, pytest.raises(TimeoutError):
            read_bulks(reader.fileno(), 1, 0, _timeout_ms(reader))
        assert runs[0] >= 1  # the signals came within the wait
    finally:
        reader.close()
        writer.close()


def test_bulks_reads_as_the_list_it_stands_for() -> None:
    items = [b"a", None, b"", b"xyz"]
    b = bulks_of(items)
    assert len(b) == 4 and list(b) == items and b == items and b[-1] == b"xyz" and b[1] is None
    assert b[1:3] == [None, b""] and b[::-1] == items[::-1]
    with pytest.raises(IndexError):
        b[4]


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = connect(redis_url)
    yield c
    c.close()


def test_a_fetch_reads_its_data_from_the_socket_past_hiredis(client: redis.Redis) -> None:
    """On the CF: hmget with a size hint reads the reply as Bulks (the fast path taken, the same strings as the
    hiredis path), a backup's fetch hands its data over so, and an error reply is raised as redis-py raises it
    with the connection still usable."""
    fields = [f"f{i}" for i in range(300)]
    client.hset("h", mapping={f: (b"v%d" % i) * i for i, f in enumerate(fields) if i % 7})
    got = bulk.hmget(client, "h", fields, size_hint=1000)
    assert type(got) is Bulks and list(got) == bulk.hmget(client, "h", fields)
    client.hset(keys.data("APP1"), mapping={"a": b"1", "b": b"22"})
    client.hset(keys.entries("APP1"), mapping={"a": b"\x81\xa3len\x01", "b": b"\x81\xa3len\x02"})
    parts = list(bulk.fetch_raw(client, "APP1", [b"a", b"c", b"b"]))
    assert [(d, type(x), list(x)) for d, x in parts] == [
        ([b"\x81\xa3len\x01", None, b"\x81\xa3len\x02"], Bulks, [b"1", None, b"22"])]
    client.set("s", "x")
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        bulk.hmget(client, "s", fields, size_hint=0)
    assert client.ping()


def test_a_python_timeout_longer_than_a_wait_in_milliseconds_holds_is_read_past_hiredis(redis_url: str) -> None:
    """A redis-py client whose socket timeout is longer than poll's milliseconds hold (about 25 days: "effectively
    none") reads its data as Bulks like any other, the wait bounded at the longest poll takes (an OverflowError
    of the milliseconds had failed the read, after its command went out)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=1e7)
    try:
        client.hset("h", mapping={"a": b"1", "b": b"22"})
        got = bulk.hmget(client, "h", ["b", "x", "a"], size_hint=0)
        assert type(got) is Bulks and list(got) == [b"22", None, b"1"]
    finally:
        client.close()


def test_a_reply_out_of_step_drops_the_connection_and_the_read_is_made_again(
        client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply the C reader refuses (here: made to refuse it) drops that connection, and hmget reads again through
    redis-py, which connects again: the caller gets the values."""
    client.hset("h", mapping={"a": b"1"})
    said: list[Any] = []

    def refusing(fd: int, count: int, hint: int, timeout_ms: int) -> Any:
        said.append(fd)
        raise ValueError("the CF's reply is not an array of bulk strings: made up")

    monkeypatch.setattr(bulk._bulk, "read_bulks", refusing)
    assert bulk.hmget(client, "h", ["a", "b"], size_hint=0) == [b"1", None]
    assert len(said) == 1


def test_a_read_interrupted_within_the_reply_drops_the_connection(client: redis.Redis,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal's handler that raises within the read (here: the reader made to raise KeyboardInterrupt, the reply
    left unread on the socket) drops that connection: it never goes back to the pool with a reply on it, and the
    next read gets its own answer."""
    client.hset("h", mapping={"a": b"1", "b": b"2"})
    used: list[Any] = []
    real = bulk._bulk.read_bulks

    def interrupted(fd: int, count: int, hint: int, timeout_ms: int) -> Any:
        used.append(fd)
        raise KeyboardInterrupt

    monkeypatch.setattr(bulk._bulk, "read_bulks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bulk.hmget(client, "h", ["a"], size_hint=0)
    monkeypatch.setattr(bulk._bulk, "read_bulks", real)
    pool = client.connection_pool
    assert all(c._sock is None or c._sock.fileno() != used[0] for c in pool._available_connections)  # type: ignore[attr-defined]
    assert list(bulk.hmget(client, "h", ["b", "a"], size_hint=0)) == [b"2", b"1"]
