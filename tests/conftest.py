"""Shared fixtures: a real redis-server as the coupling facility.

* ``redis_server`` (session): an ``EmbeddedRedis`` -- or, if ``$REDIS_URL`` is set, an
  ``ExternalRedis`` for that server (same ``.url``/``.client()``; its ``kill()`` skips the test).
* ``redis_url`` (function): URL of the session server, FLUSHALLed before the test.
* ``redis_factory`` (function): ``redis_factory(**EmbeddedRedis_kwargs)`` starts a private
  server (data dir under pytest's tmp dir); all are stopped after the test.
* ``fresh_redis`` (function): a private, started ``EmbeddedRedis`` for tests that kill it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis


class ExternalRedis:
    """An externally managed server named by ``$REDIS_URL`` (not started/stopped by us)."""

    external = True

    def __init__(self, url: str) -> None:
        self.url = url
        self.pid: int | None = None

    def client(self, **kw: Any) -> redis.Redis:
        return connect(self.url, **kw)

    def kill(self) -> None:
        pytest.skip("cannot kill an external Redis server ($REDIS_URL is set)")

    def stop(self) -> None:
        pass


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis | ExternalRedis]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield ExternalRedis(url)
        return
    srv = EmbeddedRedis()
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis | ExternalRedis) -> str:
    client = redis_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., EmbeddedRedis]]:
    started: list[EmbeddedRedis] = []

    def make(**kwargs: Any) -> EmbeddedRedis:
        kwargs.setdefault("data_dir", tmp_path_factory.mktemp("cf"))
        srv = EmbeddedRedis(**kwargs)
        started.append(srv)
        return srv.start()

    try:
        yield make
    finally:
        for srv in reversed(started):
            srv.stop()


@pytest.fixture
def fresh_redis(redis_factory: Callable[..., EmbeddedRedis]) -> EmbeddedRedis:
    return redis_factory()
