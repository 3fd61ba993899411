"""The restore point written as the load goes (backup.points.RestorePointWriter, restore.run): what an operator
would hit, against a real redis-server and real queue managers.

- A restore whose switch to ACTIVE went through but whose reply was lost (the connection broke after EXEC, an
  interrupt while the reply was read) leaves the structure ACTIVE, its header naming the restore point: the point
  must stay. Removed, the next restore would start from the older base and cross this restore, replaying the old
  incarnation's logs (docs/architecture.md, "The group's durable history").
- A restore from a point gives the CF content the point's restore gave, with 1 and 2 workers, in memory and
  partitioned.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from backup.catalog import OK, find_backup, list_backups
from backup.files import read_backup
from cfemu import bulk, keys
from cfemu.admin import Admin
from restore.run import RestoreStoppedError, run_restore
from sqm.log import find_log_dirs
from tests.restore.test_engine_spark import both_plans
from tests.restore.test_restore import VOLATILE, S, small_workload, snapshot
from tests.support.harness import lose_cf


@pytest.fixture
def group(redis_url: str, tmp_path: Path) -> Iterator[tuple[redis.Redis, Path, Path]]:
    """test_restore's small workload (17 entries to restore): the CF's client, the log root, the backup root."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    qms, _ = small_workload(redis_url, logs, backups)
    yield Admin(qms[0].redis).redis, logs, backups
    for qm in qms:
        qm.stop()


def test_a_restore_whose_activation_reply_is_lost_keeps_its_restore_point(
        group: tuple[redis.Redis, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import restore.load
    client, logs, backups = group
    lose_cf(client)
    activate = bulk.activate

    def applied_then_lost(*args: Any, **kwargs: Any) -> None:
        activate(*args, **kwargs)  # the CF switched the structure to ACTIVE ...
        raise redis.exceptions.ConnectionError("Connection closed by server.")  # ... and its reply was lost

    monkeypatch.setattr(restore.load.bulk, "activate", applied_then_lost)
    with pytest.raises(RestoreStoppedError, match="the CF was lost or replaced"):
        run_restore(client, S, backup_root=backups, log_root=logs)
    monkeypatch.undo()
    header = client.hgetall(keys.meta(S))
    assert header[b"state"] == b"ACTIVE"  # the group may use it from now on
    point = header[b"last_backup"].decode()
    assert read_backup(find_backup(backups, point)).manifest["kind"] == "restore"
    newest = next(b for b in list_backups(backups, S) if b.state == OK)
    assert newest.id == point  # the next restore starts there, not from the older base
    Admin(client).set_state(S, "FAILED")
    again = run_restore(client, S, backup_root=backups, log_root=logs)
    assert (again.backup_id, again.base_kind) == (point, "restore")
    assert again.loaded_entries == 17


@pytest.mark.parametrize(("first", "second"), [
    ({"workers": 2, "memory": 64 << 10}, {"workers": 1}),
    ({"workers": 1, "partitions": 1}, {"workers": 2, "memory": 64 << 10}),
])
def test_a_restore_from_a_point_gives_the_content_the_points_restore_gave(
        group: tuple[redis.Redis, Path, Path], first: dict[str, int], second: dict[str, int]) -> None:
    client, logs, backups = group
    lose_cf(client)
    one = run_restore(client, S, backup_root=backups, log_root=logs, engine_options=first)
    after_first = snapshot(client, volatile=VOLATILE)
    point = read_backup(find_backup(backups, one.restore_point))
    assert point.manifest["entries"] == one.loaded_entries == client.hlen(keys.entries(S))
    lose_cf(client)
    two = run_restore(client, S, backup_root=backups, log_root=logs, engine_options=second)
    assert (two.backup_id, two.base_kind) == (one.restore_point, "restore")
    assert snapshot(client, volatile=VOLATILE) == after_first
    again = read_backup(find_backup(backups, two.restore_point))
    assert sorted((d["id"], d, data) for _, d, data in again.copies()) == \
        sorted((d["id"], d, data) for _, d, data in point.copies())


@pytest.mark.slow
@pytest.mark.xdist_group("spark")  # on the worker that holds the Spark session (tests/restore/conftest.py)
def test_the_spark_engine_plans_from_a_point_as_the_local_engine_does(
        group: tuple[redis.Redis, Path, Path], spark: Any) -> None:
    """The point's descriptors are the CF's bytes (add_raw), not wire forms: both engines read them alike."""
    client, logs, backups = group
    lose_cf(client)
    one = run_restore(client, S, backup_root=backups, log_root=logs, engine_options={"workers": 2})
    point = read_backup(find_backup(backups, one.restore_point))
    local, remote = both_plans(spark, point, find_log_dirs(logs), int(point.manifest["replay_from"]))
    assert local == remote
    assert len(local["settled"]) == one.loaded_entries == 17
