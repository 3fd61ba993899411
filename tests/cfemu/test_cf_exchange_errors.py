"""The errors of the lean CF exchange (cfemu.cf._lean_exchange) and the kernel-timed CF sockets: what redis-py's
own path raises, the lean path raises too. Real redis-server processes."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import pytest
import redis

from cfemu.embedded import EmbeddedRedis
from sqm.core.manager import reply_lost
from tests.support.cf_loading import answers_loading
from tests.support.one_connection_cf import browse_q1, one_connection_cf


@pytest.mark.slow
def test_a_cf_still_loading_its_data_is_an_error_not_a_reply(redis_factory: Callable[..., EmbeddedRedis]) -> None:
    """A CF restarted from its dump answers -LOADING until its data is in memory: redis-py raises it (its class
    for it, BusyLoadingError, is a ConnectionError: nothing ran) and drops the connection. The lean path returned
    the error object as the script's reply, for the caller to unpack as a browse, a put, a get..."""
    srv = redis_factory()
    cf, client = one_connection_cf(srv)
    browse_q1(cf)
    client.config_set("rdbcompression", "no")  # a dump of 2 MB
    client.execute_command("DEBUG", "POPULATE", "20000", "k", "100")
    client.save()
    srv.kill()
    # The same server again, each key loaded slowly (key-load-delay, microseconds: a second or more of loading),
    # serving clients every 256 KiB it loads (by default every 2 MB: a dump of 30 MB had been needed).
    cmd = srv._command(srv.port, srv.data_dir) + ["--key-load-delay", "50",
                                                   "--loading-process-events-interval-bytes", str(256 << 10)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not answers_loading(srv.port):
            assert time.monotonic() < deadline, "the CF never answered LOADING"
            time.sleep(0.01)
        with pytest.raises(redis.exceptions.BusyLoadingError) as loading:
            browse_q1(cf)
        assert not reply_lost(loading.value)  # refused before anything ran
        deadline = time.monotonic() + 30
        while answers_loading(srv.port):
            assert time.monotonic() < deadline, "the CF never finished loading"
            time.sleep(0.05)
        assert browse_q1(cf) == 0  # and the connection is usable once the data is in
    finally:
        proc.kill()
        proc.wait()
