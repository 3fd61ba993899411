"""A request decodes within bounds taken from what the protocol carries (docs/protocol.md, "Limits";
docs/security.md, "Limits and timeouts"): a frame whose few bytes would become many objects (an array of empty
maps, arrays nested a thousand wide) is refused with ProtocolError at once, the member's memory growing by a small
multiple of the frame at most, and the connection goes on; the largest legitimate requests still pass. Probed as an
attacker holding the application token would, with raw sockets against a real `sqm run`, measuring the member's
resident memory (/proc/PID/status) while it answers."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu.limits import MAX_PROPERTIES_LENGTH
from sqm.service.client import Client, handshake
from sqm.service.protocol import (
    HEADER,
    ITEM_BYTES,
    MAX_BATCH,
    REQUEST_ITEMS,
    FrameTooLargeError,
    ProtocolError,
    decode_request,
    request_items,
)
from tests.support.group import define_group
from tests.support.service_proc import TOKEN, Raw, ServerProc, start_server

FRAME = 10 * 2**20  # within the frame limit and the member's budget: only the decode's bounds stand in the way


@pytest.fixture
def server(redis_url: str, tmp_path: Path) -> Iterator[ServerProc]:
    """A member with the default limits (what `sqm run` does without flags)."""
    define_group(redis_url)
    srv = start_server(redis_url, tmp_path, "QMD")
    yield srv
    assert srv.stop() == 0, srv.log_text()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def refused_quickly(srv: ServerProc, raw: Raw, body: bytes) -> tuple[dict[str, object], float, int]:
    """Send one frame; its reply, the seconds from the frame's last byte to the reply, and the most the member's
    resident memory grew above what it was before the frame (sampled every 5 ms while it was read and answered)."""
    base = rss_bytes(srv.proc.pid)
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes(srv.proc.pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        raw.send_bytes(HEADER.pack(len(body)) + body)
        sent = time.monotonic()
        reply = raw.reply()
        took = time.monotonic() - sent
        time.sleep(0.2)  # what it freed after the reply counts as well
    finally:
        done.set()
        sampler.join(5)
    return reply, took, peak[0] - base


def put_of(body_value: bytes, rid: int = 7) -> bytes:
    """A put request, id and op first (as the client library sends them), whose body is the given msgpack."""
    return b"\x83\xa2id" + bytes([rid]) + b"\xa2op\xa3put\xa4args\x82\xa5queue\xa2Q1\xa4body" + body_value


def test_an_array_of_empty_maps_is_refused_at_once_and_the_member_serves_on(server: ServerProc) -> None:
    raw = Raw(server.port)
    assert raw.login()["ok"]
    n = FRAME
    reply, took, grew = refused_quickly(server, raw, put_of(b"\xdd" + struct.pack(">I", n) + b"\x80" * n))
    assert took < 0.5, took  # was 0.8 s for 10 MB (3.7 s for 30 MB)
    assert grew < 3 * FRAME, grew  # the frame read, and nothing made from it (was about 70 times the frame)
    assert reply["ok"] is False and reply["id"] == 7, reply
    error = reply["error"]
    assert isinstance(error, dict) and error["type"] == "ProtocolError", reply
    assert "max_array_len" in str(error["message"]), reply
    assert raw.request("ping")["ok"]  # the stream is in step: the same connection goes on
    raw.close()
    with Client(server.endpoint, token=TOKEN) as c:  # and a well-behaved client is served
        c.put("Q1", b"after", syncpoint=False)
        got = c.get("Q1", syncpoint=False)
        assert got is not None and got.body == b"after"


def test_arrays_nested_past_the_allowance_are_refused_within_a_small_multiple_of_the_frame(
        server: ServerProc) -> None:
    raw = Raw(server.port)
    assert raw.login()["ok"]
    inner = b"\xdc" + struct.pack(">H", 1000) + b"\x80" * 1000  # 1000 empty maps: each array is within bounds
    middle = b"\xdc" + struct.pack(">H", 1000) + inner * 1000
    outer = b"\xdc" + struct.pack(">H", FRAME // len(middle)) + middle * (FRAME // len(middle))
    reply, took, grew = refused_quickly(server, raw, put_of(outer, rid=8))
    assert took < 0.5, took
    assert grew < 6 * FRAME, grew  # the frame, and the objects of its allowance (was about 70 times the frame)
    assert reply["ok"] is False and reply["id"] == 8, reply
    assert reply["error"]["type"] == "ProtocolError", reply  # type: ignore[index]
    assert raw.request("ping")["ok"]
    raw.close()


def test_the_largest_legitimate_requests_still_pass(server: ServerProc) -> None:
    """A batch of MAX_BATCH messages with every field of a put and properties; a put with as many properties as
    fit its limit; an indoubt naming MAX_BATCH xids."""
    props = {f"property{j:02d}": f"value {j}" for j in range(20)}
    messages = [{"queue": "Q1", "body": b"m%d" % i, "persistent": True, "priority": i % 10,
                 "msgid": b"%024d" % i, "correlid": b"c" * 24, "expiry_ms": 0, "properties": props}
                for i in range(MAX_BATCH)]
    many = {f"{j:x}": 1 for j in range(MAX_PROPERTIES_LENGTH // 8)}  # 8,192 tiny properties within their limit
    with Client(server.endpoint, token=TOKEN) as c:
        assert len(c.put_batch(messages, commit=True)) == MAX_BATCH
        got = c.get_batch("Q1", MAX_BATCH, commit=True)
        assert len(got) == MAX_BATCH and got[-1].properties == props
        c.put("Q1", b"many", syncpoint=False, properties=many)
        one = c.get("Q1", syncpoint=False)
        assert one is not None and one.properties == many
        assert c.indoubt([f"XID-{i}" for i in range(MAX_BATCH)]) == []


def test_the_allowance_counts_every_array_and_map() -> None:
    """In process: the bounds by themselves, at their edges."""
    assert decode_request(b"\xdc" + struct.pack(">H", MAX_BATCH) + b"\xc0" * MAX_BATCH) == [None] * MAX_BATCH
    with pytest.raises(ProtocolError, match="max_array_len"):
        decode_request(b"\xdc" + struct.pack(">H", MAX_BATCH + 1) + b"\xc0" * (MAX_BATCH + 1))
    with pytest.raises(ProtocolError, match="max_ext_len"):
        decode_request(b"\xd4\x01\x00")  # the protocol carries no extension types
    # 66 arrays of 1000 empty arrays: each within bounds, 132,133 items in 66,201 bytes, whose allowance is 36,905
    nested = b"\xdc" + struct.pack(">H", 66) + (b"\xdc" + struct.pack(">H", 1000) + b"\x90" * 1000) * 66
    assert request_items(len(nested)) == REQUEST_ITEMS + len(nested) // ITEM_BYTES < 66 * 2001
    with pytest.raises(ProtocolError, match="arrays, maps and their elements"):
        decode_request(nested)
    fits = b"\xdc" + struct.pack(">H", 16) + (b"\xdc" + struct.pack(">H", 1000) + b"\x90" * 1000) * 16
    assert len(decode_request(fits)) == 16


def test_a_handshake_reply_is_a_strangers_frame() -> None:
    """Until the server has proven it holds the token, the client reads its replies as a member reads requests:
    no longer than a frame before authentication, and decoded within a request's bounds."""
    for reply, error in ((b"\xdd" + struct.pack(">I", 60_000) + b"\x80" * 60_000, ProtocolError),
                         (b"\xc4\xff" + b"x" * 255 + b"\x80" * 70_000, FrameTooLargeError)):
        client_end, server_end = socket.socketpair()
        try:
            client_end.settimeout(5)
            server_end.sendall(HEADER.pack(len(reply)) + reply)
            with pytest.raises(error):
                handshake(client_end, token=TOKEN)
        finally:
            client_end.close()
            server_end.close()
