"""The group's durable history (docs/architecture.md, "The group's durable history"): what must outlive the CF, and
what a restore must never cross: restore points, purges, definitions and members the CF lost, the one log root.
Each test breaks a rule the way a group would, against a real redis-server, real logs and, where the rule is kept
by a command, the real command line (subprocesses that resolve their settings as operators' do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from backup.catalog import OK, list_backups
from backup.run import run_backup
from cfemu import keys
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import BackedOutError, OutcomePendingError
from cfemu.procs import free_port
from restore.run import RestoreError, run_restore
from sqm.core.manager import QueueManager
from sqm.log import LogReader
from tests.restore.test_restore import drain, rejoin
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf as flush_cf

S = "APP1"


def tool(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120
         ) -> subprocess.CompletedProcess[str]:
    """One of the house's commands (cfemu: qsg.cli, cfrestore: restore.cli, sqm: sqm.cli) in a subprocess."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def ok(module: str, *args: str, env: dict[str, str] | None = None) -> str:
    r = tool(module, *args, env=env)
    assert r.returncode == 0, f"{module} {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def settings_env(url: str, logs: Path, backups: Path) -> dict[str, str]:
    """The group's settings as the environment gives them (no flags: the commands resolve them themselves)."""
    return {"REDIS_URL": url, "CFEMU_LOG_ROOT": str(logs), "CFEMU_BACKUP_DIR": str(backups),
            "CFEMU_CLUSTER_DIR": str(logs.parent / "no-cluster"), "CFEMU_CF_DIR": str(logs.parent / "no-cf")}


def lose_cf(client: redis.Redis, qms: list[QueueManager]) -> None:
    """The CF is lost (and comes back empty); the members stay up and re-join when it is back."""
    flush_cf(client)


def back(qms: list[QueueManager]) -> None:
    for qm in qms:
        rejoin(qm)
        qm._queue_cache.clear()


# --- restore points: a later restore starts at the last one --------------------------------------------------------
def test_a_get_that_reaches_the_disk_after_a_restore_is_not_replayed_by_the_next_one(
        redis_url: str, tmp_path: Path) -> None:
    """QM1 puts E and F; a backup; QM2's UOW U gets E (its GET appended, not forced); the CF is lost and
    restored: E comes back available, QM1 gets E and commits. Then QM2's log is forced (U's commit is refused as
    backed out) and U's stale GET reaches the disk. The CF is lost again before a new backup: the restore must
    not fold U's GET into E's history (it brought E back, backout count 1: E consumed twice)."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm1, qm2 = (start_qm(redis_url, logs, name, background=False) for name in ("QM1", "QM2"))
    try:
        a = qm1.connect()
        a.put("Q1", b"E")
        a.put("Q1", b"F")
        a.commit()
        run_backup(client, S, backups, log_root=logs)
        u = qm2.connect()
        assert u.get("Q1").body == b"E"  # U's GET is appended to QM2's log, not forced
        on_disk = [r["k"] for _, r in LogReader(logs / "QM2").records()]
        assert "GET" not in on_disk, "the GET must still be in QM2's buffer when the CF is lost"

        lose_cf(client, [qm1, qm2])
        first = run_restore(client, S, backup_root=backups, log_root=logs)
        back([qm1, qm2])
        taker = qm1.connect()
        assert taker.get("Q1").body == b"E"
        taker.commit()
        with pytest.raises(BackedOutError):  # U ran in the lost generation: refused, and QM2's log is forced
            u.commit()
        assert "GET" in [r["k"] for _, r in LogReader(logs / "QM2").records()]

        lose_cf(client, [qm1, qm2])  # again, before any new backup
        second = run_restore(client, S, backup_root=backups, log_root=logs)
        back([qm1, qm2])
        assert drain(qm2.connect(), "Q1") == [(b"F", 0)]  # E was consumed once, by QM1
        assert (second.backup_id, second.base_kind) == (first.restore_point, "restore")
    finally:
        for qm in (qm1, qm2):
            qm.stop()


def test_an_in_doubt_uow_stays_in_doubt_across_two_cf_losses_and_its_commit_counts_after_a_third(
        redis_url: str, tmp_path: Path) -> None:
    """The generation rule against a UOW carried across restores: its PREPARE and its later COMMIT come from the
    first generation, yet they decide the entries it holds in the restore point."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        setup = qm.connect()
        setup.put("Q1", b"got-by-D")
        setup.commit()
        d = qm.connect()
        d.put("Q1", b"put-by-D")
        assert d.get("Q1").body == b"got-by-D"
        uow = d.prepare("xid-D")
        run_backup(client, S, backups, log_root=logs)
        for _ in range(2):
            lose_cf(client, [qm])
            result = run_restore(client, S, backup_root=backups, log_root=logs)
            assert result.in_doubt_uows == {uow: "QM1"} and result.counts["in-doubt"] == 2
            back([qm])
        qm.resolve(uow, True)
        lose_cf(client, [qm])
        result = run_restore(client, S, backup_root=backups, log_root=logs)
        back([qm])
        assert result.in_doubt_uows == {} and drain(qm.connect(), "Q1") == [(b"put-by-D", 0)]
        assert result.base_kind == "restore"
    finally:
        qm.stop()


