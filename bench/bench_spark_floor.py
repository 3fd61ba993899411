"""The floor under any Spark plan of restore (BENCHMARKS.md, "spark floor"): the least work every plan of the fold
must do, run on Spark and on DuckDB over the same records, against the columnar engine's whole plan.

The goal for Spark (BENCHMARKS.md, "restore and backup, newest figures") is its plan of 1M messages (2M log records)
on 2 standalone workers within 2x of the local engine. Whatever its shape, a plan of the fold must read every record, decide each unit of work's outcome from its
records (a grouping by UOW id), give every entry's events their outcomes (a join by UOW id), and reduce each
entry's events to the last decisive one (a grouping by entry id): that is this benchmark's query, with none of the
fold's rules (carried UOWs, in-doubt, relogs, purges, copies from the backup), so every real plan costs more. If
Spark's run of it alone is already beyond twice the local engine's whole plan, no Spark plan can meet the goal on
this machine; the figure says by how much.

    .venv/bin/python bench/bench_spark_floor.py [--records 2000000] [--workers 2] [--rounds 2]
        [--engines duckdb local standalone] [--quick]

The records are synthetic, shaped as the restore benchmark's (a PUT and a GET per message, each in a UOW of its own
whose COMMIT follows, but for one GET in two, left in flight; 12-character entry and UOW ids; eight Parquet files,
one a member), written once
to a temporary directory on the real disk. Each engine reads the same files. DuckDB runs with 2 threads in this
process; Spark as local[2] in a driver of its own, and on a standalone cluster of --workers workers of 1 core
each (qsg.spark_standalone, as `cfemu cluster up --spark N`). Times are the query's wall seconds (Spark's session
start-up apart, and given), best of --rounds; CPU seconds are every process's of the engine (the JVMs included).
Appends one JSON line to bench/results/spark_floor.jsonl.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from harness import append_result, load_average, machine
from rich.console import Console
from rich.table import Table

PUT, GET, COMMIT = 0, 1, 2
FILES = 8
ENGINES = ("duckdb", "local", "standalone")

# The least every plan of the fold does (see the module): outcomes by UOW, joined to the entries' events, each
# entry reduced to its last event. DuckDB's and Spark's spellings of the same query.
FLOOR_DUCKDB = """
WITH outcome AS (SELECT u, max(l) AS decided FROM recs WHERE k = 2 GROUP BY u),
     ev AS (SELECT r.e, r.l, r.k, o.decided FROM recs r JOIN outcome o ON r.u = o.u WHERE r.k <> 2),
     fin AS (SELECT e, arg_max(k, l) AS last_k, max(decided) AS at FROM ev GROUP BY e)
SELECT count(*) AS entries, sum(CASE WHEN last_k = 0 THEN 1 ELSE 0 END) AS available FROM fin
"""
FLOOR_SPARK = FLOOR_DUCKDB.replace("arg_max(k, l)", "max_by(k, l)")


def make_records(directory: Path, records: int) -> int:
    """Write about `records` log records as FILES Parquet files: each message a PUT and its COMMIT, then a GET whose
    UOW commits for one message in two (the other's is in flight: backed out, the message stays available);
    returns the bytes written."""
    messages = records * 2 // 7
    per_file = -(-messages // FILES)
    written = 0
    for f in range(FILES):
        lo, hi = f * per_file, min(messages, (f + 1) * per_file)
        if lo >= hi:
            break
        n = hi - lo
        ids = [f"{i:012x}" for i in range(lo, hi)]
        put_uows = [f"p{i:011x}" for i in range(lo, hi)]
        get_uows = [f"g{i:011x}" for i in range(lo, hi)]
        base = [1_796_000_000_000_000 + 4 * i for i in range(lo, hi)]
        odd = [i % 2 == 1 for i in range(lo, hi)]
        e = ids * 3 + [x for x, o in zip(ids, odd, strict=True) if o]
        u = put_uows + put_uows + get_uows + [x for x, o in zip(get_uows, odd, strict=True) if o]
        k = [PUT] * n + [COMMIT] * n + [GET] * n + [COMMIT] * sum(odd)
        lrsn = (base + [b + 1 for b in base] + [b + 2 for b in base]
                + [b + 3 for b, o in zip(base, odd, strict=True) if o])
        table = pa.table({"e": pa.array(e, pa.string()), "u": pa.array(u, pa.string()),
                          "l": pa.array(lrsn, pa.int64()), "k": pa.array(k, pa.int8())})
        path = directory / f"member-{f}.parquet"
        pq.write_table(table, path)
        written += path.stat().st_size
    return written


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its live descendants (and of their children that ended), from /proc."""
    total, todo = 0.0, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / tick  # utime, stime, cutime, cstime
        todo += _children(p)
    return total


def run_duckdb(directory: Path, rounds: int) -> dict[str, Any]:
    con = duckdb.connect()
    con.execute("SET threads = 2")
    con.execute(f"CREATE VIEW recs AS SELECT * FROM read_parquet('{directory}/*.parquet')")
    me = os.getpid()
    best: dict[str, Any] = {}
    for _ in range(rounds):
        c0, t0 = tree_cpu(me), time.perf_counter()
        entries, available = con.execute(FLOOR_DUCKDB).fetchone()  # type: ignore[misc]
        wall, cpu = time.perf_counter() - t0, tree_cpu(me) - c0
        if not best or wall < best["wall_s"]:
            best = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "entries": entries, "available": available}
    con.close()
    return best


