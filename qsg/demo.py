"""cfemu demo: the end-to-end demonstration (what `make demo` runs).

A queue-sharing group of three queue-manager servers over an embedded CF works under a client workload; a fuzzy
backup is taken while it works; the CF's redis-server is killed (everything in it is lost), restarted empty and
the structure restored from the backup plus the merged logs; the clients carry on through the same servers
(no restart); then every queue is drained and checked against what the clients were told:

  lost        a put acknowledged as committed whose message was neither consumed nor drained
  duplicated  a message consumed by two committed gets, or consumed and still there
  phantom     a message drained that no client put
  corrupted   a message whose payload fails its checksum
  resurrected a non-persistent message put before the CF loss that came back

Operations whose outcome the client could not know (the connection or the CF died mid-commit) may go either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from backup.run import run_backup
from cfemu.clitools import Output, run_command
from cfemu.connection import connect
from cfemu.errors import MQError, NoMessageError, OutcomeUnknownError
from restore.run import run_restore
from sqm.service.client import Client

QUEUES = ("Q1", "Q2")
STRUCTURE = "APP1"


def make_body(msg_id: str, size: int) -> bytes:
    payload = (msg_id.encode() * (size // max(1, len(msg_id)) + 1))[:size]
    return msg_id.encode() + b"|" + hashlib.sha256(payload).hexdigest()[:16].encode() + b"|" + payload


def parse_body(body: bytes) -> tuple[str, bool]:
    """(message id, checksum ok)."""
    try:
        mid, digest, payload = body.split(b"|", 2)
    except ValueError:
        return body[:32].decode(errors="replace"), False
    return mid.decode(), hashlib.sha256(payload).hexdigest()[:16].encode() == digest


@dataclass
class Ledger:
    """What the clients were told, and what they saw."""

    committed: set[str] = field(default_factory=set)
    unknown_puts: set[str] = field(default_factory=set)
    consumed: Counter[str] = field(default_factory=Counter)
    unknown_gets: set[str] = field(default_factory=set)
    nonpersistent_before_loss: set[str] = field(default_factory=set)
    nonpersistent: set[str] = field(default_factory=set)
    commits_after_restore: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Workload:
    """Producer and consumer client threads, spread over the group's servers."""

    def __init__(self, endpoints: list[tuple[str, str, int]], ledger: Ledger, *, producers: int, consumers: int,
                 size: int, token: str | None) -> None:
        self.endpoints = endpoints
        self.ledger = ledger
        self.size = size
        self.token = token
        self.stop = threading.Event()
        self.cf_lost = threading.Event()
        self.restored = threading.Event()
        self.threads = [threading.Thread(target=self._producer, args=(i,), daemon=True) for i in range(producers)]
        self.threads += [threading.Thread(target=self._consumer, args=(i,), daemon=True) for i in range(consumers)]

    def _client(self, i: int) -> Any:

        # Each client prefers one server and fails over to the others.
        eps = self.endpoints[i % len(self.endpoints):] + self.endpoints[:i % len(self.endpoints)]
        return Client([(h, p) for _, h, p in eps], token=self.token, client_name=f"demo-{i}",
                      reconnect_timeout=30.0)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def _pause(self) -> None:
        time.sleep(0.05)

    def _abandon(self, client: Any, e: MQError) -> None:
        """A put or get failed: count it, back the UOW out (nothing of it happened), and pause a moment."""
        with self.ledger.lock:
            self.ledger.errors[e.reason_name] += 1
        try:
            client.backout()
        except MQError:
            pass
        self._pause()

    def _producer(self, n: int) -> None:
        rnd = random.Random(n)
        led = self.ledger
        client = self._client(n)
        seq = 0
        while not self.stop.is_set():
            batch = []
            try:
                for _ in range(rnd.randint(1, 4)):
                    seq += 1
                    mid = f"p{n}-{seq}"
                    client.put(QUEUES[seq % 2], make_body(mid, self.size), priority=rnd.randint(0, 9))
                    batch.append(mid)
                if rnd.random() < 0.1:  # a few non-persistent messages, outside syncpoint
                    seq += 1
                    mid = f"p{n}-{seq}-np"
                    client.put(QUEUES[0], make_body(mid, self.size), persistent=False, syncpoint=False)
                    with led.lock:
                        led.nonpersistent.add(mid)
                        if not self.cf_lost.is_set():  # acknowledged before the kill began: in the lost CF
                            led.nonpersistent_before_loss.add(mid)
            except MQError as e:
                self._abandon(client, e)
                continue
            self._commit(client, batch, put=True)
        client.close()

    def _consumer(self, n: int) -> None:
        client = self._client(100 + n)
        while not self.stop.is_set():
            got = []
            try:
                for q in QUEUES:
                    for _ in range(3):
                        got.append(parse_body(client.get(q, wait_ms=100).body)[0])
            except NoMessageError:
                pass
            except MQError as e:
                self._abandon(client, e)
                continue
            if got:
                self._commit(client, got, put=False)
            else:
                self._pause()
        client.close()

    def _commit(self, client: Any, ids: list[str], *, put: bool) -> None:
        led = self.ledger
        try:
            client.commit()
        except OutcomeUnknownError:
            with led.lock:
                (led.unknown_puts if put else led.unknown_gets).update(ids)
            return
        except MQError as e:  # backed out: nothing happened
            with led.lock:
                led.errors[e.reason_name] += 1
            self._pause()
            return
        with led.lock:
            if put:
                led.committed.update(ids)
            else:
                led.consumed.update(ids)
            if self.restored.is_set():
                led.commits_after_restore += 1