def test_a_commit_completed_by_restore_is_still_known_after_the_next_cf_loss(
        redis_url: str, tmp_path: Path) -> None:
    """An in-commit UOW completed by the first restore (its owner had not applied it): the restore point keeps
    the tombstone, so the owner's retry after the second restore is a no-op, not a backout of a committed UOW."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        run_backup(client, S, backups, log_root=logs)
        conn = qm.connect()
        conn.put("Q1", b"in-commit")
        client.hset(keys.meta(S), "state", "FAILED")  # the CF fails between the forced COMMIT and its update
        with pytest.raises(OutcomePendingError):
            conn.commit()
        assert qm.pending
        for _ in range(2):
            lose_cf(client, [qm])
            run_restore(client, S, backup_root=backups, log_root=logs)
            back([qm])
        assert qm.retry_pending() == 1
        assert qm.log is not None
        qm.log.force()
        assert "BACKOUT" not in [r["k"] for _, r in LogReader(logs / "QM1").records()]
        assert drain(qm.connect(), "Q1") == [(b"in-commit", 0)]
    finally:
        qm.stop()


# --- purges: a purge is a restore point too ------------------------------------------------------------------------
def test_purged_messages_do_not_come_back_after_a_later_cf_loss(redis_url: str, tmp_path: Path) -> None:
    """`cfrestore purge APP1` (its settings from the environment), more work, then a CF loss: the restore starts
    at the purge, not at the backup taken before it."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        conn = qm.connect()
        conn.put("Q1", b"purged-1")
        conn.put("Q1", b"purged-2")
        conn.commit()
        run_backup(client, S, backups, log_root=logs)
        out = json.loads(ok("restore.cli", "purge", S, "--mark-failed", "--json",
                            env=settings_env(redis_url, logs, backups)))
        assert out["discarded"] == 2
        conn.put("Q1", b"after the purge")
        conn.commit()
        lose_cf(client, [qm])
        result = run_restore(client, S, backup_root=backups, log_root=logs)
        back([qm])
        assert drain(qm.connect(), "Q1") == [(b"after the purge", 0)]
        assert (result.backup_id, result.base_kind) == (out["restore_point"], "purge")
    finally:
        qm.stop()


