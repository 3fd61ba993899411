"""The exporters' HTTP server (cfemu exporter, the group supervisor's metrics, cfbackup schedule's) against idle
peers: each connection is a thread, so connections past the cap are closed at once and an idle one is closed after
the read timeout. Before, the client library's server started a thread per connection and never timed one out.
Real sockets; caps and timeouts set small."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

from prometheus_client.core import GaugeMetricFamily

from cfemu.exposition import serve
from tests.support.raw_sockets import closed_by_server
from tests.support.slowloris import Slowloris


class _One:
    def collect(self):  # type: ignore[no-untyped-def]
        g = GaugeMetricFamily("probe_value", "a value")
        g.add_metric([], 1.0)
        yield g


def test_the_exporters_server_caps_connections_and_times_idle_ones_out() -> None:
    port = serve([_One()], "127.0.0.1", 0, read_timeout_s=0.5, max_connections=4, max_connections_per_peer=2)
    threads_before = threading.active_count()
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    try:
        held[1].sendall(b"GET /metrics HTTP/1.1\r\n")
        time.sleep(0.1)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert closed_by_server(extra, 0.3), "a third connection from one address was not closed at once"
        extra.close()
        assert threading.active_count() <= threads_before + 2
        for s in held:
            assert closed_by_server(s, 2.0), "an idle connection was held open"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"probe_value 1.0" in r.read()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 2
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads_before  # the connections' threads ended


def test_a_trickled_request_head_is_closed_at_its_deadline() -> None:
    """The read timeout was per read: a peer sending one byte of its request line every few seconds held its
    connection (and its thread) for ever (16 of 16 still open after 25 s of a byte every 3 s). Now the whole request
    head must come within the read timeout of the accept."""
    port = serve([_One()], "127.0.0.1", 0, read_timeout_s=1.0, max_connections=4, max_connections_per_peer=2)
    trickler = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        t0 = time.monotonic()
        for ch in b"GET /metrics":  # a byte every 0.3 s: each read comes well within the read timeout
            try:
                trickler.sendall(bytes([ch]))
            except OSError:
                break
            if closed_by_server(trickler, 0.3):
                break
        assert time.monotonic() - t0 < 2.0, "a trickled request head was read past its deadline"
        assert closed_by_server(trickler, 0.5)
    finally:
        trickler.close()


def test_a_slowloris_from_several_addresses_does_not_keep_a_scraper_out() -> None:
    """Connections from two addresses, each under the per-address cap, filled the server with partial request
    heads, reopened as soon as closed: every scraper was refused. Now past the total cap the oldest connection
    without a whole head is closed to make room for the newcomer."""
    port = serve([_One()], "127.0.0.1", 0, read_timeout_s=30.0, max_connections=4, max_connections_per_peer=2)
    with Slowloris(port, ["127.0.0.2", "127.0.0.3"], 2, b"GET /metrics HTTP/1.1\r\n"):
        time.sleep(0.3)
        answered = 0
        for _ in range(10):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    answered += b"probe_value 1.0" in r.read()
            except OSError:
                pass
    assert answered == 10
