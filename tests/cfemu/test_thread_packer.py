"""cfemu.thread_packer packs as msgpack.packb does, by a Packer kept per thread; a Packer whose output was large
is not kept (its buffer stays as long as its longest output: a thread would hold a large message's size for as long
as it lives). The log's records and the service's frames are packed by it."""

from __future__ import annotations

import collections
import gc
import threading
from typing import Any

import msgpack

from cfemu import thread_packer
from sqm.log import writer
from sqm.service import protocol


def test_it_packs_what_packb_packs() -> None:
    for obj in ({"k": "PUT", "l": 12, "d": b"x" * 1024, "e": {"id": "ab", "pr": {"a": 1.5}}}, [1, "two", b"3"], None,
                {"big": b"y" * (thread_packer.KEEP_BELOW + 1)}):
        assert thread_packer.pack(obj) == msgpack.packb(obj, use_bin_type=True)


def test_a_thread_keeps_its_packer_for_small_outputs_and_drops_it_after_a_large_one() -> None:
    seen: list[bool] = []

    def run() -> None:
        seen.append(thread_packer.kept())
        thread_packer.pack({"small": 1})
        seen.append(thread_packer.kept())
        thread_packer.pack({"large": b"z" * (thread_packer.KEEP_BELOW + 1)})
        seen.append(thread_packer.kept())
        thread_packer.pack({"small": 2})
        seen.append(thread_packer.kept())

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    assert seen == [False, True, False, True]


def test_a_value_it_cannot_pack_leaves_nothing_for_the_next_call() -> None:
    try:
        thread_packer.pack({"a": 1, "b": object()})
    except TypeError:
        pass
    else:
        raise AssertionError("an object msgpack cannot pack was packed")
    assert thread_packer.pack({"x": 1}) == msgpack.packb({"x": 1}, use_bin_type=True)


def test_the_log_and_the_service_frames_pack_with_it() -> None:
    assert writer._pack is thread_packer.pack
    reply = {"id": 7, "ok": True, "result": {"body": b"b" * 100}}
    frame = protocol.encode_frame(reply)
    assert frame[4:] == msgpack.packb(reply, use_bin_type=True)
    assert protocol.decode_body(frame[4:]) == reply


class _PacksWhenCollected:
    """Garbage (a cycle) whose finalizer packs, as a finalizer or a signal handler run by one may."""

    packed: list[bytes] = []

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        _PacksWhenCollected.packed.append(thread_packer.pack({"nested": "record", "n": 7}))


def test_a_pack_nested_in_another_in_the_same_thread_leaves_both_whole() -> None:
    """Packing a dict subclass allocates, so the garbage collector may run a finalizer in the middle of a pack; a
    finalizer (or a signal handler it lets run) that packs in turn gets its own bytes, and the outer pack its own:
    neither holds the other's."""
    thread_packer.pack({"warm": 1})  # the thread's Packer is made and kept
    record: collections.defaultdict[str, Any] = collections.defaultdict(list)
    for i in range(50):
        record[f"k{i}"] = [i, {"x": i}]
    obj = {"k": "PUT", "e": record, "d": b"x" * 100}
    _PacksWhenCollected.packed.clear()
    threshold = gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        gc.set_threshold(1)  # a collection at the first allocation inside the pack
        for _ in range(3):
            _PacksWhenCollected()
        gc.enable()
        out = thread_packer.pack(obj)
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
    assert _PacksWhenCollected.packed, "the collector should have run the finalizers during the pack"
    assert out == msgpack.packb(obj, use_bin_type=True)
    assert _PacksWhenCollected.packed == [msgpack.packb({"nested": "record", "n": 7})] * 3
    assert thread_packer.kept()
