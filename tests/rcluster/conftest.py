"""A local 3-master Redis Cluster as the CF (cfemu.embedded_rcluster), started per test: the tests kill its nodes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from cfemu.embedded_rcluster import EmbeddedCluster


@pytest.fixture
def redis_cluster_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., EmbeddedCluster]]:
    started: list[EmbeddedCluster] = []

    def make(**kwargs: object) -> EmbeddedCluster:
        cl = EmbeddedCluster(tmp_path_factory.mktemp("rcluster"), **kwargs)  # type: ignore[arg-type]
        started.append(cl)
        return cl.start()

    try:
        yield make
    finally:
        for cl in reversed(started):
            cl.stop()  # every node, by the pid it was started with


@pytest.fixture
def redis_cluster(redis_cluster_factory: Callable[..., EmbeddedCluster]) -> EmbeddedCluster:
    """Three masters, no replicas."""
    return redis_cluster_factory()
