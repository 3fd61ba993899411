"""Store migration's guards against serving a structure's messages nowhere or twice (backup.migrate;
docs/migration.md): no unload of a structure started WARM; no load back into a lost source CF; an unload that
fails on a full disk (a file-size limit here) leaves the source ACTIVE and nothing behind; an unload held by
SIGSTOP keeps its source from being reopened while its lease is live, and one reopened under it (its lease lapsed)
keeps nothing; a load that another load took over says so in one line; a killed unload's directory is reused.
Real redis-servers, real members, real unload and load processes stopped, continued and killed with signals."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backup import migrate
from backup.files import BackupError
from cfemu import keys
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from cfemu.repository import GroupRepository
from restore.start_modes import start
from tests.backup.test_migration import ROOT, S, backed_up_source, define, drain, fill
from tests.support.group import start_qm
from tests.support.harness import lose_cf

# A migrate command line in its own process, stopped (SIGSTOP) at a chosen point: "frozen" (right after the
# unload's freeze), "recorded" (the unload complete and recorded, before its final state change), "loading" (a
# load after its first batch); "-" for none. LEASE (environment) sets the unload's lease in seconds.
STOPPER = """
import os, signal, sys
from backup import migrate
from backup.files import BackupError
point = sys.argv[1]
stop = lambda: os.kill(os.getpid(), signal.SIGSTOP)
if point == "frozen":
    freeze = migrate._freeze_when_no_backup_runs
    def frozen(*a, **k):
        freeze(*a, **k)
        stop()
    migrate._freeze_when_no_backup_runs = frozen
elif point == "recorded":
    set_state = migrate._set_state
    def recorded(*a, **k):
        if k.get("to") == migrate.MIGRATED:
            stop()
        return set_state(*a, **k)
    migrate._set_state = recorded
elif point == "loading":
    batches = []
    def loading(name):
        batches.append(name)
        if len(batches) == 1:
            stop()
    migrate.failpoint = loading
if os.environ.get("LEASE"):
    unload = migrate.unload
    migrate.unload = lambda *a, **k: unload(*a, lease_s=float(os.environ["LEASE"]), **k)
from qsg.migrate_cli import main
sys.exit(main(sys.argv[2:]))
"""


_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_process_left() -> Iterator[None]:
    """A test that fails with its migrate process stopped kills it: no stopped process outlives the test."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)


def migrate_process(point: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", STOPPER, point, *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
    _STARTED.append(proc)
    return proc


def wait_stopped(proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        time.sleep(0.02)
    raise AssertionError("the migrate process did not reach its stop")


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def cli(*args: str, status: int, env: dict[str, str] | None = None, limit_bytes: int | None = None) -> str:
    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails (EFBIG), as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))  # type: ignore[arg-type]

    r = subprocess.run([sys.executable, "-m", "qsg.cli", "migrate", *args], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env={**os.environ, **(env or {})},
                       preexec_fn=limited if limit_bytes else None)
    assert r.returncode == status, (args, r.returncode, r.stdout, r.stderr)
    return r.stderr


def untouched(client: Any, repo: GroupRepository) -> None:
    """The source serves as before the failed or refused unload: ACTIVE, no migration in its header or the
    group repository."""
    header = {keys.text(k): keys.text(v) for k, v in client.hgetall(keys.meta(S)).items()}
    assert header.get("state") == "ACTIVE" and migrate.FIELD not in header and migrate.UNTIL not in header, header
    assert repo.migrated() == {}


