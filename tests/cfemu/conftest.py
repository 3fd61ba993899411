"""Fixtures of the CF's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cfemu.embedded import EmbeddedRedis


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """One real server for a whole test module, with the CF's server module loaded where the build made it (the
    tests comparing the module with its scripts: each test uses databases of its own, flushed as it starts)."""
    srv = EmbeddedRedis(data_dir=tmp_path_factory.mktemp("cf"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
