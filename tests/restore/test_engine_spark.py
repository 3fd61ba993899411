"""The Spark restore engine against the local one: the same plan on every input (docs/spark.md).

Random histories are built as data (the records sqm.core.manager writes, and backup copies), written to real log
segment files (small segments, so each log has several, some sealed below replay_from) and a real backup
directory (several entry files), then planned by both engines. Two real histories come from running queue
managers, with a fuzzy backup taken while they work.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from backup.files import Backup, BackupWriter, ChecksumMismatchError, read_backup
from cfemu.entry import Entry
from restore.archive import archive_logs
from restore.engine import READ_BACKUP, READ_LOGS, SETTLE, LocalEngine, get_engine
from restore.engine_spark import SparkEngine
from restore.plan import RestorePlan
from sqm.core import records
from sqm.core.records import Record
from sqm.log import RecordLog, find_log_dirs

# slow: run after the fast tier (tests/support/tiers.py); spark: on the worker that holds the Spark session
# (tests/restore/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.xdist_group("spark")]

pyspark = pytest.importorskip("pyspark")

S, OTHER = "APP1", "APP2"
MEMBERS = ("QM1", "QM2", "QM3")
NOW_MS = 1_700_000_000_000


# ------------------------------------------------------------------------------------------- random histories


@dataclass
class History:
    """Records per member (in append order) and backup copies, built by a small simulation of a QSG."""

    logs: dict[str, list[Record]] = field(default_factory=lambda: {m: [] for m in MEMBERS})
    copies: list[tuple[int, dict[str, Any], bytes, str]] = field(default_factory=list)  # step, wire, data, s
    replay_from: int = 0
    gen: int = 1  # the structure generation the backup was taken in
    carried: list[str] = field(default_factory=list)  # in-doubt UOWs holding entries when the generation moved on


def entry_id_of_some_shape(k: int) -> str:
    """A new entry id: mostly as members make them (12 random bytes in hex, which restore's columnar readers hold as
    those 12 bytes), every fourth of another shape that they must hold apart from those (restore.columns.entry_id):
    upper-case hex, 12 bytes of text, 11 beginning with "!", 12 beginning with "~", and not ASCII."""
    shapes = (lambda: os.urandom(12).hex().upper(), lambda: os.urandom(6).hex(), lambda: "!" + os.urandom(5).hex(),
              lambda: "~" + os.urandom(5).hex() + "x", lambda: "é" + os.urandom(4).hex())
    return os.urandom(12).hex() if k % 4 else shapes[k // 4 % len(shapes)]()


def simulate(rnd: random.Random, steps: int, body_bytes: int = 16, carry: bool = False) -> History:
    """A random history of three members. carry: the restore that moves the generation on comes in the first
    half, carrying an in-doubt UOW that holds entries (one is prepared just before it, if none is), and the backup
    comes after it: the backup shows an older generation's UOW holding entries, whose outcome records later count
    only because the backup holds them (restore.plan.current_incarnation; the partitioned plan files such records
    once the backup is read)."""
    h = History()
    lrsn = 1000
    entries: dict[str, dict[str, Any]] = {}  # id -> wire descriptor (the CF's view)
    data: dict[str, bytes] = {}
    structure_of: dict[str, str] = {}
    open_uows: dict[str, list[str]] = {m: [] for m in MEMBERS}  # member -> open UOW ids
    prepared: list[str] = []
    seq = 0
    backup_at = rnd.randrange(steps) if steps else 0
    # The structure's generation moves on once (a restore or a purge): UOWs keep the one they started in, and
    # the generation rule (restore.plan.current_incarnation) leaves out the older one's unless carried.
    gen, flip_at = 1, rnd.randrange(steps) if steps else 0
    if carry and steps > 2:
        flip_at = rnd.randrange(steps // 4, steps // 2)
        backup_at = rnd.randrange(flip_at + 1, steps)
    gen_of: dict[str, int] = {}

    def tick() -> int:
        nonlocal lrsn
        lrsn += rnd.choice((0, 1, 1, 2, 5))  # ties happen, across members and within one
        return lrsn - rnd.choice((0, 0, 0, 1))  # appends land slightly out of LRSN order

    def uow_of(member: str) -> str:
        nonlocal seq
        if open_uows[member] and rnd.random() < 0.7:
            return rnd.choice(open_uows[member])
        seq += 1
        u = f"{member}.1.{seq}"
        open_uows[member].append(u)
        gen_of[u] = gen
        return u

    def held_by(u: str) -> list[str]:
        return [i for i, e in entries.items() if e["u"] == u]

    def finish(member: str, u: str, commit: bool, record: Record) -> None:
        for i in held_by(u):
            e = entries[i]
            if commit and e["st"] == "UG" or not commit and e["st"] == "UP":
                del entries[i]
            else:
                e.update(st="CP", u="", l=record["l"])
                if commit:
                    e["o1"] = record["l"]
                else:
                    e["bc"] += 1
        for m in MEMBERS:
            if u in open_uows[m]:
                open_uows[m].remove(u)
        if u in prepared:
            prepared.remove(u)
        if rnd.random() < 0.8:
            h.logs[member].append(records.end(u, tick()))

    def gets_data(u: str) -> list[list[Any]]:
        return [[structure_of[i], dict(entries[i]), data[i]] for i in held_by(u) if entries[i]["st"] == "UG"]

    stale: list[tuple[str, str]] = []  # (member, UOW) of the old generation the new one no longer knows

    for step in range(steps):
        if step == flip_at:  # a restore: the in-flight UOWs are backed out; their owners' later records are stale
            holding = [(m, u) for m in MEMBERS for u in open_uows[m] if held_by(u)]
            if carry and holding and not any(u in prepared for _, u in holding):
                m, u = rnd.choice(holding)
                prepared.append(u)
                h.logs[m].append(records.prepare(u, tick(), {S: gen_of[u]}, xid=f"xid-{u}"))
            h.carried = sorted(u for _, u in holding if u in prepared)
            gen = 2
            for m in MEMBERS:
                for u in [u for u in open_uows[m] if u not in prepared]:
                    for i in held_by(u):
                        if entries[i]["st"] == "UP":
                            del entries[i]
                        else:
                            entries[i].update(st="CP", u="", l=lrsn, bc=entries[i]["bc"] + 1)
                    open_uows[m].remove(u)
                    stale.append((m, u))
        if stale and rnd.random() < 0.1:
            # A stale UOW's record reaches the disk after the restore (the generation rule): a GET the CF never saw
            # in this generation, or its owner's refused COMMIT and the BACKOUT after it. The CF's state does not
            # change.
            m, u = rnd.choice(stale)
            available = [i for i, e in entries.items() if e["st"] == "CP"]
            if available and rnd.random() < 0.5:
                i = rnd.choice(available)
                h.logs[m].append(records.get(u, tick(), structure=structure_of[i], gen=1, entry_id=i,
                                             queue=entries[i]["q"]))
            else:
                h.logs[m].append(records.commit(u, tick(), {S: 1}))
                h.logs[m].append(records.backout(u, tick(), {S: 1}, reason="backed out by recovery"))
        if step == backup_at:
            h.gen = gen
            h.replay_from = lrsn - rnd.choice((0, 3, 10, 50))
            for i, e in entries.items():
                if rnd.random() < 0.9 and structure_of[i] == S:
                    h.copies.append((rnd.randint(1, 5), dict(e), data[i], S))
        member = rnd.choice(MEMBERS)
        op = rnd.choices(("put", "get", "commit", "backout", "prepare", "recover", "expire"),
                         (8, 5, 4, 2, 1, 1, 1))[0]
        if op == "put":
            eid = entry_id_of_some_shape(len(entries))
            s = S if rnd.random() < 0.8 else OTHER
            u = uow_of(member)
            at = tick()
            e = Entry(id=eid, queue=rnd.choice(("Q1", "Q2")), priority=rnd.randint(0, 2), put_time=at // 1000,
                      expiry=rnd.choice((0, 0, 0, NOW_MS - 1, NOW_MS + 10_000))).wire()
            body = os.urandom(rnd.randint(0, body_bytes))
            rec = records.put(u, at, structure=s, gen=gen_of[u], entry=dict(e), data=body)
            h.logs[member].append(rec)
            e.update(st="UP", u=u, l=at, o1=0, o2=at)
            entries[eid], data[eid], structure_of[eid] = e, body, s
        elif op == "get":
            available = [i for i, e in entries.items() if e["st"] == "CP"]
            if available:
                i = rnd.choice(available)
                u, at = uow_of(member), tick()
                h.logs[member].append(records.get(u, at, structure=structure_of[i], gen=gen_of[u], entry_id=i,
                                                  queue=entries[i]["q"]))
                entries[i].update(st="UG", u=u, l=at)
        elif op in ("commit", "backout") and open_uows[member]:
            u = rnd.choice(open_uows[member])
            ss = {S: gen_of[u]}
            if op == "commit":
                rec = records.commit(u, tick(), ss)
            else:
                rec = records.backout(u, tick(), ss, data=gets_data(u) if rnd.random() < 0.5 else ())
            if op == "commit" and rnd.random() < 0.05:
                h.logs[member].append(rec)  # a commit the CF refused: the owner's BACKOUT follows
                rec = records.backout(u, tick(), ss, reason="backed out by recovery")
            h.logs[member].append(rec)
            finish(member, u, rec["k"] == "COMMIT", rec)
        elif op == "prepare" and open_uows[member]:
            u = rnd.choice(open_uows[member])
            if u not in prepared:
                prepared.append(u)
                h.logs[member].append(records.prepare(u, tick(), {S: gen_of[u]}, xid=f"xid-{u}"))
        elif op == "recover":
            victim = rnd.choice([m for m in MEMBERS if m != member])
            if open_uows[victim]:
                u = rnd.choice(open_uows[victim])
                commit = u in prepared and rnd.random() < 0.5
                at = tick()
                carried = gets_data(u) if not commit and rnd.random() < 0.5 else []
                rec = records.recovery(u, at, {S: gen_of[u]}, commit=commit, of=victim, by=member, data=carried)
                h.logs[member].append(rec)
                finish(member, u, commit, rec)
        elif op == "expire":
            gone = [i for i, e in entries.items() if e["st"] == "CP" and e["exp"] and rnd.random() < 0.5]
            if gone:
                s = structure_of[gone[0]]
                h.logs[member].append(records.expire(tick(), structure=s,
                                                     ids=[i for i in gone if structure_of[i] == s]))
                for i in gone:
                    if structure_of[i] == structure_of[gone[0]]:
                        del entries[i]
        if step > backup_at and h.copies and entries and rnd.random() < 0.05:
            # a second copy of an entry taken later in the backup (steps 1 and 4)
            i = rnd.choice(list(entries))
            if structure_of[i] == S:
                h.copies.append((4, dict(entries[i]), data[i], S))
    return h


def write_history(h: History, root: Path, segment_bytes: int = 600) -> tuple[Backup, list[Path]]:
    """The history as real files: one RecordLog per member (small segments), one backup directory."""
    for member, logged in h.logs.items():
        with RecordLog(root / "logs" / member, member, segment_bytes=segment_bytes) as log:
            for r in logged:
                log.append(r)
            log.force()
    writer = BackupWriter(root / "backup" / S / "b", roll_bytes=400)
    for step, wire, body, _ in h.copies:
        writer.add(step, wire, body)
    writer.finish({"id": "b", "group": "G", "structure": S, "entries": len(h.copies), "replay_from": h.replay_from,
                   "gen": h.gen})
    return read_backup(root / "backup" / S / "b"), find_log_dirs(root / "logs")


# ------------------------------------------------------------------------------------------------ comparison


def normalized(plan: RestorePlan) -> dict[str, Any]:
    """Everything a plan says, with the restore's own LRSN (it reads the wall clock) replaced by a marker."""

    def fix(value: Any) -> Any:
        if value == plan.restore_lrsn:
            return "RESTORE_LRSN"
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [fix(v) for v in value]
        return value

    return {
        "settled": {s.id: (s.disposition, s.structure, fix(s.entry), s.data) for s in plan.settled},
        "settled_count": len(list(plan.settled)),
        "outcomes": {u: (o.kind, fix(o.lrsn), o.decided_by, fix(dict(o.data))) for u, o in plan.outcomes.items()},
        "decisions": plan.decisions,
        "in_commit": plan.in_commit,
        "counts": dict(plan.counts),
        "records_by_member": dict(plan.records_by_member),
        "max_lrsn": plan.max_lrsn,
        "above_max": plan.restore_lrsn > plan.max_lrsn,
    }


