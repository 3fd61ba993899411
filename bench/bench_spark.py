"""Benchmark of restore planning on Spark (BENCHMARKS.md, "spark"): the local engine against the spark engine.

A synthetic but realistic history is written to real files: three members' record logs (64 MiB segments) and a
backup of the structure taken just before the replay range starts. In the replay range the members put
messages in UOWs of 1-4 puts and commit them (3% backed out), get the oldest messages in UOWs of 1-4 gets and
commit (5% backed out: the messages come back with a higher backout count), and each member ends with a put UOW
and a get UOW in flight (restore backs them out). About one message in five put stays on the queue, so the
5-million-record log leaves about a million messages (plus the backup's) to restore.

For each log size the plan is computed by
  * local          restore.engine.LocalEngine (in-process)
  * spark local[2] restore.engine_spark.SparkEngine on both cores, and local[1] for the scaling with cores
  * spark standalone N   the spark engine on a Spark standalone cluster of N workers (qsg.spark_standalone: a
                 master and N workers from the installed pyspark on 127.0.0.1, 1 core each, authenticated, as
                 `cfemu cluster up --spark N` starts it), for each N of --workers (BENCHMARKS.md, "spark standalone")
(each Spark master in its own driver process, started before the clock starts: the table shows start-up apart),
and every plan is checked against the known truth of the history (which messages are restored, with which
backout count; how many were consumed, backed out; which UOWs restore decided).

    .venv/bin/python bench/bench_spark.py [--quick] [--sizes 100000 1000000 5000000] [--no-local-above N]
                                          [--masters local[2] local[1]] [--workers 1 2 4]

Prints tables and appends one JSON line to bench/results/spark.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sqm.core.records  # noqa: E402  (by its full name: generate() has a parameter called records)
from backup.files import BackupWriter, read_backup  # noqa: E402
from cfemu import credentials  # noqa: E402
from cfemu.entry import Entry  # noqa: E402
from cfemu.private_files import write_private  # noqa: E402
from restore.plan import RestorePlan  # noqa: E402
from sqm.log import RecordLog, find_log_dirs  # noqa: E402

S = "APP1"
MEMBERS = ("QM1", "QM2", "QM3")
REPLAY_FROM = 10_000_000
NOW_MS = 1_700_000_000_000
RESULTS = ROOT / "bench" / "results" / "spark.jsonl"


@dataclass
class Truth:
    """What a correct plan of the synthetic history says."""

    restored: dict[str, int] = field(default_factory=dict)  # id -> backout count
    consumed: int = 0
    put_backed_out: int = 0
    decided: set[str] = field(default_factory=set)  # UOWs in flight at the end
    records: int = 0
    backup_copies: int = 0
    log_bytes: int = 0


def generate(root: Path, records: int, seed: int = 1, backup_messages: int | None = None) -> Truth:
    """Write the history (logs under root/logs, the backup under root/backup) and return its truth."""
    rnd = random.Random(seed)
    truth = Truth()
    available: deque[tuple[str, dict[str, Any], bytes]] = deque()  # committed messages, oldest first
    lrsn = REPLAY_FROM - 1

    writer = BackupWriter(root / "backup" / S / "b", backup_keys=bench_keys(root))
    for n in range(backup_messages or max(1000, records // 20)):  # the backup: committed before the replay range
        e = Entry(id=f"b{n:011x}", queue=f"Q{n % 4}", put_time=NOW_MS - 10**6,
                  msgid=os.urandom(8).hex()).wire()
        e.update(st="CP", l=REPLAY_FROM - 1000 + n % 900, o1=n, o2=n)
        body = rnd.randbytes(64)
        writer.add(3, e, body)
        available.append((e["id"], e, body))
        truth.restored[e["id"]] = 0
        truth.backup_copies += 1
    writer.finish({"id": "b", "group": "BENCH", "structure": S, "entries": truth.backup_copies,
                   "replay_from": REPLAY_FROM})

    logs = {m: RecordLog(root / "logs" / m, m) for m in MEMBERS}
    seq = 0
    written = 0

    def put_uow(member: str, finish: bool) -> None:
        nonlocal lrsn, seq, written
        seq += 1
        u = f"{member}.1.{seq}"
        log = logs[member]
        mine: list[tuple[str, dict[str, Any], bytes]] = []
        for _ in range(rnd.randint(1, 4)):
            lrsn += 1
            eid = f"{seq:08x}{len(mine):02x}{rnd.getrandbits(16):04x}"
            e = Entry(id=eid, queue=f"Q{rnd.randrange(4)}", put_time=lrsn // 1000, msgid=eid).wire()
            body = rnd.randbytes(64)
            log.append(sqm.core.records.put(u, lrsn, structure=S, gen=0, entry=e, data=body))
            mine.append((eid, e, body))
        written += len(mine)
        if not finish:
            truth.decided.add(u)
            truth.put_backed_out += len(mine)
            return
        lrsn += 1
        commit = rnd.random() >= 0.03
        log.append((sqm.core.records.commit if commit else sqm.core.records.backout)(u, lrsn, {S: 0}))
        lrsn += 1
        log.append(sqm.core.records.end(u, lrsn))
        written += 2
        if commit:
            for eid, e, body in mine:
                available.append((eid, e, body))
                truth.restored[eid] = 0
        else:
            truth.put_backed_out += len(mine)

    def get_uow(member: str, finish: bool) -> None:
        nonlocal lrsn, seq, written
        seq += 1
        u = f"{member}.1.{seq}"
        log = logs[member]
        taken = []
        for _ in range(min(rnd.randint(1, 4), len(available))):
            lrsn += 1
            eid, e, body = available.popleft()
            log.append(sqm.core.records.get(u, lrsn, structure=S, gen=0, entry_id=eid, queue=e["q"]))
            taken.append((eid, e, body))
        written += len(taken)
        if not finish:
            truth.decided.add(u)
            for eid, _, _ in taken:
                truth.restored[eid] += 1  # restore backs the get out: available again, one more backout
            return
        lrsn += 1
        commit = rnd.random() >= 0.05
        log.append((sqm.core.records.commit if commit else sqm.core.records.backout)(u, lrsn, {S: 0}))
        lrsn += 1
        log.append(sqm.core.records.end(u, lrsn))
        written += 2
        for item in taken:
            if commit:
                del truth.restored[item[0]]
                truth.consumed += 1
            else:
                truth.restored[item[0]] += 1
                available.append(item)  # backed out: available again (at the end of our FIFO model)

    turn = 0
    while written < records:
        member = MEMBERS[turn % 3]
        turn += 1
        if rnd.random() < 0.68:
            put_uow(member, True)
        else:
            get_uow(member, True)
    for member in MEMBERS:  # work in flight when the CF was lost
        put_uow(member, False)
        get_uow(member, False)
    for log in logs.values():
        log.force()
        truth.log_bytes += log.stats.bytes
        log.close()
    truth.records = written
    return truth


def check(plan: RestorePlan, truth: Truth) -> list[str]:
    """Differences between a plan and the truth (empty when the plan is right)."""
    problems = []
    restored = {s.id: int(s.entry.get("bc", 0)) for s in plan.settled if s.disposition == "restored" and s.entry}
    if restored != truth.restored:
        missing = truth.restored.keys() - restored.keys()
        extra = restored.keys() - truth.restored.keys()
        wrong = sum(1 for k in restored.keys() & truth.restored.keys() if restored[k] != truth.restored[k])
        problems.append(f"restored: {len(missing)} missing, {len(extra)} extra, {wrong} wrong backout counts")
    if plan.counts["consumed"] != truth.consumed:
        problems.append(f"consumed {plan.counts['consumed']} != {truth.consumed}")
    if plan.counts["put-backed-out"] != truth.put_backed_out:
        problems.append(f"put-backed-out {plan.counts['put-backed-out']} != {truth.put_backed_out}")
    if set(plan.decisions) != truth.decided:
        problems.append(f"decisions {len(plan.decisions)} != {len(truth.decided)}")
    return problems


# --------------------------------------------------------------------------------------------- one engine run


def run_engine(root: Path, engine: str, master: str, truth_file: Path, memory: str, e2e: bool,
               conf: dict[str, str] | None = None) -> dict[str, Any]:
    """Plan in a child process (one Spark driver per master); returns its measurements. conf: further Spark
    settings for the driver (a standalone cluster's secret), handed over in a 0600 file, not on a command line."""
    conf_file = root / "driver-conf.json"
    write_private(conf_file, json.dumps(conf or {}).encode())
    cmd = [sys.executable, __file__, "--child", str(root), engine, master, str(truth_file), memory, str(int(e2e)),
           str(conf_file)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        (root / f"{engine}-{master}.stderr").write_text(out.stderr)  # the whole story, for --keep
        return {"engine": engine, "master": master, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def bench_keys(root: Path) -> credentials.BackupKeys:
    """A backup key of the bench's own, beside its data (backups are signed: docs/security.md)."""
    credentials.create_backup_key(root / "secrets")
    return credentials.backup_keys(root / "secrets")


def child(root: Path, engine: str, master: str, truth_file: Path, memory: str, e2e: bool, conf_file: Path) -> None:
    from restore.engine import get_engine

    truth = Truth(**json.loads(truth_file.read_text()))
    truth.decided = set(truth.decided)
    backup = read_backup(root / "backup" / S / "b", backup_keys=bench_keys(root))
    log_dirs = find_log_dirs(root / "logs")
    result: dict[str, Any] = {"engine": engine, "master": master}
    t0 = time.perf_counter()
    if engine == "spark":
        eng: Any = get_engine("spark", master=master, log_file=root / "spark.log",
                              conf={"spark.driver.memory": memory, "spark.local.dir": str(root / "spark-tmp"),
                                    **json.loads(conf_file.read_text())}, keep_session=True)
        eng.session()
    else:
        eng = get_engine("local")
    result["startup_s"] = round(time.perf_counter() - t0, 2)
    phase_times: dict[str, float] = {}
    last = {"t": time.perf_counter()}

    def progress(phase: str, done: int, total: int | None) -> None:
        now = time.perf_counter()
        phase_times[phase] = phase_times.get(phase, 0.0) + now - last["t"]
        last["t"] = now

    t0 = time.perf_counter()
    last["t"] = t0
    plan = eng.plan(S, backup, log_dirs, REPLAY_FROM, NOW_MS, progress)
    result["plan_s"] = round(time.perf_counter() - t0, 2)
    result["phases_s"] = {k: round(v, 2) for k, v in (getattr(eng, "phase_seconds", None) or phase_times).items()}
    result["problems"] = check(plan, truth)
    result["restored"] = plan.counts["restored"]
    result["settled"] = len(plan.settled)
    if e2e:
        result.update(end_to_end(root, plan))
        result["restore_over_raw"] = round((result["plan_s"] + result["load_s"]) / result["raw_write_s"], 2)
    print(json.dumps(result))


def end_to_end(root: Path, plan: RestorePlan) -> dict[str, float]:
    """Load the plan into a fresh CF with restore.load.load_plan, and time a raw pipelined write of the same
    final data (descriptor and data hashes, queue lists, in batches of the same size) for comparison."""
    from cfemu import keys
    from cfemu.admin import Admin
    from cfemu.bulk import claim, descriptor, list_of, observe
    from cfemu.embedded import EmbeddedRedis
    from restore.load import BATCH, load_plan

    server = EmbeddedRedis(data_dir=root / "redis")
    server.start()
    try:
        client = server.client()
        survivors = [s for s in plan.settled if s.entry is not None]
        ent_key, data_key = keys.entries(S), keys.data(S)
        t0 = time.perf_counter()
        for start in range(0, len(survivors), BATCH):
            chunk = survivors[start:start + BATCH]
            pipe = client.pipeline(transaction=False)
            pipe.hset(ent_key, mapping={s.id: descriptor(s.entry or {}, s.data) for s in chunk})
            pipe.hset(data_key, mapping={s.id: s.data for s in chunk})
            for s in chunk:
                assert s.entry is not None
                pipe.rpush(list_of(S, s.entry), s.id)
            pipe.execute()
        raw_s = time.perf_counter() - t0
        client.flushall()
        admin = Admin(client)
        admin.define_structure(S)
        queues = [f"Q{n}" for n in range(4)]
        for q in queues:
            admin.define_queue(q, S)
        t0 = time.perf_counter()
        with claim(client, S, observe(client, S)) as owner:
            load = load_plan(owner, plan, admin.structure_def(S), queues)
        load_s = time.perf_counter() - t0
        return {"raw_write_s": round(raw_s, 2), "load_s": round(load_s, 2), "loaded": load.entries}
    finally:
        server.stop()


def standalone_runs(console: Console, n: int, kept: list[tuple[Path, Truth, Path]], memory: str,
                    executor_memory: str) -> list[dict[str, Any]]:
    """Start a standalone cluster of n workers (1 core each), plan every kept size on it, stop it (by pid)."""
    from qsg.spark_standalone import SparkStandalone

    work = Path(tempfile.mkdtemp(prefix=f"bench-spark-standalone-{n}-"))
    rows = []
    t0 = time.perf_counter()
    cluster = SparkStandalone.start(work / "spark", n, secrets_dir=work / "secrets", cores=1,
                                    memory=executor_memory)
    try:
        console.print(f"[bold]standalone, {n} worker(s)[/]: {cluster.master_url} up in "
                      f"{time.perf_counter() - t0:.0f} s")
        conf = {**cluster.driver_conf(), "spark.executor.memory": executor_memory,
                "spark.default.parallelism": str(max(2, n))}
        for root, truth, truth_file in kept:
            r = run_engine(root, "spark", cluster.master_url, truth_file, memory, False, conf)
            r.update(master=f"standalone x{n}", records=truth.records, messages=len(truth.restored),
                     log_mib=round(truth.log_bytes / 2**20), workers=n)
            rows.append(r)
            status = r.get("error") or ("correct" if not r["problems"] else "; ".join(r["problems"]))
            console.print(f"  {truth.records:,} records: plan {r.get('plan_s', '-')} s (start-up "
                          f"{r.get('startup_s', '-')} s) phases {r.get('phases_s', {})}: {status}")
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows


# --------------------------------------------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "memory_gb": round(mem / 2**30, 1), "python": platform.python_version(),
            "platform": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run: 20k and 100k records (unless --sizes)")
    ap.add_argument("--sizes", type=int, nargs="+")
    ap.add_argument("--no-local-above", type=int, default=5_000_000,
                    help="skip the local engine for larger logs (it holds the whole log in memory)")
    ap.add_argument("--masters", nargs="*", default=["local[2]", "local[1]"], help="none: the local engine only")
    ap.add_argument("--workers", nargs="*", type=int, default=None,
                    help="standalone clusters of these many workers, 1 core each (default 1 2 4; --quick: 1 2; "
                         "none: no standalone cluster)")
    ap.add_argument("--executor-memory", default="2g", help="standalone: each worker's executor memory")
    ap.add_argument("--backup-messages", type=int, help="messages in the backup (default: records / 20)")
    ap.add_argument("--memory", default="8g", help="spark.driver.memory (local mode: the executors too)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files (printed)")
    ap.add_argument("--e2e-up-to", type=int, default=1_000_000,
                    help="load the first spark plan into a fresh CF (and time a raw write) up to this size")
    args = ap.parse_args(argv)
    sizes = args.sizes or ([20_000, 100_000] if args.quick else [100_000, 1_000_000, 5_000_000])
    workers = args.workers if args.workers is not None else ([1, 2] if args.quick else [1, 2, 4])
    console = Console()
    console.print(f"load average before: {os.getloadavg()}")
    rows: list[dict[str, Any]] = []
    kept: list[tuple[Path, Truth, Path]] = []  # each size's data, for the standalone clusters after
    for size in sizes:
        root = Path(tempfile.mkdtemp(prefix=f"bench-spark-{size}-"))
        keep_for_clusters = False
        try:
            t0 = time.perf_counter()
            truth = generate(root, size, backup_messages=args.backup_messages)
            gen_s = time.perf_counter() - t0
            truth_file = root / "truth.json"
            truth_file.write_text(json.dumps({**asdict(truth), "decided": sorted(truth.decided)}))
            console.print(f"[bold]{size:,} records[/]: {truth.records:,} log records ({truth.log_bytes / 2**20:.0f} "
                          f"MiB), {truth.backup_copies:,} backup copies, {len(truth.restored):,} messages to "
                          f"restore; generated in {gen_s:.0f} s")
            runs = []
            if size <= args.no_local_above:
                runs.append(("local", "-"))
            runs += [("spark", m) for m in args.masters]
            for engine, master in runs:
                # end to end: the local engine's plan, and the first spark plan
                e2e = size <= args.e2e_up_to and (engine == "local" or (engine, master) == ("spark", args.masters[0]))
                r = run_engine(root, engine, master, truth_file, args.memory, e2e)
                r.update(records=truth.records, messages=len(truth.restored), log_mib=round(truth.log_bytes / 2**20))
                rows.append(r)
                status = r.get("error") or ("correct" if not r["problems"] else "; ".join(r["problems"]))
                console.print(f"  {engine:5} {master:8} plan {r.get('plan_s', '-')} s "
                              f"(start-up {r.get('startup_s', '-')} s) phases {r.get('phases_s', {})}: {status}")
                if "load_s" in r:
                    console.print(f"    end to end: plan {r['plan_s']} s + load {r['load_s']} s "
                                  f"({r['loaded']:,} messages) = {r['restore_over_raw']} x a raw pipelined "
                                  f"write of the same data ({r['raw_write_s']} s)")
            if workers:
                kept.append((root, truth, truth_file))
                keep_for_clusters = True
        finally:
            if args.keep:
                console.print(f"  kept {root}")
            elif not keep_for_clusters:
                shutil.rmtree(root, ignore_errors=True)
    try:
        for n in workers:
            rows += standalone_runs(console, n, kept, args.memory, args.executor_memory)
    finally:
        for root, _, _ in kept:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)

    table = Table(title="Restore planning: local vs spark (seconds; Spark start-up not included)")
    for col in ("records", "messages", "engine", "master", "plan s", "read backup", "read logs", "settle",
                "start-up s", "result"):
        table.add_column(col, justify="right")
    for r in rows:
        ph = r.get("phases_s", {})
        table.add_row(f"{r['records']:,}", f"{r['messages']:,}", r["engine"], r["master"], str(r.get("plan_s", "-")),
                      str(ph.get("read backup", "-")), str(ph.get("read logs", "-")), str(ph.get("settle", "-")),
                      str(r.get("startup_s", "-")),
                      r.get("error") or ("correct" if not r.get("problems") else "WRONG"))
    console.print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps({"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
                            "quick": args.quick, "load_after": os.getloadavg(), "runs": rows}) + "\n")
    return 0 if all(not r.get("error") and not r.get("problems") for r in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5]), sys.argv[6], sys.argv[7] == "1",
              Path(sys.argv[8]))
    else:
        sys.exit(main())
