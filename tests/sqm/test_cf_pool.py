"""The CF connection pool: sized by configuration, waited on, and never mistaken for a failed CF (a local limit
such as a pool with no free connection is never reported as MQRC_CF_STRUC_FAILED)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cfemu.errors import StructureFailedError

try:
    from cfemu.errors import ResourceProblemError
except ImportError:
    ResourceProblemError = Exception
from tests.support.group import define_group, start_qm


def test_more_concurrent_requests_than_connections_wait_instead_of_failing(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False, cf_connections=4)
    errors: list[BaseException] = []
    n = 150  # more than redis-py's default pool of 100, all at the CF at once
    start = threading.Barrier(n)

    def work(i: int) -> None:
        try:
            conn = qm.connect()
            start.wait()
            conn.put("Q1", b"m%d" % i)
            conn.commit()
            conn.get("Q1", wait_ms=5000)
            conn.commit()
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        assert qm.counters["commits"] == 2 * n
    finally:
        qm.stop()


def test_a_pool_that_stays_busy_is_a_resource_problem_not_a_failed_structure(redis_url: str,
                                                                            tmp_path: Path) -> None:
    define_group(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False, cf_connections=2, cf_pool_timeout_s=0.3)
    pool = qm.redis.connection_pool
    held = [pool.get_connection(), pool.get_connection()]
    conn = qm.connect()
    try:
        with pytest.raises(ResourceProblemError, match="connections to the CF stayed busy") as e:
            conn.put("Q1", b"x")
        assert not isinstance(e.value, StructureFailedError)
        assert e.value.reason_name == "MQRC_RESOURCE_PROBLEM"
        pool.release(held.pop())
        conn.put("Q1", b"x")  # a connection is free again: the same handle goes on
        conn.commit()
    finally:
        for c in held:
            pool.release(c)
        qm.stop()
