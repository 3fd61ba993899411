"""The restore load's stream (restore.load, restore.workers.Workers.stream): a worker making a load's batches
holds no more of them than it must, and a load that fails or is stopped leaves no worker, thread or spill file.
Real processes, a real redis-server."""

from __future__ import annotations

import itertools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import restore.load
import restore.workers
from backup.files import BackupWriter, read_backup
from cfemu import bulk, keys
from cfemu.admin import Admin, StructureDef
from cfemu.embedded import EmbeddedRedis
from cfemu.entry import Entry
from cfemu.progress import no_progress
from restore.engine import LocalEngine
from restore.load import STREAM_BELOW, STREAM_FROM, LoadVerifyError, batch_bytes_for, load_plan
from restore.partitioned import SpilledPlan
from restore.plan import RestorePlan
from restore.reference import plan_local, read_logs
from restore.workers import WorkerError, Workers
from sqm.log import RecordLog
from tests.support.children import child_pids

ITEM = 48 << 20  # a load's batch of 1,000 messages of 48 KiB


@pytest.fixture(autouse=True)
def _small_loads_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """These loads are of a few thousand messages (quick), but what they check is the worker's stream, which a load
    takes from restore.load.STREAM_FROM entries on."""
    monkeypatch.setattr(restore.load, "STREAM_FROM", 0)


def _peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def big_items(size: int) -> Iterator[int | bytes]:
    """A worker's stream of two items of `size` bytes, then how much its peak memory grew meanwhile (KiB)."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    start = _peak_kib()
    yield os.urandom(size)
    yield os.urandom(size)
    yield _peak_kib() - start


def test_a_worker_holds_an_item_and_its_frame_only_while_it_is_sent() -> None:
    """Each item of a stream is made, pickled and written, then let go. The worker held the item it had sent while
    it made the next one, and wrote each frame as a copy of its pickle joined to its header: three times an item
    (a load's batch: all its messages' data), against two (the item and its pickle)."""
    with Workers(1, processes=1) as pool:
        *items, growth_kib = pool.stream(big_items, ITEM)
    assert [len(i) for i in items] == [ITEM, ITEM]  # type: ignore[arg-type]
    assert growth_kib * 1024 < 2.5 * ITEM, f"the worker grew by {growth_kib >> 10} MiB for items of {ITEM >> 20}"


# --- a load that stops part way -------------------------------------------------------------------------------
S = "APP1"
N = 5000  # five batches


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A backup of N committed messages (and an empty log)."""
    root = tmp_path_factory.mktemp("load-stream")
    w = BackupWriter(root / "b")
    for i in range(N):
        w.add(1, Entry(f"b{i:09d}", "Q1", state="CP", lrsn=1000 + i, order=(1000 + i, 1000 + i)).wire(),
              b"%d" % i * 100)
    w.finish({"id": "b", "group": "G", "structure": S, "entries": N, "bytes": 0, "replay_from": 10**7, "gen": 1})
    with RecordLog(root / "logs" / "QM1", "QM1") as log:
        log.force()
    return root


def _plan(history: Path, tmp_path: Path, workers: int) -> RestorePlan:
    return LocalEngine(memory=1 << 20, work_dir=tmp_path / "work", workers=workers).plan(
        S, read_backup(history / "b"), [history / "logs" / "QM1"], 10**7, 0)


def _content(client: redis.Redis) -> dict[bytes, Any]:
    out: dict[bytes, Any] = {}
    for k in sorted(client.scan_iter(match="{APP1}:*")):
        t = client.type(k)
        out[k] = (client.hgetall(k) if t == b"hash" else client.lrange(k, 0, -1) if t == b"list"
                  else sorted(client.smembers(k)) if t == b"set" else client.zrange(k, 0, -1, withscores=True)
                  if t == b"zset" else client.get(k))
    meta = out.get(keys.meta(S).encode())
    if isinstance(meta, dict):  # the claim's token, and the plan's restore LRSN (from the clock when planned)
        for f in (b"restore_token", b"gen", b"clock", b"floor"):
            meta.pop(f, None)
    return out


