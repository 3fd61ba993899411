"""The in-process Spark session the restore tests share (one per worker process: a JVM and its warm-up cost about
a minute of CPU on a loaded machine). The tests that use it are marked ``xdist_group("spark")``, so that a run
spread over workers starts one, on the worker that runs them all (tests/support/workers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("pyspark")
    from restore.engine_spark import start_session

    log_file = tmp_path_factory.mktemp("spark") / "spark.log"
    session = start_session("local[2]", {"spark.default.parallelism": "2"}, log_file)
    yield session
    session.stop()
