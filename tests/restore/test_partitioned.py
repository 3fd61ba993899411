"""Restore in bounded memory (docs/architecture.md, "Restore in bounded memory"): the partitioned plan
(restore.partitioned, the local engine's) against the in-memory reference plan (restore.plan.plan_local), on random
histories written to real log segments and backups (the Spark differential test's generator), on real queue managers'
histories, and end to end through run_restore with a tiny memory limit; the peak RSS of a plan does not grow with its
input; bad memory limits are one clear line."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from backup.files import Backup, BackupWriter
from cfemu import keys
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from cfemu.entry import Entry
from cfemu.settings import parse_size, resolve
from restore.engine import LocalEngine
from restore.partitioned import SpilledPlan, merge_read_size, partitions_for
from restore.plan import RestorePlan, base_lrsn
from restore.reference import load_order, plan_local, read_logs
from restore.run import WORK_DIR, RestoreError, run_restore
from sqm.core import records
from sqm.log import RecordLog
from tests.restore.test_engine_spark import NOW_MS, S, _real_history, normalized, simulate, write_history
from tests.restore.test_restore import small_workload, snapshot
from tests.support.children import child_pids
from tests.support.harness import lose_cf

TINY = 64 << 10  # the least memory limit there is: forces a partition per few dozen records here


def reference(backup: Backup, log_dirs: list[Path], replay_from: int) -> RestorePlan:
    """The in-memory plan of the same input: every copy and record at once (restore.plan.plan_local)."""
    m = backup.manifest
    return plan_local(S, list(backup.copies()), read_logs(log_dirs, replay_from), now_ms=NOW_MS,
                      gen=int(m.get("gen", 0) or 0), carried=m.get("carried", ()), lrsn=base_lrsn(m),
                      registered=list(m.get("uows") or ()))


def described(plan: RestorePlan) -> dict[str, Any]:
    """normalized (the differential tests' view), and what the load and the report take from a plan: the load
    order, the in-doubt UOWs, first LRSNs, restore's decisions."""
    fixed = normalized(plan)
    order = [(s.id, s.entry) for s in plan.in_load_order()]
    return {**fixed, "order": [i for i, _ in order], "loaded_total": plan.loaded_total(),
            "in_doubt": plan.in_doubt_uows(), "first": plan.loaded_first_lrsn(),
            "backed_out_by_restore": plan.backed_out_by_restore(),
            "order_is_load_order": [i for i, _ in order] == [s.id for s in load_order(list(plan.settled))]}


def three_ways(backup: Backup, log_dirs: list[Path], replay_from: int, tmp: Path) -> tuple[Any, Any, Any, int]:
    """The in-memory plan, the partitioned plan in one partition, and in many partitions; the last also settled
    by 3 worker processes side by side (more than the cores: partitions finish out of order), which must give
    exactly what one process gives."""
    ref = reference(backup, log_dirs, replay_from)
    one = LocalEngine(partitions=1, work_dir=tmp, workers=1).plan(S, backup, log_dirs, replay_from, NOW_MS)
    many = LocalEngine(memory=TINY, work_dir=tmp, workers=1).plan(S, backup, log_dirs, replay_from, NOW_MS)
    parallel = LocalEngine(memory=TINY, work_dir=tmp, workers=3,
                           partitions=getattr(many, "partitions", 1)).plan(S, backup, log_dirs, replay_from, NOW_MS)
    try:
        assert isinstance(many, SpilledPlan) and isinstance(parallel, SpilledPlan)
        assert described(parallel) == described(many)
        assert many.worker_peak_bytes == 0  # settled in this process
        assert parallel.worker_peak_bytes > 0 or many.partitions == 1  # by the workers (one partition: by one)
        return described(ref), described(one), described(many), many.partitions
    finally:
        one.close()
        many.close()
        parallel.close()
        assert list(tmp.iterdir()) == []  # every spill directory removed


# The differential tests below run 10 and 12 of the generator's histories in the default suite; their deep twins
# (`make deep-test`) 25 and 30 more.
@pytest.mark.slow
@settings(max_examples=10, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(0, 120))
def test_partitioned_plans_equal_the_in_memory_plan(tmp_path_factory: pytest.TempPathFactory, seed: int,
                                                    steps: int) -> None:
    plan_three_ways_the_same(tmp_path_factory, seed, steps)


@pytest.mark.deep
@settings(max_examples=25, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(0, 120))
def test_partitioned_plans_equal_the_in_memory_plan_on_more_histories(tmp_path_factory: pytest.TempPathFactory,
                                                                      seed: int, steps: int) -> None:
    plan_three_ways_the_same(tmp_path_factory, seed, steps)


def plan_three_ways_the_same(tmp_path_factory: pytest.TempPathFactory, seed: int, steps: int) -> None:
    h = simulate(random.Random(seed), steps)
    root = tmp_path_factory.mktemp("history")
    backup, log_dirs = write_history(h, root)
    ref, one, many, _ = three_ways(backup, log_dirs, h.replay_from, root / "work")
    assert one == ref
    assert many == ref


@pytest.mark.slow
def test_a_rich_history_in_many_partitions(tmp_path: Path) -> None:
    """Every disposition and outcome kind, spread over many partitions, gives the in-memory plan."""
    h = simulate(random.Random(3), 1500)
    backup, log_dirs = write_history(h, tmp_path)
    ref, one, many, partitions = three_ways(backup, log_dirs, h.replay_from, tmp_path / "work")
    assert partitions >= 16
    assert one == ref and many == ref
    assert {d for d, *_ in ref["settled"].values()} == {"restored", "in-doubt", "consumed", "put-backed-out",
                                                         "expired", "gone"}
    assert ref["decisions"] and ref["in_commit"] and ref["in_doubt"]
    assert ref["order_is_load_order"] and many["order_is_load_order"]


def test_a_history_across_a_restore_in_many_partitions(tmp_path: Path) -> None:
    """The generation rule (records of an older incarnation left out) partitions alike."""
    h = simulate(random.Random(12), 300)
    assert h.gen == 2
    backup, log_dirs = write_history(h, tmp_path)
    ref, one, many, _ = three_ways(backup, log_dirs, h.replay_from, tmp_path / "work")
    assert one == ref and many == ref


@pytest.mark.parametrize("seed", [1, 2])
def test_real_queue_manager_histories_partition_the_same(redis_url: str, tmp_path: Path, seed: int) -> None:
    backup, log_dirs, replay_from = _real_history(redis_url, tmp_path, seed)
    ref, one, many, _ = three_ways(backup, log_dirs, replay_from, tmp_path / "work")
    assert one == ref and many == ref
    assert ref["counts"]["restored"] > 0 and ref["counts"]["consumed"] > 0


def _cf_content(client: Any) -> dict[str, Any]:
    """The structure as restore left it, but the header and the UOW records (they carry the generation, which is
    the restore's own LRSN)."""
    snap = snapshot(client)
    snap.pop(keys.meta(S))
    snap.pop(keys.uows(S), None)
    return snap


def test_a_restore_in_tiny_memory_loads_what_the_default_loads(fresh_redis: EmbeddedRedis, tmp_path: Path) -> None:
    """End to end: a restore with the least memory limit (many partitions settled by 3 worker processes, the load
    streamed from a merge of many runs) leaves the CF as a restore with the default does, from the same backup; the report says its peak
    memory, its limit and partitions; the spill directory is left empty."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    qms, manifest = small_workload(fresh_redis.url, logs, backups)
    for qm in qms:
        qm.log.force()
    client = connect(fresh_redis.url)
    lose_cf(client)
    tiny = run_restore(client, S, backup_root=backups, log_root=logs, backup_id=manifest["id"], engine="local",
                       engine_options={"memory": TINY, "partitions": 7, "workers": 3})
    after_tiny = _cf_content(client)
    default = run_restore(client, S, backup_root=backups, log_root=logs, backup_id=manifest["id"], mark_failed=True)
    assert _cf_content(client) == after_tiny
    assert tiny.counts == default.counts and tiny.loaded_entries == default.loaded_entries > 0
    assert tiny.in_doubt_uows == default.in_doubt_uows
    assert (tiny.partitions, default.partitions) == (7, 1)
    assert (tiny.workers, default.workers) == (3, 1)  # 7 partitions settled by 3 worker processes; 1 here
    assert tiny.memory_limit == TINY and default.memory_limit == 1 << 30
    assert 0 < tiny.peak_rss_bytes < 2**31
    report = json.loads(Path(str(tiny.report_path)).read_text())
    assert report["peak_rss_bytes"] == tiny.peak_rss_bytes and report["partitions"] == 7 and report["workers"] == 3
    assert list((backups / WORK_DIR).iterdir()) == []
    assert oct((backups / WORK_DIR).stat().st_mode & 0o777) == "0o700"
    for qm in qms:
        qm.stop(checkpoint=False)


def test_the_merge_read_buffers_share_a_quarter_of_the_memory() -> None:
    """Each sorted run costs about 3x its read size in the merge (the Unpacker's doubled buffer and a read's
    transient bytes): 171 runs of an 8 MiB restore at a 16 KiB floor took 9 MiB, more than the whole limit."""
    for memory, runs in [(8 << 20, 171), (1 << 30, 64), (1 << 30, 4096), (64 << 20, 300)]:
        size = merge_read_size(memory, runs)
        assert size >= 4 << 10
        assert size == 4 << 10 or 3 * size * runs <= memory // 4, (memory, runs, size)
    assert merge_read_size(1 << 30, 1) == 1 << 20


def test_partitions_grow_with_the_input_and_shrink_with_the_memory() -> None:
    assert partitions_for(0, 1 << 30) == 1
    assert partitions_for(10 << 30, 1 << 30) > partitions_for(1 << 30, 1 << 30) > 1
    assert partitions_for(1 << 30, 256 << 20) > partitions_for(1 << 30, 1 << 30)


# --------------------------------------------------------------------------------------------- memory bounds

def write_input(root: Path, n_backup: int, n_log: int) -> None:
    """A backup of n_backup committed messages (root/b, replay from 10**7) and a log of n_log more, each put and
    committed by a UOW of its own (root/logs/QM1); 1 KiB each."""
    body = bytes(1024)
    w = BackupWriter(root / "b")
    for i in range(n_backup):
        w.add(1, Entry(f"b{i:09d}", "Q1", state="CP", lrsn=1000 + i, order=(1000 + i, 1000 + i)).wire(), body)
    w.finish({"id": "b", "group": "G", "structure": S, "entries": n_backup, "bytes": n_backup * 1024,
              "replay_from": 10**7, "gen": 1})
    lrsn = 10**7
    with RecordLog(root / "logs" / "QM1", "QM1") as log:
        for i in range(n_log):
            u = f"QM1.1.{i}"
            e = Entry(f"p{i:09d}", "Q1", state="UP", lrsn=lrsn, uow=u, order=(0, lrsn)).wire()
            log.append(records.put(u, lrsn, structure=S, gen=1, entry=e, data=body))
            log.append(records.commit(u, lrsn + 1, {S: 1}))
            log.append(records.end(u, lrsn + 2))
            lrsn += 3
        log.force()


_MEASURE = textwrap.dedent("""
    import sys
    from pathlib import Path

    def peak_kib():
        # VmHWM, this process's own peak RSS: ru_maxrss keeps the forking parent's peak across exec (Linux), so
        # a child of a pytest process grown by a long suite started at that process's size.
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise SystemExit("no VmHWM")

    from backup.files import read_backup
    from restore.engine import LocalEngine
    from restore.reference import plan_local, read_logs
    memory, root, workers = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    backup = read_backup(root / "b")
    logs = [root / "logs" / "QM1"]
    before = peak_kib()
    if memory:
        plan = LocalEngine(memory=memory, work_dir=root / "work", workers=workers).plan("APP1", backup, logs, 10**7,
                                                                                        0)
    else:  # the in-memory plan, for contrast
        plan = plan_local("APP1", list(backup.copies()), read_logs(logs, 10**7), now_ms=0, gen=1)
        plan.partitions = 0
    loaded = sum(1 for _ in plan.in_load_order())
    plan.close()
    print(loaded, plan.partitions, before, peak_kib(), getattr(plan, "worker_peak_bytes", 0) // 1024)
""")


def _measure(n: int, memory: int, root: Path, workers: int = 1) -> tuple[int, int, int, int, int]:
    """(messages loaded, partitions, peak RSS in KiB before the plan, and after the plan and a pass over its
    load order, and the worker processes' peaks summed), planned in a fresh process (memory 0: by the in-memory
    plan_local)."""
    if not root.exists():
        write_input(root, n, n)
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(memory), str(root), str(workers)], check=True,
                         capture_output=True, text=True, timeout=280,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    loaded, partitions, before, after, workers_peak = (int(x) for x in out.stdout.split())
    return loaded, partitions, before, after, workers_peak


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 35 s on an idle machine; three subprocesses, slow on a loaded one
def test_peak_memory_stays_bounded_as_the_input_grows(tmp_path: Path) -> None:
    """A plan of 4x the messages (4x the bytes: 1 KiB each) under the same 8 MiB limit: its peak RSS grows by
    far less than the input (the in-memory plan holds all of it: 2 KiB a message pair, and more in objects)."""
    small_n, big_n, memory = 6_000, 24_000, 8 << 20
    small = _measure(small_n, memory, tmp_path / "small")
    big = _measure(big_n, memory, tmp_path / "big")
    assert small[0] == 2 * small_n and big[0] == 2 * big_n
    assert big[1] > small[1] > 1
    input_growth_kib = (big_n - small_n) * 2
    assert big[3] - small[3] < input_growth_kib // 4, (small, big)
    assert big[3] - big[2] < 3 * memory // 1024, big  # KiB: within a few times its limit over the start
    in_memory = _measure(big_n, 0, tmp_path / "big")  # the measure is not blind: the in-memory plan grows it
    assert in_memory[0] == big[0] and in_memory[3] - in_memory[2] > input_growth_kib // 2, (in_memory, big)
    # Settled by 2 worker processes: the processes together (this one and the workers' peaks) grow by far less
    # than the input too; each worker costs its interpreter's fixed size, whatever the input.
    small2 = _measure(small_n, memory, tmp_path / "small", workers=2)
    big2 = _measure(big_n, memory, tmp_path / "big", workers=2)
    assert small2[0] == big2[0] - 2 * (big_n - small_n) and small2[4] > 0 and big2[4] > 0
    assert (big2[3] + big2[4]) - (small2[3] + small2[4]) < input_growth_kib // 4, (small2, big2)


# ----------------------------------------------------------------------------------------------- the setting

@pytest.mark.parametrize(("text", "size"), [("1GiB", 1 << 30), ("512m", 512 << 20), ("65536", 65536),
                                             ("1.5 GiB", 3 << 29), ("2G", 2 << 30), ("100MB", 100_000_000),
                                             ("1024TiB", 1 << 50)])
def test_memory_limits_parse(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "12 parsecs", "-1G", "0", "1k", "nanG", "inf",
                                  "1e30", "1e300", "99999999TiB", "1025TiB"])
def test_bad_memory_limits_are_refused_in_one_line(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_size(text, what="--memory-limit")
    assert "\n" not in str(e.value) and str(e.value).startswith("--memory-limit") and repr(text) in str(e.value)


def test_the_memory_limit_resolves_from_the_flag_then_the_environment(tmp_path: Path) -> None:
    env = {"CFEMU_RESTORE_MEMORY": "256MiB"}
    assert resolve(memory_limit="2GiB", env=env, cwd=tmp_path).memory_limit() == 2 << 30
    assert resolve(env=env, cwd=tmp_path).memory_limit() == 256 << 20
    assert resolve(env={}, cwd=tmp_path).memory_limit() == 1 << 30
    with pytest.raises(ValueError, match=r"^\$CFEMU_RESTORE_MEMORY: 'x' is not a size"):
        resolve(env={"CFEMU_RESTORE_MEMORY": "x"}, cwd=tmp_path).memory_limit()


def test_run_restore_takes_the_memory_limit_from_the_environment(fresh_redis: EmbeddedRedis, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller with no flag (RECAUTO) gets $CFEMU_RESTORE_MEMORY; a bad one is a RestoreError of one line,
    raised before anything is read."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    qms, _ = small_workload(fresh_redis.url, logs, backups)
    client = connect(fresh_redis.url)
    monkeypatch.setenv("CFEMU_RESTORE_MEMORY", "3MiB")
    assert run_restore(client, S, backup_root=backups, log_root=logs, dry_run=True).memory_limit == 3 << 20
    monkeypatch.setenv("CFEMU_RESTORE_MEMORY", "much")
    with pytest.raises(RestoreError, match=r"^\$CFEMU_RESTORE_MEMORY: 'much' is not a size"):
        run_restore(client, S, backup_root=backups, log_root=logs, dry_run=True)
    for qm in qms:
        qm.stop(checkpoint=False)


def test_cfrestore_refuses_a_bad_memory_limit_in_one_line(tmp_path: Path) -> None:
    """Refused before it connects or reads anything: one line on stderr, exit status 2."""
    out = subprocess.run([sys.executable, "-m", "restore.cli", "run", "APP1", "--memory-limit", "lots",
                          "--redis-url", "redis://127.0.0.1:1", "--log-root", str(tmp_path / "l"),
                          "--backup-dir", str(tmp_path / "b")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert "--memory-limit: 'lots' is not a size" in out.stderr
    assert not (tmp_path / "b").exists()


# ------------------------------------------------------------------------------------------ the load pipeline

class _Loader:
    """Stands in for bulk.prepare: counts what it prepared, fails at batch `fail_at`."""

    def __init__(self, fail_at: int = -1) -> None:
        self.prepared, self.fail_at = 0, fail_at

    def prepare(self, chunk: list[int]) -> list[int]:
        if self.prepared == self.fail_at:
            raise RuntimeError("prepare failed")
        self.prepared += 1
        return chunk

    def source(self, chunks: list[list[int]]) -> Iterator[list[int]]:
        return (self.prepare(c) for c in chunks)


def test_the_load_pipeline_keeps_order_and_hands_errors_to_the_loader() -> None:
    from restore.load import Prepared

    with Prepared(_Loader().source([[1], [2], [3]])) as p:  # type: ignore[arg-type]
        assert list(p) == [[1], [2], [3]]
    with pytest.raises(RuntimeError, match="prepare failed"), \
            Prepared(_Loader(fail_at=1).source([[1], [2], [3]])) as p:  # type: ignore[arg-type]
        for _ in p:
            pass


def test_a_load_that_stops_early_stops_the_preparing_thread_at_most_two_batches_ahead() -> None:
    """The loader leaves after one batch (a NotOwnerError, say): the thread does not prepare the whole plan, and
    the `with` ends it (it would otherwise block on the full queue for ever)."""
    from restore.load import Prepared

    loader = _Loader()
    with Prepared(loader.source([[i] for i in range(100)])) as p:  # type: ignore[arg-type]
        next(iter(p))
        deadline = time.monotonic() + 5
        while loader.prepared < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert loader.prepared <= 1 + Prepared.DEPTH + 1
    assert not p.thread.is_alive()


class _Interrupted(Exception):
    pass


@pytest.mark.slow
def test_a_plan_interrupted_while_workers_settle_leaves_nothing(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's side raises in the middle of the fold (an interrupt, a progress display that fails): the
    error comes out as itself, at once, with no worker process, no thread of the pool (none dying with an error
    of its own) and no spill file left."""
    import threading
    thread_errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: thread_errors.append(a.exc_value))
    h = simulate(random.Random(3), 1500)
    backup, log_dirs = write_history(h, tmp_path)
    work = tmp_path / "work"
    before = child_pids()

    def progress(phase: str, done: int, total: int | None) -> None:
        if phase == "settle" and done == 2:
            raise _Interrupted

    with pytest.raises(_Interrupted):
        LocalEngine(memory=TINY, work_dir=work, workers=3, partitions=40).plan(
            S, backup, log_dirs, h.replay_from, NOW_MS, progress)
    assert list(work.iterdir()) == []
    assert child_pids() - before == set()
    time.sleep(0.5)  # a thread still handing out tasks would fail now
    assert [t.name for t in threading.enumerate() if t.name.startswith("restore-worker-")] == []
    assert thread_errors == []


@pytest.mark.slow
@settings(max_examples=12, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_histories_that_carry_a_uow_across_a_restore_partition_the_same(tmp_path_factory: pytest.TempPathFactory,
                                                                        seed: int) -> None:
    """The generator's histories with an in-doubt UOW carried across the restore and a backup after it (simulate's
    carry): the workers' deferred records, filed once the backup is read, give the in-memory plan."""
    partition_a_carried_uow_the_same(tmp_path_factory, seed)


@pytest.mark.deep
@settings(max_examples=30, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_more_histories_that_carry_a_uow_across_a_restore_partition_the_same(
        tmp_path_factory: pytest.TempPathFactory, seed: int) -> None:
    partition_a_carried_uow_the_same(tmp_path_factory, seed)


def partition_a_carried_uow_the_same(tmp_path_factory: pytest.TempPathFactory, seed: int) -> None:
    h = simulate(random.Random(seed), 150, carry=True)
    assume(h.carried)  # not vacuous: a UOW holding entries was carried (3 seeds in 300 carry none)
    root = tmp_path_factory.mktemp("carried")
    backup, log_dirs = write_history(h, root)
    work = root / "work"
    work.mkdir()
    plan = LocalEngine(memory=TINY, work_dir=work, workers=2).plan(S, backup, log_dirs, h.replay_from, NOW_MS)
    try:
        assert described(plan) == described(reference(backup, log_dirs, h.replay_from))
    finally:
        plan.close()


def test_records_of_an_older_generation_read_beside_the_backup_are_filed_once_its_uows_are_known(
        tmp_path: Path) -> None:
    """The workers read the logs while this process reads the backup, knowing only the manifest's UOWs: a record
    of an older generation is set aside, and filed once the backup's UOWs are known. Here the backup (generation
    2) holds an entry got by a UOW of generation 1 carried across the restore that began generation 2: that
    UOW's COMMIT counts (the entry is consumed), while another generation-1 UOW's get and commit, on an entry the
    backup holds committed, are left out (the entry is restored). Filed too late or not at all, the carried UOW
    would be in flight, and its get backed out."""
    from backup.files import read_backup

    R = 10**6
    w = BackupWriter(tmp_path / "b")
    w.add(1, Entry("b0", "Q1", state="UG", lrsn=R - 10, uow="QM1.1.7", order=(R - 20, R - 20)).wire(), b"x")
    w.add(1, Entry("b1", "Q1", state="CP", lrsn=R - 9, order=(R - 19, R - 19)).wire(), b"y")
    w.finish({"id": "b", "group": "G", "structure": S, "entries": 2, "bytes": 2, "replay_from": R, "gen": 2})
    with RecordLog(tmp_path / "logs" / "QM1", "QM1") as log:
        log.append(records.get("QM1.1.8", R + 1, structure=S, gen=1, entry_id="b1", queue="Q1"))
        log.append(records.commit("QM1.1.8", R + 2, {S: 1}))
        log.append(records.commit("QM1.1.7", R + 3, {S: 1}))
        log.append(records.end("QM1.1.7", R + 4))
        log.force()
    backup, log_dirs = read_backup(tmp_path / "b"), [tmp_path / "logs" / "QM1"]
    ref = reference(backup, log_dirs, R)
    assert {i: s[0] for i, s in normalized(ref)["settled"].items()} == {"b0": "consumed", "b1": "restored"}
    work = tmp_path / "work"
    work.mkdir()
    plan = LocalEngine(work_dir=work, workers=2, partitions=4).plan(S, backup, log_dirs, R, NOW_MS)
    try:
        assert isinstance(plan, SpilledPlan) and plan.worker_peak_bytes > 0  # the logs read by the workers
        assert plan.deferred_records == 3  # the two generation-1 UOWs' three records, filed after the backup
        assert described(plan) == described(ref)
    finally:
        plan.close()
