"""The backup mark never outlives its backup: a lease the backup renews, cleared on every way out of run_backup, taken
over once stale, and ended by an operator with `cfbackup cancel`. Real redis-server, real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from backup.catalog import list_backups
from backup.run import BackupCancelledError, run_backup
from cfemu.admin import Admin
from cfemu.cf import CF, BackupMark, Structure
from cfemu.connection import connect
from qsg.chaos.stalled_backup import start_stalled_backup
from tests.support.cfbackup import cfbackup, group_to_back_up
from tests.support.waits import wait_until

S = "APP1"

@pytest.fixture
def env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    return group_to_back_up(redis_url, tmp_path, 5, queues=("Q1",))


def slow_backup(env: dict[str, str], slow_s: float, *args: str) -> subprocess.Popen[str]:
    """A `cfbackup run APP1` process stalled before its step 2 for slow_s seconds, once it says so."""
    return start_stalled_backup(["run", S, *args], env, slow_s)


def mark(url: str) -> BackupMark | None:
    return CF(connect(url)).structure(S).backup_mark()


# --- every way out of run_backup -----------------------------------------------------------------------------------
def test_a_backup_that_fails_on_a_response_error_leaves_no_mark(
        qsg: tuple[redis.Redis, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backup failing on BUSY (a long script holding the CF) leaves no mark: its end, refused BUSY as well, is
    asked again until the CF takes it, so that no later backup is refused (BACKUPRUNNING)."""
    client, _ = qsg
    real_end = Structure.backup_end
    busy: list[int] = []

    def end_while_busy(self: Structure, backup_id: str, caller_lrsn: int, ok: bool) -> int:
        if not ok and len(busy) < 2:
            busy.append(1)
            raise redis.exceptions.ResponseError("BUSY Redis is busy running a script. You can only call "
                                                 "SCRIPT KILL or SHUTDOWN NOSAVE.")
        return real_end(self, backup_id, caller_lrsn, ok)

    def busy_fetch(number: int, state: str) -> None:
        if number == 3:
            raise redis.exceptions.ResponseError("BUSY Redis is busy running a script.")

    monkeypatch.setattr(Structure, "backup_end", end_while_busy)
    with pytest.raises(redis.exceptions.ResponseError, match="BUSY"):
        run_backup(client, S, tmp_path / "bk", on_step=busy_fetch)
    assert len(busy) == 2
    assert "backup" not in CF(client).structure(S).info()
    assert list((tmp_path / "bk" / S).iterdir()) == []
    assert run_backup(client, S, tmp_path / "bk")["entries"] == 0