def test_a_purge_discards_messages_not_the_outcome_of_uows_on_other_structures(
        redis_url: str, tmp_path: Path) -> None:
    """A purge discards a structure's messages, not the outcome of UOWs that span it: a UOW on APP1 and APP2 whose
    commit was logged while APP1 had failed (the application was told its outcome is pending), and an in-doubt
    one; APP1 is purged. The owner's retry meets APP1's new generation and still completes the commit on APP2
    (never BACKOUT, never APP2 work left locked), and the coordinator's commit of the in-doubt one completes too."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    admin = Admin(client)
    admin.define_structure("APP2")
    admin.define_queue("Q3", "APP2")
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        a = qm.connect()
        a.put("Q1", b"purged")
        a.put("Q3", b"committed on APP2")
        d = qm.connect()
        d.put("Q1", b"purged too")
        d.put("Q3", b"in doubt on APP2")
        uow = d.prepare("xid-1")
        client.hset(keys.meta(S), "state", "FAILED")
        with pytest.raises(OutcomePendingError):
            a.commit()  # logged: the commit waits for APP1
        assert qm.pending
        ok("restore.cli", "purge", S, env=settings_env(redis_url, logs, backups))
        assert qm.retry_pending() == 1
        qm.resolve(uow, True)
        assert qm.log is not None
        qm.log.force()
        assert "BACKOUT" not in [r["k"] for _, r in LogReader(logs / "QM1").records()]
        got = qm.connect()
        assert drain(got, "Q3") == [(b"committed on APP2", 0), (b"in doubt on APP2", 0)]
        assert drain(got, "Q1") == []
    finally:
        qm.stop()


# --- definitions the CF lost: the group repository -----------------------------------------------------------------
@pytest.fixture
def cli_group(redis_url: str, tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """APP1 with queue Q1, defined by `cfemu define` (settings from the environment)."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    env = settings_env(redis_url, logs, backups)
    ok("qsg.cli", "define", "structure", S, env=env)
    ok("qsg.cli", "define", "queue", "Q1", "--structure", S, env=env)
    return env, logs, backups


def test_a_queue_defined_after_the_last_backup_is_defined_again_by_restore(
        redis_url: str, cli_group: tuple[dict[str, str], Path, Path]) -> None:
    env, logs, backups = cli_group
    client = connect(redis_url)
    ok("qsg.cli", "put", "Q1", "before", env=env)
    run_backup(client, S, backups, log_root=logs)
    ok("qsg.cli", "define", "queue", "Q3", "--structure", S, env=env)
    ok("qsg.cli", "put", "Q3", "on Q3", env=env)
    flush_cf(client)
    run_restore(client, S, backup_root=backups, log_root=logs)
    got = json.loads(ok("qsg.cli", "get", "Q3", "--json", env=env))
    assert [m["body"] for m in got["messages"]] == ["on Q3"]


def test_a_structure_never_backed_up_is_restored_from_its_definition_and_the_logs(
        redis_url: str, cli_group: tuple[dict[str, str], Path, Path]) -> None:
    env, logs, backups = cli_group
    client = connect(redis_url)
    run_backup(client, S, backups, log_root=logs)
    ok("qsg.cli", "define", "structure", "APP2", env=env)
    ok("qsg.cli", "define", "queue", "Q5", "--structure", "APP2", env=env)
    ok("qsg.cli", "put", "Q5", "never backed up", env=env)
    flush_cf(client)
    out = json.loads(ok("restore.cli", "run", "APP2", "--json", env=env))
    # from its definition, or from the logs alone when a member's relog pass made a window (docs/log-management.md):
    # either way the definitions come from the group repository
    assert out["base_kind"] in ("definition", "logs") and out["loaded_entries"] == 1
    got = json.loads(ok("qsg.cli", "get", "Q5", "--json", env=env))
    assert [m["body"] for m in got["messages"]] == ["never backed up"]
    # It has a restore point now: the next loss restores from there.
    assert [b.manifest["kind"] for b in list_backups(backups, "APP2") if b.manifest] == ["restore"]


def test_status_shows_the_last_backup_after_a_restore(
        redis_url: str, cli_group: tuple[dict[str, str], Path, Path]) -> None:
    env, logs, backups = cli_group
    client = connect(redis_url)
    run_backup(client, S, backups, log_root=logs)
    flush_cf(client)
    run_restore(client, S, backup_root=backups, log_root=logs)
    (app1,) = json.loads(ok("qsg.cli", "status", "--json", env=env))["structures"]
    assert app1["last_backup"] is not None and app1["last_backup_age_s"] is not None
    on_disk = {b.id for b in list_backups(backups, S) if b.state == OK}
    assert {b["id"] for b in Admin(client).backups(S)} == on_disk and len(on_disk) == 2


