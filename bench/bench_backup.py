"""Benchmark of BACKUP CFSTRUCT (BENCHMARKS.md, "backup"), on a private redis-server started and stopped here.

  (a) raw read: the same entries read with pipelined HMGETs of descriptor and data, in batches
  (b) run_backup of the structure on an idle CF: ratio raw-read time / backup time (target >= 0.8)
  (c) foreground throughput of put+commit / get+commit loops on 2 SQMs (threads): windows without a backup, with
      backups running back to back in another process (`cfbackup run`) paced at --share (backup.pacing), unpaced
      (share 1), and unpaced at nice 19: drop % against the mean of the quiet windows (target <= 10% paced,
      without nice)
  (d) log records per message lifecycle under the patent's protocol, against naive logging of every list move as
      a delete plus an insert (counted from the moves the foreground loops made)

    .venv/bin/python bench/bench_backup.py [--messages 1000000] [--seconds 10]

With --restore it measures RECOVER CFSTRUCT's load instead (BENCHMARKS.md, "restore load under ownership": every
batch of the load is a guarded transaction of the restore's claim): one backup of the filled structure, then --rounds
restores of it into an emptied CF (FLUSHALL, as after a CF loss), each interleaved with a raw pipelined write of the
same entries (descriptor and data hashes, queue list, index sets; batches of restore's size) as the baseline. The
load is timed from the restore's first load report to its end (its batches, UOW records, verify and switch to
ACTIVE). To compare with an older restore, run the same script with that tree first on PYTHONPATH.

    .venv/bin/python bench/bench_backup.py --restore --messages 200000 --rounds 3

Prints a table and appends one JSON line to bench/results/backup.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgpack
import redis
from harness import Windows, append_result
from rich.console import Console
from rich.table import Table

from backup.run import DEFAULT_BATCH, run_backup
from cfemu import credentials, keys
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.clitools import PhaseBars
from cfemu.embedded import EmbeddedRedis
from cfemu.errors import NoMessageError

try:
    from cfemu.settings import DEFAULT_BACKUP_SHARE
    PACING: bool = True
except ImportError:  # a tree from before pacing (backup.pacing), on PYTHONPATH to compare: its backups never pause
    DEFAULT_BACKUP_SHARE, PACING = 1.0, False
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.wings import WINGS

STRUCTURE, FILL_QUEUE, FG_QUEUE = "BENCH", "FILLQ", "FGQ"
BODY = 1024
BATCH = 2000


def fill(client: redis.Redis, n: int, console: Console) -> list[str]:
    """N persistent committed 1 KiB messages, written with pipelined calls of the CF's put script."""
    cf = CF(client)
    admin = Admin(client)
    epoch = admin.join("FILLER", {"bench": True}, 600_000)
    put = cf.script("put")
    skeys = keys.script_keys(STRUCTURE)
    body = os.urandom(BODY)
    ids = [os.urandom(12).hex() for _ in range(n)]
    t0 = time.perf_counter()
    now = int(time.time() * 1000) - 3_600_000
    for start in range(0, n, BATCH):
        pipe = client.pipeline(transaction=False)
        for i in ids[start:start + BATCH]:
            desc = msgpack.packb({"p": 0, "per": 1, "mid": i, "cid": "", "exp": 0, "pt": now, "bc": 0, "pr": {}},
                                 use_bin_type=False)
            put(keys=skeys, args=["FILLER", epoch, 0, "", 0, i, FILL_QUEUE, desc, body], client=pipe)
        pipe.execute()
    admin.leave("FILLER")
    console.print(f"filled {n} messages in {time.perf_counter() - t0:.1f} s")
    return ids


