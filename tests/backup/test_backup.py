"""The backup package: the file format and its refusals, run_backup under load and across its rules (one backup
per structure, EXCLINT, the patent's exception record), and the on-disk catalog. Real redis-server, real SQMs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import crc32c
import pytest
import redis

from backup.catalog import CORRUPT, INCOMPLETE, OK, BackupInfo, find_backup, list_backups, parse_age, prune
from backup.files import (
    FRAME_HEAD,
    MANIFEST_NAME,
    BackupNotFoundError,
    BackupWriter,
    ChecksumMismatchError,
    CorruptFrameError,
    ForeignBackupError,
    IncompleteBackupError,
    NoBackupKeyError,
    TruncatedBackupError,
    UntrustedBackupError,
    new_backup_id,
    read_backup,
    sign_backup,
    verify,
)
from backup.run import StructureNotReadyError, run_backup
from cfemu import credentials
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.credentials import BackupKeys, key_id
from cfemu.errors import BackupRunningError, NoMessageError
from cfemu.private_files import private_dir
from sqm.core.manager import QueueManager
from sqm.log import LogReader
from tests.support.group import define_group, start_qm


def _descriptor(i: int, state: str = "CP") -> dict[str, Any]:
    return {"id": f"{i:024x}", "q": "Q1", "p": i % 10, "per": 1, "mid": "ab", "cid": "", "exp": 0, "pt": 1000 + i,
            "bc": 0, "pr": {"k": "v"}, "st": state, "l": 5000 + i, "u": "", "o1": 5000 + i, "o2": 4000 + i,
            "len": 3}


def _write_backup(root: Path, structure: str = "APP1", n: int = 50, roll_bytes: int = 2000,
                  when: datetime | None = None, backup_keys: BackupKeys | None = None) -> Path:
    bid = new_backup_id(structure, when or datetime.now(UTC))
    w = BackupWriter(root / structure / bid, roll_bytes=roll_bytes, backup_keys=backup_keys)
    for i in range(n):
        w.add(3, _descriptor(i), f"d{i:02d}".encode())
    w.finish({"id": bid, "group": "QSG1", "structure": structure, "entries": n, "start_lrsn": 1})
    return root / structure / bid


def latest_good(backup_root: Path, structure: str, *, deep: bool = False) -> BackupInfo | None:
    """The newest backup of `structure` whose state is ok (None when there is none)."""
    return next((b for b in list_backups(backup_root, structure, deep=deep) if b.state == OK), None)


# --- the format -------------------------------------------------------------------------------------------
def test_round_trip_over_several_rolled_files(tmp_path: Path) -> None:
    path = _write_backup(tmp_path, n=50, roll_bytes=2000)
    b = read_backup(path, structure="APP1", group="QSG1")
    assert len(b.manifest["files"]) > 2, "roll_bytes should have rolled the entry files"
    assert sum(f["frames"] for f in b.manifest["files"]) == 50
    copies = list(b.copies())
    assert copies == [("APP1", _descriptor(i), f"d{i:02d}".encode()) for i in range(50)]
    assert [s for s, _, _ in b.frames()] == [3] * 50
    assert verify(path)["id"] == path.name
    assert not (path / (MANIFEST_NAME + ".tmp")).exists()


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = _write_backup(tmp_path)
    f = path / "entries-0002.bin"
    os.truncate(f, f.stat().st_size - 7)
    with pytest.raises(TruncatedBackupError, match=r"entries-0002.bin: truncated: \d+ of \d+ bytes"):
        read_backup(path)


def test_flipped_byte_in_a_frame_names_file_and_offset(tmp_path: Path) -> None:
    path = _write_backup(tmp_path)
    f = path / "entries-0001.bin"
    raw = bytearray(f.read_bytes())
    frame_at = 9  # after the file header: magic (7) + version (2)
    raw[frame_at + 8 + 20] ^= 0x40  # inside the first frame's body
    f.write_bytes(bytes(raw))
    b = read_backup(path)  # sizes still match: the frame check finds it
    with pytest.raises(CorruptFrameError, match=rf"entries-0001.bin: bad CRC in the frame at byte {frame_at}$"):
        list(b.copies())
    with pytest.raises(CorruptFrameError):
        verify(path)


def test_a_changed_manifest_no_longer_matches_its_signature(tmp_path: Path) -> None:
    path = _write_backup(tmp_path)
    m = path / MANIFEST_NAME
    m.write_text(m.read_text().replace('"entries": 50', '"entries": 51'))
    with pytest.raises(UntrustedBackupError, match=f"{m}: the signature does not match"):
        read_backup(path)


def test_frame_rewritten_with_a_valid_crc_is_a_digest_mismatch(tmp_path: Path) -> None:
    """A change the frame CRC cannot see (a body rewritten with a matching CRC) still fails the file's digest."""
    path = _write_backup(tmp_path, n=2, roll_bytes=10**6)
    f = path / "entries-0001.bin"
    raw = bytearray(f.read_bytes())
    length = FRAME_HEAD.unpack_from(raw, 9)[0]
    body = bytes(raw[17:17 + length]).replace(b"d00", b"d99")
    raw[9:17 + length] = FRAME_HEAD.pack(length, crc32c.crc32c(body)) + body
    f.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match="entries-0001.bin: blake3 does not match the manifest"):
        verify(path)


