"""A restore owns its structure from its start to the end of its load (docs/architecture.md, "The group's durable
history", ownership).

Against a real redis-server that the tests kill and start again, real logs and backups, and (for the operator's
view) a real `cfrestore` process:
  * the CF is killed while restore loads 50,000 messages and an empty one is started on the same port at
    once: restore stops, says in words that the CF was lost, writes nothing into the new CF; a re-run restores it;
  * a restore that planned while another one restored the structure (and clients committed work on it)
    refuses and wipes nothing;
  * a purge while a restore loads takes the structure over: the restore stops at its next batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import redis

from backup.run import run_backup
from cfemu import keys, lua
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis
from restore.engine import LOAD, READ_BACKUP
from restore.run import RestoreError, run_purge, run_restore
from tests.restore.test_restore import S, all_keys, drain
from tests.support.group import define_group, start_qm

MESSAGES = 50_000  # 50 load batches: long enough for the CF to be lost with the load half done


def fill(client: redis.Redis, n: int, queue: str = "Q1") -> None:
    """n committed persistent 1 KiB messages, put with pipelined calls of the CF's put script (a member that then
    leaves: the backup names no member, so restore needs no log)."""
    admin = Admin(client)
    epoch = admin.join("FILLER", {}, 600_000)
    put = lua.register(client, ["put"])["put"]
    body = b"m" * 1024
    for start in range(0, n, 2000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(n, start + 2000)):
            desc = msgpack.packb({"p": 0, "per": 1, "mid": f"{i:08x}", "cid": "", "exp": 0, "pt": 1, "bc": 0,
                                  "pr": {}}, use_bin_type=False)
            put(keys=keys.script_keys(S), args=["FILLER", epoch, 0, "", 0, f"m-{i:06d}", queue, desc, body],
                client=pipe)
        pipe.execute()
    admin.leave("FILLER")


@pytest.fixture
def lost_with_a_backup(fresh_redis: EmbeddedRedis, tmp_path: Path) -> tuple[EmbeddedRedis, Path, Path]:
    """A structure of MESSAGES messages, backed up; then the CF is lost (killed, started again empty)."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(fresh_redis.url)
    fill(client, MESSAGES)
    run_backup(client, S, backups)
    fresh_redis.kill()
    fresh_redis.start()
    return fresh_redis, logs, backups


def structure_keys(client: redis.Redis) -> list[bytes]:
    return list(client.scan_iter(match=keys.all_structure_keys_pattern(S), count=1000))


# --- the CF lost and restarted empty while restore loads -----------------------------------------------------------

@pytest.mark.slow
def test_a_cf_restarted_empty_mid_load_stops_the_restore_which_writes_nothing_into_it(
        lost_with_a_backup: tuple[EmbeddedRedis, Path, Path]) -> None:
    cf, logs, backups = lost_with_a_backup
    replaced: list[int] = []

    def progress(phase: str, done: int, total: int | None) -> None:
        if phase == LOAD and done >= 20_000 and not replaced:
            replaced.append(done)
            cf.kill()  # the CF is lost mid-load ...
            cf.start()  # ... and an empty one is started on the same port at once

    with pytest.raises(RestoreError) as refused:
        run_restore(cf.client(), S, backup_root=backups, log_root=logs, progress=progress)
    message = str(refused.value)
    assert replaced, "the load never reached 20,000 messages"
    assert "the CF was lost or replaced during the restore" in message
    assert "nothing more was written" in message and "run the restore of APP1 again" in message
    assert "Connection" not in message and "\n" not in message
    fresh = cf.client()
    assert all_keys(fresh) == {}  # not one key in the new CF: no structure keys without a header

    # the operator runs the restore again once the CF is back: a clean restore from the start
    result = run_restore(fresh, S, backup_root=backups, log_root=logs)
    assert result.loaded_entries == MESSAGES and Admin(fresh).state(S) == "ACTIVE"
    assert fresh.hlen(keys.entries(S)) == MESSAGES


