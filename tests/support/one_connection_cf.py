"""A CF client on one pooled connection, so that every script call reuses it (tests of the CF call's send and
reply: tests/cfemu/test_cf_exchange.py, test_cf_exchange_errors.py)."""

from __future__ import annotations

import time
from typing import Any

import redis

from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis


def one_connection_cf(srv: EmbeddedRedis, **kw: Any) -> tuple[CF, redis.Redis]:
    """APP1 with Q1 defined on srv, and a CF over a pool of one connection (kw: connect()'s options)."""
    client = connect(srv.url, max_connections=1, **kw)
    Admin(client).define_structure("APP1")
    Admin(client).define_queue("Q1", "APP1")
    return CF(client), client


def browse_q1(cf: CF) -> int:
    """One script call (browse.lua): the messages available on Q1."""
    return len(cf.structure("APP1").browse("Q1", 10, int(time.time() * 1000)))