def process_cpu_s() -> float:
    """CPU seconds of this process (all its threads) and of its children that ended."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def server_cpu_s(client: redis.Redis) -> float:
    """CPU seconds the redis-server has used (INFO cpu)."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def raw_read(client: redis.Redis, ids: list[str]) -> tuple[float, int]:
    ent, data = keys.entries(STRUCTURE), keys.data(STRUCTURE)
    t0 = time.perf_counter()
    nbytes = 0
    for start in range(0, len(ids), BATCH):
        chunk = ids[start:start + BATCH]
        pipe = client.pipeline(transaction=False)
        pipe.hmget(ent, chunk)
        pipe.hmget(data, chunk)
        descs, datas = pipe.execute()
        nbytes += sum(len(d) for d in datas)
    return time.perf_counter() - t0, nbytes


class Foreground:
    """put+commit, get+commit loops on two SQMs (one thread each); one get in ten is backed out first."""

    def __init__(self, url: str, log_root: Path) -> None:
        # No relogging (cpl_entries=0): a relog pass of the filled structure (each member relogs every resident
        # 1 KiB message at every third LOGLOAD checkpoint: 240 MB at 200k messages) swings a window by 3x with or
        # without a backup (BENCHMARKS.md, "backup"), which would drown the backup's own cost.
        self.qms = [QueueManager(QueueManagerConfig(name=f"FG{i}", log_root=log_root, redis_url=url,
                                                    background=False, cpl_entries=0), wings=WINGS) for i in (1, 2)]
        for qm in self.qms:
            qm.start()

    def run(self, seconds: float) -> dict[str, float]:
        stop = threading.Event()
        done = [0, 0]
        moves = [0, 0]
        errors: list[BaseException] = []
        records0 = sum(qm.log.stats.records for qm in self.qms if qm.log)

        def loop(k: int) -> None:
            conn = self.qms[k].connect()
            body = os.urandom(BODY)
            i = 0
            try:
                while not stop.is_set():
                    i += 1
                    conn.put(FG_QUEUE, body)
                    conn.commit()  # moves: none -> UP (put), UP -> CP (commit)
                    moves[k] += 2
                    try:
                        conn.get(FG_QUEUE)
                    except NoMessageError:
                        continue
                    moves[k] += 1  # CP -> UG
                    if i % 10 == 0:
                        conn.backout()  # UG -> CP, then get it again
                        moves[k] += 1
                        conn.get(FG_QUEUE)
                        moves[k] += 1
                    conn.commit()  # UG -> gone
                    moves[k] += 1
                    done[k] += 1
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=loop, args=(k,)) for k in (0, 1)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        if errors:
            raise errors[0]
        records = sum(qm.log.stats.records for qm in self.qms if qm.log) - records0
        return {"lifecycles": sum(done), "per_s": sum(done) / elapsed, "moves": sum(moves), "records": records,
                "seconds": elapsed, "backout_records_with_data": sum(qm.counters["backout_records_with_data"]
                                                                     for qm in self.qms)}

    def stop(self) -> None:
        for qm in self.qms:
            qm.stop()


def backups_in_a_loop(url: str, backup_dir: Path, log_root: Path, stop: threading.Event,
                      out: list[dict[str, Any]], batch: int, nice: int, share: float) -> None:
    cfbackup = str(Path(sys.executable).parent / "cfbackup")
    # the bench's own backup key (bench_keys): backups are signed, and cfbackup finds the key through the settings
    env = {**os.environ, credentials.ENV_SECRETS_DIR: str(backup_dir.parent / "secrets")}
    while not stop.is_set():
        p = subprocess.run(["nice", "-n", str(nice), cfbackup, "run", STRUCTURE, "--json", "--backup-dir",
                            str(backup_dir), "--redis-url", url, "--log-root", str(log_root), "--batch", str(batch),
                            *(["--backup-share", str(share)] if PACING else [])],
                           capture_output=True, text=True, env=env)
        if p.returncode != 0:
            out.append({"error": p.stderr.strip()})
            return
        m = json.loads(p.stdout)
        out.append({k: m.get(k) for k in ("entries", "elapsed_s", "exception_records", "pacing")})
        shutil.rmtree(backup_dir / STRUCTURE, ignore_errors=True)


