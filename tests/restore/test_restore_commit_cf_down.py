"""A commit through the network service (`sqm run` and its client) whose CF was killed with SIGKILL: the member
forces the COMMIT, the CF does not answer, and the client is told the outcome is pending (MQRC_OUTCOME_PENDING,
2124, one line), never "committed": a restore of the structure may have read the logs before the COMMIT. The
member completes the commit when the CF is back: restored empty (the restore read the COMMIT, so the message is
there, once) or back with its data (same generation: the retry applies it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu.embedded import EmbeddedRedis
from cfemu.errors import OutcomePendingError, OutcomeUnknownError
from restore.run import run_restore
from sqm.service.client import Client
from tests.support.group import define_group
from tests.support.prom import families, scrape
from tests.support.service_proc import TOKEN, start_server
from tests.support.waits import wait_until

S = "APP1"


def pending(metrics_port: int) -> float:
    """The member's decided work waiting for the CF (its sqm_pending gauge)."""
    family = families(scrape(metrics_port))["sqm_pending"]
    return sum(s.value for s in family.samples)  # type: ignore[attr-defined]


def bodies(c: Client) -> list[bytes]:
    """Q1's available messages, as the client browses them (a CF not back yet answers nothing)."""
    try:
        return [m.body for m in c.browse("Q1", limit=100)]
    except Exception:  # noqa: BLE001 - the CF or the structure not back yet
        return []


def commit_with_the_cf_killed(cf: EmbeddedRedis, tmp_path: Path,
                              after: Callable[[], object]) -> tuple[OutcomePendingError, list[bytes]]:
    """A unit of work put through `sqm run`, the structure backed up, the CF killed -9, then the client's commit;
    ``after`` brings the CF back. Returns the commit's error and Q1 once the member has no pending work left."""
    logs = tmp_path / "logs"
    client = define_group(cf.url)
    run_backup(client, S, tmp_path / "backups", log_root=logs)
    client.close()
    srv = start_server(cf.url, tmp_path, "QM1")
    try:
        with Client(srv.endpoint, token=TOKEN, reconnect_timeout=2) as c:
            c.put("Q1", b"before", syncpoint=False)
            c.put("Q1", b"committed while the CF died")
            cf.kill()
            with pytest.raises(OutcomePendingError) as e:
                c.commit()
            assert pending(srv.metrics_port) == 1
            after()
            wait_until(lambda: pending(srv.metrics_port) == 0, 60, "the member to complete its pending commit")
            return e.value, bodies(c)
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_the_client_is_told_pending_and_a_restore_that_read_the_commit_completes_it(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    def restore() -> None:
        fresh_redis.start()  # empty: the CF was lost
        client = fresh_redis.client()
        try:
            run_restore(client, S, backup_root=tmp_path / "backups", log_root=tmp_path / "logs")
        finally:
            client.close()

    error, after = commit_with_the_cf_killed(fresh_redis, tmp_path, restore)
    assert isinstance(error, OutcomeUnknownError)  # a kind of unknown outcome: either outcome is legal
    text = str(error)
    assert error.reason == 2124 and text.startswith("MQRC_OUTCOME_PENDING (2124): the commit of unit of work")
    assert "\n" not in text and "APP1" in text
    assert after == [b"before", b"committed while the CF died"]


@pytest.mark.slow
def test_a_pending_commit_completes_when_the_cf_comes_back_with_its_data(
        redis_factory: Callable[..., EmbeddedRedis], tmp_path: Path) -> None:
    cf = redis_factory(appendonly=True, appendfsync="always")
    error, after = commit_with_the_cf_killed(cf, tmp_path, cf.start)  # the same CF, its data from its AOF
    assert error.reason == 2124
    assert after == [b"before", b"committed while the CF died"]