def test_missing_manifest_is_an_unfinished_backup(tmp_path: Path) -> None:
    path = _write_backup(tmp_path)
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteBackupError, match="has no manifest: it is unfinished"):
        read_backup(path)
    with pytest.raises(BackupNotFoundError):
        read_backup(tmp_path / "APP1" / "nothing-here")


def test_key_rotation_the_previous_key_still_checks_and_sign_moves_a_backup_to_the_new_one(tmp_path: Path) -> None:
    """docs/security.md, "Rotating the backup key": the current key becomes backup-previous.key, a new one is made;
    backups signed before still verify; `cfbackup sign` re-signs them; once the previous key is gone, a backup
    nobody re-signed is untrusted."""
    secrets = private_dir(tmp_path / "secrets")
    credentials.create_backup_key(secrets)
    before = credentials.backup_keys(secrets)
    assert before.current is not None and key_id(before.current) not in repr(before.current)
    assert "ids=[" in repr(before) and before.current.decode() not in repr(before)  # a key is never printed
    old, resigned = (_write_backup(tmp_path / "bk", backup_keys=before, when=datetime(2026, 1, 1, 0, 0, i, tzinfo=UTC))
                     for i in (1, 2))
    (secrets / credentials.BACKUP_KEY_FILE).rename(secrets / credentials.BACKUP_PREVIOUS_KEY_FILE)
    credentials.create_backup_key(secrets)
    rotated = credentials.backup_keys(secrets)
    assert rotated.current != before.current and rotated.previous == (before.current,)
    assert verify(old, backup_keys=rotated)["signature"]["key"] == key_id(before.current)
    new = _write_backup(tmp_path / "bk", backup_keys=rotated)
    assert read_backup(new, backup_keys=rotated).manifest["signature"]["key"] == key_id(rotated.current)
    assert sign_backup(resigned, backup_keys=rotated)["signature"]["key"] == key_id(rotated.current)

    (secrets / credentials.BACKUP_PREVIOUS_KEY_FILE).unlink()
    after = credentials.backup_keys(secrets)
    assert verify(resigned, backup_keys=after) and verify(new, backup_keys=after)
    with pytest.raises(UntrustedBackupError, match=rf"signed with a key this group does not hold \(key id "
                                                   rf"{key_id(before.current)}"):
        verify(old, backup_keys=after)
    assert {b.path: b.state for b in list_backups(tmp_path / "bk", "APP1", backup_keys=after)}[old] == "untrusted"

    (secrets / credentials.BACKUP_KEY_FILE).chmod(0o644)  # a key others could read is refused, like any secret
    with pytest.raises(credentials.SecretsError, match="chmod 600 it and rotate"):
        credentials.backup_keys(secrets)
    with pytest.raises(NoBackupKeyError, match="no backup key to sign the backup with"):
        _write_backup(tmp_path / "bk", backup_keys=BackupKeys(source="nowhere"))
    assert sorted(p.name for p in (tmp_path / "bk" / "APP1").iterdir()) == sorted(p.name for p in (old, resigned, new))


