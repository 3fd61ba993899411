"""Poison messages and the backout queue, property-based (hypothesis, bounded examples) on a real redis-server and
real logs: random histories of puts, gets inside and outside syncpoint, commits and backouts on a queue with a
backout threshold. The generator that would have found a get outside syncpoint backing out the move of a poison
message alone on its queue (it never reached the backout queue, CHAOS-RESULTS.md R15-3).

After every step, with no unit of work open: every message put is in exactly one place (IN, the backout queue, or
consumed); everything on the backout queue reached the threshold, nothing delivered from IN had; and a get outside
syncpoint that found no message left no message available on IN (each poison message it met is moved)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cfemu.admin import Admin
from cfemu.errors import NoMessageError
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

THRESHOLD = 2
# "fail": an application's failed attempt (a get under syncpoint, then a backout), what makes a message poison.
OPS = st.lists(st.sampled_from(["put", "put", "get", "get", "get-sync", "commit", "backout", "fail", "fail"]),
               min_size=4, max_size=24)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(ops=OPS)
def test_every_message_is_in_one_place_and_poison_reaches_the_backout_queue(redis_url: str, tmp_path_factory: Any,
                                                                            ops: list[str]) -> None:
    lose_cf(redis.Redis.from_url(redis_url))  # each example from an empty CF (the session server)
    client = define_group(redis_url, queues=("BQ",))
    Admin(client).define_queue("IN", "APP1", backout_threshold=THRESHOLD, backout_queue="BQ")
    qm = start_qm(redis_url, Path(tmp_path_factory.mktemp("logs")), "QM1", background=False)
    try:
        c = qm.connect()
        put: list[bytes] = []
        consumed: list[bytes] = []
        held: list[bytes] = []  # delivered inside the open unit of work
        for n, op in enumerate(ops):
            if op == "put":
                body = b"m%d" % n
                c.put("IN", body, syncpoint=False)
                put.append(body)
            elif op == "fail":
                try:
                    c.get("IN")
                except NoMessageError:
                    pass
                c.backout()
                held = []
            elif op in ("get", "get-sync"):
                try:
                    m = c.get("IN", syncpoint=op == "get-sync")
                except NoMessageError:
                    if op == "get":
                        assert not list(c.browse("IN")), f"{ops[:n + 1]}: a poison message stayed on IN"
                    continue
                assert m.backout_count < THRESHOLD, f"{ops[:n + 1]}: a poison message was delivered"
                (held if op == "get-sync" else consumed).append(m.body)
            elif op == "commit":
                c.commit()
                consumed += held
                held = []
            else:
                c.backout()
                held = []
            if c.uow is None or c.uow.operations == 0:
                in_in = [m.body for m in c.browse("IN", limit=1000)]
                backed = list(c.browse("BQ", limit=1000))
                assert all(m.backout_count >= THRESHOLD for m in backed), f"{ops[:n + 1]}: {backed}"
                places = Counter(in_in + [m.body for m in backed] + consumed)
                assert places == Counter(put), f"{ops[:n + 1]}: {places} against {put}"
        c.backout()
    finally:
        qm.stop(checkpoint=False)