@pytest.mark.slow
def test_cfrestore_says_in_one_line_that_the_cf_was_lost_mid_load(
        lost_with_a_backup: tuple[EmbeddedRedis, Path, Path]) -> None:
    """The operator's view, with a real cfrestore process: the CF is killed from outside once the load is
    under way, and an empty one started on the same port."""
    cf, logs, backups = lost_with_a_backup
    cmd = [sys.executable, "-m", "restore.cli", "run", S, "--redis-url", cf.url, "--backup-dir", str(backups),
           "--log-root", str(logs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    watcher = cf.client()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if watcher.hlen(keys.entries(S)) >= 5_000:
                break
        except redis.exceptions.RedisError:
            pass
        time.sleep(0.005)
    assert proc.poll() is None, f"the restore ended before the test could kill the CF: {proc.communicate()}"
    cf.kill()
    cf.start()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cfrestore: error: restore of APP1 stopped: the CF was lost "
                                                    "or replaced during the restore"), err
    assert "Connection reset" not in err and "descriptors" not in err
    assert structure_keys(cf.client()) == []


# --- overlapping restores ------------------------------------------------------------------------------------------

class SlowPlan:
    """A progress callback that holds a restore in its plan until released (a slow Spark plan)."""

    def __init__(self) -> None:
        self.planning = threading.Event()
        self.release = threading.Event()

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if phase == READ_BACKUP and not self.planning.is_set():
            self.planning.set()
            assert self.release.wait(60)


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException | object]]:
    out: list[BaseException | object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_restore_that_planned_while_another_restored_refuses_and_wipes_nothing(
        redis_url: str, tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    conn = qm.connect()
    for i in range(30):
        conn.put("Q1", f"m-{i:02d}".encode())
    conn.commit()
    run_backup(client, S, backups, log_root=logs)
    Admin(client).set_state(S, "FAILED")  # cfrestore mark-failed APP1

    slow = SlowPlan()
    stale, outcome = in_thread(lambda: run_restore(client, S, backup_root=backups, log_root=logs, progress=slow))
    assert slow.planning.wait(30)
    first = run_restore(client, S, backup_root=backups, log_root=logs)  # finishes first: ACTIVE again
    assert first.loaded_entries == 30 and Admin(client).state(S) == "ACTIVE"
    for i in range(30, 35):  # clients work on it, each put acknowledged as committed
        conn.put("Q1", f"m-{i:02d}".encode())
        conn.commit()
    before = all_keys(client)

    slow.release.set()
    stale.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], RestoreError), outcome
    message = str(outcome[0])
    assert message.startswith("restore of APP1 refused: another restore restored the structure since this one "
                              "started"), message
    assert "nothing was written" in message
    assert all_keys(client) == before
    got = [body for body, _ in drain(qm.connect(), "Q1")]
    assert got == [f"m-{i:02d}".encode() for i in range(35)]
    qm.stop()


@pytest.mark.slow
def test_a_purge_while_a_restore_loads_stops_the_restore_at_its_next_batch(
        lost_with_a_backup: tuple[EmbeddedRedis, Path, Path]) -> None:
    """The operator gives up on a slow restore and purges the structure: the purge takes the structure over,
    and the restore writes nothing after it (it would otherwise load its plan over the purged structure)."""
    cf, logs, backups = lost_with_a_backup
    client = cf.client()
    purged: list[object] = []

    def progress(phase: str, done: int, total: int | None) -> None:
        if phase == LOAD and done >= 10_000 and not purged:
            purged.append(run_purge(cf.client(), S, backup_root=backups, log_root=logs))

    with pytest.raises(RestoreError) as stopped:
        run_restore(client, S, backup_root=backups, log_root=logs, progress=progress)
    assert str(stopped.value).startswith("restore of APP1 stopped: a later restore or a purge took the structure "
                                         "over"), stopped.value
    assert "nothing more was written" in str(stopped.value)
    assert Admin(client).state(S) == "ACTIVE" and client.hlen(keys.entries(S)) == 0