def test_every_product_reader_and_writer_of_backups_passes_the_groups_keys() -> None:
    """The keys reach every reader and writer through the settings resolver: a command passes the ones it
    resolved (its flags, its cluster), never leaving a library call to find its own from the working directory."""
    import ast

    calls = {"run_backup", "run_restore", "run_purge", "list_backups", "inspect", "prune",
             "rebuild_catalog", "write_restore_point", "open_backup", "read_backup", "verify", "read_manifest",
             "sign_backup", "BackupWriter"}
    root = Path(__file__).resolve().parents[2]
    missing = []
    for package in ("backup", "restore", "qsg", "sqm", "cfemu"):
        for path in (root / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            ours = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and (node.module or "").startswith(("backup.", "restore.")) for a in node.names}  # not the log's
            if package in ("backup", "restore"):
                ours |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in calls & ours
                        and not any(k.arg == "backup_keys" for k in node.keywords)):
                    missing.append(f"{path.relative_to(root)}:{node.lineno} {node.func.id}()")
    assert not missing, "calls without backup_keys=: " + ", ".join(missing)


def test_wrong_structure_or_group_is_refused(tmp_path: Path) -> None:
    path = _write_backup(tmp_path, structure="APP2")
    with pytest.raises(ForeignBackupError, match=rf"^backup {path.name} is of structure APP2, not APP1$"):
        read_backup(path, structure="APP1")
    with pytest.raises(ForeignBackupError, match="belongs to group QSG1, not QSG9"):
        read_backup(path, structure="APP2", group="QSG9")


# --- run_backup -------------------------------------------------------------------------------------------
@pytest.fixture
def qsg(redis_url: str, tmp_path: Path) -> Iterator[tuple[redis.Redis, list[QueueManager]]]:
    client = define_group(redis_url)
    qms = [start_qm(redis_url, tmp_path / "logs", f"QM{i}", background=False) for i in (1, 2)]
    yield client, qms
    for qm in qms:
        qm.stop()


