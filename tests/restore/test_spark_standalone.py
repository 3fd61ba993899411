"""Restore on a real Spark standalone cluster (docs/spark.md): `cfemu cluster up --spark 2` starts a master
and two workers from the installed pyspark on 127.0.0.1; queue managers of the same cluster make a real history
around a real fuzzy backup; `cfrestore` plans it with the local engine and with the Spark engine on the cluster
(found from the cluster with no flag, and named with --master spark://127.0.0.1:PORT), the plans agree, the Spark
restore loads what the local plan said; `cfemu cluster down` then leaves no Java process behind.

Opt-in (marker spark_cluster, `make spark-cluster-test`): JVMs start slowly on two cores, the test takes
~2-4 minutes (docs/spark.md says the figure measured).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cfemu.errors import NoMessageError
from cfemu.procs import pid_alive
from sqm.service.client import Client

pytest.importorskip("pyspark")
pytestmark = [pytest.mark.spark_cluster,
              pytest.mark.skipif(shutil.which("java") is None, reason="Spark needs a JRE on the PATH"),
              pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def cli(module: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    # The cluster's commands find its secrets in its directory: not the suite's (tests/conftest.py).
    env = {k: v for k, v in os.environ.items() if k != "CFEMU_SECRETS_DIR"}
    r = subprocess.run([sys.executable, "-m", module, *args, "--json"], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"{module} {' '.join(args)}: {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    return dict(json.loads(r.stdout))


def processes_naming(text: str) -> list[int]:
    """The live processes whose command line holds text."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                out.append(int(cmdline.parent.name))
        except OSError:
            pass
    return out


def comparable(result: dict[str, Any]) -> dict[str, Any]:
    """What a plan says, without what differs between two runs of it (engine, times, report, own LRSN)."""
    return {k: result[k] for k in ("backup_id", "replay_from", "replay_to", "log_ranges", "records_by_member",
                                   "counts", "in_doubt_uows", "nonpersistent_lost", "base_kind")}


def plans_of_unchanged_logs(where: tuple[str, str], tries: int = 4) -> tuple[dict[str, Any], dict[str, Any]]:
    """The local plan and the cluster's, of logs that did not change while the cluster planned: the members are
    live, and a record one appends between the two plans is read by the second alone. Each try plans locally
    again after the cluster; a try whose two local plans differ is made again."""
    for _ in range(tries):
        local = cli("restore.cli", "plan", "APP1", "--engine", "local", *where)
        found = cli("restore.cli", "plan", "APP1", "--engine", "spark", *where)  # the cluster's master
        if comparable(cli("restore.cli", "plan", "APP1", "--engine", "local", *where)) == comparable(local):
            return local, found
    raise AssertionError(f"the members' logs changed during each of {tries} tries of the two plans")


def test_restore_on_a_standalone_spark_cluster_equals_the_local_engine(tmp_path: Path) -> None:
    d = tmp_path / "cluster"
    where = ("--cluster-dir", str(d))
    java_pids: set[int] = set()
    try:
        up = cli("qsg.cli", "cluster", "up", "--dir", str(d), "--managers", "2", "--backup-interval", "0",
                 "--spark", "2")
        rows = {p["process"]: p for p in up["processes"]}
        assert {"spark-master", "spark-worker-1", "spark-worker-2"} <= set(rows)
        assert all(p["alive"] for p in up["processes"])
        master = up["spark_master"]
        assert master.startswith("spark://127.0.0.1:")
        java_pids |= {int(rows[n]["pid"]) for n in ("spark-master", "spark-worker-1", "spark-worker-2")}
        # Secured: the shared secret in 0600 files, never on a command line; every port on loopback.
        secret = (d / "secrets" / "spark.secret").read_text().strip()
        for f in (d / "secrets" / "spark.secret", d / "spark" / "spark.properties"):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600
        for pid in java_pids:
            assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout.splitlines()
        ours = [line for line in listening if any(f"pid={pid}," in line for pid in java_pids)]
        assert ours and all("127.0.0.1" in line.split()[3] for line in ours), ours
        status = cli("qsg.cli", "cluster", "status", "--dir", str(d))
        assert status["spark_master"] == master

        # A real history: two queue managers, a fuzzy backup between two waves of work, a UOW left in flight.
        state = json.loads((d / "cluster.json").read_text())
        token = (d / "secrets" / "service.token").read_text().strip()
        endpoints = [f"127.0.0.1:{m['port']}" for m in state["managers"]]
        with Client(endpoints, token=token) as c:
            for i in range(120):
                c.put("Q1" if i % 2 else "Q2", b"before %d" % i + os.urandom(200))
                if i % 10 == 9:
                    c.commit()
            c.commit()
        cli("backup.cli", "run", "APP1", *where)
        with Client(endpoints, token=token) as c, Client(endpoints, token=token) as open_uow:
            for i in range(80):
                c.put("Q1", b"after %d" % i + os.urandom(300))
            c.commit()
            for _ in range(50):
                c.get("Q2")
            c.commit()
            for _ in range(10):
                c.get("Q1")
            c.backout()
            open_uow.put("Q1", b"in flight")  # never committed: the restore backs it out
            # A put in a UOW is written to the log before its commit, not at once: a forced commit on the same
            # member (both clients are on the first endpoint) writes it, so both plans read the same log.
            c.put("Q2", b"forces the log")
            c.commit()
            local, found = plans_of_unchanged_logs(where)
        assert comparable(found) == comparable(local)
        assert local["counts"]["restored"] == 120 + 80 - 50 + 1, local["counts"]
        local = cli("restore.cli", "plan", "APP1", "--engine", "local", *where)  # the in-flight UOW ended since
        ran = cli("restore.cli", "run", "APP1", "--engine", "spark", "--master", master, "--mark-failed", *where)
        assert ran["engine"] == "spark" and not ran["dry_run"]
        assert comparable(ran) == comparable(local)
        assert ran["loaded_entries"] == local["counts"]["restored"]
        # The Spark jobs ran on the cluster's executors (their work directories), not in a local[*] driver.
        apps = {p.name for w in (d / "spark" / "work").iterdir() for p in w.iterdir() if p.name.startswith("app-")}
        assert len(apps) >= 2
        with Client(endpoints, token=token) as c:
            got = 0
            for queue in ("Q1", "Q2"):
                with contextlib.suppress(NoMessageError):
                    while c.get(queue, syncpoint=False):
                        got += 1
        assert got == local["counts"]["restored"]
    finally:
        java_pids |= set(processes_naming(str(d / "spark")))  # executors included: their cwd args name it
        down = cli("qsg.cli", "cluster", "down", "--dir", str(d))
    assert down["still_running"] == {}
    assert not [pid for pid in java_pids if pid_alive(pid)]
    assert processes_naming(str(d / "spark")) == []