def run_spark(directory: Path, rounds: int, master: str, conf: dict[str, str],
              executors: list[int] | None = None) -> dict[str, Any]:
    """The floor query on Spark (a driver in this process's JVM gateway); executors: the standalone workers'
    processes, whose CPU counts too."""
    from pyspark.sql import SparkSession

    t0 = time.perf_counter()
    builder = SparkSession.builder.master(master).appName("bench-spark-floor")
    for k, v in {"spark.sql.shuffle.partitions": "8", "spark.ui.enabled": "false", **conf}.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    startup = time.perf_counter() - t0
    watched = [os.getpid(), *(executors or [])]
    try:
        spark.read.parquet(str(directory)).createOrReplaceTempView("recs")
        best: dict[str, Any] = {}
        for _ in range(rounds):
            c0, t1 = sum(tree_cpu(p) for p in watched), time.perf_counter()
            row = spark.sql(FLOOR_SPARK).collect()[0]
            wall = time.perf_counter() - t1
            cpu = sum(tree_cpu(p) for p in watched) - c0
            if not best or wall < best["wall_s"]:
                best = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "entries": row["entries"],
                        "available": row["available"], "startup_s": round(startup, 1)}
        return best
    finally:
        spark.stop()


def run_standalone(directory: Path, rounds: int, workers: int, console: Console) -> dict[str, Any]:
    from qsg.spark_standalone import SparkStandalone

    work = Path(tempfile.mkdtemp(prefix=f"bench-spark-floor-standalone-{workers}-"))
    cluster = SparkStandalone.start(work / "spark", workers, secrets_dir=work / "secrets", cores=1, memory="2g")
    try:
        console.log(f"standalone cluster of {workers} worker(s) at {cluster.master_url}")
        daemons = [int(r["pid"]) for r in cluster.processes() if r["pid"] and r["alive"]]
        return run_spark(directory, rounds, cluster.master_url,
                         {**cluster.driver_conf(), "spark.executor.memory": "2g",
                          "spark.default.parallelism": str(max(2, workers))}, daemons)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--workers", type=int, default=2, help="the standalone cluster's workers, 1 core each")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES),
                    help="which engines run (default: all three; DuckDB always runs, as the reference answer)")
    ap.add_argument("--quick", action="store_true", help="20,000 records, one round")
    ap.add_argument("--local-plan-s", type=float, default=10.41,
                    help="the columnar engine's whole plan at this size, seconds (BENCHMARKS.md: 10.41 at 2M "
                         "records, the default --memory-limit)")
    args = ap.parse_args(argv)
    if args.quick:
        args.records, args.rounds = 20_000, 1
    console = Console()
    root = Path(__file__).resolve().parent.parent / "var"
    root.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-spark-floor-", dir=root))
    result: dict[str, Any] = {"machine": machine(work), "load_start": load_average(), "records": args.records}
    try:
        t0 = time.perf_counter()
        result["parquet_bytes"] = make_records(work, args.records)
        console.log(f"{args.records:,} records written in {time.perf_counter() - t0:.1f} s")
        rows: list[tuple[str, dict[str, Any]]] = [("duckdb (2 threads)", run_duckdb(work, args.rounds))]
        console.log(f"duckdb: {rows[-1][1]}")
        if "local" in args.engines:
            rows.append(("spark local[2]", run_spark(work, args.rounds, "local[2]", {"spark.driver.memory": "4g"})))
            console.log(f"spark local[2]: {rows[-1][1]}")
        if "standalone" in args.engines:
            rows.append((f"spark standalone x{args.workers}", run_standalone(work, args.rounds, args.workers,
                                                                               console)))
            console.log(f"spark standalone: {rows[-1][1]}")
        answers = {(r["entries"], r["available"]) for _, r in rows}
        if len(answers) != 1:
            raise SystemExit(f"the engines answered differently: {answers}")
        duck = rows[0][1]["wall_s"]
        table = Table(title=f"the fold's floor over {args.records:,} records (best of {args.rounds})")
        for col in ("engine", "query s", "CPU s", "start-up s", "/ DuckDB's query", "/ the local engine's plan"):
            table.add_column(col)
        for name, r in rows:
            table.add_row(name, f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}", str(r.get("startup_s", "-")),
                          f"{r['wall_s'] / duck:.1f}x", f"{r['wall_s'] / args.local_plan_s:.2f}x")
        console.print(table)
        result.update(engines={name: r for name, r in rows}, local_plan_s=args.local_plan_s,
                      load_end=load_average(),
                      floor_over_local_plan={name: round(r["wall_s"] / args.local_plan_s, 2) for name, r in rows})
        append_result("spark_floor", result)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    raise SystemExit(main())
