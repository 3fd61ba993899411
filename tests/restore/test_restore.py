"""RECOVER CFSTRUCT against a real redis-server and real queue managers: a workload on three SQMs, a fuzzy
backup with gets backed out while it runs, more work (in flight, in commit, in doubt, expiry, non-persistent),
the CF lost, then restore; plus bad input, dry run, idempotence and purge."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from backup.catalog import find_backup
from backup.files import BackupError, read_backup
from backup.run import run_backup
from cfemu import bulk, keys
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis
from cfemu.errors import BackedOutError, NoMessageError, StructureFailedError
from restore.engine import LOAD, READ_BACKUP, READ_LOGS, SETTLE
from restore.run import RESTORE_MEMBER, RestoreError, run_purge, run_restore
from sqm.core import records
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager
from sqm.log import LogCorruptError, LogReader, RecordLog
from tests.support.group import define_group, rejoin, start_qm
from tests.support.harness import lose_cf

S = "APP1"


# --- helpers shared with the other restore test modules ---------------------------------------------------

def snapshot(client: redis.Redis, structure: str = S, *, volatile: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every key of the structure and its value (meta fields named in `volatile` left out)."""
    out: dict[str, Any] = {}
    for k in client.scan_iter(match=keys.all_structure_keys_pattern(structure), count=1000):
        kind = keys.text(client.type(k))
        if kind == "hash":
            v: Any = dict(client.hgetall(k))
            if k == keys.meta(structure).encode():
                v = {f: x for f, x in v.items() if keys.text(f) not in volatile}
        elif kind == "list":
            v = client.lrange(k, 0, -1)
        elif kind == "set":
            v = sorted(client.smembers(k))
        elif kind == "zset":
            v = client.zrange(k, 0, -1, withscores=True)
        else:
            v = client.get(k)
        out[keys.text(k)] = (kind, v)
    return out


def all_keys(client: redis.Redis) -> dict[str, Any]:
    """The whole CF (every structure and the admin structure), for "nothing changed" checks: every key but those
    made to expire (a member's lease, a lock), which lapse on their own while a slow test runs."""
    return {keys.text(k): client.dump(k) for k in client.scan_iter(count=1000) if client.pttl(k) == -1}


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under root (the logs must be byte-identical after a refused restore)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "writer.lock"}


def drain(conn: Connection, queue: str) -> list[tuple[bytes, int]]:
    """Get everything from a queue (committing): (body, backout count) in get order."""
    out = []
    while True:
        try:
            m = conn.get(queue)
        except NoMessageError:
            break
        out.append((m.body, m.backout_count))
    conn.commit()
    return out


def uow_records(log_dir: Path, uow: str) -> list[str]:
    return [r["k"] for _, r in LogReader(log_dir).records() if r.get("u") == uow]


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "logs", tmp_path / "backups"


def small_workload(url: str, logs: Path, backups: Path) -> tuple[list[QueueManager], dict[str, Any]]:
    """Three SQMs, committed messages with priorities and a backout, a non-persistent one, a backup, more work,
    an in-flight UOW whose records are on disk. Returns the (running) SQMs and the backup manifest."""
    client = define_group(url)
    qms = [start_qm(url, logs, f"QM{i}", background=False) for i in (1, 2, 3)]
    a, b, c = (qm.connect() for qm in qms)
    for i in range(12):
        a.put("Q1", f"m{i}".encode(), priority=i % 3, correlid=b"corr" if i == 4 else b"")
    a.put("Q1", b"np", persistent=False, syncpoint=False)
    a.commit()
    b.get("Q1")
    b.backout()
    manifest = run_backup(client, S, backups, log_root=logs)
    for i in range(5):
        c.put("Q2", f"n{i}".encode(), expiry_ms=3_600_000 if i == 2 else 0)
    c.commit()
    b.get("Q1")
    b.commit()
    inflight = qms[1].connect()
    inflight.put("Q2", b"inflight")
    b.put("Q2", b"forces QM2's log")
    b.commit()
    return qms, manifest


# --- the full scenario ------------------------------------------------------------------------------------