def _load(client: redis.Redis, plan: RestorePlan, progress: Callable[[str, int, int | None], None] = no_progress
          ) -> None:
    with bulk.claim(client, S, bulk.observe(client, S)) as owner:
        load_plan(owner, plan, StructureDef(S), ["Q1"], progress=progress)


@pytest.mark.slow
def test_a_small_load_starts_no_worker_process(redis_url: str, history: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A load of fewer than restore.load.STREAM_FROM entries makes its batches in a thread, even for a plan settled
    by workers: a worker's start (0.3-0.5 s) is more than such a load takes, and every restore of a few queues (a
    RECAUTO after a CF loss) paid it."""
    monkeypatch.setattr(restore.load, "STREAM_FROM", STREAM_FROM)  # the real threshold, not this module's 0
    assert N < STREAM_FROM
    client = redis.Redis.from_url(redis_url)
    Admin(client).define_structure(S)
    Admin(client).define_queue("Q1", S)
    plan = _plan(history, tmp_path, workers=2)
    assert isinstance(plan, SpilledPlan) and plan.partitions > 1  # settled by the two workers
    started: list[Any] = []
    real = restore.workers.subprocess.Popen

    def popen(args: Any, *rest: Any, **kw: Any) -> Any:
        started.append(args)
        return real(args, *rest, **kw)

    monkeypatch.setattr(restore.workers.subprocess, "Popen", popen)
    try:
        _load(client, plan)
    finally:
        plan.close()
    assert started == []
    assert client.hlen(keys.data(S)) == N


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_stopped_load_leaves_no_worker_and_no_thread(redis_url: str, history: Path, tmp_path: Path,
                                                       workers: int) -> None:
    """A purge takes the structure over while the load is at its third batch, and then an interrupt in the
    middle of one, and then the worker preparing the batches is killed: each load stops with its own error, with
    no worker process and no preparing thread left behind."""
    client = redis.Redis.from_url(redis_url)
    Admin(client).define_structure(S)
    Admin(client).define_queue("Q1", S)
    plan = _plan(history, tmp_path, workers)
    before = child_pids()
    try:
        def purge_at_3000(phase: str, done: int, total: int | None) -> None:
            if done == 3000:
                bulk.purge(client, StructureDef(S), ["Q1"])

        with pytest.raises(bulk.NotOwnerError, match="a later restore or a purge took the structure over"):
            _load(client, plan, purge_at_3000)

        def interrupt_at_2000(phase: str, done: int, total: int | None) -> None:
            if done == 2000:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            _load(client, plan, interrupt_at_2000)

        def kill_the_worker_at_1000(phase: str, done: int, total: int | None) -> None:
            if done == 1000:
                for pid in child_pids() - before:
                    os.kill(pid, signal.SIGKILL)

        if workers > 1:
            with pytest.raises(WorkerError, match="a restore worker process .* stopped"):
                _load(client, plan, kill_the_worker_at_1000)
        assert child_pids() - before == set()
        assert [t.name for t in threading.enumerate() if t.name == "restore-load-prepare"] == []
        _load(client, plan)  # and a load after them all loads it all
        assert client.hlen("{APP1}:data") == N
    finally:
        plan.close()
    assert list((tmp_path / "work").iterdir()) == []


@pytest.mark.slow
def test_a_load_with_workers_writes_what_a_load_without_writes(fresh_redis: EmbeddedRedis, history: Path,
                                                                tmp_path: Path) -> None:
    """The batches prepared in a worker process (the stream), in a thread of this one from the same runs, and
    from the in-memory plan: the same CF content."""
    client = fresh_redis.client()
    contents = []
    for workers in (2, 1, 0):
        client.flushall()
        Admin(client).define_structure(S)
        Admin(client).define_queue("Q1", S)
        if workers:
            plan = _plan(history, tmp_path / str(workers), workers)
        else:
            backup = read_backup(history / "b")
            plan = plan_local(S, list(backup.copies()), read_logs([history / "logs" / "QM1"], 10**7), now_ms=0,
                              gen=1)
        try:
            _load(client, plan)
        finally:
            plan.close()
        contents.append(_content(client))
    assert contents[0] == contents[1] == contents[2] and len(contents[0][b"{APP1}:data"]) == N


def test_a_stream_on_a_worker_that_died_before_it_is_a_worker_error() -> None:
    """The worker died before the task reached it (at its start, say): the same clear error as when it dies
    after (it was a bare BrokenPipeError, or the WorkerError, by the timing)."""
    with Workers(1, processes=1) as pool:
        os.kill(pool.procs[0].pid, signal.SIGKILL)
        pool.procs[0].wait()
        with pytest.raises(WorkerError, match=r"a restore worker process \(pid \d+\) stopped"):
            list(pool.stream(big_items, 10))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_load_that_wrote_less_than_the_plan_holds_is_refused(fresh_redis: EmbeddedRedis, history: Path,
                                                                tmp_path: Path, workers: int, damage: str) -> None:
    """A sorted run of the plan lost under the load (removed, or cut short: a cleaner of old files, a full disk):
    its merge reads what is there and ends, and the load's check compared the CF with what the load had sent,
    not with the plan: the structure became ACTIVE without those messages. Now the load's count of entries is
    checked against the plan's: LoadVerifyError, the structure left RECOVERING for a re-run."""
    client = fresh_redis.client()
    Admin(client).define_structure(S)
    Admin(client).define_queue("Q1", S)
    plan = _plan(history, tmp_path, workers)
    try:
        assert isinstance(plan, SpilledPlan) and plan.partitions > 1
        run = plan.spill.file("run-0")
        if damage == "removed":
            run.unlink()
        else:
            os.truncate(run, run.stat().st_size // 2)
        with pytest.raises(LoadVerifyError, match=f"{N} entries in the plan"):
            _load(client, plan)
    finally:
        plan.close()
    assert client.hget(keys.meta(S), "state") == b"RECOVERING"


@pytest.fixture(scope="module")
def large_history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A backup of 2,000 committed messages of 8 KiB (and an empty log)."""
    root = tmp_path_factory.mktemp("load-large")
    w = BackupWriter(root / "b")
    for i in range(2000):
        w.add(1, Entry(f"b{i:09d}", "Q1", state="CP", lrsn=1000 + i, order=(1000 + i, 1000 + i)).wire(),
              os.urandom(8 << 10))
    w.finish({"id": "b", "group": "G", "structure": S, "entries": 2000, "bytes": 0, "replay_from": 10**7, "gen": 1})
    with RecordLog(root / "logs" / "QM1", "QM1") as log:
        log.force()
    return root


@pytest.mark.parametrize("large", [False, True])
def test_a_plan_of_large_messages_is_loaded_from_a_thread_not_through_a_worker(
        redis_url: str, history: Path, large_history: Path, tmp_path: Path, large: bool) -> None:
    """A worker's batches come through a pipe, every message's data pickled and read again: with messages of
    restore.load.STREAM_BELOW or more on average that costs more than the merge the worker takes off the sending
    process, so such a plan, settled by workers, is loaded from a thread. Either way the CF ends with every message
    (verified by the load)."""
    client = redis.Redis.from_url(redis_url)
    Admin(client).define_structure(S)
    Admin(client).define_queue("Q1", S)
    plan = _plan(large_history if large else history, tmp_path, workers=2)
    assert isinstance(plan, SpilledPlan)
    assert (plan.loaded_bytes >= STREAM_BELOW * plan.loaded_count) is large
    before = child_pids()
    spawned: list[set[int]] = []

    def look(phase: str, done: int, total: int | None) -> None:
        if done and not spawned:
            spawned.append(child_pids() - before)

    try:
        _load(client, plan, look)
    finally:
        plan.close()
    assert bool(spawned[0]) is not large  # a worker process beside the load, for small messages only
    assert client.hlen(keys.data(S)) == (2000 if large else N)


def test_a_load_of_large_messages_holds_batches_bounded_by_bytes(redis_url: str, tmp_path: Path) -> None:
    """A batch was a thousand messages whatever their size: 4 GiB for messages of 4 MiB (a queue's default
    MAXMSGL), held several times over (batches prepared ahead, the one sent, the restore point's copies). A batch
    now ends at restore.load.batch_bytes_for(memory) of data: 300 messages of 512 KiB (150 MiB) load in batches
    of 4 MiB, and the load's peak grows by a few batches, not by the whole load."""
    root = tmp_path / "h"
    w = BackupWriter(root / "b")
    body = 512 << 10
    for i in range(300):
        w.add(1, Entry(f"b{i:09d}", "Q1", state="CP", lrsn=1000 + i, order=(1000 + i, 1000 + i)).wire(),
              os.urandom(body))
    w.finish({"id": "b", "group": "G", "structure": S, "entries": 300, "bytes": 0, "replay_from": 10**7, "gen": 1})
    with RecordLog(root / "logs" / "QM1", "QM1") as log:
        log.force()
    client = redis.Redis.from_url(redis_url)
    Admin(client).define_structure(S)
    Admin(client).define_queue("Q1", S)
    plan = LocalEngine(memory=64 << 20, work_dir=tmp_path / "work", workers=1).plan(
        S, read_backup(root / "b"), [root / "logs" / "QM1"], 10**7, 0)
    assert batch_bytes_for(64 << 20) == 4 << 20
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    start = _peak_kib()
    try:
        with bulk.claim(client, S, bulk.observe(client, S)) as owner:
            result = load_plan(owner, plan, StructureDef(S), ["Q1"], batch_bytes=batch_bytes_for(64 << 20))
    finally:
        plan.close()
    grown = (_peak_kib() - start) << 10
    assert result.entries == 300 and result.batches == 38  # 8 messages of 512 KiB make 4 MiB
    assert grown < 48 << 20, f"the load's peak grew by {grown >> 20} MiB for batches of 4 MiB"
    assert client.hlen(keys.data(S)) == 300


def test_a_restore_bounds_its_load_batches_by_its_memory_limit(redis_url: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """run_restore hands the load batch_bytes_for the engine's memory limit: with a limit of 16 MiB, messages of
    600 KiB put by a real SQM go two to a batch."""
    import restore.run
    from backup.run import run_backup
    from restore.run import run_restore
    from tests.restore.test_restore import drain, rejoin
    from tests.support.group import define_group, start_qm
    from tests.support.harness import lose_cf

    loads: list[tuple[int, int]] = []
    real = restore.run.load_plan

    def spied(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        loads.append((kwargs["batch_bytes"], out.batches))
        return out

    monkeypatch.setattr(restore.run, "load_plan", spied)
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client: redis.Redis = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    bodies = [os.urandom(600 << 10) for _ in range(6)]
    try:
        conn = qm.connect()
        for b in bodies:
            conn.put("Q1", b)
        conn.commit()
        run_backup(client, "APP1", backups, log_root=logs)
        lose_cf(client)
        run_restore(client, "APP1", backup_root=backups, log_root=logs, engine_options={"memory": 16 << 20})
        rejoin(qm)
        assert [b for b, _ in drain(qm.connect(), "Q1")] == bodies
    finally:
        qm.stop()
    assert loads == [(1 << 20, 3)]


def _cuts_by_batch_end(datas: list[bytes], size: int, max_bytes: int) -> list[int]:
    ends, start = [], 0
    while start < len(datas):
        end = bulk.batch_end(datas, start, size, max_bytes)
        start = len(datas) if end < 0 else end
        ends.append(start)
    return ends


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_the_load_and_the_columnar_load_cut_batches_by_one_rule(monkeypatch: pytest.MonkeyPatch,
                                                                 native: bool) -> None:
    """restore.load.batches (a stream of survivors) and bulk.batch_end (the columnar load's list of data, in C or,
    where the extension is not built, in Python) cut the same batches: cfemu.bulk.batch_full's."""
    import random

    from restore.settle import Settled

    if not native:
        monkeypatch.setattr(bulk, "_bulk", None)
    elif bulk._bulk is None:
        pytest.fail("cfemu._bulk was not built")
    rng = random.Random(7)
    for _ in range(300):
        datas = [b"d" * rng.choice([0, 1, 3, 8, 40]) for _ in range(rng.randrange(0, 30))]
        size, max_bytes = rng.randrange(1, 9), rng.choice([0, 1, 5, 16, 60])
        streamed = restore.load.batches((Settled(f"e{k}", "load", data=d) for k, d in enumerate(datas)), size,
                                        max_bytes)
        ends = list(itertools.accumulate(len(b) for b in streamed))
        assert ends == _cuts_by_batch_end(datas, size, max_bytes), (datas, size, max_bytes)