def drain(endpoints: list[tuple[str, str, int]], token: str | None) -> tuple[Counter[str], int, list[str]]:
    """Get every message off every queue: (ids seen, messages, corrupted ids)."""

    seen: Counter[str] = Counter()
    corrupted = []
    n = 0
    with Client([(h, p) for _, h, p in endpoints], token=token) as client:
        for q in QUEUES:
            while True:
                try:
                    body = client.get(q, syncpoint=False).body
                except NoMessageError:
                    break
                mid, ok = parse_body(body)
                seen[mid] += 1
                n += 1
                if not ok:
                    corrupted.append(mid)
    return seen, n, corrupted


def check(led: Ledger, drained: Counter[str], corrupted: list[str]) -> dict[str, list[str]]:
    persistent_drained = {m for m in drained if not m.endswith("-np")}
    lost = sorted(m for m in led.committed if led.consumed[m] == 0 and m not in drained
                  and m not in led.unknown_gets)
    duplicated = sorted({m for m, c in led.consumed.items() if c > 1} | {m for m, c in drained.items() if c > 1}
                        | {m for m in persistent_drained if led.consumed[m] > 0})
    phantom = sorted(m for m in drained if m not in led.committed and m not in led.unknown_puts
                     and m not in led.nonpersistent)
    resurrected = sorted(m for m in drained if m in led.nonpersistent_before_loss)
    return {"lost": lost, "duplicated": duplicated, "phantom": phantom, "corrupted": sorted(corrupted),
            "resurrected": resurrected}


def run_demo(directory: Path, *, managers: int = 3, producers: int = 4, consumers: int = 2, size: int = 1024,
             work_s: float = 6.0, console: Console | None = None) -> dict[str, Any]:
    from qsg.cluster import Cluster

    console = console or Console(stderr=True)
    timings: dict[str, float] = {}
    led = Ledger()
    cluster = Cluster.up(directory, managers=managers, backup_interval=None, structure=STRUCTURE, queues=QUEUES,
                         lease_ms=3000)
    work: Workload | None = None
    try:
        work = Workload(cluster.endpoints, led, producers=producers, consumers=consumers, size=size,
                        token=cluster.token)
        with Progress(TextColumn("{task.description:<34}"), BarColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), console=console, transient=False) as bar:

            def phase(name: str, seconds: float) -> None:
                task = bar.add_task(name, total=seconds, info="")
                t0 = time.monotonic()
                while (el := time.monotonic() - t0) < seconds:
                    with led.lock:
                        info = f"committed {len(led.committed)}  consumed {sum(led.consumed.values())}"
                    bar.update(task, completed=el, info=info)
                    time.sleep(0.2)
                bar.update(task, completed=seconds)
                timings[name] = seconds

            work.start()
            phase(f"group working ({managers} managers)", work_s)
            task = bar.add_task("fuzzy backup of APP1 under load", total=None, info="")
            t0 = time.monotonic()
            client = connect(cluster.redis_url)
            manifest = run_backup(client, STRUCTURE, cluster.backup_dir, log_root=cluster.log_root)
            client.close()
            timings["backup"] = time.monotonic() - t0
            bar.update(task, total=1, completed=1, info=f"{manifest['entries']} messages copied, "
                       f"{manifest.get('exception_records', 0)} exception records")
            phase("more work after the backup", work_s / 2)

            task = bar.add_task("CF lost: redis-server killed", total=1, info="")
            with led.lock:
                committed_before_loss = len(led.committed)
            work.cf_lost.set()
            cluster.kill_cf()
            time.sleep(1.0)  # the group sees the failed structure
            cluster.restart_cf()
            bar.update(task, completed=1, info="restarted empty")

            task = bar.add_task("restore APP1 (backup + merged logs)", total=None, info="")
            t0 = time.monotonic()
            client = connect(cluster.redis_url)
            result = run_restore(client, STRUCTURE, backup_root=cluster.backup_dir, log_root=cluster.log_root)
            client.close()
            work.restored.set()
            timings["restore"] = time.monotonic() - t0
            bar.update(task, total=1, completed=1, info=f"{result.loaded_entries} messages restored")

            phase("group working on the restored CF", work_s / 2)
            work.join()
            task = bar.add_task("drain every queue and check", total=None, info="")
            drained, n_drained, corrupted = drain(cluster.endpoints, cluster.token)
            bar.update(task, total=1, completed=1, info=f"{n_drained} messages drained")
    finally:
        if work is not None:
            work.join()
        cluster.down()

    findings = check(led, drained, corrupted)
    return {
        "committed": len(led.committed),
        "committed_before_cf_loss": committed_before_loss,
        "consumed": sum(led.consumed.values()),
        "restored": result.loaded_entries,
        "drained": n_drained,
        "unknown_outcome": len(led.unknown_puts) + len(led.unknown_gets),
        "commits_after_restore": led.commits_after_restore,
        "nonpersistent_put": len(led.nonpersistent),
        "nonpersistent_lost_with_cf": len(led.nonpersistent_before_loss - set(drained)),
        "backup_id": manifest["id"],
        "backup_entries": manifest["entries"],
        "restore_counts": result.counts,
        "errors_seen_by_clients": dict(led.errors),
        "seconds": {k: round(v, 2) for k, v in timings.items()},
        **{k: len(v) for k, v in findings.items()},
        "findings": {k: v[:20] for k, v in findings.items() if v},
    }