def raw_write(client: redis.Redis, ids: list[str], body: bytes, *, guarded: bool = False) -> float:
    """The restore load's baseline: the same entries written with plain pipelines (descriptor and data hashes,
    the queue list and the message-id index sets), in batches of restore's size, into an emptied CF: what each
    batch of the load did before it was guarded. guarded: the same batches, each a transaction of an owner of
    the structure (cfemu.bulk.Owner: WATCH, check of token, state and CF identity, MULTI/EXEC), as the load
    writes them now; the difference is the guard's cost alone."""
    from cfemu import bulk

    desc = msgpack.packb({"id": "x", "q": FILL_QUEUE, "p": 0, "per": 1, "st": "CP"}, use_bin_type=False)
    ent, data, lst = keys.entries(STRUCTURE), keys.data(STRUCTURE), keys.state_list(STRUCTURE, FILL_QUEUE, "CP")
    owner = bulk.claim(client, STRUCTURE, bulk.observe(client, STRUCTURE)) if guarded else None
    t0 = time.perf_counter()
    for start in range(0, len(ids), bulk.BATCH):
        chunk = ids[start:start + bulk.BATCH]

        def stage(pipe: Any, chunk: list[str] = chunk) -> None:
            pipe.hset(ent, mapping=dict.fromkeys(chunk, desc))
            pipe.hset(data, mapping=dict.fromkeys(chunk, body))
            pipe.rpush(lst, *chunk)
            for i in chunk:
                pipe.sadd(keys.index_set(STRUCTURE, FILL_QUEUE, "m", i), i)

        if owner is not None:
            owner.transaction(stage)
        else:
            pipe = client.pipeline(transaction=False)
            stage(pipe)
            pipe.execute()
    elapsed = time.perf_counter() - t0
    if owner is not None:
        owner.close()
    return elapsed


def bench_keys(work: Path) -> credentials.BackupKeys:
    """A backup key of the bench's own, in its work directory (backups are signed: docs/security.md)."""
    credentials.create_backup_key(work / "secrets")
    return credentials.backup_keys(work / "secrets")


def restore_rounds(client: redis.Redis, work: Path, ids: list[str], rounds: int, console: Console, *,
                   guard: bool = True) -> dict[str, Any]:
    """--restore: the load of run_restore against a raw pipelined write (and, with guard, the same batches as
    guarded transactions), interleaved rounds, the best of each."""
    from restore.engine import LOAD
    from restore.run import run_restore

    manifest = run_backup(client, STRUCTURE, work / "bk", backup_keys=bench_keys(work))
    loads: list[float] = []
    totals: list[float] = []
    raws: list[float] = []
    guarded: list[float] = []
    cpu_us: dict[str, list[float]] = {"raw_write": [], "raw_write_cf": [], "restore": [], "restore_cf": []}
    for _ in range(rounds):
        client.flushall()  # the CF is lost
        c0, s0 = process_cpu_s(), server_cpu_s(client)
        raws.append(raw_write(client, ids, os.urandom(BODY)))
        cpu_us["raw_write"].append(round((process_cpu_s() - c0) / len(ids) * 1e6, 2))
        cpu_us["raw_write_cf"].append(round((server_cpu_s(client) - s0) / len(ids) * 1e6, 2))
        client.flushall()
        if guard:
            guarded.append(raw_write(client, ids, os.urandom(BODY), guarded=True))
            client.flushall()
        marks: dict[str, float] = {}

        def progress(phase: str, done: int, total: int | None, marks: dict[str, float] = marks) -> None:
            if phase == LOAD:
                marks.setdefault("load", time.perf_counter())

        t0 = time.perf_counter()
        c0, s0 = process_cpu_s(), server_cpu_s(client)
        result = run_restore(client, STRUCTURE, backup_root=work / "bk", log_root=work / "logs", progress=progress,
                             backup_keys=bench_keys(work))
        t1 = time.perf_counter()
        cpu_us["restore"].append(round((process_cpu_s() - c0) / len(ids) * 1e6, 2))
        cpu_us["restore_cf"].append(round((server_cpu_s(client) - s0) / len(ids) * 1e6, 2))
        assert result.loaded_entries == len(ids), result.loaded_entries
        loads.append(t1 - marks["load"])
        totals.append(t1 - t0)
        console.print(f"round: raw write {raws[-1]:.2f} s" + (f", guarded write {guarded[-1]:.2f} s" if guard else "")
                      + f", restore load {loads[-1]:.2f} s (restore {totals[-1]:.2f} s)")
    out = {"bench": "restore-load", "backup_entries": manifest["entries"], "rounds": rounds,
           "raw_write_rounds_s": [round(x, 3) for x in raws], "load_rounds_s": [round(x, 3) for x in loads],
           "restore_rounds_s": [round(x, 3) for x in totals], "raw_write_s": round(min(raws), 3),
           "load_s": round(min(loads), 3), "restore_s": round(min(totals), 3),
           "load_over_raw": round(min(loads) / min(raws), 3), "cpu_us_per_entry": cpu_us,
           "loadavg_end": os.getloadavg()}
    if guard:
        out.update(guarded_write_rounds_s=[round(x, 3) for x in guarded], guarded_write_s=round(min(guarded), 3),
                   guarded_over_raw=round(min(guarded) / min(raws), 3))
    return out