def _ids_by_step(path: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for step, d, _ in read_backup(path).frames():
        out.setdefault(step, set()).add(d["id"])
    return out


def _backup_path(root: Path, manifest: dict[str, Any]) -> Path:
    return root / manifest["structure"] / manifest["id"]


def test_backup_under_load_copies_every_resident_message_and_verifies(
        qsg: tuple[redis.Redis, list[QueueManager]], tmp_path: Path) -> None:
    client, qms = qsg
    loader = qms[0].connect()
    resident = set()
    for i in range(3000):  # Q2 is left alone: every one of these must be in the backup
        resident.add(loader.put("Q2", os.urandom(256), priority=i % 10).entry_id)
    loader.put("Q2", b"np", persistent=False)
    loader.commit()

    stop = threading.Event()
    ops = {"during": 0}
    errors: list[BaseException] = []

    def work(qm: QueueManager, seed: int) -> None:
        conn = qm.connect()
        n = 0
        try:
            while not stop.is_set():
                n += 1
                conn.put("Q1", b"w" * 200)
                conn.commit()
                try:
                    conn.get("Q1")
                except NoMessageError:
                    continue
                if (n + seed) % 3 == 0:
                    conn.backout()
                else:
                    conn.commit()
                ops["during"] += 1
        except BaseException as e:  # surfaces in the main thread's assert
            errors.append(e)

    threads = [threading.Thread(target=work, args=(qm, i)) for i, qm in enumerate(qms)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    before = ops["during"]
    try:
        manifest = run_backup(client, "APP1", tmp_path / "bk", log_root=tmp_path / "logs", batch=200)
    finally:
        during = ops["during"] - before
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert during > 0, "the workload should have run while the backup did"
    path = _backup_path(tmp_path / "bk", manifest)
    assert verify(path, structure="APP1", group="QSG1") == manifest
    steps = _ids_by_step(path)
    assert resident <= steps[3]
    assert manifest["nonpersistent_skipped"] >= 1
    assert manifest["entries"] == sum(f["frames"] for f in manifest["files"])
    assert manifest["members"] == ["QM1", "QM2"]
    assert [q["name"] for q in manifest["queues"]] == ["Q1", "Q2"]
    assert manifest["floor_lrsn"] <= manifest["start_lrsn"] < manifest["end_lrsn"]
    assert manifest["replay_from"] == manifest["floor_lrsn"]
    with_data = sum(qm.counters["backout_records_with_data"] for qm in qms)
    assert 0 <= manifest["exception_records"] <= with_data
    assert Admin(client).backups("APP1")[-1]["id"] == manifest["id"]
    assert not CF(client).structure("APP1").info().get("backup"), "the running mark must be cleared"


def test_get_backed_out_mid_backup_logs_its_data_and_is_counted(
        qsg: tuple[redis.Redis, list[QueueManager]], tmp_path: Path) -> None:
    """The patent's window: a get held when the backup starts, backed out after step 3 copied the committed
    puts and before step 4 copies the uncommitted gets. Only step 1 copies it, and the BACKOUT record carries its
    data; a backout with no backup running carries none."""
    client, (qm, _) = qsg
    conn = qm.connect()
    for body in (b"held", b"quiet"):
        conn.put("Q1", body)
    conn.commit()
    conn.get("Q1")
    conn.backout()  # no backup running: no data in the record
    held = conn.get("Q1")

    def between_steps(number: int, state: str) -> None:
        if number == 4:
            conn.backout()

    manifest = run_backup(client, "APP1", tmp_path / "bk", log_root=tmp_path / "logs", on_step=between_steps)
    steps = _ids_by_step(_backup_path(tmp_path / "bk", manifest))
    assert held.entry_id in steps[1]
    assert held.entry_id not in steps.get(3, set()) | steps.get(4, set())
    backouts = [r for _, r in LogReader(tmp_path / "logs" / "QM1").records() if r["k"] == "BACKOUT"]
    assert [bool(r.get("dd")) for r in backouts] == [False, True]
    carried = backouts[1]["dd"]
    assert [(s, d["id"], data) for s, d, data in carried] == [("APP1", held.entry_id, b"held")]
    assert manifest["start_lrsn"] <= backouts[1]["l"] <= manifest["end_lrsn"]
    assert manifest["exception_records"] == 1


def test_second_backup_of_a_structure_is_refused_another_structure_may_run(
        qsg: tuple[redis.Redis, list[QueueManager]], tmp_path: Path) -> None:
    client, (qm, _) = qsg
    admin = Admin(client)
    admin.define_structure("APP2")
    admin.define_queue("Q3", "APP2")
    conn = qm.connect()
    conn.put("Q1", b"one")
    conn.put("Q3", b"two")
    conn.commit()
    seen: dict[str, Any] = {}

    def during_app1(number: int, state: str) -> None:
        if number != 3:
            return
        with pytest.raises(BackupRunningError, match="backup APP1-.* of this structure is running") as e:
            run_backup(client, "APP1", tmp_path / "bk")
        seen["refused"] = str(e.value)
        seen["app2"] = run_backup(client, "APP2", tmp_path / "bk")

    first = run_backup(client, "APP1", tmp_path / "bk", on_step=during_app1)
    assert "refused" in seen
    assert seen["app2"]["structure"] == "APP2" and seen["app2"]["entries"] == 1
    assert first["entries"] == 1
    assert sorted(p.name for p in (tmp_path / "bk" / "APP1").iterdir()) == [first["id"]], \
        "the refused backup must leave nothing behind"
    # after the first one ended, a new backup of APP1 runs
    assert run_backup(client, "APP1", tmp_path / "bk")["entries"] == 1


def test_exclint_leaves_out_young_messages_and_lowers_replay_from(
        qsg: tuple[redis.Redis, list[QueueManager]], tmp_path: Path) -> None:
    client, (qm, _) = qsg
    conn = qm.connect()
    old = {conn.put("Q1", b"old").entry_id for _ in range(3)}
    conn.commit()
    time.sleep(1.3)
    young = {conn.put("Q1", b"young").entry_id for _ in range(4)}
    conn.commit()
    manifest = run_backup(client, "APP1", tmp_path / "bk", exclint_s=1)
    copied = set().union(*_ids_by_step(_backup_path(tmp_path / "bk", manifest)).values())
    assert copied == old
    assert manifest["excluded"] == 4 and manifest["steps"][2]["excluded"] == 4
    put_lrsns = [r["l"] for _, r in LogReader(tmp_path / "logs" / "QM1").records()
                 if r["k"] == "PUT" and r["e"]["id"] in young]
    assert manifest["replay_from"] == min(put_lrsns) < manifest["floor_lrsn"]
    plain = run_backup(client, "APP1", tmp_path / "bk")
    assert plain["entries"] == 7 and plain["replay_from"] == plain["floor_lrsn"]


def test_failed_backup_ends_as_failed_and_leaves_nothing(
        qsg: tuple[redis.Redis, list[QueueManager]], tmp_path: Path) -> None:
    client, (qm, _) = qsg
    conn = qm.connect()
    conn.put("Q1", b"x")
    conn.commit()

    def explode(number: int, state: str) -> None:
        if number == 3:
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        run_backup(client, "APP1", tmp_path / "bk", on_step=explode)
    assert list((tmp_path / "bk" / "APP1").iterdir()) == []
    info = CF(client).structure("APP1").info()
    assert "backup" not in info and "last_backup" not in info
    assert Admin(client).backups("APP1") == []
    assert run_backup(client, "APP1", tmp_path / "bk")["entries"] == 1


def test_structure_must_be_defined_and_active(qsg: tuple[redis.Redis, list[QueueManager]], tmp_path: Path) -> None:
    client, _ = qsg
    with pytest.raises(StructureNotReadyError, match="structure NOPE is not defined"):
        run_backup(client, "NOPE", tmp_path / "bk")
    Admin(client).set_state("APP1", "FAILED")
    with pytest.raises(StructureNotReadyError, match="APP1 is FAILED; only an ACTIVE structure"):
        run_backup(client, "APP1", tmp_path / "bk")
    with pytest.raises(ValueError, match="EXCLINT"):
        run_backup(client, "APP1", tmp_path / "bk", exclint_s=-1)
    assert not (tmp_path / "bk").exists()


# --- the catalog ------------------------------------------------------------------------------------------
def test_catalog_states_newest_first_and_latest_good(tmp_path: Path) -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    good_old = _write_backup(tmp_path, when=t0)
    good = _write_backup(tmp_path, when=t0 + timedelta(hours=1))
    corrupt = _write_backup(tmp_path, when=t0 + timedelta(hours=2))
    (corrupt / "entries-0001.bin").write_bytes(b"CFBKP1\n")  # truncated
    unfinished = tmp_path / "APP1" / new_backup_id("APP1", t0 + timedelta(hours=3))
    BackupWriter(unfinished).add(3, _descriptor(1), b"x")  # a backup that never finished
    (tmp_path / "APP1" / "notes.txt").write_text("not a backup")
    listed = list_backups(tmp_path, "APP1")
    assert [(b.path, b.state) for b in listed] == [(unfinished, INCOMPLETE), (corrupt, CORRUPT), (good, OK),
                                                   (good_old, OK)]
    assert "truncated" in listed[1].problem
    best = latest_good(tmp_path, "APP1")
    assert best is not None and best.path == good
    # a flipped frame byte is only seen by a deep listing
    raw = bytearray((good / "entries-0001.bin").read_bytes())
    raw[-1] ^= 1
    (good / "entries-0001.bin").write_bytes(bytes(raw))
    assert latest_good(tmp_path, "APP1") is not None and latest_good(tmp_path, "APP1").path == good  # type: ignore[union-attr]
    deep = latest_good(tmp_path, "APP1", deep=True)
    assert deep is not None and deep.path == good_old
    assert find_backup(tmp_path, good.name) == good
    with pytest.raises(BackupNotFoundError):
        find_backup(tmp_path, new_backup_id("APP1", t0))
    assert latest_good(tmp_path, "APP9") is None


def test_prune_by_count_and_age_never_removes_the_newest_good(redis_url: str, tmp_path: Path) -> None:
    client = define_group(redis_url)
    admin = Admin(client)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    paths = [_write_backup(tmp_path, when=t0 + timedelta(days=d)) for d in range(4)]
    for p in paths:
        admin.record_backup("APP1", {"id": p.name, "start_lrsn": 1})
    (paths[3] / MANIFEST_NAME).unlink()  # the newest is unfinished: paths[2] is the newest good one
    result = prune(tmp_path, "APP1", keep=1, client=client)
    assert [b.path for b in result.removed] == [paths[1], paths[0]]
    assert {b.path for b in result.kept} == {paths[3], paths[2]}
    assert result.admin_updated
    assert sorted(b["id"] for b in admin.backups("APP1")) == sorted([paths[2].name, paths[3].name])
    assert not paths[0].exists() and paths[2].exists()
    # by age: everything is older than a day, but the newest good one stays
    result = prune(tmp_path, "APP1", older_than=parse_age("1d"), now=t0 + timedelta(days=30))
    assert [b.path for b in result.removed] == [paths[3]]
    assert not result.admin_updated and "not reachable" in result.note
    assert [b.path for b in list_backups(tmp_path, "APP1")] == [paths[2]]


def test_prune_spares_the_running_backup_and_rejects_bad_requests(redis_url: str, tmp_path: Path) -> None:
    client = define_group(redis_url)
    good = _write_backup(tmp_path, when=datetime(2026, 1, 1, tzinfo=UTC))
    running = tmp_path / "APP1" / new_backup_id("APP1", datetime(2026, 1, 2, tzinfo=UTC))
    BackupWriter(running)
    CF(client).structure("APP1").backup_begin(running.name, 0)
    result = prune(tmp_path, "APP1", keep=1, client=client)
    assert result.removed == [] and running.exists() and good.exists()
    with pytest.raises(ValueError, match="say what to prune"):
        prune(tmp_path, "APP1")
    with pytest.raises(ValueError, match="at least 1"):
        prune(tmp_path, "APP1", keep=0)
    for bad in ("7", "d7", "7y", ""):
        with pytest.raises(ValueError, match="bad age"):
            parse_age(bad)
    assert parse_age("2w") == timedelta(weeks=2)


def test_copies_are_in_the_entry_wire_form(qsg: tuple[redis.Redis, list[QueueManager]], tmp_path: Path) -> None:
    """The backup reads descriptors without Entry objects (its hot loop); they must still be Entry.wire() exactly,
    properties or none, as restore and the model check expect."""
    client, (qm, _) = qsg
    conn = qm.connect()
    conn.put("Q1", b"plain")
    conn.put("Q1", b"rich", priority=7, correlid=b"\x01\x02", expiry_ms=600_000,
             properties={"colour": "blue", "n": 3, "ok": True})
    conn.commit()
    conn.put("Q2", b"uncommitted")
    manifest = run_backup(client, "APP1", tmp_path / "bk")
    cf = CF(client).structure("APP1")
    frames = list(read_backup(_backup_path(tmp_path / "bk", manifest)).frames())
    assert len(frames) == 3
    for _, wire, data in frames:
        (_, entry, current), = list(cf.fetch([wire["id"]]))
        assert entry is not None and wire == entry.wire() and data == current
    assert {w["st"] for _, w, _ in frames} == {"CP", "UP"}
    assert {tuple(sorted(w["pr"])) for _, w, _ in frames} == {(), ("colour", "n", "ok")}


def test_progress_is_reported_through_the_port_one_phase_per_step(
        qsg: tuple[redis.Redis, list[QueueManager]], tmp_path: Path) -> None:
    """run_backup reports through cfemu.progress (no rich below the CLI): each step starts with an unknown total
    and ends complete, with its snapshot as the total."""
    client, (qm, _) = qsg
    conn = qm.connect()
    for _ in range(5):
        conn.put("Q1", b"m")
    conn.commit()
    calls: list[tuple[str, int, int | None]] = []
    manifest = run_backup(client, "APP1", tmp_path / "bk",
                          progress=lambda phase, done, total: calls.append((phase, done, total)))
    phases = list(dict.fromkeys(phase for phase, _, _ in calls))
    assert [p.split()[0] for p in phases] == ["1", "2", "3", "4", "5"]
    for step, phase in zip(manifest["steps"], phases):
        mine = [(done, total) for p, done, total in calls if p == phase]
        assert mine[0] == (0, None) and mine[-1] == (step["snapshot"], step["snapshot"])
    assert sum(step["snapshot"] for step in manifest["steps"]) >= 5


def test_failed_backup_clears_its_mark_once_the_cf_answers_again(
        qsg: tuple[redis.Redis, list[QueueManager]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backup that fails while the CF does not answer (a duplexed CF promoting its copy, a cut link) keeps
    asking to clear its mark: a mark left on a CF that kept its data refused every later backup (BACKUPRUNNING)."""
    from cfemu.cf import Structure

    client, (qm, _) = qsg
    conn = qm.connect()
    conn.put("Q1", b"x")
    conn.commit()
    real_end = Structure.backup_end
    refused: list[int] = []

    def end_while_cf_away(self: Structure, backup_id: str, caller_lrsn: int, ok: bool) -> int:
        if not ok and len(refused) < 3:
            refused.append(1)
            raise redis.exceptions.ConnectionError("the CF does not answer (promotion under way)")
        return real_end(self, backup_id, caller_lrsn, ok)

    def explode(number: int, state: str) -> None:
        if number == 2:
            raise redis.exceptions.ConnectionError("Connection closed by server.")

    monkeypatch.setattr(Structure, "backup_end", end_while_cf_away)
    with pytest.raises(redis.exceptions.ConnectionError):
        run_backup(client, "APP1", tmp_path / "bk", on_step=explode)
    assert len(refused) == 3
    assert "backup" not in CF(client).structure("APP1").info()
    assert run_backup(client, "APP1", tmp_path / "bk")["entries"] == 1