def test_restore_after_cf_loss_settles_every_message(fresh_redis: EmbeddedRedis, dirs: tuple[Path, Path]) -> None:
    logs, backups = dirs
    url = fresh_redis.url
    client = define_group(url)
    qm1, qm2, qm3 = (start_qm(url, logs, f"QM{i}", background=False) for i in (1, 2, 3))
    a, b, c = qm1.connect(), qm2.connect(), qm3.connect()

    # before the backup: six committed puts (a4 at priority 5), one consumed, one backed out, a non-persistent one
    msgs = {f"a{i}": a.put("Q1", f"a{i}".encode(), priority=5 if i == 4 else 0) for i in range(6)}
    a.put("Q2", b"np0", persistent=False, syncpoint=False)
    a.commit()
    assert b.get("Q1").body == b"a4"
    b.commit()
    assert c.get("Q1").body == b"a0"
    c.backout()
    g = qm2.connect()
    assert g.get("Q1", msgid=msgs["a0"].msgid).backout_count == 1  # in flight when the backup starts
    h = qm3.connect()

    def on_step(number: int, state: str) -> None:
        if number == 2:  # a get after the first uncommitted-gets pass ...
            h.get("Q1", msgid=msgs["a1"].msgid)
        if number == 4:  # ... backed out after the committed puts were copied: only the log has it (with data)
            h.backout()
            g.backout()

    manifest = run_backup(client, S, backups, log_root=logs, on_step=on_step)
    assert manifest["nonpersistent_skipped"] == 1 and manifest["exception_records"] == 2

    # after the backup
    b_msgs = {n: a.put("Q2", n.encode(), priority=4 if n == "b1" else 0) for n in ("b0", "b1", "b2")}
    a.commit()
    a.put("Q2", b"b3", syncpoint=False)  # persistent, outside syncpoint: log-first
    a.put("Q2", b"np1", persistent=False, syncpoint=False)
    assert b.get("Q1", msgid=msgs["a2"].msgid)
    b.commit()
    a.put("Q1", b"e0", expiry_ms=150)
    a.commit()
    time.sleep(0.2)
    assert qm1.expire_messages() == 1  # an EXPIRE record
    a.put("Q1", b"e1", expiry_ms=150)  # expires before the restore, with no EXPIRE record
    a.commit()
    f = qm1.connect()  # in doubt
    f.put("Q2", b"i0")
    f.get("Q1", msgid=msgs["a3"].msgid)
    in_doubt = f.prepare("xid-1")
    e = qm3.connect()  # in commit: the COMMIT record is forced, then QM3 dies before the CF sees it
    e.put("Q2", b"c0")
    e.get("Q1", msgid=msgs["a5"].msgid)
    assert e.uow is not None
    in_commit = e.uow.id
    qm3.append(records.commit(e.uow.id, qm3.clock.now(), e.uow.structures))
    qm3.stop(checkpoint=False)
    d = qm2.connect()  # in flight, its records on disk (b's commit below forces QM2's log): restore decides it
    d.put("Q2", b"f0")
    d.get("Q2", msgid=b_msgs["b2"].msgid)
    assert d.uow is not None
    decided = d.uow.id
    b.put("Q2", b"b4")
    b.commit()
    d2 = qm2.connect()  # in flight, its PUT record never reached the disk
    d2.put("Q1", b"f1")
    time.sleep(0.2)  # e1 expires

    fresh_redis.kill()  # the CF is lost
    fresh_redis.start()
    with pytest.raises(StructureFailedError):
        b.put("Q1", b"the structure is gone")

    phases: list[str] = []
    result = run_restore(fresh_redis.client(), S, backup_root=backups, log_root=logs,
                         progress=lambda p, done, total: phases.append(p))
    assert [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p] == [READ_BACKUP, READ_LOGS, SETTLE,
                                                                                 LOAD]
    assert result.counts["restored"] == 8  # a0 a1 b0 b1 b2 b3 b4 c0
    assert result.counts["in-doubt"] == 2 and result.counts["uows in doubt"] == 1
    assert result.counts["uows in flight backed out"] == 1 and result.decisions_logged == 1
    assert result.counts["expired"] >= 2 and result.counts["put-backed-out"] == 1  # f0
    assert result.nonpersistent_lost == {"skipped by the backup": 1, "found in the CF": 0}
    assert result.in_doubt_uows == {in_doubt: "QM1"}
    assert set(result.records_by_member) == {"QM1", "QM2", "QM3"}
    report = json.loads(Path(result.report_path or "").read_text())
    assert report["counts"] == result.counts and report["backup_id"] == manifest["id"]
    assert set(report["timings"]) == {READ_BACKUP, READ_LOGS, SETTLE, LOAD}

    client = fresh_redis.client()
    admin = Admin(client)
    assert admin.state(S) == "ACTIVE" and admin.group_name() == manifest["group"]
    assert {q.name for q in admin.queues()} == {"Q1", "Q2"}
    info = {keys.text(k): int(v) for k, v in client.hgetall(keys.meta(S)).items() if keys.text(k) != "state"
            if keys.text(v).isdigit()}
    assert info["clock"] > result.replay_to and info["gen"] == info["floor"] == result.restore_lrsn
    assert [r["k"] for _, r in LogReader(logs / RESTORE_MEMBER).records()] == ["RECOVERY"]

    # the running members use the restored structure without a restart; QM3 restarts and completes its commit
    rejoin(qm1)
    rejoin(qm2)
    qm3 = start_qm(url, logs, "QM3", background=False)
    assert qm3.last_restart.in_commit == 1
    with pytest.raises(BackedOutError):
        d.commit()
    kinds = uow_records(qm2.log_dir, decided)  # its COMMIT, refused, then a forced BACKOUT (END is not forced)
    assert kinds[kinds.index("COMMIT"):][:2] == ["COMMIT", "BACKOUT"]
    with pytest.raises(BackedOutError):
        d2.commit()
    qm1.resolve(in_doubt, commit=True)

    q1, q2 = drain(b, "Q1"), drain(b, "Q2")
    assert q1 == [(b"a0", 2), (b"a1", 1)]
    assert q2 == [(b"b1", 0), (b"b0", 0), (b"b2", 1), (b"b3", 0), (b"c0", 0), (b"b4", 0), (b"i0", 0)]
    a.put("Q1", b"after")
    a.commit()
    assert qm3.connect().get("Q1").body == b"after"
    for qm in (qm1, qm2, qm3):
        qm.stop()
    # restore completed QM3's commit: its restart found a no-op on the CF, not a refusal
    assert uow_records(logs / "QM3", in_commit) == ["PUT", "GET", "COMMIT", "END"]