# The foreground windows, and the rounds of raw read / backup pairs (interleaved; the best of each).
WINDOWS = Windows(seconds=10.0, rounds=2, quick_seconds=3.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=None, help="messages backed up (default 1M, --quick 20k)")
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="entries per fetch of the measured backup")
    ap.add_argument("--fg-batch", type=int, default=DEFAULT_BATCH,
                    help="entries per fetch of the backups that run beside the foreground loops")
    ap.add_argument("--share", type=float, default=DEFAULT_BACKUP_SHARE,
                    help="the paced backups' share (--backup-share) beside the foreground loops; the unpaced and "
                         "niced windows run with 1")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    WINDOWS.add_to(ap, "a short run: 20k messages, 3 s foreground windows, 1 raw read / backup pair (unless "
                       "--messages, --seconds, --rounds say otherwise)")
    ap.add_argument("--restore", action="store_true",
                    help="measure restore's load (against a raw pipelined write) instead of the backup")
    ap.add_argument("--no-guard", action="store_true",
                    help="--restore: skip the guarded write (for a tree from before the guard, to compare)")
    args = ap.parse_args()
    # --quick shortens what the command line leaves to the defaults (tests/bench runs it shorter still).
    args.messages = args.messages or (20_000 if args.quick else 1_000_000)
    args.seconds, args.rounds = WINDOWS.of(ap, args)
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="bench-backup-"))
    srv = EmbeddedRedis(data_dir=work / "cf").start()
    result: dict[str, Any] = {"bench": "backup", "date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                                          "python": platform.python_version(), "platform": platform.platform()},
                              "messages": args.messages, "body_bytes": BODY}
    try:
        client = srv.client()
        admin = Admin(client)
        admin.define_structure(STRUCTURE)
        admin.define_queue(FILL_QUEUE, STRUCTURE)
        admin.define_queue(FG_QUEUE, STRUCTURE)
        ids = fill(client, args.messages, console)
        if args.restore:
            result.update(restore_rounds(client, work, ids, args.rounds, console, guard=not args.no_guard))
            return _finish(console, result, args)

        # Interleaved rounds, the best of each: the machine may be shared, and a single pair can straddle a burst.
        raws: list[float] = []
        backups: list[float] = []
        # CPU an entry (this process's threads; the redis-server's, by its INFO): on a machine shared with other
        # work the wall times swing with it, the CPU much less.
        cpu_us: dict[str, list[float]] = {"raw_read": [], "raw_read_cf": [], "backup": [], "backup_cf": []}
        for _ in range(args.rounds):
            c0, s0 = process_cpu_s(), server_cpu_s(client)
            raw_s, raw_bytes = raw_read(client, ids)
            raws.append(raw_s)
            c1, s1 = process_cpu_s(), server_cpu_s(client)
            t0 = time.perf_counter()
            with PhaseBars(console, disabled=not console.is_terminal, width=36) as bars:
                manifest = run_backup(client, STRUCTURE, work / "bk", progress=bars, batch=args.batch,
                                      backup_keys=bench_keys(work))
            backups.append(time.perf_counter() - t0)
            c2, s2 = process_cpu_s(), server_cpu_s(client)
            for k, v in (("raw_read", c1 - c0), ("raw_read_cf", s1 - s0), ("backup", c2 - c1), ("backup_cf", s2 - s1)):
                cpu_us[k].append(round(v / args.messages * 1e6, 2))
            assert manifest["entries"] == args.messages, manifest["entries"]
            shutil.rmtree(work / "bk")
        raw_s, backup_s = min(raws), min(backups)
        result.update(raw_read_rounds_s=[round(x, 3) for x in raws], backup_rounds_s=[round(x, 3) for x in backups],
                      batch=args.batch, fg_batch=args.fg_batch, cpu_us_per_entry=cpu_us,
                      loadavg_start=os.getloadavg())
        result.update(raw_read_s=round(raw_s, 3), raw_read_mb_s=round(raw_bytes / raw_s / 2**20, 1),
                      backup_s=round(backup_s, 3), backup_mb_s=round(manifest["bytes"] / backup_s / 2**20, 1),
                      backup_ratio=round(raw_s / backup_s, 3))

        fg = Foreground(srv.url, work / "logs")
        windows: dict[str, dict[str, float]] = {}
        runs: dict[str, list[dict[str, Any]]] = {}
        try:
            fg.run(1.0)  # warm up
            # quiet, busy (paced), quiet, busy (unpaced), quiet, busy (unpaced, niced): each busy window sits
            # between quiet ones of the same moment
            for name, nice, share in (("quiet1", None, 1.0), ("busy", 0, args.share), ("quiet2", None, 1.0),
                                      ("busy_unpaced", 0, 1.0), ("quiet3", None, 1.0), ("busy_niced", 19, 1.0)):
                if nice is None:
                    windows[name] = fg.run(args.seconds)
                    continue
                stop = threading.Event()
                runs[name] = []
                looper = threading.Thread(target=backups_in_a_loop,
                                          args=(srv.url, work / "bk-loop", work / "logs", stop, runs[name],
                                                args.fg_batch, nice, share))
                looper.start()
                time.sleep(0.5)  # let the first backup begin
                windows[name] = fg.run(args.seconds)
                stop.set()
                looper.join()
        finally:
            fg.stop()
        failed = [r for rs in runs.values() for r in rs if "error" in r]
        if failed:
            raise RuntimeError(f"background backup failed: {failed}")
        quiet_per_s = sum(windows[q]["per_s"] for q in ("quiet1", "quiet2", "quiet3")) / 3
        paced = [r for r in runs["busy"] if r.get("entries")]
        lifecycles = sum(w["lifecycles"] for w in windows.values())
        records = sum(w["records"] for w in windows.values())
        moves = sum(w["moves"] for w in windows.values())
        result.update(fg_quiet_per_s=round(quiet_per_s, 1), fg_busy_per_s=round(windows["busy"]["per_s"], 1),
                      fg_busy_niced_per_s=round(windows["busy_niced"]["per_s"], 1),
                      fg_busy_unpaced_per_s=round(windows["busy_unpaced"]["per_s"], 1),
                      fg_quiet_windows_per_s=[round(windows[q]["per_s"], 1) for q in ("quiet1", "quiet2", "quiet3")],
                      share=args.share if PACING else None,
                      fg_drop_pct=round((1 - windows["busy"]["per_s"] / quiet_per_s) * 100, 1),
                      fg_drop_unpaced_pct=round((1 - windows["busy_unpaced"]["per_s"] / quiet_per_s) * 100, 1),
                      paced_backup_entries_per_s=round(sum(r["entries"] for r in paced)
                                                       / max(sum(r["elapsed_s"] for r in paced), 1e-9)),
                      fg_drop_niced_pct=round((1 - windows["busy_niced"]["per_s"] / quiet_per_s) * 100, 1),
                      backup_runs=runs,
                      exception_records=sum(r["exception_records"] or 0 for rs in runs.values() for r in rs),
                      lifecycles=lifecycles, log_records=records, list_moves=moves,
                      records_per_msg=round(records / lifecycles, 2),
                      naive_move_records_per_msg=round(2 * moves / lifecycles, 2),
                      naive_total_records_per_msg=round((records + 2 * moves) / lifecycles, 2))
    finally:
        srv.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    return _finish(console, result, args)


