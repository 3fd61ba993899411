"""The backup scheduler's retention (backup.catalog.retain, cfbackup schedule --keep) and an operator's backup or
unload waiting for a running backup instead of failing (cfbackup run --wait, cfemu migrate unload --wait)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from backup import migrate
from backup.catalog import CORRUPT, OK, list_backups, retain
from backup.files import MANIFEST_NAME
from backup.points import RESTORE, kind_of
from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.errors import BackupRunningError
from cfemu.pstore import record_warm_generation
from cfemu.repository import GroupRepository
from restore.run import open_backup, run_restore
from sqm.core.manager import QueueManager
from tests.support.cfbackup import cfbackup_env
from tests.support.harness import lose_cf

S = "APP1"


def _backups(client: redis.Redis, root: Path, logs: Path, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        ids.append(run_backup(client, S, root, log_root=logs)["id"])
        time.sleep(0.01)
    return ids


def _restored(client: redis.Redis, root: Path, logs: Path) -> str:
    """The CF lost and the structure restored: returns the restore point's id."""
    lose_cf(client)
    return run_restore(client, S, backup_root=root, log_root=logs).restore_point


def _corrupt(root: Path, backup_id: str) -> None:
    path = next(p for p in (root / S / backup_id).iterdir() if p.name != MANIFEST_NAME and p.is_file())
    with path.open("ab") as f:
        f.write(b"x")


def test_retention_keeps_the_newest_good_and_never_leaves_a_restore_below_a_point_it_would_cross(
        qsg: tuple[redis.Redis, QueueManager], tmp_path: Path) -> None:
    client, qm = qsg
    conn = qm.connect()
    conn.put("Q1", b"m")
    conn.commit()
    root, logs = tmp_path / "bk", tmp_path / "logs"
    b1, b2 = _backups(client, root, logs, 2)
    _corrupt(root, b1)
    qm.stop()
    point = _restored(client, root, logs)
    b3, b4, b5 = _backups(client, root, logs, 3)
    states = {b.id: b.state for b in list_backups(root, S)}
    assert states[b1] == CORRUPT and states[point] == OK

    result = retain(root, S, 2, client=client, repo=GroupRepository(logs))
    assert {b.id for b in result.removed} == {b3, b2}
    # The point stays while the (corrupt) b1 older than it stays: a restore never starts below it unseen.
    assert [b.id for b in list_backups(root, S)] == [b5, b4, point, b1]
    assert {b["id"] for b in Admin(client).backups(S)}.isdisjoint({b3, b2})  # gone from the admin catalog too
    assert retain(root, S, 2, client=client, repo=GroupRepository(logs)).removed == []  # nothing more to remove


def test_retention_keeps_the_restore_base_when_the_newest_backups_are_warm(
        qsg: tuple[redis.Redis, QueueManager], tmp_path: Path) -> None:
    """Backups taken while the structure runs from a WARM start hold none of its persistent content and are never
    a restore's base: the base before them stays, whatever their number."""
    client, qm = qsg
    conn = qm.connect()
    conn.put("Q1", b"m")
    conn.commit()
    qm.stop()
    root, logs = tmp_path / "bk", tmp_path / "logs"
    b1, b2 = _backups(client, root, logs, 2)
    point = _restored(client, root, logs)
    repo = GroupRepository(logs)
    record_warm_generation(repo, S, int(CF(client).structure(S).info()["gen"]))  # as a WARM start records it
    warm = _backups(client, root, logs, 3)
    base = open_backup(root, S, None, None, repo=repo)
    assert kind_of(base.manifest) == RESTORE and base.manifest["id"] == point

    result = retain(root, S, 2, client=client, repo=repo)
    assert {b.id for b in result.removed} == {warm[0], b2, b1}
    assert [b.id for b in list_backups(root, S)] == [warm[2], warm[1], point]
    assert open_backup(root, S, None, None, repo=repo).manifest["id"] == point


