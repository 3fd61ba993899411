"""sqm.core.random_bytes: the kernel's randomness for a put's ids, fetched in chunks: each byte handed out once,
across threads and across a fork, and a put's ids are made from it."""

from __future__ import annotations

import os
import threading

import pytest

from sqm.core import random_bytes as rb
from sqm.core.random_bytes import CHUNK, random_bytes


def test_bytes_are_handed_out_once_across_threads_and_chunks() -> None:
    got: list[bytes] = []
    lock = threading.Lock()

    def take() -> None:
        mine = [random_bytes(12) for _ in range(2000)]  # many chunks' worth
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 16000 and all(len(b) == 12 for b in got)
    assert len(set(got)) == len(got)


def test_a_request_outside_one_chunk_is_refused() -> None:
    for bad in (0, -1, CHUNK + 1):
        with pytest.raises(ValueError, match=f"1-{CHUNK} bytes"):
            random_bytes(bad)


def test_a_forked_child_does_not_repeat_its_parents_bytes() -> None:
    random_bytes(8)  # the parent holds a chunk, mostly unused
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what it takes next, to the parent
        try:
            os.write(w, random_bytes(32))
        finally:
            os._exit(0)
    os.close(w)
    child = b""
    while len(child) < 32:
        chunk = os.read(r, 32 - len(child))
        assert chunk, "the child wrote nothing"
        child += chunk
    os.close(r)
    os.waitpid(pid, 0)
    assert child != random_bytes(32)  # the parent's next bytes, which the child would have taken from its copy


def test_a_puts_ids_come_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from sqm.core import connection
    assert connection.random_bytes is rb.random_bytes
    calls: list[int] = []
    monkeypatch.setattr(connection, "random_bytes", lambda n: calls.append(n) or b"\x01" * n)
    monkeypatch.setattr(os, "urandom", lambda n: (_ for _ in ()).throw(AssertionError("os.urandom per put")))
    from sqm.core.connection import Connection, PutSpec
    conn = Connection.__new__(Connection)

    class _QM:
        def queue_def(self, name: str) -> object:
            return type("Q", (), {"max_msg_length": 4096, "structure": "APP1"})()

    conn.qm = _QM()  # type: ignore[assignment]
    _, entry = conn._new_entry(PutSpec("Q1", b"body", True, 0, None, b"", 0, None))
    assert calls == [12, 24] and entry.id == "01" * 12 and entry.msgid == "01" * 24