# --- bad input: a clear error and nothing changed ------------------------------------------------------------

@pytest.fixture
def live_group(redis_url: str, dirs: tuple[Path, Path]) -> Iterator[tuple[redis.Redis, list[QueueManager], dict[str, Any]]]:
    logs, backups = dirs
    qms, manifest = small_workload(redis_url, logs, backups)
    yield Admin(qms[0].redis).redis, qms, manifest
    for qm in qms:
        qm.stop()


def _refused(client: redis.Redis, logs: Path, backups: Path, error: type[Exception], match: str,
             **kwargs: Any) -> None:
    before, log_files = all_keys(client), tree_digest(logs)
    with pytest.raises(error, match=match):
        run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True, **kwargs)
    assert all_keys(client) == before
    assert tree_digest(logs) == log_files
    assert not (logs / RESTORE_MEMBER).exists()
    assert Admin(client).state(S) == "ACTIVE"


def _entry_file(backups: Path, manifest: dict[str, Any]) -> Path:
    return backups / S / manifest["id"] / "entries-0001.bin"


def test_truncated_backup_is_refused(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client, _, manifest = live_group
    path = _entry_file(dirs[1], manifest)
    path.write_bytes(path.read_bytes()[:-10])
    _refused(client, *dirs, RestoreError, r"no good backup of structure APP1 .*truncated")


def test_flipped_byte_in_backup_is_refused(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client, _, manifest = live_group
    path = _entry_file(dirs[1], manifest)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    _refused(client, *dirs, BackupError, r"entries-0001.bin: bad CRC in the frame at byte \d+")


def test_flipped_byte_in_a_log_is_refused(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client, qms, _ = live_group
    segment = sorted((dirs[0] / "QM3").glob("seg-*.log"))[0]
    raw = bytearray(segment.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    segment.write_bytes(bytes(raw))
    _refused(client, *dirs, LogCorruptError, rf"corrupt record log .*{segment.name} at byte offset \d+")


def test_missing_member_log_is_refused(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client, qms, _ = live_group
    qms[1].stop()
    (dirs[0] / "QM2").rename(dirs[0].parent / "QM2-elsewhere")
    _refused(client, *dirs, RestoreError, r"no log for member QM2 under")


def test_backup_of_another_structure_is_refused(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client, _, _ = live_group
    Admin(client).define_structure("APP2")
    other = run_backup(client, "APP2", dirs[1])
    _refused(client, *dirs, BackupError, r"is of structure APP2, not APP1", backup_id=other["id"])


def test_backup_of_another_group_is_refused(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client, _, _ = live_group
    Admin(client).set_group_name("OTHERQSG")
    _refused(client, *dirs, BackupError, r"belongs to group QSG1, not OTHERQSG")


def test_active_structure_is_refused_without_mark_failed(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client = live_group[0]
    logs, backups = dirs
    before = all_keys(client)
    with pytest.raises(RestoreError, match="structure APP1 is ACTIVE: .*--mark-failed"):
        run_restore(client, S, backup_root=backups, log_root=logs)
    assert all_keys(client) == before and not (logs / RESTORE_MEMBER).exists()


def test_dry_run_touches_nothing(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client = live_group[0]
    logs, backups = dirs
    lose_cf(client)
    before, log_files = all_keys(client), tree_digest(logs)
    result = run_restore(client, S, backup_root=backups, log_root=logs, dry_run=True)
    assert result.dry_run and result.counts["restored"] == 17 and result.report_path is None
    assert result.state_before == "FAILED"
    assert all_keys(client) == before == {}
    assert tree_digest(logs) == log_files and not (logs / RESTORE_MEMBER).exists()
    assert not list((backups / S).glob("restore-*.json"))


# --- idempotence, mark-failed, purge ---------------------------------------------------------------------------

# The header fields that name a restore rather than the content: the generation, clock and floor it started, the
# base it read, the restore point it wrote and the restore token of its claim.
VOLATILE = ("clock", "floor", "gen", "restored_from", "last_backup", bulk.TOKEN)


def test_restore_twice_gives_the_same_structure(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client = live_group[0]
    logs, backups = dirs
    lose_cf(client)
    first = run_restore(client, S, backup_root=backups, log_root=logs)
    assert first.decisions_logged == 1 and first.loaded_entries == 17
    after_first = snapshot(client, volatile=VOLATILE)
    assert any(k.endswith(":tomb") for k in after_first)
    Admin(client).set_state(S, "FAILED")
    second = run_restore(client, S, backup_root=backups, log_root=logs)
    # The second run starts at the first one's restore point: what the first settled is in it, tombstones too.
    assert (second.backup_id, second.base_kind) == (first.restore_point, "restore")
    assert second.decisions_logged == 0
    assert second.counts["restored"] == first.counts["restored"] and second.loaded_entries == 17
    assert snapshot(client, volatile=VOLATILE) == after_first
    assert second.restore_lrsn > first.restore_lrsn  # a new generation each time


def test_a_load_that_fails_leaves_no_restore_point(live_group: Any, dirs: tuple[Path, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The point's entries are written as the load goes: a load that fails after its batches (here its verify)
    removes them; the structure stays RECOVERING and the next restore starts from the same base."""
    import restore.load
    client = live_group[0]
    logs, backups = dirs
    before = sorted(p.name for p in (backups / S).iterdir())
    lose_cf(client)
    monkeypatch.setattr(restore.load.bulk, "verify_counts", lambda *a, **k: ["1 descriptor too many"])
    with pytest.raises(restore.load.LoadVerifyError, match="1 descriptor too many"):
        run_restore(client, S, backup_root=backups, log_root=logs)
    assert Admin(client).state(S) == "RECOVERING"
    after = sorted(p.name for p in (backups / S).iterdir() if not p.name.startswith("restore-"))  # the report
    assert after == before
    monkeypatch.undo()
    assert run_restore(client, S, backup_root=backups, log_root=logs).loaded_entries == 17


def test_the_restore_point_holds_each_entry_as_the_cf_holds_it(live_group: Any, dirs: tuple[Path, Path]) -> None:
    """Written as the load goes, from the same packed descriptors the load sends: byte for byte the CF's (a point
    of wire forms was re-packed, and differed from the CF's in its defaults and its data length)."""
    client = live_group[0]
    logs, backups = dirs
    lose_cf(client)
    result = run_restore(client, S, backup_root=backups, log_root=logs)
    point = read_backup(find_backup(backups, result.restore_point))
    copies = {d["id"]: (d, data) for _, d, data in point.copies()}
    assert len(copies) == result.loaded_entries == client.hlen(keys.entries(S)) == 17
    assert point.manifest["entries"] == 17 and point.manifest["bytes"] == sum(len(v) for _, v in copies.values())
    for eid, (desc, data) in copies.items():
        assert msgpack.unpackb(client.hget(keys.entries(S), eid), raw=False) == desc
        assert client.hget(keys.data(S), eid) == data


def test_mark_failed_restores_a_live_structure_and_counts_its_nonpersistent_messages(
        live_group: Any, dirs: tuple[Path, Path]) -> None:
    client, qms, _ = live_group
    logs, backups = dirs
    conn = qms[0].connect()
    conn.put("Q1", b"np-a", persistent=False, syncpoint=False)
    conn.put("Q2", b"np-b", persistent=False, syncpoint=False)
    result = run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True)
    assert result.state_before == "ACTIVE"
    assert result.nonpersistent_lost == {"skipped by the backup": 1, "found in the CF": 3}
    assert Admin(client).state(S) == "ACTIVE"
    rejoin(qms[0])
    assert (b"np-a", 0) not in drain(conn, "Q1")


def test_marked_failed_structure_refuses_work(live_group: Any) -> None:
    client, qms, _ = live_group
    Admin(client).set_state(S, "FAILED")
    with pytest.raises(StructureFailedError, match="CF_STRUC_FAILED"):
        qms[0].connect().put("Q1", b"x")


def test_purge_empties_the_structure_and_keeps_it_usable(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client, qms, _ = live_group
    logs, backups = dirs
    inflight = qms[2].connect()
    inflight.get("Q1")
    busy = qms[2].connect()
    busy.get("Q1")
    with pytest.raises(RestoreError, match="ACTIVE"):
        run_purge(client, S, backup_root=backups, log_root=logs)
    result = run_purge(client, S, backup_root=backups, log_root=logs, mark_failed=True)
    assert result.discarded == 19 and result.state_before == "ACTIVE"  # 17 committed, 1 non-persistent, 1 in flight
    assert Admin(client).state(S) == "ACTIVE" and {q.name for q in Admin(client).queues()} == {"Q1", "Q2"}
    # A purge discards messages, not outcomes: the UOWs that held some complete as decided (here a no-op), and
    # more work of theirs on the purged structure is refused.
    inflight.commit()
    with pytest.raises(BackedOutError, match="purged"):
        busy.put("Q1", b"more")
    conn = qms[0].connect()
    assert drain(conn, "Q1") == [] and drain(conn, "Q2") == []
    conn.put("Q1", b"fresh")
    conn.commit()
    assert drain(qms[1].connect(), "Q1") == [(b"fresh", 0)]


def test_a_second_restore_at_the_same_time_is_refused(live_group: Any, dirs: tuple[Path, Path]) -> None:
    client = live_group[0]
    logs, backups = dirs
    lose_cf(client)
    with RecordLog(logs / RESTORE_MEMBER, RESTORE_MEMBER):  # what a running restore holds
        with pytest.raises(RestoreError, match="another restore is running"):
            run_restore(client, S, backup_root=backups, log_root=logs)
        assert all_keys(client) == {}


def test_a_damaged_purge_point_is_never_crossed_silently(live_group: Any, dirs: tuple[Path, Path]) -> None:
    """A restore point or purge point cuts the structure's history: a restore from an older base crosses it and
    brings back what it purged or consumed. When the newest such point is damaged, restore fell back to the older
    fuzzy backup without a word (the 17 purged messages came back). It must refuse, naming the point; an
    operator who has checked may still name a base with --backup."""
    client, _, _ = live_group
    logs, backups = dirs
    purge = run_purge(client, S, backup_root=backups, log_root=logs, mark_failed=True)
    point = find_backup(backups, purge.restore_point)
    (point / "manifest.json").write_text("{ damaged")
    lose_cf(client)
    with pytest.raises(RestoreError, match=f"{purge.restore_point} .*corrupt.*restore or purge point"):
        run_restore(client, S, backup_root=backups, log_root=logs)
    assert Admin(client).state(S) != "ACTIVE"