def test_a_backup_cancelled_after_its_last_renewal_says_it_ended_before_it_finished(
        qsg: tuple[redis.Redis, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's cancel that lands after the backup's last renewal is found by its end, which the CF refuses:
    the error is the one a renewal gives (a loaded machine decides which of the two sees it first)."""
    client, _ = qsg
    real_end = Structure.backup_end

    def cancelled_first(self: Structure, backup_id: str, caller_lrsn: int, ok: bool) -> int:
        if ok:
            self.backup_cancel(backup_id)  # cfbackup cancel, between the last renewal and the end
        return real_end(self, backup_id, caller_lrsn, ok)

    monkeypatch.setattr(Structure, "backup_end", cancelled_first)
    with pytest.raises(BackupCancelledError, match=r"^backup \S+ ended before it finished: .*cfbackup cancel.*"
                                                   "nothing was kept$"):
        run_backup(client, S, tmp_path / "bk")
    assert list_backups(tmp_path / "bk", S) == [] and CF(client).structure(S).backup_mark() is None


def test_a_backup_killed_with_sigkill_leaves_a_mark_the_next_backup_takes_over_after_its_lease(
        env: dict[str, str], redis_url: str, tmp_path: Path) -> None:
    # A lease longer than a loaded machine takes to start the next cfbackup, so that it finds the lease running
    proc = slow_backup(env, 600, "--lease", "6")
    left = mark(redis_url)
    assert left is not None and not left.stale
    proc.kill()
    proc.wait(30)
    refused = cfbackup("run", S, "--wait", "0", env=env)  # its lease still runs (--wait 0: refused at once)
    assert refused.returncode == 2 and f"backup {left.backup} of this structure is running" in refused.stderr
    assert "cfbackup cancel ends it" in refused.stderr
    wait_until(lambda: (m := mark(redis_url)) is not None and m.stale, 30, "the killed backup's lease to lapse")
    stale = mark(redis_url)
    assert stale is not None and stale.backup == left.backup and stale.stale
    taken = cfbackup("run", S, "--json", env=env)
    assert taken.returncode == 0, taken.stderr
    manifest = json.loads(taken.stdout)
    assert manifest["took_over"] == left.backup and manifest["entries"] == 5
    assert f"took over the stale mark of backup {left.backup}" in taken.stderr
    assert mark(redis_url) is None


def test_sigterm_ends_the_backup_as_failed_at_once(env: dict[str, str], redis_url: str, tmp_path: Path) -> None:
    proc = slow_backup(env, 600)  # the default lease (30 s): the mark is gone at once, not by its lease
    running = mark(redis_url)
    assert running is not None and not running.stale
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.count("\n") == 1 and "terminated (SIGTERM)" in err and "mark cleared" in err, err
    assert mark(redis_url) is None
    assert list((tmp_path / "bk" / S).iterdir()) == [], "a terminated backup leaves no directory"
    assert cfbackup("run", S, env=env).returncode == 0


# --- cfbackup cancel -----------------------------------------------------------------------------------------------
def test_cancel_as_an_operator_runs_it(env: dict[str, str], redis_url: str, tmp_path: Path) -> None:
    none = cfbackup("cancel", "--structure", S, env=env)
    assert none.returncode == 0 and none.stdout.strip() == f"no backup of {S} to cancel", none.stderr
    floor_before = CF(connect(redis_url)).structure(S).info().get("floor")

    proc = slow_backup(env, 3, "--lease", "1.5")  # renews every 0.3 s; works again after 3 s
    running = mark(redis_url)
    assert running is not None
    cancelled = cfbackup("cancel", "--structure", S, "--json", env=env)
    assert cancelled.returncode == 0, cancelled.stderr
    out = json.loads(cancelled.stdout)
    assert out["cancelled"] == [{"structure": S, "backup": running.backup, "state": "running"}]
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and f"backup {running.backup} ended before it finished" in err, err
    assert "cancel" in err and "nothing was kept" in err
    assert list((tmp_path / "bk" / S).iterdir()) == [], "its files are not published"
    assert list_backups(tmp_path / "bk", S) == []
    assert Admin(connect(redis_url)).backups(S) == [] and mark(redis_url) is None
    info = CF(connect(redis_url)).structure(S).info()
    assert "last_backup" not in info and int(info["floor"]) >= int(floor_before or 0)  # never goes down

    # A stale mark (its backup killed), cancelled by name of every structure: the next backup need not wait.
    proc = slow_backup(env, 600, "--lease", "60")
    killed = mark(redis_url)
    assert killed is not None
    proc.kill()
    proc.wait(30)
    text = cfbackup("cancel", env=env)
    assert text.returncode == 0 and text.stdout.strip() == (
        f"cancelled backup {killed.backup} of {S}: it was running; it fails at its next renewal of its lease and "
        "keeps nothing"), text.stdout
    assert cfbackup("run", S, env=env).returncode == 0

    unknown = cfbackup("cancel", "--structure", "NOPE", env=env)
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    assert "structure NOPE is not defined" in unknown.stderr


def test_cancel_names_a_stale_mark(env: dict[str, str], redis_url: str) -> None:
    CF(connect(redis_url)).structure(S).backup_begin("APP1-20200101T000000Z-abcdef", 0, lease_ms=1)
    time.sleep(0.01)
    out = cfbackup("cancel", "--structure", S, env=env)
    assert out.returncode == 0 and out.stdout.strip() == (
        f"cancelled backup APP1-20200101T000000Z-abcdef of {S}: its mark was stale (its lease had ended: the "
        "backup died or stalled)"), out.stdout
    assert "cancel" in cfbackup("--help", env=env).stdout
