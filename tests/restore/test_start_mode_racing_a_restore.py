"""A WARM or COLD start decided on a failed structure must not empty it when a HOT restore of it completes
between the start's decision and its purge (two operators, or RECAUTO and an operator, at once): the purge's claim
compares the structure with what the start saw, and refuses, changing nothing. Real redis-server lost with
FLUSHALL, a real queue manager, its log and a real backup; the restore runs at the exact moment by a wrapper
around the start's last check before it purges."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import restore.run
import restore.start_modes
from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis
from cfemu.pstore import warm_generations
from cfemu.repository import GroupRepository
from restore.run import RestoreError, run_restore
from restore.start_modes import start
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf
from tests.support.messages import drained

S = "APP1"


@pytest.mark.parametrize("mode", ["WARM", "COLD"])
def test_a_start_refuses_to_empty_a_structure_a_restore_brought_back_meanwhile(
        fresh_redis: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(fresh_redis.url)
    qm = start_qm(fresh_redis.url, logs, "QM1", background=False)
    c = qm.connect()
    for i in range(3):
        c.put("Q1", f"p{i}".encode())
    c.commit()
    run_backup(client, S, backups, log_root=logs)
    qm.stop()
    lose_cf(fresh_redis.client())
    points_before = sorted(p.name for p in (backups / S).iterdir())

    # The start's check of every member's log is its last step before the purge: the HOT restore completes there.
    module: Any = restore.start_modes if mode == "WARM" else restore.run
    checked = module.refuse_missing_member_logs

    def then_a_restore_completes(*args: Any, **kwargs: Any) -> None:
        checked(*args, **kwargs)
        run_restore(client, S, backup_root=backups, log_root=logs)

    monkeypatch.setattr(module, "refuse_missing_member_logs", then_a_restore_completes)
    # (COLD's purge finds the restore's point first; the claim would refuse it as well)
    with pytest.raises(RestoreError, match="another restore restored the structure since|another restore or a purge "
                                           "wrote its restore point .* this one would empty what that one made"):
        start(client, S, mode, backup_root=backups, log_root=logs)
    monkeypatch.undo()

    assert Admin(client).state(S) == "ACTIVE"
    assert not warm_generations(GroupRepository(logs), S)
    new_points = sorted(p.name for p in (backups / S).iterdir() if p.is_dir() and p.name not in points_before)
    assert len(new_points) == 1, new_points  # the HOT restore's restore point, no purge's
    qm = start_qm(fresh_redis.url, logs, "QM1", background=False)
    try:
        assert sorted(drained(qm.connect(), "Q1")) == [b"p0", b"p1", b"p2"]
    finally:
        qm.stop()
