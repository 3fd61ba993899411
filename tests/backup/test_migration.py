"""Store migration (backup.migrate; docs/migration.md): a structure filled by real members (plain messages in large
units of work, UOWs sent to a service and their statuses) is unloaded from one real redis-server and loaded into
another under another group; the reports compare equal and the target serves the same messages in the same order and
the same UOW statuses; the handshake's refusals; a tampered report and a partial load (SIGKILL at a failpoint) are
detected; the source stays MIGRATED (members refused, RECAUTO not triggered) until it is reopened.

The 100k-message migration is ``soak`` (opt-in: ``pytest -m soak tests/backup/test_migration.py``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from backup import migrate
from backup.files import MANIFEST_NAME, sign_manifest
from backup.migrate_report import PartialReportError, TamperedReportError, compare, read_report
from backup.run import run_backup
from cfemu import keys, rcluster
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect
from cfemu.credentials import BackupKeys
from cfemu.embedded import EmbeddedRedis
from cfemu.embedded_rcluster import EmbeddedCluster
from cfemu.errors import BackupEndedError, NoMessageError, StructureFailedError
from cfemu.repository import GroupRepository
from restore.run import RestoreError, run_restore
from restore.start_modes import automatic_start, start
from sqm.conversations.conversation import SYNC, Conversation
from sqm.core.manager import QueueManager
from sqm.core.recauto import StructureRecovery
from tests.support.group import start_qm
from tests.support.harness import lose_cf

S, Q, SVC = "APP1", "Q1", "SVC"
ROOT = Path(__file__).resolve().parents[2]


def define(url: str) -> None:
    admin = Admin(connect(url))
    admin.ensure_structure(S, (Q, "Q2"))
    admin.define_queue(SVC, S, uow={"status_lifetime": 3})  # persistent statuses, kept after a UOW ends


def fill(qm: QueueManager, messages: int, *, per_uow: int = 1000, uows: int = 6) -> dict[str, Any]:
    """Plain messages put by a real member in large UOWs (priorities 0-2), and UOWs sent to the service: half left
    ACCEPTED, half received and committed (PROCESSED, their status kept)."""
    conn = qm.connect()
    for i in range(messages):
        conn.put(Q, b"m%06d" % i, priority=i % 3)
        if (i + 1) % per_uow == 0:
            conn.commit()
    conn.commit()
    conn.put("Q2", b"not persistent", persistent=False)
    conn.commit()
    conn.close()
    snd, rcv = Conversation(qm, "alice", "tok-a"), Conversation(qm, "bob", "tok-b")
    sent = []
    for u in range(uows):
        uow = ""
        for k in range(3):
            uow = snd.send(SVC, b"u%d-%d" % (u, k)).uow
        snd.commit()
        sent.append(uow)
    for _ in range(uows // 2):
        for _ in range(3):
            rcv.receive(SVC, option=SYNC)
        rcv.commit()
    statuses = {u: snd.query(u)["status"] for u in sent}
    snd.close()
    rcv.close()
    return statuses


def order_of(client: redis.Redis) -> list[Any]:
    """Q1's messages in get order (priority 9 first, then each list in order), read from the CF."""
    out = []
    for p in range(9, -1, -1):
        ids = [keys.text(x) for x in client.lrange(keys.state_list(S, Q, "CP", p), 0, -1)]
        out += client.hmget(keys.data(S), ids) if ids else []
    return out