def test_defining_again_a_structure_the_cf_lost_is_refused(
        redis_url: str, cli_group: tuple[dict[str, str], Path, Path]) -> None:
    """Defining APP1 again, empty, over its history would hide its committed messages: restore it instead."""
    env, _, _ = cli_group
    flush_cf(connect(redis_url))
    r = tool("qsg.cli", "define", "structure", S, env=env)
    assert r.returncode == 2 and "restore it with 'cfrestore run APP1'" in r.stderr
    assert Admin(connect(redis_url)).structures() == []


# --- membership and the one log root -------------------------------------------------------------------------------
def test_sqm_run_with_a_log_root_that_is_not_the_groups_is_refused(redis_url: str, tmp_path: Path) -> None:
    """`sqm run --name QM3 --log-root /elsewhere` must not join: its work would be invisible to peer recovery,
    backup and restore, which read the group's log root."""
    logs, backups, elsewhere = tmp_path / "logs", tmp_path / "backups", tmp_path / "elsewhere"
    client = define_group(redis_url, queues=("Q1",))
    qm1 = start_qm(redis_url, logs, "QM1", background=False)
    try:
        run_backup(client, S, backups, log_root=logs)
        ready = tmp_path / "QM3.ready"
        proc = subprocess.Popen(
            [sys.executable, "-m", "sqm.cli", "run", "--name", "QM3", "--log-root", str(elsewhere), "--redis-url",
             redis_url, "--port", str(free_port("127.0.0.1")), "--ready-file", str(ready), "--no-auth"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 60
            while proc.poll() is None and not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            joined = ready.exists()
        finally:
            if proc.poll() is None:
                proc.kill()
            output = proc.communicate()[0]
        assert not joined, "QM3 joined the group with a log root restore does not read"
        assert proc.returncode == 2, output
        assert "QM3: the log root" in output and str(logs / "_group") in output
        assert "QM3" not in Admin(client).members()
        assert not (elsewhere / "QM3").exists()  # refused before it created anything
    finally:
        qm1.stop()


def test_restore_refuses_while_a_member_the_group_knows_has_no_log_under_the_log_root(
        redis_url: str, tmp_path: Path) -> None:
    """QM3 joins after the last backup and commits 2 messages; its log is not under the log root when the
    structure is restored: plan and run must refuse, naming QM3 and where its log is, whether the CF still
    lists it or the CF was lost (the group repository remembers it)."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm1 = start_qm(redis_url, logs, "QM1", background=False)
    try:
        run_backup(client, S, backups, log_root=logs)
        qm3 = start_qm(redis_url, logs, "QM3", background=False)
        conn = qm3.connect()
        conn.put("Q1", b"one")
        conn.put("Q1", b"two")
        conn.commit()
        qm3.stop(checkpoint=False)  # as a crash leaves it: still listed in the admin structure
        (logs / "QM3").rename(tmp_path / "QM3-elsewhere")
        with pytest.raises(RestoreError, match=r"no log for member QM3 under .*bring it back"):
            run_restore(client, S, backup_root=backups, log_root=logs, dry_run=True)
        flush_cf(client)  # the CF is lost: only the group repository knows QM3 now
        with pytest.raises(RestoreError, match=r"no log for member QM3 under .*bring it back"):
            run_restore(client, S, backup_root=backups, log_root=logs)
        (tmp_path / "QM3-elsewhere").rename(logs / "QM3")
        run_restore(client, S, backup_root=backups, log_root=logs)
        back([qm1])
        assert drain(qm1.connect(), "Q1") == [(b"one", 0), (b"two", 0)]
    finally:
        qm1.stop()