def both_plans(spark: Any, backup: Backup, log_dirs: list[Path], replay_from: int, **spark_options: Any
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    local = LocalEngine().plan(S, backup, log_dirs, replay_from, NOW_MS)
    remote = SparkEngine(spark=spark, **spark_options).plan(S, backup, log_dirs, replay_from, NOW_MS)
    return normalized(local), normalized(remote)


# The default suite plans 4 histories of each kind on both engines (about 3-10 s each with Spark's jobs), the deep
# tests (`make deep-test`) 24 and 16 more: the same property on more of the generator's histories. The partitioned
# engine's differential tests against the local one (tests/restore/test_partitioned.py) run 10 and 12 of the same
# generator's in the default suite, 25 and 30 more in the deep tier.
# The timeouts: all the histories of one test count against one pytest-timeout, and on a machine loaded by other
# work (the suite's own workers among it) a plan takes up to 20 s; a timeout raised inside a py4j call leaves the
# worker's Spark session unusable for every test after it.
def plan_identically(spark: Any, root: Path, seed: int, steps: int) -> None:
    h = simulate(random.Random(seed), steps)
    backup, log_dirs = write_history(h, root)
    local, remote = both_plans(spark, backup, log_dirs, h.replay_from)
    assert remote == local


def plan_a_carried_uow_identically(spark: Any, root: Path, seed: int) -> None:
    """The generator's histories with an in-doubt UOW that holds entries carried across the restore that moved the
    generation on, and a backup after it (simulate's carry): the UOW's outcome in the log counts under the
    generation rule, and both engines settle it alike."""
    h = simulate(random.Random(seed), 150, carry=True)
    assume(h.carried)  # not vacuous: a UOW holding entries was carried (3 seeds in 300 carry none)
    backup, log_dirs = write_history(h, root)
    local, remote = both_plans(spark, backup, log_dirs, h.replay_from)
    assert remote == local


@pytest.mark.timeout(900)
@settings(max_examples=4, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(0, 120))
def test_spark_and_local_engines_give_identical_plans(spark: Any, tmp_path_factory: pytest.TempPathFactory,
                                                       seed: int, steps: int) -> None:
    plan_identically(spark, tmp_path_factory.mktemp("history"), seed, steps)


@pytest.mark.deep
@pytest.mark.timeout(1800)
@settings(max_examples=24, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(0, 120))
def test_spark_and_local_engines_give_identical_plans_on_more_histories(
        spark: Any, tmp_path_factory: pytest.TempPathFactory, seed: int, steps: int) -> None:
    plan_identically(spark, tmp_path_factory.mktemp("history"), seed, steps)


@pytest.mark.timeout(900)
@settings(max_examples=4, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_spark_and_local_engines_agree_on_histories_that_carry_a_uow_across_a_restore(
        spark: Any, tmp_path_factory: pytest.TempPathFactory, seed: int) -> None:
    plan_a_carried_uow_identically(spark, tmp_path_factory.mktemp("carried"), seed)


@pytest.mark.deep
@pytest.mark.timeout(1800)
@settings(max_examples=16, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_spark_and_local_engines_agree_on_more_histories_that_carry_a_uow_across_a_restore(
        spark: Any, tmp_path_factory: pytest.TempPathFactory, seed: int) -> None:
    plan_a_carried_uow_identically(spark, tmp_path_factory.mktemp("carried"), seed)


def test_a_rich_history_exercises_every_disposition(spark: Any, tmp_path: Path) -> None:
    """The random histories are not vacuous: one long one reaches every disposition and outcome kind."""
    h = simulate(random.Random(3), 1500)
    backup, log_dirs = write_history(h, tmp_path)
    local, remote = both_plans(spark, backup, log_dirs, h.replay_from)
    assert remote == local
    dispositions = {d for d, *_ in local["settled"].values()}
    assert dispositions == {"restored", "in-doubt", "consumed", "put-backed-out", "expired", "gone"}
    assert {k for k, *_ in local["outcomes"].values()} == {"C", "B", "D"}
    assert local["decisions"] and local["in_commit"]
    assert any(len(list(d.iterdir())) > 3 for d in log_dirs)  # several segments per member were read


def test_a_history_across_a_restore_exercises_the_generation_rule(spark: Any, tmp_path: Path) -> None:
    """A history whose backup was taken after the structure's generation moved on, with stale records of the old
    generation written after it (the generation rule, docs/architecture.md, "The group's durable history"): both
    engines leave them out alike, and leaving them out changes what is restored (the rule is not vacuous here)."""
    h = simulate(random.Random(12), 300)
    assert h.gen == 2
    backup, log_dirs = write_history(h, tmp_path)
    local, remote = both_plans(spark, backup, log_dirs, h.replay_from)
    assert remote == local
    without_rule = LocalEngine().plan(S, _with_gen(backup, 0), log_dirs, h.replay_from, NOW_MS)
    assert normalized(without_rule)["settled"] != local["settled"]


def _with_gen(backup: Backup, gen: int) -> Backup:
    return Backup(backup.path, {**backup.manifest, "gen": gen})


def test_archived_segments_give_the_same_plan(spark: Any, tmp_path: Path) -> None:
    h = simulate(random.Random(11), 600)
    backup, log_dirs = write_history(h, tmp_path, segment_bytes=8192)
    result = archive_logs(tmp_path / "logs", tmp_path / "archive")
    assert result.archived and result.records
    local, remote = both_plans(spark, backup, log_dirs, h.replay_from, archive_dir=tmp_path / "archive")
    assert remote == local


def test_a_log_with_a_corrupt_frame_fails_the_spark_plan(spark: Any, tmp_path: Path) -> None:
    h = simulate(random.Random(3), 200)
    backup, log_dirs = write_history(h, tmp_path)
    first = sorted(log_dirs[0].glob("seg-*.log"))[0]
    raw = bytearray(first.read_bytes())
    raw[40] ^= 0xFF  # inside the first frame of a sealed segment
    first.write_bytes(bytes(raw))
    with pytest.raises(Exception, match="corrupt record log .*seg-00000001.log"):
        SparkEngine(spark=spark).plan(S, backup, log_dirs, 0, NOW_MS)


def test_an_entry_file_changed_since_the_backup_fails_the_spark_plan_with_the_backups_own_error(
        spark: Any, tmp_path: Path) -> None:
    """The Spark engine reads entry files in its workers: a byte flipped in a body (its frame's CRC fixed) comes back
    to the driver as the error the local engine raises, naming the file, so that cfrestore refuses it in the same
    one line on either engine (tests/security/test_backup_forgery.py runs that refusal through cfrestore)."""
    h = simulate(random.Random(5), 200)
    backup, log_dirs = write_history(h, tmp_path)
    f = sorted((tmp_path / "backup" / S / "b").glob("entries-*.bin"))[0]
    raw = bytearray(f.read_bytes())
    length = int.from_bytes(raw[9:13], "little")
    raw[9 + 8 + length - 1] ^= 0x01  # the last byte of the first frame's body: its data
    raw[13:17] = crc32c.crc32c(bytes(raw[17:17 + length])).to_bytes(4, "little")
    f.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=f"^{re.escape(str(f))}: blake3 does not match the manifest$"):
        LocalEngine().plan(S, backup, log_dirs, h.replay_from, NOW_MS)
    with pytest.raises(ChecksumMismatchError, match=f"^{re.escape(str(f))}: blake3 does not match the manifest$"):
        SparkEngine(spark=spark).plan(S, backup, log_dirs, h.replay_from, NOW_MS)


def test_progress_reports_spark_stages_as_the_restore_phases(spark: Any, tmp_path: Path) -> None:
    h = simulate(random.Random(5), 300)
    backup, log_dirs = write_history(h, tmp_path)
    engine = get_engine("spark", spark=spark)
    finals = []
    for _ in range(2):  # a second plan on the same session counts its own tasks only
        seen: list[tuple[str, int, int | None]] = []
        engine.plan(S, backup, log_dirs, h.replay_from, NOW_MS, lambda p, d, t, seen=seen: seen.append((p, d, t)))
        phases = [p for p, _, _ in seen]
        assert phases.index(READ_BACKUP) < phases.index(READ_LOGS) < phases.index(SETTLE)
        last = {p: (d, t) for p, d, t in seen}
        assert all(d == t and t for d, t in last.values())  # each phase ends with all of its Spark tasks done
        finals.append(last)
    assert finals[0] == finals[1]
    assert set(engine.phase_seconds) == {READ_BACKUP, READ_LOGS, SETTLE}  # type: ignore[attr-defined]


def test_spark_logging_goes_to_the_log_file_not_the_console(spark: Any, tmp_path_factory: Any) -> None:
    log_file = Path(spark.sparkContext.getConf().get("spark.driver.extraJavaOptions").split("file:")[1])
    text = log_file.with_suffix("").with_suffix(".log").read_text()
    assert "SparkContext" in text  # Spark's INFO lines landed in the file


def test_a_session_started_leaves_the_processes_sigint_handler_as_it_was(spark_started: Any) -> None:
    """PySpark's SparkContext installs its own SIGINT handler and leaves it after the session stops: start_session
    puts the process's back (run alone, a test that started a session failed at teardown for the handler it
    left, and a program's Ctrl-C would cancel a stopped context's jobs instead of doing what the program said)."""
    assert spark_started.sigint_after is spark_started.sigint_before


# -------------------------------------------------------------------------------------------- real histories


def _real_history(redis_url: str, root: Path, seed: int) -> tuple[Backup, list[Path], int]:
    """Three queue managers put (some outside syncpoint), get, commit and back out while a fuzzy backup runs; some
    UOWs stay open."""
    import threading

    from backup.run import run_backup
    from tests.support.group import define_group, start_qm

    client = define_group(redis_url)
    qms = [start_qm(redis_url, root / "logs", m, segment_bytes=4096) for m in MEMBERS]
    rnd = random.Random(seed)
    stop = threading.Event()

    def work(qm: Any, rnd: random.Random) -> None:
        conn = qm.connect()
        while not stop.is_set():
            if rnd.random() < 0.3:  # outside syncpoint: a UOW of its own
                conn.put(rnd.choice(("Q1", "Q2")), os.urandom(20), syncpoint=False)
            for _ in range(rnd.randint(1, 4)):
                conn.put(rnd.choice(("Q1", "Q2")), os.urandom(20), priority=rnd.randint(0, 3))
            for _ in range(rnd.randint(0, 3)):
                try:
                    conn.get(rnd.choice(("Q1", "Q2")))
                except Exception:
                    break
            conn.commit() if rnd.random() < 0.8 else conn.backout()
        conn.put("Q1", b"left in flight")  # an open UOW at the end: restore backs it out

    threads = [threading.Thread(target=work, args=(qm, random.Random(rnd.random()))) for qm in qms]
    for t in threads:
        t.start()
    manifest = run_backup(client, S, root / "backups", log_root=root / "logs")
    stop.set()
    for t in threads:
        t.join()
    for qm in qms:
        qm.log.force()
    backup = read_backup(root / "backups" / S / manifest["id"])
    for qm in qms:
        qm.stop(checkpoint=False)
    return backup, find_log_dirs(root / "logs"), int(manifest["replay_from"])


@pytest.mark.parametrize("seed", [1, 2])
def test_real_queue_manager_histories_plan_the_same(spark: Any, redis_url: str, tmp_path: Path, seed: int) -> None:
    backup, log_dirs, replay_from = _real_history(redis_url, tmp_path, seed)
    local, remote = both_plans(spark, backup, log_dirs, replay_from)
    assert remote == local
    assert local["counts"]["restored"] > 0 and local["counts"]["consumed"] > 0


def audit_dataframe(spark: Any, archive_dir: str | Path, entry_id: str) -> Any:
    """The Spark form of restore.archive.audit_message, for archives too big for one machine (the query
    docs/spark.md shows): a DataFrame of the records that name `entry_id` and the outcome records of their UOWs,
    ordered by (lrsn, member, segment, offset)."""
    from pyspark.sql import functions as F

    from restore.archive import SCHEMA_DDL, UOW_KINDS

    log = spark.read.schema(SCHEMA_DDL).parquet(str(Path(archive_dir) / "*" / "seg-*.parquet"))
    naming = log.where(F.array_contains("entry_ids", entry_id))
    uows = naming.where(F.col("uow").isNotNull()).select("uow").distinct()
    outcomes = log.where(F.col("kind").isin(*UOW_KINDS)).join(uows, "uow", "left_semi")
    return naming.unionByName(outcomes).distinct().orderBy("lrsn", "member", "segment", "offset")


def test_the_pyspark_audit_query_finds_a_message_history(spark: Any, tmp_path: Path) -> None:
    from restore.archive import audit_message

    h = simulate(random.Random(13), 400)
    write_history(h, tmp_path, segment_bytes=4096)
    archive_logs(tmp_path / "logs", tmp_path / "archive")
    got = [r for rs in h.logs.values() for r in rs if r["k"] == "GET"]
    target = got[len(got) // 2]["i"]
    rows = audit_dataframe(spark, tmp_path / "archive", target).collect()
    expected = audit_message(tmp_path / "archive", target)
    assert [(r["lrsn"], r["member"], r["kind"]) for r in rows] == [(r["l"], r["m"], r["k"]) for r in expected]
    assert {"PUT", "GET"} <= {r["kind"] for r in rows}


def test_cfrestore_passes_master_conf_and_archive_to_the_spark_engine() -> None:
    from restore.cli import _engine_options, build_parser

    args = build_parser().parse_args(["run", "APP1", "--engine", "spark", "--master", "spark://h:7077", "--conf",
                                      "spark.driver.memory=8g", "--conf", "spark.a=b=c", "--archive-dir", "/a"])
    assert _engine_options(args) == {"master": "spark://h:7077", "archive_dir": Path("/a"), "memory": 2**30,
                                     "conf": {"spark.driver.memory": "8g", "spark.a": "b=c"}}
    limited = build_parser().parse_args(["run", "APP1", "--engine", "spark", "--memory-limit", "2GiB"])
    assert _engine_options(limited)["memory"] == 2 * 2**30
    assert set(_engine_options(build_parser().parse_args(["run", "APP1"]))) == {"memory", "workers"}  # the default engine's
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "APP1", "--engine", "spark", "--conf", "no-equals-sign"])


@contextlib.contextmanager
def max_result_size(spark: Any, size: str) -> Iterator[None]:
    """spark.driver.maxResultSize set to `size` in the running session (each new job reads it) while it lasts."""
    conf = spark.sparkContext._jsc.sc().conf()
    before = conf.getOption("spark.driver.maxResultSize")
    conf.set("spark.driver.maxResultSize", size)
    try:
        yield
    finally:
        if before.isDefined():
            conf.set("spark.driver.maxResultSize", before.get())
        else:
            conf.remove("spark.driver.maxResultSize")


@pytest.fixture
def tiny_max_result_size(spark: Any) -> Iterator[int]:
    """spark.driver.maxResultSize set to 80 KiB in the running session, for one test."""
    with max_result_size(spark, "80k"):
        yield 80 * 1024


def place_executors_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's executors as on other machines: they do not share the driver's spill directory (they are given
    another token than the one it holds: restore.spill.share), so the plan comes back through the driver."""
    import restore.engine_spark as engine_spark

    real = engine_spark.share
    monkeypatch.setattr(engine_spark, "share", lambda spill: real(spill) and "another machine's directory")


@pytest.fixture
def executors_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    place_executors_elsewhere(monkeypatch)


def counted_streams(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many items each spark_fetch.stream the Spark engine makes brings through the driver (one count each)."""
    import restore.engine_spark as engine_spark

    real = engine_spark.stream
    counts: list[int] = []

    def counting(rdd: Any, budget: int | None = None) -> Iterator[Any]:
        counts.append(0)
        for item in real(rdd, budget):
            counts[-1] += 1
            yield item

    monkeypatch.setattr(engine_spark, "stream", counting)
    return counts


def test_executors_that_share_the_spill_directory_write_the_plan_themselves(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Executors on the driver's machine write the settled entries and the UOWs' outcomes into its spill files
    themselves: nothing whose size grows with the entries comes through the driver (what it streams: the base's
    UOWs and a count per partition), no task's part file is left, the spill files' bytes are counted, and the plan
    equals the local engine's. With executors elsewhere the same plan came through the driver, every entry."""
    h = simulate(random.Random(4), 1500, body_bytes=100)
    backup, log_dirs = write_history(h, tmp_path / "history", segment_bytes=65536)
    local = normalized(LocalEngine().plan(S, backup, log_dirs, h.replay_from, NOW_MS))
    streamed = counted_streams(monkeypatch)
    plan = SparkEngine(spark=spark, work_dir=tmp_path / "work").plan(S, backup, log_dirs, h.replay_from, NOW_MS)
    try:
        assert normalized(plan) == local
        assert plan.settled_count > 300 and sum(streamed) < plan.settled_count / 10, (streamed, plan.settled_count)
        files = [f for f in plan.spill.path.iterdir() if f.name.startswith(("run-", "gone-", "decided-"))]
        assert files and not [f for f in files if f.name.endswith(".part")]
        assert plan.spill.bytes_written == sum(f.stat().st_size for f in files)
    finally:
        plan.close()
    streamed.clear()
    place_executors_elsewhere(monkeypatch)
    plan = SparkEngine(spark=spark, work_dir=tmp_path / "work").plan(S, backup, log_dirs, h.replay_from, NOW_MS)
    try:
        assert normalized(plan) == local
        assert sum(streamed) >= plan.settled_count
    finally:
        plan.close()


def test_a_plan_bigger_than_max_result_size_comes_back_in_bounded_fetches(
        spark: Any, tmp_path: Path, tiny_max_result_size: int, executors_elsewhere: None) -> None:
    """A plan of 1M messages (1.07 GB) is over the 1 GiB default maxResultSize: whether to stream cannot be
    decided by a count of records. Here the limit is 80 KiB and the plan
    twice that, with a few hundred records only, and the executors (as on other machines) cannot write the plan
    into the driver's spill files: the plan still comes back whole, equal to the local
    engine's, and a plain collect() of it does fail under the same limit (the test is not vacuous)."""
    import pickle

    from restore.spark_fetch import result_budget

    h = simulate(random.Random(3), 1500, body_bytes=8000)
    backup, log_dirs = write_history(h, tmp_path, segment_bytes=65536)
    local, remote = both_plans(spark, backup, log_dirs, h.replay_from)
    assert remote == local
    plan_bytes = len(pickle.dumps(local["settled"]))
    assert plan_bytes > 2 * tiny_max_result_size
    assert result_budget(spark.sparkContext) == tiny_max_result_size // 2
    big = spark.sparkContext.parallelize([os.urandom(1024) for _ in range(plan_bytes // 1024)], 2)
    with pytest.raises(Exception, match="maxResultSize"):
        big.collect()


def test_stream_splits_partitions_into_runs_of_bounded_bytes() -> None:
    from restore.spark_fetch import pickled_chunks, runs

    items = [os.urandom(100) for _ in range(50)]
    chunks = list(pickled_chunks(items, 1000))
    assert all(len(c) <= 1000 + 200 for c in chunks) and len(chunks) > 5
    assert [__import__("pickle").loads(one) for c in chunks for one in __import__("pickle").loads(c)] == items
    assert list(pickled_chunks([b"x" * 5000], 1000)) and len(list(pickled_chunks([b"x" * 5000], 1000))) == 1
    assert list(runs([10, 10, 10, 50, 5], 30)) == [(0, 3), (3, 4), (4, 5)]
    assert list(runs([], 30)) == []
    from restore.spark_fetch import fetches

    # small partitions share a job; a big one is fetched in runs; nothing passes the budget but a lone chunk
    assert list(fetches([(0, [5, 5]), (1, [10]), (2, [20]), (3, [30, 30, 5]), (4, [1])], 30)) == [
        ([0, 1], 0, None), ([2], 0, None), ([3], 0, 1), ([3], 1, 2), ([3], 2, 3), ([4], 0, None)]


def test_cfrestore_gives_a_loopback_standalone_master_the_groups_secret_in_process(tmp_path: Path) -> None:
    """The project's standalone cluster (cfemu cluster up --spark N) runs with spark.authenticate: cfrestore's
    driver gets the group's spark.secret and loopback addresses in its SparkConf, never on a command line; a
    local master gets nothing; --conf still wins; a secret file others can read is refused."""
    import stat

    from cfemu import credentials
    from cfemu.settings import resolve
    from restore.cli import _engine_options, build_parser

    secrets_dir = tmp_path / "secrets"
    secret = credentials.spark_secret(credentials.spark_secret_file(secrets_dir).parent)
    assert secret and stat.S_IMODE(credentials.spark_secret_file(secrets_dir).stat().st_mode) == 0o600
    found = resolve(env={"CFEMU_SECRETS_DIR": str(secrets_dir), "CFEMU_SPARK_MASTER": "spark://127.0.0.1:7077"},
                    cwd=tmp_path)
    options = _engine_options(build_parser().parse_args(["run", "APP1", "--engine", "spark"]), found)
    assert options["master"] == "spark://127.0.0.1:7077"
    assert options["conf"] == {"spark.authenticate": "true", "spark.authenticate.secret": secret,
                               "spark.network.crypto.enabled": "true", "spark.driver.host": "127.0.0.1",
                               "spark.driver.bindAddress": "127.0.0.1"}
    args = build_parser().parse_args(["run", "APP1", "--engine", "spark", "--master", "local[2]"])
    assert _engine_options(args, found)["conf"] == {}
    args = build_parser().parse_args(["run", "APP1", "--engine", "spark", "--conf", "spark.driver.host=10.0.0.1"])
    assert _engine_options(args, found)["conf"]["spark.driver.host"] == "10.0.0.1"
    credentials.spark_secret_file(secrets_dir).chmod(0o644)
    with pytest.raises(credentials.SecretsError, match="spark.secret is readable"):
        _engine_options(build_parser().parse_args(["run", "APP1", "--engine", "spark"]), found)


def test_b12_a_uow_carried_across_a_restore_and_decided_later_is_decided_by_the_spark_engine_too(
        spark: Any, redis_url: str, tmp_path: Path) -> None:
    """Chaos B12 (tests/restore/test_chaos_regressions.py): the older generation's COMMIT of a UOW a relog copy
    shows holding an entry decides it on Spark as in the local engine."""
    from tests.restore.test_chaos_regressions import b12_history

    b12_history(redis_url, tmp_path, "spark", {"spark": spark})


@pytest.mark.deep
@pytest.mark.timeout(900)  # some tens of fetch jobs: up to 300 s on a loaded machine when they were 80 KiB each
@pytest.mark.parametrize("executors", ["here", "elsewhere"])
def test_the_spark_plan_streams_its_entries_to_spill_files_not_the_drivers_memory(
        spark: Any, tmp_path: Path, executors: str, request: pytest.FixtureRequest) -> None:
    """The settled entries go to sorted runs in spill files (a SpilledPlan the load merges), written by the
    executors themselves or, from executors elsewhere, by the driver straight from the fetches, so that the
    driver's memory does not grow with the history: its peak of Python allocations while it plans is a fraction
    of the data the plan restores (a list of the settled entries would hold all of it), and the plan still equals
    the local engine's. The fetches are bounded by a maxResultSize of 512 KiB (fetches of 256 KiB: some thirty
    jobs for the 8 MiB restored), a sixteenth of the data."""
    import tracemalloc

    if executors == "elsewhere":
        request.getfixturevalue("executors_elsewhere")

    from restore.partitioned import SpilledPlan

    h = simulate(random.Random(5), 200, body_bytes=1000)
    for n in range(400):  # committed messages the backup holds, none of them touched since: all restored
        lrsn = 10 + n
        e = Entry(id=f"kept{n:04d}", queue="Q1", priority=n % 3, put_time=lrsn, expiry=0).wire()
        e.update(st="CP", u="", l=lrsn, o1=lrsn, o2=lrsn)
        h.copies.append((1, e, os.urandom(20_000), S))
    backup, log_dirs = write_history(h, tmp_path / "history", segment_bytes=65536)
    engine = SparkEngine(spark=spark, memory=2**20, work_dir=tmp_path / "work")
    tracemalloc.start()
    try:
        with max_result_size(spark, "512k"):
            plan = engine.plan(S, backup, log_dirs, h.replay_from, NOW_MS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        assert isinstance(plan, SpilledPlan)
        assert any(plan.spill.path.glob("run-*")) and plan.spill.path.parent == tmp_path / "work"
        assert plan.loaded_bytes > 7 * 2**20
        assert peak < plan.loaded_bytes / 3, (peak, plan.loaded_bytes)
        assert normalized(plan) == normalized(LocalEngine().plan(S, backup, log_dirs, h.replay_from, NOW_MS))
    finally:
        plan.close()
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())


@pytest.mark.deep
@pytest.mark.parametrize("executors", ["here", "elsewhere"])
def test_the_spark_plan_joins_entries_with_outcomes_in_spark_not_in_the_drivers_memory(
        spark: Any, tmp_path: Path, executors: str, request: pytest.FixtureRequest) -> None:
    """The UOWs' outcomes meet the entries that need them in a shuffle by UOW (a hash join in Spark): the driver
    only appends them to spill files as they stream past, so that its memory does not grow with the UOWs. Here
    every UOW's outcome is big (a backout carrying the data of the entry it got, while a backup ran): the driver's
    peak of Python allocations while it plans is a fraction of the outcomes' data (a map of every outcome, or a
    broadcast of it, would hold all of it), and the plan, its outcomes included, equals the local engine's."""
    import tracemalloc

    from restore.partitioned import SpilledOutcomes

    if executors == "elsewhere":
        request.getfixturevalue("executors_elsewhere")

    h = History(replay_from=1000)
    lrsn = 1000
    for n in range(300):  # a committed message in the backup, got by a UOW that backs out carrying its data
        e = Entry(id=f"got{n:04d}", queue="Q1", priority=0, put_time=10 + n, expiry=0).wire()
        e.update(st="CP", u="", l=10 + n, o1=10 + n, o2=10 + n)
        body = os.urandom(40_000)
        h.copies.append((1, dict(e), body, S))
        u, member = f"QM{n % 3 + 1}.1.{n}", MEMBERS[n % 3]
        lrsn += 2
        h.logs[member].append(records.get(u, lrsn, structure=S, gen=1, entry_id=e["id"], queue="Q1"))
        got = dict(e, st="UG", u=u, l=lrsn)
        h.logs[member].append(records.backout(u, lrsn + 1, {S: 1}, data=[[S, got, body]]))
    backup, log_dirs = write_history(h, tmp_path / "history", segment_bytes=65536)
    engine = SparkEngine(spark=spark, memory=2**20, work_dir=tmp_path / "work")
    tracemalloc.start()
    try:
        with max_result_size(spark, "1m"):  # fetches of 512 KiB: a few dozen jobs, not hundreds
            plan = engine.plan(S, backup, log_dirs, h.replay_from, NOW_MS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        outcome_bytes = sum(len(c[2]) for o in plan.outcomes.values() for c in o.data.values())
        assert outcome_bytes == 300 * 40_000
        assert peak < outcome_bytes / 3, (peak, outcome_bytes)
        assert isinstance(plan.outcomes, SpilledOutcomes) and len(plan.outcomes) == 300
        assert normalized(plan) == normalized(LocalEngine().plan(S, backup, log_dirs, h.replay_from, NOW_MS))
    finally:
        plan.close()


def test_the_spark_engine_derives_its_memory_settings_from_the_memory_limit() -> None:
    from restore.spark_conf import memory_conf

    two = memory_conf("spark://h:7077", 2 * 2**30)  # each JVM a quarter; a fetch an eighth of Spark's share of it
    assert two == {"spark.driver.memory": "512m", "spark.executor.memory": "512m",
                   "spark.driver.maxResultSize": "53m", "spark.python.worker.memory": "1024m"}
    # local[...]: the one JVM runs the tasks and holds their persisted chunks (its tasks write the plan themselves,
    # no fetch of it passes through it): three eighths of the limit, each of the two Python workers a quarter
    assert memory_conf("local[2]", 2 * 2**30) == {"spark.driver.memory": "768m", "spark.driver.maxResultSize": "117m",
                                                   "spark.python.worker.memory": "512m"}
    assert memory_conf("local[2]", 8 * 2**30) == {"spark.driver.memory": "3072m", "spark.driver.maxResultSize": "693m",
                                                   "spark.python.worker.memory": "2048m"}
    assert memory_conf("local[2]", 2**20)["spark.driver.memory"] == "512m"  # a JVM needs that much to start
    engine = SparkEngine("local[2]", conf={"spark.driver.memory": "3g"}, memory=2 * 2**30)
    assert engine.conf["spark.driver.memory"] == "3g" and engine.conf["spark.python.worker.memory"] == "512m"
    with pytest.raises(ValueError, match="memory limit must be positive"):
        SparkEngine(memory=0)


def test_a_local_masters_jvm_runs_with_the_serial_collector_and_two_malloc_arenas(spark: Any) -> None:
    """The restore's own JVM in a local[...] master (start_session) runs every task within the restore's memory
    limit: its arguments name the serial collector, and its environment (as /proc shows the running JVM's) holds
    MALLOC_ARENA_MAX 2, unless this process had its own value; this process's own environment is left as it was."""
    from pyspark import SparkContext

    jvm = spark.sparkContext._jvm
    assert "-XX:+UseSerialGC" in list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    environ = Path(f"/proc/{SparkContext._gateway.proc.pid}/environ").read_bytes().split(b"\0")
    assert f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', '2')}".encode() in environ
    if "MALLOC_ARENA_MAX" not in os.environ:
        from restore.engine_spark import LOCAL_JVM_ENV, _environment

        with _environment(LOCAL_JVM_ENV):
            assert os.environ["MALLOC_ARENA_MAX"] == "2"
        assert "MALLOC_ARENA_MAX" not in os.environ


OWN_SESSION_CHILD = """
import json, os, sys
from pathlib import Path
from pyspark import SparkContext
from backup.files import read_backup
from restore.engine_spark import SparkEngine
from sqm.log import find_log_dirs

root, replay_from, now_ms = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
backup, log_dirs = read_backup(root / "backup" / "APP1" / "b"), find_log_dirs(root / "logs")
engine = SparkEngine("local[1]", log_file=root / "spark.log", work_dir=root / "work", memory=2**30)
out = {}
for n in range(2):
    engine.session()
    pid = SparkContext._gateway.proc.pid
    plan = engine.plan("APP1", backup, log_dirs, replay_from, now_ms)
    gone = not Path(f"/proc/{pid}").exists()
    out[n] = {"jvm": pid, "jvm_gone": gone, "gateway": SparkContext._gateway is not None,
              "loaded": sum(1 for _ in plan.in_load_order()), "counts": dict(plan.counts)}
    plan.close()
print(json.dumps(out))
"""


def test_an_engine_that_started_its_own_session_ends_its_jvm_after_each_plan(tmp_path: Path) -> None:
    """The plan is in spill files once made: the JVM the engine launched (its heap grown to its share of the memory
    limit, its Python workers) must not sit beside the load that reads them. A real process: its JVM is gone after
    each plan, the plan is read whole after it, and the next plan starts a JVM again and plans the same. A session
    given to the engine (the tests' shared one) is left running (every other test here)."""
    import json
    import subprocess
    import sys

    h = simulate(random.Random(11), 300)
    write_history(h, tmp_path, segment_bytes=65536)
    done = subprocess.run([sys.executable, "-c", OWN_SESSION_CHILD, str(tmp_path), str(h.replay_from), str(NOW_MS)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    first, second = runs["0"], runs["1"]
    assert first["jvm_gone"] and second["jvm_gone"] and not first["gateway"] and not second["gateway"]
    assert first["jvm"] != second["jvm"]
    assert first["loaded"] > 0 and (first["loaded"], first["counts"]) == (second["loaded"], second["counts"])