def test_a_structure_started_warm_is_not_unloaded(fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """Started WARM after a CF loss, a structure's persistent content is in its backups and logs only: an unload
    would carry an empty store away and leave the committed messages served nowhere. Refused, nothing changed;
    once started HOT, it unloads every message."""
    url = fresh_redis.url
    roots: dict[str, Any] = {"backup_root": tmp_path / "backups", "log_root": tmp_path / "logs"}
    qm = backed_up_source(url, tmp_path)
    client = connect(url)
    try:
        lose_cf(fresh_redis.client())
        start(client, S, "WARM", **roots)
        assert Admin(client).state(S) == "ACTIVE"
        with pytest.raises(migrate.MigrationError, match=f"structure {S} runs from a WARM start: .*start it HOT or "
                                                         "COLD first"):
            migrate.unload(client, S, tmp_path / "mig", log_root=tmp_path / "logs")
        untouched(client, GroupRepository(tmp_path / "logs"))
        assert not (tmp_path / "mig").exists()
        start(client, S, "HOT", **roots)
        assert migrate.unload(client, S, tmp_path / "mig", log_root=tmp_path / "logs").entries == 6
    finally:
        qm.stop()


def test_an_unload_is_not_loaded_back_into_its_lost_source_cf(fresh_redis: EmbeddedRedis, redis_factory: Any,
                                                               tmp_path: Path) -> None:
    """After a migration the source CF is lost (restarted empty): its header and run id went with it, the group
    repository still records the migration. A load of the same unload into it is refused (the command line reads
    the repository from the settings' log root), so that the source group never serves beside the target."""
    url = fresh_redis.url
    qm = backed_up_source(url, tmp_path)
    try:
        migrate.unload(connect(url), S, tmp_path / "mig")
        migrate.load(redis_factory().client(), tmp_path / "mig", group="QSG2")
        fresh_redis.kill()  # the source CF is lost: restarted (a new run id) and empty
        fresh_redis.start()
        lose_cf(fresh_redis.client())
        lost = connect(fresh_redis.url)
        err = cli("load", str(tmp_path / "mig"), "--redis-url", url, "--report", str(tmp_path / "back.jsonl"),
                  status=2, env={"CFEMU_LOG_ROOT": str(tmp_path / "logs")})
        assert err.count("\n") == 1 and f"records structure {S} migrated away" in err, err
        assert "the target is its source" in err, err
        with pytest.raises(migrate.SameStoreError, match=f"records structure {S} migrated away"):
            migrate.load(lost, tmp_path / "mig", report=tmp_path / "back2.jsonl",
                         default_log_root=tmp_path / "logs")
        assert Admin(lost).state(S) == "FAILED" and not lost.hlen(keys.entries(S))
        assert not (tmp_path / "back.jsonl").exists()
    finally:
        qm.stop()


def test_an_unload_that_fills_the_disk_leaves_the_source_active_and_nothing_behind(
        fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """A write of the unload fails (a file-size limit: EFBIG, as ENOSPC on a full disk; the report's flush fails
    again in the cleanup): the source is ACTIVE again, its members' work accepted, nothing of the unload stays,
    the error is one line naming the directory. With room, the same unload goes through."""
    url = fresh_redis.url
    define(url)
    qm = start_qm(url, tmp_path / "logs", "QM1", background=False)
    try:
        fill(qm, 2000, per_uow=500)
        err = cli("unload", S, "--to", str(tmp_path / "mig"), "--redis-url", url, status=2, limit_bytes=64_000)
        assert err.count("\n") == 1 and f"writing the unload into {tmp_path / 'mig'} failed" in err, err
        untouched(connect(url), GroupRepository(tmp_path / "logs"))
        assert not (tmp_path / "mig").exists()
        c = qm.connect()
        c.put("Q2", b"served")
        c.commit()
        c.close()
        cli("unload", S, "--to", str(tmp_path / "mig"), "--redis-url", url, status=0)
        assert Admin(connect(url)).state(S) == migrate.MIGRATED
    finally:
        qm.stop()


def test_an_unload_that_runs_is_not_reopened_under_it(fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """An unload held by SIGSTOP right after its freeze holds a live lease: reopen is refused, and continued, the
    unload completes."""
    url = fresh_redis.url
    qm = backed_up_source(url, tmp_path)
    try:
        proc = migrate_process("frozen", "unload", S, "--to", str(tmp_path / "mig"), "--redis-url", url)
        wait_stopped(proc)
        with pytest.raises(migrate.MigrationError, match=f"structure {S}: the unload of migration .* is running"):
            migrate.reopen(connect(url), S)
        assert migrate.status(connect(url), S)["meaning"].startswith("being unloaded (its lease has")
        err = cli("reopen", S, "--confirm", S, "--redis-url", url, status=2)
        assert err.count("\n") == 1 and "is running" in err, err
        rc, out, err = finish(proc)
        assert rc == 0 and "the source is now MIGRATED" in out, (out, err)
        assert Admin(connect(url)).state(S) == migrate.MIGRATED
    finally:
        qm.stop()


@pytest.mark.parametrize("point", ["frozen", "recorded"])
def test_an_unload_reopened_under_it_keeps_nothing(point: str, fresh_redis: EmbeddedRedis, redis_factory: Any,
                                                   tmp_path: Path) -> None:
    """An unload held by SIGSTOP past its lease (after its freeze; or complete, its manifest signed and its
    migration recorded, before its final state change) is reopened under it: continued, it finds the state
    changed and removes its unload and its repository record; nothing is left to load, and the source serves."""
    url = fresh_redis.url
    qm = backed_up_source(url, tmp_path)
    repo = GroupRepository(tmp_path / "logs")
    try:
        proc = migrate_process(point, "unload", S, "--to", str(tmp_path / "mig"), "--redis-url", url,
                               env={"LEASE": "0.5"})
        wait_stopped(proc)
        time.sleep(0.6)
        assert migrate.status(connect(url), S)["meaning"].startswith("an unload that died or stalled")
        assert migrate.reopen(connect(url), S)["state"] == "ACTIVE"
        rc, out, err = finish(proc)
        assert rc == 2 and err.count("\n") == 1, (out, err)
        untouched(connect(url), repo)
        assert not (tmp_path / "mig" / migrate.UNLOAD_DIR).exists()
        with pytest.raises(BackupError, match="no such backup directory"):
            migrate.load(redis_factory().client(), tmp_path / "mig", group="QSG2")
        assert drain(qm) == [b"m%d" % i for i in range(6)]
    finally:
        qm.stop()


def test_a_load_taken_over_by_another_says_so_in_one_line(fresh_redis: EmbeddedRedis, redis_factory: Any,
                                                          tmp_path: Path) -> None:
    """Two loads of one unload into one target: the first, held by SIGSTOP after its first batch, is taken over
    by a second (--restart); continued, it stops with one line that says so (exit status 2), no traceback."""
    url = fresh_redis.url
    qm = backed_up_source(url, tmp_path)
    try:
        migrate.unload(connect(url), S, tmp_path / "mig")
    finally:
        qm.stop()
    target = redis_factory()
    first = migrate_process("loading", "load", str(tmp_path / "mig"), "--redis-url", target.url, "--batch", "2",
                            "--report", str(tmp_path / "first.jsonl"))
    wait_stopped(first)
    second = migrate.load(target.client(), tmp_path / "mig", restart=True, report=tmp_path / "second.jsonl")
    assert second.entries == 6
    rc, out, err = finish(first)
    assert rc == 2 and err.count("\n") == 1, (out, err)
    assert f"another load or restore took structure {S} over" in err and "Traceback" not in err, err
    assert Admin(target.client()).state(S) == "ACTIVE" and target.client().hlen(keys.entries(S)) == 6


def test_a_killed_unload_s_directory_is_used_again(fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """An unload killed midway leaves its directory without a manifest: once the source is reopened, an unload
    into the same directory replaces what it left. A directory with anything else in it is refused."""
    url = fresh_redis.url
    qm = backed_up_source(url, tmp_path)
    try:
        proc = migrate_process("recorded", "unload", S, "--to", str(tmp_path / "mig"), "--redis-url", url,
                               env={"LEASE": "0.5"})
        wait_stopped(proc)
        (tmp_path / "mig" / migrate.UNLOAD_DIR / "manifest.json").unlink()  # as if killed before its manifest
        proc.kill()
        proc.communicate(timeout=60)
        time.sleep(0.6)
        migrate.reopen(connect(url), S)
        assert (tmp_path / "mig" / migrate.UNLOAD_REPORT).exists()
        done = migrate.unload(connect(url), S, tmp_path / "mig")
        assert done.entries == 6 and Admin(connect(url)).state(S) == migrate.MIGRATED
        migrate.reopen(connect(url), S)
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "notes.txt").write_text("mine")
        with pytest.raises(migrate.MigrationError, match="is not empty"):
            migrate.unload(connect(url), S, tmp_path / "other")
        assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
        untouched(connect(url), GroupRepository(tmp_path / "logs"))
    finally:
        qm.stop()