@pytest.fixture
def source(redis_url: str, tmp_path: Path) -> Iterator[tuple[QueueManager, dict[str, Any]]]:
    define(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    statuses = fill(qm, 2500, per_uow=500)
    yield qm, statuses
    qm.stop()


@pytest.fixture
def target(fresh_redis: EmbeddedRedis) -> redis.Redis:
    return fresh_redis.client()


def test_a_structure_moves_to_another_cf_and_group_and_the_reports_compare_equal(
        source: tuple[QueueManager, dict[str, Any]], redis_url: str, target: redis.Redis, tmp_path: Path) -> None:
    qm, statuses = source
    src = connect(redis_url)
    before = order_of(src)
    assert len(before) == 2500
    done = migrate.unload(src, S, tmp_path / "mig")
    # Q1, Q2, the unreceived UOWs' messages; a status per UOW, alice's LAST pointer, a conversation per UOW
    assert done.by_type == {"message": 2500 + 1 + 9, "uow-status": 6, "uow-last": 1, "conversation": 6}
    assert Admin(src).state(S) == migrate.MIGRATED
    # the source serves nothing now: a member's put is refused as on a failed structure...
    with pytest.raises(StructureFailedError, match="MIGRATED"):
        c = qm.connect()
        c.put(Q, b"late")
    # ...and no member takes it for a lost CF: RECAUTO restores only FAILED (or its own dead RECOVERING) structures
    recovered: list[str] = []

    def recover(name: str, progress: Any) -> dict[str, Any]:
        recovered.append(name)
        return {}

    recauto = StructureRecovery(qm, recover)
    qm.repository.record_structure(Admin(src).structure_def(S), 1)  # type: ignore[union-attr]
    assert recauto.check(now=1e9) == [] and recovered == []

    loaded = migrate.load(target, tmp_path / "mig", group="QSG2", log_root=tmp_path / "target-logs")
    assert (loaded.entries, loaded.state, loaded.group) == (done.entries, "ACTIVE", "QSG2")
    result = compare(read_report(tmp_path / "mig" / migrate.UNLOAD_REPORT),
                     read_report(tmp_path / "mig" / migrate.LOAD_REPORT))
    assert result.equal, result.differences
    assert result.by_type["definition"] == [6, 6]  # the structure, Q1, Q2, SVC and its two companions
    assert order_of(target) == before
    assert Admin(target).group_name() == "QSG2" and Admin(target).queue_def(SVC).uow["status_lifetime"] == 3

    # a member of the target group gets the messages in the source's order, and the UOWs with their statuses
    url = f"redis://{target.connection_pool.connection_kwargs['host']}:{target.connection_pool.connection_kwargs['port']}"
    qm2 = start_qm(url, tmp_path / "target-logs", "QM9", background=False)
    try:
        conv = Conversation(qm2, "alice", "tok-a")
        assert {u: conv.query(u)["status"] for u in statuses} == statuses
        rcv = Conversation(qm2, "bob", "tok-b")
        got = [rcv.receive(SVC, option=SYNC).body for _ in range(3)]
        assert got[0].startswith(b"u3-") and rcv.commit()["status"] == "PROCESSED"
        c = qm2.connect()
        assert [c.get(Q).body for _ in range(5)] == before[:5]
        c.commit()
        conv.close()
        rcv.close()
    finally:
        qm2.stop()
    # once FAILED (as a CF loss leaves it), the group repository's record of the migration keeps it away...
    Admin(src).set_state(S, "FAILED")
    assert recauto.check(now=2e9) == [] and recovered == []
    # ...until it is reopened, its target given up (loaded, it serves the messages): then the same check recovers it
    with pytest.raises(migrate.LoadedElsewhereError, match="reopen with --target-given-up"):
        migrate.reopen(src, S)
    assert migrate.reopen(src, S, target_given_up=True)["restore_needed"]
    assert recauto.check(now=3e9) == [S] and recauto.wait(10) and recovered == [S]


def test_the_load_refuses_the_same_store_a_full_target_another_format_and_a_foreign_queue(
        source: tuple[QueueManager, dict[str, Any]], redis_url: str, target: redis.Redis, tmp_path: Path,
        group_backup_key: BackupKeys) -> None:
    src = connect(redis_url)
    migrate.unload(src, S, tmp_path / "mig")
    with pytest.raises(migrate.SameStoreError, match="the target is the source store"):
        migrate.load(src, tmp_path / "mig")
    Admin(target).ensure_structure(S, ("OTHER",))
    target.hset(keys.entries(S), "x", b"?")
    with pytest.raises(migrate.TargetNotEmptyError, match="not empty \\(1 entries\\)"):
        migrate.load(target, tmp_path / "mig")
    target.flushall()
    Admin(target).ensure_structure("ELSE", (Q,))
    with pytest.raises(migrate.HandshakeError, match="queue Q1 is defined in the target on structure ELSE"):
        migrate.load(target, tmp_path / "mig")
    target.flushall()
    manifest_path = tmp_path / "mig" / migrate.UNLOAD_DIR / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["migration"]["format"] = 99
    assert group_backup_key.current is not None
    manifest_path.write_text(json.dumps(sign_manifest(manifest, group_backup_key.current)))
    with pytest.raises(migrate.HandshakeError, match="unload format 99; this tool loads format 1"):
        migrate.load(target, tmp_path / "mig")
    assert target.dbsize() == 0  # every refusal came before anything was written
    migrate.reopen(src, S)
    assert Admin(src).state(S) == "ACTIVE"


def test_an_unload_waits_for_no_unit_of_work_and_leaves_the_source_active_when_refused(
        source: tuple[QueueManager, dict[str, Any]], redis_url: str, tmp_path: Path) -> None:
    qm, _ = source
    c = qm.connect()
    c.put(Q, b"in flight")
    with pytest.raises(migrate.MigrationError, match="1 units of work hold entries on it"):
        migrate.unload(connect(redis_url), S, tmp_path / "mig")
    assert Admin(connect(redis_url)).state(S) == "ACTIVE" and not (tmp_path / "mig" / "unload").exists()
    c.commit()
    cf = CF(connect(redis_url)).structure(S)
    cf.backup_begin("B1", 1)
    with pytest.raises(migrate.MigrationError, match="backup B1 is running; unload once it has ended"):
        migrate.unload(connect(redis_url), S, tmp_path / "mig")
    cf.backup_end("B1", 2, False)
    migrate.unload(connect(redis_url), S, tmp_path / "mig")
    with pytest.raises(migrate.HandshakeError, match="is MIGRATED .*reopen it first"):
        migrate.unload(connect(redis_url), S, tmp_path / "mig2")


def test_an_unload_after_a_backup_that_died_is_not_refused_by_its_stale_mark(
        source: tuple[QueueManager, dict[str, Any]], redis_url: str, tmp_path: Path) -> None:
    """A backup that died (SIGKILL: nothing cleared its mark) does not refuse an unload once its mark's lease has
    ended: the unload goes on, clears the mark, and the dead backup cannot end well."""
    cf = CF(connect(redis_url)).structure(S)
    cf.backup_begin("B1", 1, lease_ms=1)
    time.sleep(0.01)
    migrate.unload(connect(redis_url), S, tmp_path / "mig")
    assert Admin(connect(redis_url)).state(S) == "MIGRATED" and "backup" not in cf.info()
    with pytest.raises(BackupEndedError):
        cf.backup_end("B1", 2, True)


def backed_up_source(url: str, tmp_path: Path) -> QueueManager:
    """APP1 with six messages put by a real member: five in its backup, the sixth in its log only."""
    Admin(connect(url)).ensure_structure(S, (Q,))
    qm = start_qm(url, tmp_path / "logs", "QM1", background=False)
    c = qm.connect()
    for i in range(5):
        c.put(Q, b"m%d" % i)
    c.commit()
    run_backup(connect(url), S, tmp_path / "backups", log_root=tmp_path / "logs")
    c.put(Q, b"m5")
    c.commit()
    return qm


def drain(qm: QueueManager) -> list[bytes]:
    c, out = qm.connect(), []
    while True:
        try:
            out.append(c.get(Q).body)
        except NoMessageError:
            c.backout()
            return out


def cfemu_migrate(*args: str, status: int = 0) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "qsg.cli", "migrate", *args], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == status, (args, r.returncode, r.stdout, r.stderr)
    return r


