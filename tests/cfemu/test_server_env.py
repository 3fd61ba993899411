"""The CF's server starts with glibc's thread cache of freed chunks enlarged (cfemu.server_env), and a caller's own
GLIBC_TUNABLES are kept: read from the real server process's environment (/proc/<pid>/environ)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cfemu.embedded import EmbeddedRedis
from cfemu.server_env import SERVER_TCACHE_COUNT, server_environment


def _tunables_of(pid: int) -> str | None:
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        name, _, value = item.partition(b"=")
        if name == b"GLIBC_TUNABLES":
            return value.decode()
    return None


def test_the_servers_tcache_is_added_to_an_environment_without_tunables() -> None:
    env = server_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": f"glibc.malloc.tcache_count={SERVER_TCACHE_COUNT}"}


def test_the_callers_other_tunables_are_passed_on_with_it() -> None:
    env = server_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:glibc.malloc.tcache_count={SERVER_TCACHE_COUNT}"


def test_a_tcache_count_the_caller_set_wins() -> None:
    env = server_environment({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=16:glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=16:glibc.malloc.arena_max=2"


def test_the_started_server_runs_with_the_enlarged_tcache(redis_factory: Callable[..., EmbeddedRedis],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    srv = redis_factory()
    assert srv.pid is not None and srv.client().ping()
    assert _tunables_of(srv.pid) == f"glibc.malloc.tcache_count={SERVER_TCACHE_COUNT}"


def test_a_started_server_keeps_the_callers_tcache_count(redis_factory: Callable[..., EmbeddedRedis],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=16")
    srv = redis_factory()
    assert srv.pid is not None and srv.client().ping()
    assert _tunables_of(srv.pid) == "glibc.malloc.tcache_count=16"
