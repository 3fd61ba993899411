"""Benchmark of restore in bounded memory (BENCHMARKS.md, "restore in bounded memory"): peak RSS and time of the
local engine's restore (plan, load, restore point) against a raw pipelined write of the same final data, in the same
run.

The history: a generator writes three members' record logs (real RecordLog segments) and a signed backup, the
way the spark benchmark's does (UOWs of 1-4 puts or 1-4 gets, committed, 3% of put UOWs and 5% of get UOWs
backed out, each member ending with a put UOW and a get UOW in flight). Writing logs directly is only allowed
once checked against real queue managers: so every run first drives three real SQMs (sqm.core.manager.QueueManager on
an embedded redis-server) with the same workload to 100k log records, and compares the kinds of record in their
logs and their proportions with the generator's at the same size (the calibration table; the run fails when a
workload kind's share differs by more than 2 points). The real SQMs also write log management's records (RELOG
copies of live messages and CHECKPOINTs at each LOGLOAD checkpoint, docs/log-management.md), whose number follows
the queue depth rather than the workload; the generator writes none, and the table shows their share apart.

Each size is restored in a child process of its own (so that its peak RSS is the restore's): the local engine
plans with the memory limit given (restore.partitioned), restore.load.load_plan loads it into a fresh embedded
redis-server, and the restore point is written (backup.points), as run_restore does; every count is checked
against the generator's truth. Then, in the same child, the raw writes of the final data, prepared in a file
beforehand, written with pipelines of the same batch size and no transaction:
  * raw_write_s: descriptors, data and one RPUSH a message, into the same server flushed (the baseline of every
    earlier run; it leaves out the message-id index sets, and reuses the memory the restore made the server take);
  * raw_write_grouped_s: the same with one RPUSH a list a batch;
  * raw_write_same_data_s: the same final data as the restore writes, index sets included, one RPUSH a list a
    batch, into a fresh server as the restore had: the fair baseline (restore_over_same_data_raw).

    .venv/bin/python bench/bench_restore.py [--quick] [--sizes 1000000:2000000 10000000:20000000]
                                            [--body 1024] [--memory 1GiB] [--engines local columnar]
                                            [--plan-only] [--spark-master local[2]]

The spark engine (--engines spark) is given the memory limit as the others are (its Spark memory settings derived
from it: restore.spark_conf.memory_conf; its settled entries spilled to the work directory); Spark has no limit of
its own for the whole, so its driver, JVM and Python workers are measured together, as every engine is, by the
process tree's peak RSS (sampled every 0.5 s, the CF's redis-server left out), shown beside the figure of the process
and its workers' own peaks.

--plan-only measures the plan alone (time, CPU, peak memory, and its output read once in load order), each
engine's counts checked against the generator's truth: no load, no raw write.

A size is FINAL_MESSAGES:LOG_RECORDS. Prints tables and appends one JSON line per size to
bench/results/restore.jsonl as each size ends.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a driver that imports this module may have put it last, behind the tree it profiles
    sys.path.insert(0, str(ROOT))

import sqm.core.records  # noqa: E402
from backup.files import BackupWriter  # noqa: E402
from cfemu import credentials  # noqa: E402
from cfemu.entry import Entry  # noqa: E402
from sqm.log import LogReader, RecordLog, find_log_dirs  # noqa: E402

S = "APP1"
MEMBERS = ("QM1", "QM2", "QM3")
QUEUES = ("Q0", "Q1", "Q2", "Q3")
REPLAY_FROM = 10_000_000
NOW_MS = 1_700_000_000_000
# Ids shaped as the product makes them, since their length is what the plan's tables hold and compare: an entry's
# id 12 random bytes in hex, a message id 24 (sqm.core.connection), a UOW's id its member, its epoch (the time it
# joined, ms) in hex and a sequence number (sqm.core.manager.new_uow). Here a number times an odd constant, modulo
# the id's width: a different id for every number, that looks random.
ID_MIX = 0x9E3779B97F4A7C15F39CC0605CEDC835
RESULTS = ROOT / "bench" / "results" / "restore.jsonl"
PUT_SHARE, PUT_BACKOUT, GET_BACKOUT = 0.68, 0.03, 0.05
# Per UOW: 2.5 operations on average, then COMMIT or BACKOUT and END.
NET_PER_RECORD = (PUT_SHARE * 2.5 * (1 - PUT_BACKOUT) - (1 - PUT_SHARE) * 2.5 * (1 - GET_BACKOUT)) / 4.5


@dataclass
class Truth:
    """What a correct restore of the generated history gives (counts: the history may be too big to list)."""

    restored: int = 0
    consumed: int = 0
    put_backed_out: int = 0
    backed_out_gets: int = 0  # messages whose get was backed out (restored with a backout count)
    decided: int = 0  # UOWs in flight at the end
    records: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    backup_copies: int = 0
    log_bytes: int = 0
    backup_bytes: int = 0


def bench_keys(root: Path) -> credentials.BackupKeys:
    if not (root / "secrets" / "backup.key").exists():
        credentials.create_backup_key(root / "secrets")
    return credentials.backup_keys(root / "secrets")


def generate(root: Path, records: int, final: int, body_size: int, seed: int = 1) -> Truth:
    """Write the history (logs under root/logs, the backup under root/backup) and return its truth. The backup
    holds what the logs' net puts leave short of `final` messages."""
    rnd = random.Random(seed)
    truth = Truth()
    kinds: Counter[str] = Counter()
    available: deque[int] = deque()  # committed messages by number, oldest first (ids and queues derive)
    bumped: set[int] = set()  # messages whose get was backed out
    lrsn = REPLAY_FROM - 1
    body = rnd.randbytes(body_size)

    def eid(n: int) -> str:
        return f"{n * ID_MIX % (1 << 96):024x}"

    def msgid(n: int) -> str:
        return f"{n * ID_MIX % (1 << 192):048x}"

    backup_n = max(1000, final - int(records * NET_PER_RECORD))
    writer = BackupWriter(root / "backup" / S / "b", backup_keys=bench_keys(root))
    for n in range(backup_n):
        e = Entry(id=eid(n), queue=QUEUES[n % 4], put_time=NOW_MS - 10**6, msgid=msgid(n)).wire()
        e.update(st="CP", l=REPLAY_FROM - 1000 + n % 900, o1=n, o2=n)
        writer.add(3, e, body)
        available.append(n)
    truth.backup_copies = backup_n
    writer.finish({"id": "b", "group": "BENCH", "structure": S, "entries": backup_n,
                   "bytes": backup_n * body_size, "replay_from": REPLAY_FROM, "gen": 1})
    truth.backup_bytes = sum(p.stat().st_size for p in (root / "backup").rglob("*") if p.is_file())
    truth.restored = backup_n
    next_n = backup_n
    logs = {m: RecordLog(root / "logs" / m, m) for m in MEMBERS}
    seq = 0
    written = 0

    def log(member: str, rec: dict[str, Any]) -> None:
        nonlocal written
        logs[member].append(rec)
        kinds[rec["k"]] += 1
        written += 1

    def put_uow(member: str, finish: bool) -> None:
        nonlocal lrsn, seq, next_n
        seq += 1
        u = f"{member}.{NOW_MS:x}.{seq}"
        mine = []
        for _ in range(rnd.randint(1, 4)):
            lrsn += 1
            n = next_n
            next_n += 1
            e = Entry(id=eid(n), queue=QUEUES[n % 4], put_time=lrsn // 1000, msgid=msgid(n)).wire()
            log(member, sqm.core.records.put(u, lrsn, structure=S, gen=1, entry=e, data=body))
            mine.append(n)
        if not finish:
            truth.decided += 1
            truth.put_backed_out += len(mine)
            return
        lrsn += 1
        commit = rnd.random() >= PUT_BACKOUT
        log(member, (sqm.core.records.commit if commit else sqm.core.records.backout)(u, lrsn, {S: 1}))
        lrsn += 1
        log(member, sqm.core.records.end(u, lrsn))
        if commit:
            available.extend(mine)
            truth.restored += len(mine)
        else:
            truth.put_backed_out += len(mine)

    def get_uow(member: str, finish: bool) -> None:
        nonlocal lrsn, seq
        seq += 1
        u = f"{member}.{NOW_MS:x}.{seq}"
        taken = []
        for _ in range(min(rnd.randint(1, 4), len(available))):
            lrsn += 1
            n = available.popleft()
            log(member, sqm.core.records.get(u, lrsn, structure=S, gen=1, entry_id=eid(n), queue=QUEUES[n % 4]))
            taken.append(n)
        if not finish:
            truth.decided += 1
            bumped.update(taken)  # restore backs the get out: available again, one more backout
            available.extend(taken)
            return
        lrsn += 1
        commit = rnd.random() >= GET_BACKOUT
        log(member, (sqm.core.records.commit if commit else sqm.core.records.backout)(u, lrsn, {S: 1}))
        lrsn += 1
        log(member, sqm.core.records.end(u, lrsn))
        if commit:
            truth.restored -= len(taken)
            truth.consumed += len(taken)
            bumped.difference_update(taken)
        else:
            bumped.update(taken)
            available.extend(taken)

    turn = 0
    while written < records:
        member = MEMBERS[turn % 3]
        turn += 1
        (put_uow if rnd.random() < PUT_SHARE else get_uow)(member, True)
    for member in MEMBERS:  # work in flight when the CF was lost
        put_uow(member, False)
        get_uow(member, False)
    for lg in logs.values():
        lg.force()
        truth.log_bytes += lg.stats.bytes
        lg.close()
    truth.records = written
    truth.kinds = dict(kinds)
    truth.backed_out_gets = len(bumped)
    return truth


# ------------------------------------------------------------------------------- calibration: real SQMs


def real_sqm_kinds(work: Path, records: int, seed: int = 1) -> dict[str, int]:
    """Drive three real SQMs with the generator's workload until their logs hold `records` records; the kinds of
    record in their logs."""
    from cfemu.admin import Admin
    from cfemu.connection import connect
    from cfemu.embedded import EmbeddedRedis
    from cfemu.errors import NoMessageError
    from sqm.core.manager import QueueManager, QueueManagerConfig
    from sqm.wings import WINGS

    rnd = random.Random(seed)
    server = EmbeddedRedis(data_dir=work / "redis")
    server.start()
    qms: list[QueueManager] = []
    try:
        admin = Admin(connect(server.url))
        admin.define_structure(S)
        for q in QUEUES:
            admin.define_queue(q, S)
        qms = [QueueManager(QueueManagerConfig(name=m, log_root=work / "logs", redis_url=server.url), wings=WINGS)
               for m in MEMBERS]
        for qm in qms:
            qm.start()
        conns = [qm.connect() for qm in qms]
        logs = [qm.log for qm in qms if qm.log is not None]  # every started member has its log
        body = rnd.randbytes(64)
        ops = 0
        turn = 0
        while True:
            if ops % 200 == 0 and sum(lg.stats.records for lg in logs) >= records:
                break
            c = conns[turn % 3]
            turn += 1
            n = rnd.randint(1, 4)
            if rnd.random() < PUT_SHARE:
                for _ in range(n):
                    c.put(QUEUES[rnd.randrange(4)], body)
                backout = rnd.random() < PUT_BACKOUT
            else:
                for _ in range(n):
                    try:
                        c.get(QUEUES[rnd.randrange(4)])
                    except NoMessageError:
                        pass
                backout = rnd.random() < GET_BACKOUT
            (c.backout if backout else c.commit)()
            ops += n
        for lg in logs:
            lg.force()
    finally:
        for qm in qms:
            qm.stop(checkpoint=False)
        server.stop()
    kinds: Counter[str] = Counter()
    for d in find_log_dirs(work / "logs"):
        for _, rec in LogReader(d).records():
            kinds[rec["k"]] += 1
    return dict(kinds)


def calibrate(work: Path, records: int, console: Console) -> dict[str, Any]:
    t0 = time.perf_counter()
    real = real_sqm_kinds(work / "real", records)
    real_s = time.perf_counter() - t0
    gen = generate(work / "gen", records, final=records // 10, body_size=64).kinds
    # RELOG (a relog pass's copies) and CHECKPOINT: log management's, written at LOGLOAD checkpoints, in numbers
    # that follow the queue depth, not the workload; the generator writes none (see the module doc). The check is
    # on the workload's kinds, as shares of the workload's records.
    management = ("RELOG", "CHECKPOINT")
    rt = sum(real.values())
    rw = sum(v for k, v in real.items() if k not in management)
    gw = sum(v for k, v in gen.items() if k not in management)
    table = Table("kind", "real SQMs", "share", "of workload", "generator", "of workload", "difference (points)",
                  title=f"calibration at {records:,} records (real SQMs: {real_s:.0f} s)")
    worst = 0.0
    for k in sorted(set(real) | set(gen)):
        share = f"{100 * real.get(k, 0) / rt:.2f}%"
        if k in management:
            table.add_row(k, f"{real.get(k, 0):,}", share, "-", f"{gen.get(k, 0):,}", "-", "(log management)")
            continue
        rs, gs = 100 * real.get(k, 0) / rw, 100 * gen.get(k, 0) / gw
        worst = max(worst, abs(rs - gs))
        table.add_row(k, f"{real.get(k, 0):,}", share, f"{rs:.2f}%", f"{gen.get(k, 0):,}", f"{gs:.2f}%",
                      f"{rs - gs:+.2f}")
    console.print(table)
    return {"records": records, "real": real, "generator": gen, "worst_points": round(worst, 2),
            "relog_share": round(100 * real.get("RELOG", 0) / rt, 2), "real_seconds": round(real_s, 1),
            "ok": worst <= 2.0}


# --------------------------------------------------------------------------------------------- the child


def vm_hwm() -> int:
    """This process's own peak RSS in bytes (VmHWM): ru_maxrss keeps the forking parent's peak across exec on
    Linux, so a child forked by a big generator would report the generator's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def cpu_s() -> float:
    """CPU seconds of this process (every thread) and of its children that have ended."""
    own, ended = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime


def cf_cpu_s(client: Any) -> float:
    """CPU seconds the CF's redis-server has used so far (INFO cpu, its threads and children)."""
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def engine_options(root: Path, memory: int, workers: int, engine_name: str) -> dict[str, Any]:
    """What get_engine takes for this engine: the local engines' memory limit, spill directory and worker processes;
    Spark's master ($BENCH_SPARK_MASTER, default local[2]), its log file, the memory limit and spill directory (the
    process tree's sampled peak is what says whether Spark stayed within the limit)."""
    if engine_name == "spark":
        return {"master": os.environ.get("BENCH_SPARK_MASTER", "local[2]"), "log_file": root / "spark.log",
                "memory": memory, "work_dir": root / "work"}
    return {"memory": memory, "work_dir": root / "work", "workers": workers}


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            found += [int(k) for k in kids]
            todo += [int(k) for k in kids]
    return found


class TreeSampler:
    """The peak of the RSS summed over this process and every process under it (Spark's JVM and Python workers,
    the local engines' worker processes), the CF's redis-server and its children left out, sampled every
    `interval` seconds; and the CPU seconds each of those processes was last seen to have used (a floor: a
    process's last ticks before it ends can be missed)."""

    def __init__(self, exclude: set[int] | None = None, interval: float = 0.5) -> None:
        import threading
        self.exclude, self.interval = set(exclude or ()), interval
        self.peak = 0
        self.cpu: dict[tuple[int, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")
        self._page = os.sysconf("SC_PAGE_SIZE")

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        me = os.getpid()
        excluded: set[int] = set()
        for p in self.exclude:
            excluded |= {p, *_descendants(p)}
        total = 0
        for p in [me, *_descendants(me)]:
            if p in excluded:
                continue
            try:
                stat = Path(f"/proc/{p}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            total += int(fields[21]) * self._page  # rss, pages
            if p != me:  # this process's own CPU: getrusage
                self.cpu[(p, fields[19])] = (int(fields[11]) + int(fields[12])) / self._tick  # by pid and start
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def others_cpu_s(self) -> float:
        return sum(self.cpu.values())

    def stop(self) -> None:
        self.sample()
        self._stop.set()
        self._thread.join()


def plan_only(root: Path, memory: int, truth_file: Path, workers: int, engine_name: str) -> None:
    """The plan alone (--plan-only): planned by the engine, then its survivors read in load order as the load reads
    them (the plan's output), every count checked against the generator's truth; no load, no raw writes."""
    from backup.files import read_backup
    from cfemu.progress import no_progress
    from restore.engine import get_engine

    truth = json.loads(truth_file.read_text())
    backup = read_backup(root / "backup" / S / "b", backup_keys=bench_keys(root))
    log_dirs = find_log_dirs(root / "logs")
    out: dict[str, Any] = {"rss_start_mib": round(vm_hwm() / 2**20), "engine": engine_name, "plan_only": True}
    tree = TreeSampler().start()
    t0, c0 = time.perf_counter(), cpu_s()
    plan = get_engine(engine_name, **engine_options(root, memory, workers, engine_name)).plan(
        S, backup, log_dirs, REPLAY_FROM, NOW_MS, no_progress)
    out["plan_s"], out["plan_cpu_s"] = round(time.perf_counter() - t0, 2), round(cpu_s() - c0, 2)
    tree.sample()
    out["plan_tree_cpu_s"] = round(cpu_s() - c0 + tree.others_cpu_s(), 2)
    out["plan_tree_peak_rss_mib"] = round(tree.peak / 2**20)  # while planning, before the output is read
    t1, c1 = time.perf_counter(), cpu_s()
    loaded = bumped = 0
    for s in plan.in_load_order():
        loaded += 1
        bumped += bool(s.entry and int(s.entry.get("bc", 0)) > 0)
    out["read_out_s"], out["read_out_cpu_s"] = round(time.perf_counter() - t1, 2), round(cpu_s() - c1, 2)
    if hasattr(plan, "timings"):  # the columnar engine's plan (its module imported already: it made the plan)
        from restore.engine_columnar import ColumnarPlan
        assert isinstance(plan, ColumnarPlan)
        out["statements_s"] = plan.timings
        out["read_cpu_s"] = round(plan.read_cpu_s, 2)
    out["partitions"] = getattr(plan, "partitions", 0)
    out["peak_rss_mib"] = round((vm_hwm() + getattr(plan, "worker_peak_bytes", 0)) / 2**20)
    tree.stop()
    out["tree_peak_rss_mib"] = round(tree.peak / 2**20)
    counts = dict(plan.counts)
    problems = [f"{name} {counts.get(name, 0)} != {want}" for name, want in (
        ("restored", truth["restored"]), ("consumed", truth["consumed"]), ("put-backed-out", truth["put_backed_out"]))
        if counts.get(name, 0) != want]
    if len(plan.decisions) != truth["decided"]:
        problems.append(f"decisions {len(plan.decisions)} != {truth['decided']}")
    if bumped != truth["backed_out_gets"]:
        problems.append(f"messages with a backout count {bumped} != {truth['backed_out_gets']}")
    if loaded != truth["restored"]:
        problems.append(f"read out {loaded} != {truth['restored']}")
    out["problems"] = problems
    plan.close()
    print(json.dumps(out))


def child(root: Path, memory: int, truth_file: Path, workers: int, engine_name: str = "local") -> None:
    from backup.files import read_backup
    from backup.points import RESTORE, RestorePointWriter
    from cfemu import keys
    from cfemu.admin import Admin, QueueDef
    from cfemu.bulk import BATCH, claim, descriptor, list_of, observe, sets_of
    from cfemu.embedded import EmbeddedRedis
    from restore.engine import get_engine
    from restore.load import load_plan
    from restore.spill import SpillDir, SpillWriter, read_frames

    truth = json.loads(truth_file.read_text())
    backup_keys = bench_keys(root)
    backup = read_backup(root / "backup" / S / "b", backup_keys=backup_keys)
    log_dirs = find_log_dirs(root / "logs")
    out: dict[str, Any] = {"rss_start_mib": round(vm_hwm() / 2**20)}
    spans: dict[str, list[float]] = {}

    def progress(phase: str, done: int, total: int | None) -> None:
        now = time.perf_counter()
        spans.setdefault(phase, [now, now])[1] = now

    # A directory kept from an earlier run (--keep --dir): its restore point and server go first.
    shutil.rmtree(root / f"points-{engine_name}", ignore_errors=True)
    shutil.rmtree(root / f"redis-{engine_name}", ignore_errors=True)
    server = EmbeddedRedis(data_dir=root / f"redis-{engine_name}")
    server.start()
    try:
        client = server.client()
        admin = Admin(client)
        admin.define_structure(S)
        for q in QUEUES:
            admin.define_queue(q, S)
        tree = TreeSampler(exclude={server.pid} if server.pid else set()).start()
        t0, c0 = time.perf_counter(), cpu_s()
        engine = get_engine(engine_name, **engine_options(root, memory, workers, engine_name))
        plan = engine.plan(S, backup, log_dirs, REPLAY_FROM, NOW_MS, progress)
        out["plan_s"] = round(time.perf_counter() - t0, 2)
        out["plan_cpu_s"] = round(cpu_s() - c0, 2)  # this process's threads and its ended worker processes
        tree.sample()
        out["plan_tree_cpu_s"] = round(cpu_s() - c0 + tree.others_cpu_s(), 2)  # and the live ones (Spark's)
        out["plan_tree_peak_rss_mib"] = round(tree.peak / 2**20)
        out["engine"] = engine_name
        if hasattr(plan, "timings"):  # the columnar engine: each statement, and its log readers' CPU
            from restore.engine_columnar import ColumnarPlan
            assert isinstance(plan, ColumnarPlan)
            out["statements_s"] = plan.timings
            out["read_logs_cpu_s"] = round(plan.read_cpu_s, 2)
        out["partitions"] = getattr(plan, "partitions", 0)
        out["workers"] = min(workers, out["partitions"] or 1)
        out["workers_peak_mib"] = round(getattr(plan, "worker_peak_bytes", 0) / 2**20)
        out["phases_s"] = {k: round(v[1] - v[0], 2) for k, v in spans.items()}
        t1, c1, cf1 = time.perf_counter(), cpu_s(), cf_cpu_s(client)
        # As run_restore: the restore point's entries written as the load goes, its manifest before ACTIVE.
        point = RestorePointWriter(root / f"points-{engine_name}", "p", S, backup_keys=backup_keys)
        point_s = 0.0

        def finish_point() -> None:
            nonlocal point_s
            t2 = time.perf_counter()
            point.finish(kind=RESTORE, group="BENCH", sdef=admin.structure_def(S),
                         queues=[QueueDef(q, S) for q in QUEUES], members=MEMBERS, gen=plan.restore_lrsn,
                         lrsn=plan.restore_lrsn, replay_from=plan.restore_lrsn, tombstones={})
            point_s = time.perf_counter() - t2

        with claim(client, S, observe(client, S)) as owner:
            load = load_plan(owner, plan, admin.structure_def(S), list(QUEUES), copies_to=point.add_copies,
                             before_activate=finish_point)
        out["load_s"] = round(time.perf_counter() - t1 - point_s, 2)  # with the point's entries written
        out["point_s"] = round(point_s, 2)  # the point's manifest, its files' fsync
        # CPU seconds of the load (the point's manifest with it): this process (every thread), and the CF's
        out["load_cpu_s"], out["cf_load_cpu_s"] = round(cpu_s() - c1, 2), round(cf_cpu_s(client) - cf1, 2)
        out["load_timings"] = {k: round(v, 2) for k, v in getattr(load, "timings", {}).items()}
        out["loadavg_at_load"] = os.getloadavg()
        out["restore_s"] = round(time.perf_counter() - t0, 2)
        # this process's own peak, and its worker processes' (they ran beside it while the plan was settled)
        out["peak_rss_mib"] = round((vm_hwm() + getattr(plan, "worker_peak_bytes", 0)) / 2**20)
        tree.stop()
        out["tree_peak_rss_mib"] = round(tree.peak / 2**20)  # every process but the CF's, summed when sampled
        out["loaded"] = load.entries
        out["redis_used_mib"] = round(int(client.info("memory")["used_memory"]) / 2**20)
        counts = dict(plan.counts)
        bumped = sum(1 for s in plan.in_load_order() if s.entry and int(s.entry.get("bc", 0)) > 0)
        problems = []
        for name, want in (("restored", truth["restored"]), ("consumed", truth["consumed"]),
                           ("put-backed-out", truth["put_backed_out"])):
            if counts.get(name, 0) != want:
                problems.append(f"{name} {counts.get(name, 0)} != {want}")
        if len(plan.decisions) != truth["decided"]:
            problems.append(f"decisions {len(plan.decisions)} != {truth['decided']}")
        if bumped != truth["backed_out_gets"]:
            problems.append(f"messages with a backout count {bumped} != {truth['backed_out_gets']}")
        if load.entries != truth["restored"]:
            problems.append(f"loaded {load.entries} != {truth['restored']}")
        out["problems"] = problems
        print(json.dumps(out), flush=True)  # the restore's figures, kept by the parent should the baseline fail

        # The baseline: the same final data, prepared beforehand, then written raw.
        # A plan held in memory (Spark's) has no spill directory of its own: the prepared data goes to one made here.
        raw_spill = getattr(plan, "spill", None) or SpillDir(root / "work")
        raw = SpillWriter(raw_spill, "raw")
        batch: list[Any] = []

        def flush() -> None:
            raw.add([[s.id for s in batch], [descriptor(s.entry or {}, s.data) for s in batch],
                     [s.data for s in batch], [list_of(S, s.entry or {}) for s in batch],
                     [sets_of(S, s.entry or {}) for s in batch]])
            batch.clear()

        for s in plan.in_load_order():
            batch.append(s)
            if len(batch) >= BATCH:
                flush()
        if batch:
            flush()
        raw.flush()
        ent_key, data_key = keys.entries(S), keys.data(S)
        flusher = server.client(socket_timeout=None)  # FLUSHALL of 10M messages outlasts the default timeout
        # Three raw writes. The first two write the descriptors, the data and the lists only, as every earlier
        # run of this benchmark did, into the restore's server flushed (its memory already the process's); the
        # third writes the same final data as the restore (also the sets each message is in: its message id's
        # index, one set a message, since SQM gives every message an id) into a server started for it, as the
        # restore had one.
        for name, grouped, with_sets in (("raw_write_s", False, False), ("raw_write_grouped_s", True, False),
                                         ("raw_write_same_data_s", True, True)):
            flusher.flushall()
            if with_sets:
                flusher.close()
                client.close()
                server.stop()
                shutil.rmtree(root / f"redis-{engine_name}", ignore_errors=True)
                server = EmbeddedRedis(data_dir=root / f"redis-{engine_name}")
                server.start()
                client = server.client()
            t3, c3, cf3 = time.perf_counter(), cpu_s(), cf_cpu_s(client)
            for ids, descs, datas, lists, sets in read_frames(raw.path):
                pipe = client.pipeline(transaction=False)
                pipe.hset(ent_key, mapping=dict(zip(ids, descs, strict=True)))
                pipe.hset(data_key, mapping=dict(zip(ids, datas, strict=True)))
                if with_sets:
                    for i, in_sets in zip(ids, sets, strict=True):
                        for k in in_sets:
                            pipe.sadd(k, i)
                if not grouped:  # as the earlier restore benchmarks' raw write: one RPUSH a message
                    for i, lst in zip(ids, lists, strict=True):
                        pipe.rpush(lst, i)
                    pipe.execute()
                    continue
                run_start = 0
                for i in range(1, len(ids) + 1):  # consecutive ids of one list in one RPUSH
                    if i == len(ids) or lists[i] != lists[run_start]:
                        pipe.rpush(lists[run_start], *ids[run_start:i])
                        run_start = i
                pipe.execute()
            out[name] = round(time.perf_counter() - t3, 2)
            out[name[:-2] + "_cpu_s"] = round(cpu_s() - c3, 2)  # this process's, and the CF's
            out["cf_" + name[:-2] + "_cpu_s"] = round(cf_cpu_s(client) - cf3, 2)
            out["raw_written"] = client.hlen(ent_key)
        plan.close()
        if raw_spill is not getattr(plan, "spill", None):
            raw_spill.close()
    finally:
        server.stop()
    out["restore_over_raw"] = round(out["raw_write_s"] / out["restore_s"], 3)
    out["plan_load_over_raw"] = round(out["raw_write_s"] / (out["plan_s"] + out["load_s"]), 3)
    out["restore_over_grouped_raw"] = round(out["raw_write_grouped_s"] / out["restore_s"], 3)
    out["restore_over_same_data_raw"] = round(out["raw_write_same_data_s"] / out["restore_s"], 3)
    out["load_over_same_data_raw"] = round(out["load_s"] / out["raw_write_same_data_s"], 3)
    print(json.dumps(out))


# --------------------------------------------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "memory_gb": round(mem / 2**30, 1), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run: 20k messages, 40k records, 20k calibration")
    ap.add_argument("--sizes", nargs="+", help="FINAL_MESSAGES:LOG_RECORDS (default 1M:2M 10M:20M)")
    ap.add_argument("--body", type=int, nargs="+", help="message size in bytes, per size (default 1024)")
    ap.add_argument("--memory", default="1GiB", help="the restore memory limit (cfrestore --memory-limit)")
    ap.add_argument("--calibration-records", type=int, help="records for the real-SQM check (default 100k)")
    ap.add_argument("--dir", help="where to put the generated files (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--skip-calibration", action="store_true",
                    help="no real-SQM check (only when an earlier run's check stands for this generator)")
    ap.add_argument("--workers", type=int, default=None,
                    help="the local engine's worker processes (cfrestore --workers; default: its default)")
    ap.add_argument("--engines", nargs="+", default=["local"],
                    help="the restore engines to measure, each size with each in the same run (default: local)")
    ap.add_argument("--spark-master", default="local[2]",
                    help="the spark engine's master (local[N], or spark://HOST:PORT of a running standalone cluster)")
    ap.add_argument("--plan-only", action="store_true",
                    help="the plan alone: plan time, CPU and peak memory, its output read once; no load, no raw write")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        (plan_only if args.plan_only else child)(Path(args.child[0]), int(args.child[1]), Path(args.child[2]), int(args.child[3]), args.child[4])
        return 0
    from cfemu.settings import default_workers, parse_size

    os.environ["BENCH_SPARK_MASTER"] = args.spark_master  # the children's spark engine

    memory = parse_size(args.memory, what="--memory")
    workers = args.workers or default_workers()
    sizes = args.sizes or (["20000:40000"] if args.quick else ["1000000:2000000", "10000000:20000000"])
    bodies = args.body or [1024]
    calib_n = args.calibration_records or (20_000 if args.quick else 100_000)
    console = Console()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-restore-"))
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    started = datetime.now(UTC)
    record: dict[str, Any] = {"date": started.isoformat(timespec="seconds"), "machine": machine(),
                              "memory_limit": args.memory, "workers": workers, "runs": []}
    try:
        record["calibration"] = ({"skipped": True, "ok": True} if args.skip_calibration
                                 else calibrate(base / "calibration", calib_n, console))
        table = Table("engine", "messages", "log records", "body", "partitions", "plan s (CPU s)", "load s", "point s",
                      "restore s", "raw write s (grouped; same data)", "raw/restore (grouped; same data)",
                      "raw/(plan+load)",
                      "peak RSS MiB (process tree)", "correct",
                      title=f"restore, engines {', '.join(args.engines)}, --memory-limit {args.memory}, --workers {workers}")
        plan_table = Table("engine", "messages", "log records", "plan s (CPU s)", "output read s (CPU s)",
                           "peak RSS MiB (process tree)", "correct",
                           title=f"restore plan alone, --memory-limit {args.memory}, --workers {workers}")
        for i, size in enumerate(sizes):
            final, records = (int(x) for x in size.split(":"))
            body = bodies[min(i, len(bodies) - 1)]
            root = base / f"size-{final}"
            t0 = time.perf_counter()
            truth_file = root / "truth.json"
            if truth_file.exists():  # generated by an earlier run kept with --keep --dir
                truth = Truth(**json.loads(truth_file.read_text()))
            else:
                truth = generate(root, records, final, body)
                truth_file.write_text(json.dumps(asdict(truth)))
            gen_s = time.perf_counter() - t0
            console.print(f"[bold]{final:,} messages[/] of {body} B: {truth.records:,} log records "
                          f"({truth.log_bytes / 2**20:.0f} MiB), {truth.backup_copies:,} backup copies "
                          f"({truth.backup_bytes / 2**20:.0f} MiB), {truth.restored:,} to restore; generated in "
                          f"{gen_s:.0f} s")
            for engine_name in args.engines:
                proc = subprocess.run([sys.executable, __file__, "--child", str(root), str(memory), str(truth_file),
                                       str(workers), engine_name, *(["--plan-only"] if args.plan_only else [])],
                                      capture_output=True, text=True, cwd=ROOT)
                if proc.returncode != 0:
                    (base / f"child-{final}-{engine_name}.stderr").write_text(proc.stderr)
                    printed = [line for line in proc.stdout.splitlines() if line.startswith("{")]
                    run = {**(json.loads(printed[-1]) if printed else {}),
                           "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
                else:
                    run = json.loads(proc.stdout.strip().splitlines()[-1])
                run.update(messages=truth.restored, records=truth.records, body=body, generate_s=round(gen_s, 1),
                           log_mib=round(truth.log_bytes / 2**20), backup_mib=round(truth.backup_bytes / 2**20),
                           loadavg_after=os.getloadavg())
                record["runs"].append(run)
                console.print(run)
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                with RESULTS.open("a") as f:  # one line per size as it ends: a run cut short keeps what it measured
                    f.write(json.dumps({**record, "runs": [run]}) + "\n")
                if "error" not in run and args.plan_only:
                    plan_table.add_row(engine_name, f"{truth.restored:,}", f"{truth.records:,}",
                                       f"{run['plan_s']} ({run['plan_cpu_s']})",
                                       f"{run['read_out_s']} ({run['read_out_cpu_s']})",
                                       f"{run['peak_rss_mib']} ({run.get('tree_peak_rss_mib', '-')})",
                                       "yes" if not run["problems"] else "; ".join(run["problems"]))
                elif "error" not in run:
                    table.add_row(engine_name, f"{truth.restored:,}", f"{truth.records:,}", str(body), str(run["partitions"]),
                                  f"{run['plan_s']} ({run['plan_cpu_s']})", str(run["load_s"]), str(run["point_s"]), str(run["restore_s"]),
                                  f"{run['raw_write_s']} ({run['raw_write_grouped_s']}; "
                                  f"{run['raw_write_same_data_s']})",
                                  f"{run['restore_over_raw']:.2f} ({run['restore_over_grouped_raw']:.2f}; "
                                  f"{run['restore_over_same_data_raw']:.2f})",
                                  f"{run['plan_load_over_raw']:.2f}",
                                  f"{run['peak_rss_mib']} ({run.get('tree_peak_rss_mib', '-')})",
                                  "yes" if not run["problems"] else "; ".join(run["problems"]))
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        console.print(plan_table if args.plan_only else table)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    bad = [r for r in record["runs"] if "error" in r or r.get("problems")]
    return 1 if bad or not record["calibration"]["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
