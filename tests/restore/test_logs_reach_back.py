"""A restore replays every member's log from its base's replay start: whatever the base (a backup, a restore point,
the relog window, the definition), a log whose records from there on were removed is refused by name, not read
across the gap. The case: the logs pruned to the newest backup's replay start, then that backup found damaged: the
older one's replay start lies in what was pruned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

import backup.run
from backup.catalog import CORRUPT, list_backups
from restore.run import RestoreError, run_restore
from sqm.cli import main as sqm_main
from sqm.core.manager import QueueManager
from sqm.log import LogReader
from sqm.log.format import read_manifest
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"


def _messages(qm: QueueManager) -> list[bytes]:
    return sorted(m.body for m in qm.connect().browse("Q1", limit=10_000))


def _two_backups_and_the_logs_pruned(redis_url: str, logs: Path, backups: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> tuple[redis.Redis, dict, dict, list[bytes]]:
    """B1, committed work (puts and a get), B2, then `sqm log prune --all` down to B2's replay start: (the CF, B1,
    B2, the queue's messages at the end)."""
    client = define_group(redis_url, queues=("Q1", "Q2"))
    qm = start_qm(redis_url, logs, "QM1", background=False, segment_bytes=4096)
    c = qm.connect()
    for i in range(5):
        c.put("Q1", f"M{i}".encode() + b"." * 300)
        c.commit()
    first = backup.run.run_backup(client, S, backups, log_root=logs)
    for i in range(5):
        c.put("Q1", f"N{i}".encode() + b"." * 300)
        c.commit()
    c.get("Q1")
    c.commit()
    for _ in range(20):  # log load, so that segments roll
        c.put("Q2", b"churn" + b"." * 300, syncpoint=False)
        c.get("Q2", syncpoint=False)
    second = backup.run.run_backup(client, S, backups, log_root=logs)
    qm.checkpoint("after the second backup")
    truth = _messages(qm)
    qm.stop(checkpoint=False)
    capsys.readouterr()
    assert sqm_main(["log", "prune", "--all", "--json", "--log-root", str(logs), "--redis-url", redis_url]) == 0
    assert json.loads(capsys.readouterr().out)["pruned"]
    return client, first, second, truth


def test_the_older_base_is_refused_when_the_newest_backup_is_damaged_after_the_logs_were_pruned(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client, first, second, _ = _two_backups_and_the_logs_pruned(redis_url, logs, backups, capsys)
    entries = backups / S / second["id"] / "entries-0001.bin"
    entries.write_bytes(entries.read_bytes()[: entries.stat().st_size // 2])  # a short write, a bad copy
    assert {b.id: b.state for b in list_backups(backups, S)}[second["id"]] == CORRUPT
    begins = next(s.min_lrsn for s in LogReader(logs / "QM1").segments() if s.min_lrsn is not None)
    assert begins > first["replay_from"]
    lose_cf(client)

    with pytest.raises(RestoreError) as refused:
        run_restore(client, S, backup_root=backups, log_root=logs)

    message = str(refused.value)
    assert "\n" not in message
    for said in ("member QM1", f"first LRSN {begins}", f"LRSN {first['replay_from']}", first["id"], "--from-logs",
                 "--backup"):
        assert said in message, said
    assert list_backups(backups, S)[1].id == first["id"]  # nothing changed: the backups are as they were


def test_the_newest_base_restores_from_pruned_logs_that_reach_back_to_it(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The log lacks its first segments, removed by prune, which records the highest LRSN it removed: below the
    base's replay start, so nothing the restore needs is gone."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client, _, second, truth = _two_backups_and_the_logs_pruned(redis_url, logs, backups, capsys)
    manifest = read_manifest(logs / "QM1")
    assert manifest is not None and manifest["pruned"] > 1
    assert manifest["pruned_lrsn"] < second["replay_from"]
    lose_cf(client)

    assert run_restore(client, S, backup_root=backups, log_root=logs).backup_id == second["id"]

    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        assert _messages(qm) == truth
    finally:
        qm.stop()