def summary_table(r: dict[str, Any]) -> Table:
    t = Table(title="cfemu demo: queue-sharing group, fuzzy backup, CF lost, restored")
    t.add_column("what")
    t.add_column("count", justify="right")
    for key, label in [("committed", "puts committed (acknowledged)"),
                       ("committed_before_cf_loss", "  of them before the CF was lost"),
                       ("consumed", "gets committed"), ("backup_entries", "messages in the fuzzy backup"),
                       ("restored", "messages restored"), ("drained", "messages drained at the end"),
                       ("commits_after_restore", "commits after the restore (no restart)"),
                       ("unknown_outcome", "operations with unknown outcome"),
                       ("nonpersistent_lost_with_cf", "non-persistent lost with the CF (allowed)"),
                       ("lost", "LOST"), ("duplicated", "DUPLICATED"), ("phantom", "PHANTOM"),
                       ("corrupted", "CORRUPTED"), ("resurrected", "RESURRECTED non-persistent")]:
        style = "bold red" if key in ("lost", "duplicated", "phantom", "corrupted", "resurrected") and r[key] \
            else None
        t.add_row(label, str(r[key]), style=style)
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cfemu demo", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--managers", type=int, default=3)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--consumers", type=int, default=2)
    p.add_argument("--size", type=int, default=1024, help="message size in bytes (default 1024)")
    p.add_argument("--seconds", type=float, default=8.0, help="length of the first work phase")
    p.add_argument("--quick", action="store_true", help="a short run (for tests)")
    p.add_argument("--dir", type=Path, help="where the cluster lives (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("-v", "--verbose", action="store_true", help="the traceback of an error")
    # The demo drives real processes: any failure of it is one line (the traceback with --verbose).
    return run_command("cfemu demo", p.parse_args(argv), cmd_demo, (Exception,))


def cmd_demo(args: argparse.Namespace, out: Output) -> int:
    seconds = 3.0 if args.quick else args.seconds
    console = Console(stderr=True)
    # Clients report failovers and refusals as warnings; the demo counts them in its table instead.
    logging.getLogger("sqm").setLevel(logging.ERROR)
    tmp = None
    directory = args.dir
    if directory is None:
        tmp = tempfile.TemporaryDirectory(prefix="cfemu-demo-")
        directory = Path(tmp.name)
    try:
        result = run_demo(directory, managers=args.managers, producers=args.producers, consumers=args.consumers,
                          size=args.size, work_s=seconds, console=console)
    finally:
        if tmp is not None:
            tmp.cleanup()
    if args.json:
        print(json.dumps(result))
    else:
        out.print(summary_table(result))
    bad = result["lost"] + result["duplicated"] + result["phantom"] + result["corrupted"] + result["resurrected"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
