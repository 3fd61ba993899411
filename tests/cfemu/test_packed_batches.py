"""The bulk load's packed batches (cfemu.resp, cfemu.bulk.Owner.send): what the owner's redis-py pipeline
(Owner.transaction) raises for a batch, a packed batch raises too, and a packed batch costs no more memory than the
pipeline. Real redis-server processes."""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable

import pytest
import redis
from redis.client import Pipeline

from cfemu import bulk, keys, resp
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis
from tests.cfemu.test_bulk import HOW, write_marker
from tests.support.cf_loading import answers_loading

S = "APP1"


@pytest.mark.slow
@pytest.mark.parametrize("how", HOW)
def test_a_batch_sent_while_the_cf_reloads_its_data_stops_the_load_as_a_lost_cf(
        redis_factory: Callable[..., EmbeddedRedis], how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CF reloads its dataset under the load (DEBUG RELOAD; a replica's resync is the same) and answers every
    command on the owner's connection -LOADING (MULTI and EXEC it still takes). redis-py's class for it,
    BusyLoadingError, is a ConnectionError: the pipeline raised it at the first command's reply and dropped the
    connection: CFReplacedError, which the restore reports as a lost CF to run again (restore.run._owning). The
    packed batch read the errors in place and raised EXEC's EXECABORT, a plain ResponseError."""
    srv = redis_factory()
    c = srv.client(socket_timeout=None)
    Admin(c).define_structure(S)
    c.config_set("rdbcompression", "no")
    # 2 MB of keys, loaded slowly (key-load-delay: microseconds a key, a second or more of loading), with the
    # events served every 256 KiB it loads (the default, every 2 MB, had needed four times the keys).
    c.execute_command("DEBUG", "POPULATE", "20000", "pad", "100")
    c.config_set("key-load-delay", 20)
    c.config_set("loading-process-events-interval-bytes", 256 << 10)
    owner = bulk.claim(c, S, bulk.observe(c, S))
    # The owner's check of its header: through its watching pipeline, or (a packed batch) of the header read
    # with the batch's WATCH.
    # A batch the CF checks itself (native): after the owner's first check of the CF, by its probe of LOAD.
    hook = {"staged": "check", "native": "loads_natively"}.get(how, "judge")
    check = getattr(owner, hook)
    reload = threading.Thread(target=lambda: srv.client(socket_timeout=None).execute_command("DEBUG", "RELOAD"))

    def check_then_reload(*read: Pipeline | bulk.Seen) -> object:
        checked = check(*read)
        reload.start()  # between the owner's check and its batch
        deadline = time.monotonic() + 20
        while not answers_loading(srv.port):
            assert time.monotonic() < deadline, "the CF never answered LOADING"
        return checked

    monkeypatch.setattr(owner, hook, check_then_reload)
    try:
        with pytest.raises(bulk.CFReplacedError):
            write_marker(owner, "during", how)
        with pytest.raises(redis.exceptions.ConnectionError, match="does not reconnect"):
            owner.client.ping()  # the connection was dropped: whatever it had in flight is never read as a reply
    finally:
        reload.join()
        owner.close()
    assert c.hget(keys.data(S), "marker") is None


def test_a_packed_batch_is_sent_without_a_copy_of_its_messages(redis_url: str) -> None:
    """A batch of 1,000 messages of 48 KiB (48 MiB): Owner.send joined all of it (Packed.data) and then joined
    that to MULTI and to EXEC, three copies of the batch while it was sent (a batch of 1 MiB messages: 3 GiB
    more). Its long parts (the messages' data) go as they are, in the worker's pickle too."""
    import tracemalloc

    client = redis.Redis.from_url(redis_url)
    Admin(client).define_structure(S)
    body = 48 << 10
    commands = resp.Packed()
    datas: list[bytes] = []
    for i in range(1000):
        datas += (f"id{i}".encode(), os.urandom(body))
    commands.add_items((b"HSET", keys.data(S)), datas, len(datas))
    chunks = commands.chunks()
    assert b"".join(chunks) == commands.data() and any(c is datas[1] for c in chunks)  # uncopied
    assert len(pickle.loads(pickle.dumps(commands)).chunks()) == len(chunks)
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        tracemalloc.start()
        try:
            owner.send(commands)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < (1000 * body) // 4, f"{peak >> 20} MiB allocated to send a batch of {(1000 * body) >> 20} MiB"
    assert client.hlen(keys.data(S)) == 1000 and client.hget(keys.data(S), "id7") == datas[15]