def _finish(console: Console, result: dict[str, Any], args: argparse.Namespace) -> int:
    """The table, and the result line appended to bench/results/backup.jsonl."""
    if result.get("bench") == "restore-load":
        table = Table("measure", "value", title=f"restore load, {args.messages} x {BODY} B")
        for k in ("raw_write_s", "guarded_write_s", "guarded_over_raw", "load_s", "load_over_raw", "restore_s"):
            if k not in result:
                continue
            table.add_row(k, str(result[k]))
        console.print(table)
        return _append(result)
    table = Table("measure", "value", "target", title=f"backup benchmark, {args.messages} x {BODY} B")
    table.add_row("raw pipelined read (s, MiB/s)", f"{result['raw_read_s']} s, {result['raw_read_mb_s']}", "")
    table.add_row("run_backup (s, MiB/s)", f"{result['backup_s']} s, {result['backup_mb_s']}", "")
    table.add_row("backup / raw read speed (idle CF)", str(result["backup_ratio"]), ">= 0.8")
    cpu = result["cpu_us_per_entry"]
    table.add_row("CPU µs an entry, raw read: process / CF", f"{min(cpu['raw_read'])} / {min(cpu['raw_read_cf'])}", "")
    table.add_row("CPU µs an entry, backup: process / CF", f"{min(cpu['backup'])} / {min(cpu['backup_cf'])}", "")
    table.add_row("foreground lifecycles/s, no backup", str(result["fg_quiet_per_s"]), "")
    table.add_row("foreground lifecycles/s, backups paced", f"{result['fg_busy_per_s']} "
                  f"({len(result['backup_runs']['busy'])} backup runs)", "")
    table.add_row(f"foreground drop %, backups paced (share {result['share']})", str(result["fg_drop_pct"]),
                  "<= 10")
    table.add_row("paced backups under load: entries/s", str(result["paced_backup_entries_per_s"]), "")
    table.add_row("foreground lifecycles/s, backups unpaced", f"{result['fg_busy_unpaced_per_s']} "
                  f"({len(result['backup_runs']['busy_unpaced'])} backup runs)", "")
    table.add_row("foreground drop %, backups unpaced", str(result["fg_drop_unpaced_pct"]), "")
    table.add_row("foreground lifecycles/s, backups unpaced at nice 19", f"{result['fg_busy_niced_per_s']} "
                  f"({len(result['backup_runs']['busy_niced'])} backup runs)", "")
    table.add_row("foreground drop %, backups unpaced at nice 19", str(result["fg_drop_niced_pct"]), "")
    table.add_row("log records per message (patent)", str(result["records_per_msg"]), "")
    table.add_row("naive: move records per message (delete+insert)", str(result["naive_move_records_per_msg"]), "")
    table.add_row("naive: total records per message", str(result["naive_total_records_per_msg"]), "")
    table.add_row("exception records (BACKOUT with data) during backups", str(result["exception_records"]), "")
    console.print(table)
    return _append(result)


def _append(result: dict[str, Any]) -> int:
    append_result("backup", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