@pytest.mark.slow
def test_the_scheduler_keeps_the_newest_n_good_backups(qsg: tuple[redis.Redis, QueueManager], redis_url: str,
                                                         tmp_path: Path) -> None:
    client, qm = qsg
    qm.stop()
    proc = subprocess.Popen([sys.executable, "-m", "backup.cli", "schedule", "--interval", "0.2", "--keep", "2",
                             "--structure", S], env=cfbackup_env(redis_url, tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        seen: set[str] = set()
        most = 0
        while len(seen) < 6 and time.monotonic() < deadline:
            good = {b.id for b in list_backups(tmp_path / "bk", S) if b.state == OK}
            seen |= good
            most = max(most, len(good))
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert len(seen) >= 6, out
    # The newest two, and at times a third: the one just written, before the retention that follows it.
    assert most <= 3, out
    assert 2 <= len([b for b in list_backups(tmp_path / "bk", S) if b.state == OK]) <= 3, out
    assert "retention of APP1: removed" in out


def _hold_mark(client: redis.Redis, seconds: float) -> threading.Thread:
    """A backup of S runs (its mark with a live lease) for `seconds`, then ends."""
    s = CF(client).structure(S)
    s.backup_begin(f"{S}-20990101T000000Z-aaaaaa", 0, lease_ms=60_000)

    def end() -> None:
        time.sleep(seconds)
        with contextlib.suppress(Exception):  # cancelled meanwhile
            s.backup_end(f"{S}-20990101T000000Z-aaaaaa", 0, ok=False)

    t = threading.Thread(target=end, daemon=True)
    t.start()
    return t


@pytest.mark.timed
@pytest.mark.slow
def test_an_operators_backup_waits_for_a_running_one_with_progress(qsg: tuple[redis.Redis, QueueManager],
                                                                   redis_url: str, tmp_path: Path) -> None:
    client, qm = qsg
    qm.stop()
    env = cfbackup_env(redis_url, tmp_path)
    cfbackup = [sys.executable, "-m", "backup.cli"]
    t = _hold_mark(client, 2.0)
    refused = subprocess.run([*cfbackup, "run", S, "--wait", "0"], env=env, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "MQRC_CF_STRUC_IN_USE" in refused.stderr, refused.stderr
    t0 = time.monotonic()
    done = subprocess.run([*cfbackup, "run", S, "--json", "--wait", "60"], env=env, capture_output=True, text=True,
                          timeout=120)
    t.join()
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["structure"] == S and time.monotonic() - t0 >= 1.0

    phases: list[str] = []
    t = _hold_mark(client, 1.0)
    run_backup(client, S, tmp_path / "bk", wait_s=60, progress=lambda p, d, n: phases.append(p))
    t.join()
    assert any(p.startswith("waiting for backup") for p in phases), phases
    t = _hold_mark(client, 30.0)
    with pytest.raises(BackupRunningError, match="still running after waiting 0.5s"):
        run_backup(client, S, tmp_path / "bk", wait_s=0.5)
    CF(client).structure(S).backup_cancel()


def test_an_unload_waits_for_a_running_backup(qsg: tuple[redis.Redis, QueueManager], tmp_path: Path) -> None:
    client, qm = qsg
    qm.stop()
    t = _hold_mark(client, 30.0)
    with pytest.raises(migrate.BackupRunningMigrationError, match="backup .* is running"):
        migrate.unload(client, S, tmp_path / "refused", log_root=tmp_path / "logs")
    CF(client).structure(S).backup_cancel()
    t = _hold_mark(client, 1.5)
    phases: list[str] = []
    done = migrate.unload(client, S, tmp_path / "mig", log_root=tmp_path / "logs", wait_s=60,
                          progress=lambda p, d, n: phases.append(p))
    t.join()
    assert done.state == "MIGRATED" and any(p.startswith("waiting for backup") for p in phases), phases


def test_retention_by_age_keeps_every_backup_younger_than_the_age(qsg: tuple[redis.Redis, QueueManager],
                                                                   tmp_path: Path) -> None:
    """--keep-age: every good backup started within the age stays besides the newest `keep`; once they are older
    than the age (seen from a later `now`), only the newest `keep` stay."""
    from datetime import UTC, datetime, timedelta

    client, qm = qsg
    qm.stop()
    root, logs = tmp_path / "bk", tmp_path / "logs"
    ids = _backups(client, root, logs, 4)
    repo = GroupRepository(logs)
    assert retain(root, S, 1, client=client, repo=repo, keep_age=timedelta(hours=1)).removed == []
    assert {b.id for b in list_backups(root, S)} == set(ids)
    later = datetime.now(UTC) + timedelta(hours=2)
    result = retain(root, S, 1, client=client, repo=repo, keep_age=timedelta(hours=1), now=later)
    assert {b.id for b in result.removed} == set(ids[:3])
    assert [b.id for b in list_backups(root, S)] == [ids[3]]


@pytest.mark.parametrize(("flags", "says"), [
    (["--keep-age", "soon"], "soon"),
    (["--keep", "0", "--keep-age", "7d"], "--keep-age needs a retention"),
])
def test_the_scheduler_refuses_a_bad_keep_age_in_one_line(flags: list[str], says: str, redis_url: str,
                                                           tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "backup.cli", "schedule", "--interval", "1", *flags],
                          env=cfbackup_env(redis_url, tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