def test_a_source_whose_cf_is_lost_after_the_migration_is_not_restored_beside_its_target(
        fresh_redis: EmbeddedRedis, redis_factory: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A migrated source stays migrated after its CF is lost: the MIGRATED header goes with the source CF, the
    group repository's record does not (docs/migration.md). RECAUTO
    (HOT), cfrestore run and every start mode refuse the lost source until 'cfemu migrate reopen' clears it."""
    url = fresh_redis.url
    qm = backed_up_source(url, tmp_path)
    try:
        done = migrate.unload(connect(url), S, tmp_path / "mig")
        migrate.load(redis_factory().client(), tmp_path / "mig", group="QSG2")
        lose_cf(fresh_redis.client())
        lost = fresh_redis.client()
        roots: dict[str, Any] = {"backup_root": tmp_path / "backups", "log_root": tmp_path / "logs"}
        why = f"structure {S} was migrated \\(migration {done.migration}.*'cfemu migrate reopen {S} --confirm {S}'"
        with pytest.raises(RestoreError, match=why):
            automatic_start(lost, S, **roots)
        with pytest.raises(RestoreError, match=why):
            run_restore(lost, S, **roots)
        for mode in ("HOT", "WARM", "COLD"):
            with pytest.raises(RestoreError, match=why):
                start(lost, S, mode, **roots)
        # a member's RECAUTO does not even try, and says why once
        recovered: list[str] = []

        def recover(name: str, progress: Any) -> dict[str, Any]:
            recovered.append(name)
            return {}

        recauto = StructureRecovery(qm, recover)
        with caplog.at_level(logging.WARNING, logger="sqm.core.recauto"):
            assert recauto.check(now=1e9) == [] and recauto.check(now=2e9) == []
        said = [r.getMessage() for r in caplog.records if "CSQE138W" in r.getMessage()]
        assert recovered == [] and len(said) == 1 and f"cfemu migrate reopen {S}" in said[0], said
        assert Admin(lost).state(S) == "FAILED"
        st = migrate.status(lost, S, log_root=tmp_path / "logs")
        assert st["migration"] == done.migration and st["meaning"].startswith("migrated"), st
        # reopen (the CF lost its record of the repository too: --log-root names it); it says what it means
        err = cfemu_migrate("reopen", S, "--redis-url", url, "--log-root", str(tmp_path / "logs"), status=2).stderr
        assert err.count("\n") == 1 and "applications get the same messages twice" in err
        out = cfemu_migrate("reopen", S, "--redis-url", url, "--log-root", str(tmp_path / "logs"), "--confirm",
                            S, "--target-given-up").stdout
        assert "restores it from its backups and logs, and it serves again: its target must not" in out, out
        assert GroupRepository(tmp_path / "logs").migrated() == {}
        # the operator's choice now: restored, it serves every message again
        automatic_start(lost, S, **roots)
        assert drain(qm) == [b"m%d" % i for i in range(6)]
    finally:
        qm.stop()


def test_no_start_mode_and_no_restore_starts_a_migrating_or_migrated_source(fresh_redis: EmbeddedRedis,
                                                                           tmp_path: Path) -> None:
    """No start mode and no restore brings a migrating or MIGRATED source back to ACTIVE ('cfemu pstore start APP1
    --mode HOT' included)."""
    url = fresh_redis.url
    client = connect(url)
    qm = backed_up_source(url, tmp_path)
    roots: dict[str, Any] = {"backup_root": tmp_path / "backups", "log_root": tmp_path / "logs"}
    try:
        migrate.unload(client, S, tmp_path / "mig")
        for mode in ("HOT", "WARM", "COLD"):
            with pytest.raises(RestoreError, match=f"structure {S} is MIGRATED, a store migration's source: "
                                                   f"starting \\({mode}\\) it .*'cfemu migrate reopen {S}"):
                start(client, S, mode, **roots)
        with pytest.raises(RestoreError, match="is MIGRATED, a store migration's source: restoring it"):
            run_restore(client, S, mark_failed=True, **roots)
        assert Admin(client).state(S) == migrate.MIGRATED
        assert migrate.reopen(client, S)["state"] == "ACTIVE" and GroupRepository(tmp_path / "logs").migrated() == {}
        migrate.freeze(client, S, "M-1")  # an unload under way: its lease is live
        with pytest.raises(RestoreError, match="is MIGRATING, a store migration's source"):
            start(client, S, "HOT", **roots)
        with pytest.raises(migrate.MigrationError, match="the unload of migration M-1 is running"):
            migrate.reopen(client, S)
        assert Admin(client).state(S) == migrate.MIGRATING
        client.hset(keys.meta(S), migrate.UNTIL, 1)  # one that died: its lease has run out
        assert migrate.reopen(client, S)["state_before"] == migrate.MIGRATING
        with pytest.raises(migrate.MigrationError, match="is ACTIVE and the group repository .* records no migration"):
            migrate.reopen(client, S)
        assert drain(qm) == [b"m%d" % i for i in range(6)]
    finally:
        qm.stop()


def test_an_unload_needs_the_group_repository_and_a_failed_one_records_nothing(
        redis_url: str, fresh_redis: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    define(redis_url)  # no member joined: the CF records no group repository
    client = connect(redis_url)
    with pytest.raises(migrate.MigrationError, match="the CF records no group repository: give the group's log root"):
        migrate.unload(client, S, tmp_path / "mig")
    assert Admin(client).state(S) == "ACTIVE" and not (tmp_path / "mig").exists()
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)  # joins: the CF records its repository
    repo = GroupRepository(tmp_path / "logs")
    try:
        with pytest.raises(migrate.MigrationError, match="is not the group repository the CF records"):
            migrate.unload(client, S, tmp_path / "mig", log_root=tmp_path / "elsewhere")
        real = migrate._set_state

        def header_refuses(c: redis.Redis, structure: str, *, to: str, expect: tuple[str, ...],
                           migration: str | None = None) -> str:
            if to == migrate.MIGRATED:
                raise migrate.MigrationError("the header changed under the unload")
            return real(c, structure, to=to, expect=expect, migration=migration)

        monkeypatch.setattr(migrate, "_set_state", header_refuses)
        with pytest.raises(migrate.MigrationError, match="the header changed"):
            migrate.unload(client, S, tmp_path / "mig")
        assert Admin(client).state(S) == "ACTIVE" and repo.migrated() == {}
        monkeypatch.undo()
        done = migrate.unload(client, S, tmp_path / "mig2")
        assert repo.migrated()[S]["migration"] == done.migration
        # a load into a group whose repository records the name migrated away: restore would refuse what it loads
        with pytest.raises(migrate.HandshakeError, match=f"records structure {S} migrated away"):
            migrate.load(fresh_redis.client(), tmp_path / "mig2", log_root=tmp_path / "logs")
        assert fresh_redis.client().dbsize() == 0
    finally:
        qm.stop()


def test_a_tampered_report_is_detected(source: tuple[QueueManager, dict[str, Any]], redis_url: str,
                                       target: redis.Redis, tmp_path: Path) -> None:
    migrate.unload(connect(redis_url), S, tmp_path / "mig")
    migrate.load(target, tmp_path / "mig", structure="APP9")
    unload_report, load_report = tmp_path / "mig" / migrate.UNLOAD_REPORT, tmp_path / "mig" / migrate.LOAD_REPORT
    assert compare(read_report(unload_report), read_report(load_report)).equal  # under another name, too
    lines = load_report.read_bytes().splitlines(keepends=True)
    rec = json.loads(lines[10])
    for change in ({"length": rec["length"] + 1}, {"digest": "0" * 64}):
        altered = tmp_path / f"altered-{len(change)}-{next(iter(change))}.jsonl"
        altered.write_bytes(b"".join([*lines[:10], json.dumps({**rec, **change}).encode() + b"\n", *lines[11:]]))
        with pytest.raises(TamperedReportError, match="do not match its trailer"):
            read_report(altered)
    dropped = tmp_path / "dropped.jsonl"
    dropped.write_bytes(b"".join([*lines[:10], *lines[11:]]))
    with pytest.raises(TamperedReportError):
        read_report(dropped)
    # a forger who recomputes the digest and count still lacks the key
    body = b"".join([*lines[:10], *lines[11:-1]])
    end = json.loads(lines[-1])
    end["end"].update(records=end["end"]["records"] - 1, sha256=__import__("hashlib").sha256(body).hexdigest())
    forged = tmp_path / "forged.jsonl"
    forged.write_bytes(body + json.dumps(end).encode() + b"\n")
    with pytest.raises(TamperedReportError, match="signature does not match"):
        read_report(forged)


def test_a_load_killed_midway_is_detected_and_started_over(
        source: tuple[QueueManager, dict[str, Any]], redis_url: str, fresh_redis: EmbeddedRedis,
        tmp_path: Path) -> None:
    migrate.unload(connect(redis_url), S, tmp_path / "mig")
    env = {**os.environ, "SQM_FAILPOINTS": "migrate-load-batch=3"}
    r = subprocess.run([sys.executable, "-m", "qsg.cli", "migrate", "load", str(tmp_path / "mig"), "--redis-url",
                        fresh_redis.url, "--batch", "200", "--json"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=env)
    assert r.returncode == -9, (r.returncode, r.stdout, r.stderr)  # SIGKILL after the third batch
    report = tmp_path / "mig" / migrate.LOAD_REPORT
    with pytest.raises(PartialReportError, match="ends after 606 records without its trailer: the load did not"):
        read_report(report)  # 6 definitions, then 3 batches of 200
    target = fresh_redis.client()
    st = migrate.status(target, S)
    assert st["state"] == "RECOVERING" and st["entries"] == 600 and "killed midway" in st["meaning"]
    with pytest.raises(migrate.TargetNotEmptyError, match="partial load .* start it over with --restart"):
        migrate.load(target, tmp_path / "mig")
    migrate.load(target, tmp_path / "mig", restart=True)
    assert compare(read_report(tmp_path / "mig" / migrate.UNLOAD_REPORT), read_report(report)).equal


@pytest.mark.slow
def test_the_command_line(source: tuple[QueueManager, dict[str, Any]], redis_url: str,
                          fresh_redis: EmbeddedRedis, redis_factory: Any, tmp_path: Path) -> None:
    def cfemu(*args: str, status: int = 0) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([sys.executable, "-m", "qsg.cli", "migrate", *args], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
        assert r.returncode == status, (args, r.returncode, r.stdout, r.stderr)
        return r

    d = json.loads(cfemu("unload", S, "--to", str(tmp_path / "mig"), "--redis-url", redis_url, "--json").stdout)
    assert d["state"] == "MIGRATED" and d["by_type"]["uow-status"] == 6
    assert json.loads(cfemu("status", S, "--redis-url", redis_url, "--json").stdout)["state"] == "MIGRATED"
    err = cfemu("load", str(tmp_path / "mig"), status=2).stderr
    assert err.count("\n") == 1 and "needs --redis-url" in err
    loaded = json.loads(cfemu("load", str(tmp_path / "mig"), "--redis-url", fresh_redis.url, "--group", "QSG2",
                              "--json").stdout)
    assert loaded["entries"] == d["entries"]
    reports = [str(tmp_path / "mig" / migrate.UNLOAD_REPORT), str(tmp_path / "mig" / migrate.LOAD_REPORT)]
    cmp = json.loads(cfemu("compare", *reports, "--json").stdout)
    assert cmp["equal"] and cmp["differences"] == []
    assert "equal: the" in cfemu("compare", *reports).stdout
    # a load report of another migration of the same structure: compare names each difference (exit status 1)
    json.loads(cfemu("reopen", S, "--redis-url", redis_url, "--confirm", S, "--target-given-up", "--json").stdout)
    qm, _ = source
    c = qm.connect()
    c.get(Q)
    c.commit()
    unloaded = " ".join(cfemu("unload", S, "--to", str(tmp_path / "mig2"), "--redis-url", redis_url).stdout.split())
    assert f"unloaded structure {S} of group" in unloaded and "the source is now MIGRATED" in unloaded
    second = redis_factory()
    loaded_text = " ".join(cfemu("load", str(tmp_path / "mig2"), "--redis-url", second.url).stdout.split())
    assert "loaded migration" in loaded_text and "the target is ACTIVE" in loaded_text
    diff = json.loads(cfemu("compare", reports[0], str(tmp_path / "mig2" / migrate.LOAD_REPORT), "--json",
                            status=1).stdout)
    assert not diff["equal"] and diff["differences"][0].startswith("the reports are of different migrations")
    assert any("was unloaded and not loaded" in d for d in diff["differences"])  # the message got meanwhile
    table = cfemu("compare", reports[0], str(tmp_path / "mig2" / migrate.LOAD_REPORT), status=1).stdout
    assert "differences" in table and "was unloaded and not loaded" in table
    # refusals are one line, exit status 2
    err = cfemu("reopen", S, "--redis-url", redis_url, status=2).stderr
    assert err.count("\n") == 1 and f"--confirm {S}" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty report" in cfemu("compare", reports[0], str(empty), status=2).stderr
    assert "exists: a load report is never overwritten" in cfemu(
        "load", str(tmp_path / "mig2"), "--redis-url", redis_factory().url, status=2).stderr
    assert "queue Q1 is defined in the target on structure APP1" in cfemu(
        "load", str(tmp_path / "mig2"), "--redis-url", fresh_redis.url, "--structure", "APP3", "--report",
        str(tmp_path / "r3.jsonl"), status=2).stderr


def test_a_topic_s_companion_queues_are_reported_as_publications_and_subscriptions(
        redis_url: str, fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """Entries of <T>.PUB and <T>.SUB (docs/pubsub.md) are typed by their queue's suffix; a topic's own entries and
    any other queue's are messages."""
    Admin(connect(redis_url)).ensure_structure(S, ("NEWS", "NEWS.PUB", "NEWS.SUB"))
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    try:
        c = qm.connect()
        for queue, n in (("NEWS.PUB", 3), ("NEWS.SUB", 2), ("NEWS", 1)):
            for i in range(n):
                c.put(queue, b"%s %d" % (queue.encode(), i))
        c.commit()
    finally:
        qm.stop()
    done = migrate.unload(connect(redis_url), S, tmp_path / "mig")
    assert done.by_type == {"publication": 3, "subscription": 2, "message": 1}
    migrate.load(fresh_redis.client(), tmp_path / "mig")
    result = compare(read_report(tmp_path / "mig" / migrate.UNLOAD_REPORT),
                     read_report(tmp_path / "mig" / migrate.LOAD_REPORT))
    assert result.equal and result.by_type["publication"] == [3, 3] and result.by_type["subscription"] == [2, 2]


@pytest.mark.slow
def test_a_structure_moves_into_a_redis_cluster_cf(source: tuple[QueueManager, dict[str, Any]], redis_url: str,
                                                   tmp_path: Path) -> None:
    cluster = EmbeddedCluster(tmp_path / "rcluster").start()
    try:
        src = connect(redis_url)
        before = order_of(src)
        done = migrate.unload(src, S, tmp_path / "mig")
        target = connect(cluster.url("restore"))
        loaded = migrate.load(target, tmp_path / "mig", structure="APP7")
        assert loaded.entries == done.entries and loaded.cf  # the master that holds APP7's slot
        assert compare(read_report(tmp_path / "mig" / migrate.UNLOAD_REPORT),
                       read_report(tmp_path / "mig" / migrate.LOAD_REPORT)).equal
        node = rcluster.node_client(target, "APP7")
        ids = [keys.text(x) for x in node.lrange(keys.state_list("APP7", Q, "CP", 2), 0, -1)]
        assert node.hmget(keys.data("APP7"), ids[:3]) == [m for m in before if int(m[1:]) % 3 == 2][:3]
        assert Admin(target).state("APP7") == "ACTIVE" and Admin(target).queue_def(Q).structure == "APP7"
        assert migrate.status(target, "APP7")["meaning"] == "serving"
    finally:
        cluster.stop()


@pytest.mark.soak
def test_a_structure_of_100k_messages_and_uow_statuses_migrates_and_compares_equal(
        redis_url: str, fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """100k plain messages put by a real member in UOWs of 1000, and 200 UOWs sent to the service (100 received and
    committed); unload, load into another CF, compare. The phases' times are printed (pytest -s)."""
    define(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    t0 = time.monotonic()
    try:
        statuses = fill(qm, 100_000, per_uow=1000, uows=200)
    finally:
        qm.stop()
    t1 = time.monotonic()
    src = connect(redis_url)
    done = migrate.unload(src, S, tmp_path / "mig")
    t2 = time.monotonic()
    target = fresh_redis.client()
    loaded = migrate.load(target, tmp_path / "mig", group="QSG2")
    t3 = time.monotonic()
    result = compare(read_report(tmp_path / "mig" / migrate.UNLOAD_REPORT),
                     read_report(tmp_path / "mig" / migrate.LOAD_REPORT))
    t4 = time.monotonic()
    print(f"\nfill {t1 - t0:.1f} s, unload {t2 - t1:.1f} s, load {t3 - t2:.1f} s, compare {t4 - t3:.1f} s "
          f"({done.entries} entries, {done.bytes} bytes)")
    assert result.equal, result.differences[:5]
    assert done.by_type["uow-status"] == 200 and done.by_type["message"] == 100_000 + 1 + 100 * 3
    assert loaded.entries == done.entries and sum(1 for s in statuses.values() if s == "PROCESSED") == 100
    assert order_of(target) == order_of(src)


def test_record_types_follow_the_companion_queues_and_correlation_ids() -> None:
    """A topic's .SUB holds two kinds of entry (sqm.pubsub.pubsub): a subscription's position, replaced at each commit, and
    its roster entry, kept while it lives: the reports count them apart, or a topic's subscriptions counted twice."""
    from backup.migrate_report import record_type
    assert record_type("T.SUB", b"R".hex()) == "subscription-roster"
    assert record_type("T.SUB", b"S".hex()) == "subscription"
    assert record_type("T.PUB") == "publication"
    assert (record_type("S.UOWCTL", b"A".hex()), record_type("S.UOWCTL", b"L".hex())) == ("uow-status", "uow-last")
    assert record_type("S.UOWCTL", b"V".hex()) == "conversation"  # a conversation's record (docs/uow.md)
    assert record_type("S.UOWDATA") == record_type("Q1") == "message"
