"""What someone who can write the backup directory plants there does not stop the catalog's readers (docs/security.md,
"Backups"): a manifest nested too deeply to parse, or far bigger than any manifest (a sparse file costs nothing on
disk), is one corrupt backup named by its file, read within a fixed bound, while every other backup is still listed,
restored from and pruned; a symbolic link named like a backup is untrusted, never read nor removed through, and a
prune that meets one still removes (and forgets) what it can and says what it could not. The console reads the
restores' reports beside the backups within a bound too."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis

from backup import catalog
from backup.catalog import CORRUPT, OK, UNTRUSTED, find_backup, list_backups, prune, readable_kind, retain
from backup.files import (
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    ChecksumMismatchError,
    UntrustedBackupError,
    read_manifest,
)
from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.repository import GroupRepository
from qsg.console.snapshot import _backups_part
from qsg.console.source import GroupSource
from restore.run import RestoreError, run_restore
from sqm.core.manager import QueueManager
from tests.support.cfbackup import cfbackup, cfbackup_env
from tests.support.harness import lose_cf

S = "APP1"
NESTED = b"[" * 100_000 + b"]" * 100_000  # 200 kB: exhausts json's recursion, not its size bound
# Memory a reader may use with a 1 GiB manifest or report planted: the interpreter and its imports take about
# 100 MB; reading the planted file whole would take more than 1 GB.
RSS_BOUND_KB = 400_000
# The probe's own peak (VmHWM of its address space): ru_maxrss would carry its parent's, the test worker's, over
# the fork and exec that started it.
PEAK_KB = ("def peak_kb():\n    for line in open('/proc/self/status'):\n        if line.startswith('VmHWM:'):\n"
           "            return int(line.split()[1])\n")


def _planted_id(hours_from_now: float, suffix: str = "abcdef") -> str:
    return f"{S}-{datetime.now(UTC) + timedelta(hours=hours_from_now):%Y%m%dT%H%M%SZ}-{suffix}"


def _plant(root: Path, backup_id: str, manifest: bytes | None = None, *, size: int | None = None) -> Path:
    path = root / S / backup_id
    path.mkdir(parents=True, mode=0o700)
    mpath = path / MANIFEST_NAME
    if size is not None:
        with mpath.open("wb") as f:
            f.truncate(size)  # sparse: nothing on disk
    else:
        mpath.write_bytes(manifest or b"")
    return mpath


def test_a_deeply_nested_manifest_is_one_corrupt_backup_and_the_others_are_listed_and_restored_from(
        qsg: tuple[redis.Redis, QueueManager], tmp_path: Path) -> None:
    client, qm = qsg
    conn = qm.connect()
    conn.put("Q1", b"kept")
    conn.commit()
    root, logs = tmp_path / "bk", tmp_path / "logs"
    good = run_backup(client, S, root, log_root=logs)["id"]
    planted = _planted_id(1)
    mpath = _plant(root, planted, NESTED)

    with pytest.raises(ChecksumMismatchError, match="nested too deeply") as e:
        read_manifest(root / S / planted)
    assert str(mpath) in str(e.value)
    rows = {b.id: b for b in list_backups(root, S)}
    assert rows[good].state == OK
    assert rows[planted].state == CORRUPT and str(mpath) in rows[planted].problem

    snap: dict[str, list[dict[str, object]]] = {"backups": []}  # the console's listing
    _backups_part(GroupSource(where={"backup_dir": root, "log_root": logs}), snap)
    assert {(r["id"], r["state"]) for r in snap["backups"]} == {(good, OK), (planted, CORRUPT)}

    assert retain(root, S, 1, client=client, repo=GroupRepository(logs)).failed == []  # the retention runs

    qm.stop()
    lose_cf(client)
    # the choice of a base (RECAUTO, cfrestore run without --backup) does not pass over it: it may be a restore
    # point; refused naming it, before anything is changed
    with pytest.raises(RestoreError, match=f"backup {planted} of {S} is corrupt .*unreadable"):
        run_restore(client, S, backup_root=root, log_root=logs)
    result = run_restore(client, S, backup_root=root, log_root=logs, backup_id=good)  # cfrestore run --backup
    assert result.loaded_entries == 1


def test_a_huge_sparse_manifest_is_refused_without_reading_it(tmp_path: Path) -> None:
    root = tmp_path / "bk"
    planted = _planted_id(0)
    mpath = _plant(root, planted, size=2**30)
    probe = (PEAK_KB + "import json, sys; from pathlib import Path; from backup.catalog import list_backups; "
             "rows = list_backups(Path(sys.argv[1]), 'APP1'); "
             "print(json.dumps({'rows': [[b.state, b.problem] for b in rows], "
             "'maxrss_kb': peak_kb()}))")
    out = json.loads(subprocess.run([sys.executable, "-c", probe, str(root)], capture_output=True, text=True,
                                    check=True, timeout=120).stdout)
    [[state, problem]] = out["rows"]
    assert state == CORRUPT and str(mpath) in problem and f"more than the {MANIFEST_MAX_BYTES}" in problem
    assert out["maxrss_kb"] < RSS_BOUND_KB, out


def test_a_manifest_one_byte_over_the_bound_is_refused_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "bk"
    planted = _planted_id(0)
    mpath = _plant(root, planted, b" " * MANIFEST_MAX_BYTES + b"{}")  # valid JSON, but bigger than any manifest
    with pytest.raises(ChecksumMismatchError, match="more than the") as e:
        read_manifest(root / S / planted)
    assert str(mpath) in str(e.value)


def test_a_huge_sparse_restore_report_is_not_read_by_the_console(tmp_path: Path) -> None:
    root = tmp_path / "bk"
    (root / S).mkdir(parents=True)
    good = {"structure": S, "started_at": "2026-11-30T00:00:00+00:00", "engine": "local", "loaded_entries": 3}
    (root / S / "restore-20261130T000000000000Z.json").write_text(json.dumps(good))
    with (root / S / "restore-20261130T000001000000Z.json").open("wb") as f:
        f.truncate(2**30)
    (root / S / "restore-20261130T000002000000Z.json").write_bytes(NESTED)
    probe = (PEAK_KB + "import json, sys; from pathlib import Path; from qsg.console.snapshot import _restores_part; "
             "from qsg.console.source import GroupSource; snap = {'restores': []}; "
             "_restores_part(GroupSource(where={'backup_dir': Path(sys.argv[1])}), snap); "
             "print(json.dumps({'reports': [r['report'] for r in snap['restores']], "
             "'maxrss_kb': peak_kb()}))")
    out = json.loads(subprocess.run([sys.executable, "-c", probe, str(root)], capture_output=True, text=True,
                                    check=True, timeout=120).stdout)
    assert out["reports"] == ["restore-20261130T000000000000Z.json"]  # the good one, the planted ones skipped
    assert out["maxrss_kb"] < RSS_BOUND_KB, out


def test_any_error_reading_one_backup_is_its_corrupt_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "bk"
    first, second = _planted_id(0, "aaaaaa"), _planted_id(1, "bbbbbb")
    _plant(root, first, b"{}")
    _plant(root, second, b"{}")

    def read_backup(path: Path, **_: object) -> None:
        if path.name == second:
            raise RuntimeError("an unforeseen failure")
        raise ChecksumMismatchError(f"{path}: damaged")

    monkeypatch.setattr(catalog, "read_backup", read_backup)
    rows = {b.id: b for b in list_backups(root, S)}
    assert rows[second].state == CORRUPT and "RuntimeError: an unforeseen failure" in rows[second].problem
    assert str(root / S / second) in rows[second].problem
    assert rows[first].state == CORRUPT


def test_a_symbolic_link_named_like_a_backup_is_untrusted_and_a_prune_removes_the_rest_and_says_so(
        qsg: tuple[redis.Redis, QueueManager], redis_url: str, tmp_path: Path) -> None:
    client, qm = qsg
    conn = qm.connect()
    conn.put("Q1", b"m")
    conn.commit()
    root, logs = tmp_path / "bk", tmp_path / "logs"
    b1, b2, b3 = (run_backup(client, S, root, log_root=logs)["id"] for _ in range(3))
    victim = tmp_path / "victim"  # elsewhere: a copy of a real backup, so that following the link would read it
    victim.mkdir()
    for f in (root / S / b1).iterdir():
        (victim / f.name).write_bytes(f.read_bytes())
    (victim / "precious.txt").write_text("precious")
    link = root / S / f"{S}-20200101T000000Z-aaaaaa"
    link.symlink_to(victim, target_is_directory=True)
    before = sorted(p.name for p in victim.iterdir())

    rows = {b.id: b for b in list_backups(root, S)}
    assert rows[link.name].state == UNTRUSTED and "symbolic link" in rows[link.name].problem
    assert rows[link.name].manifest is None
    with pytest.raises(UntrustedBackupError, match="symbolic link"):
        find_backup(root, link.name)
    with pytest.raises(UntrustedBackupError, match="symbolic link"):
        read_manifest(link)
    kept = retain(root, S, 2, client=client, repo=GroupRepository(logs))  # the scheduler's retention
    assert [b.id for b in kept.removed] == [b1] and kept.failed == []  # the link is untrusted: never doomed
    assert link.is_symlink()

    qm.stop()
    run = cfbackup("prune", S, "--keep", "1", "--json", env=cfbackup_env(redis_url, tmp_path))
    assert run.returncode == 2, run
    out = json.loads(run.stdout)
    assert out["removed"] == [b2]
    assert [f["id"] for f in out["failed"]] == [link.name] and "symbolic link" in out["failed"][0]["problem"]
    assert [b.id for b in list_backups(root, S)] == [b3, link.name]
    assert link.is_symlink() and sorted(p.name for p in victim.iterdir()) == before
    assert {b["id"] for b in Admin(client).backups(S)}.isdisjoint({b1, b2})  # what was removed is forgotten

    human = cfbackup("prune", S, "--keep", "1", env=cfbackup_env(redis_url, tmp_path))
    assert human.returncode == 2 and f"{link.name} of {S} was not removed" in human.stderr, human
    assert link.is_symlink() and sorted(p.name for p in victim.iterdir()) == before
    assert [failed.id for failed, _ in prune(root, S, keep=1).failed] == [link.name]


def test_the_kind_a_damaged_manifest_still_says_is_read_within_the_bound(tmp_path: Path) -> None:
    root = tmp_path / "bk"
    nested, huge, point = _planted_id(0, "aaaaaa"), _planted_id(1, "bbbbbb"), _planted_id(2, "cccccc")
    _plant(root, nested, NESTED)
    _plant(root, huge, size=2**30)
    _plant(root, point, json.dumps({"kind": "restore", "files": "damaged"}).encode())
    assert readable_kind(root / S / nested) == ""  # a restore's choice of base then refuses to pass over it
    assert readable_kind(root / S / huge) == ""
    assert readable_kind(root / S / point) == "restore"
