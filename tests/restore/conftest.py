"""The in-process Spark session the restore tests share (one per worker process: a JVM and its warm-up cost about
a minute of CPU on a loaded machine). The tests that use it are marked ``xdist_group("spark")``, so that a run
spread over workers starts one, on the worker that runs them all (tests/support/workers.py)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass
class Started:
    """The session, and the process's SIGINT handler before and after start_session made it."""

    session: Any
    sigint_before: Any
    sigint_after: Any


@pytest.fixture(scope="session")
def spark_started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    pytest.importorskip("pyspark")
    from pyspark import SparkContext

    from restore.engine_spark import start_session

    assert SparkContext._active_spark_context is None, "a test started a Spark session of its own: use `spark`"
    log_file = tmp_path_factory.mktemp("spark") / "spark.log"
    before = signal.getsignal(signal.SIGINT)
    session = start_session("local[2]", {"spark.default.parallelism": "2"}, log_file)
    yield Started(session, before, signal.getsignal(signal.SIGINT))
    session.stop()


@pytest.fixture(scope="session")
def spark(spark_started: Started) -> Any:
    return spark_started.session
