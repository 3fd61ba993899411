"""A Spark standalone cluster on this machine: one master and N workers, from the installed pyspark.

pyspark ships Spark's jars and its ``bin/spark-class``, which runs ``org.apache.spark.deploy.master.Master`` and
``org.apache.spark.deploy.worker.Worker``: nothing is downloaded, a JRE on the PATH is all it needs. What
``cfemu cluster up --spark N`` starts, and what the standalone restore test and bench/bench_spark_cluster.py use::

    spark = SparkStandalone.start("var/cluster/spark", workers=2)
    spark.master_url        # spark://127.0.0.1:PORT, for cfrestore run --engine spark --master
    spark.driver_conf()     # what a driver sets to join it (the secret, read from its 0600 file)
    spark.stop()            # SIGTERM, then SIGKILL, each process by its pid

Everything binds to 127.0.0.1 (the RPC ports by --host, the web UIs by SPARK_LOCAL_IP), on ports chosen free.
Spark standalone has no users: whoever can reach the master may run code on the workers. So the cluster runs
with ``spark.authenticate`` (a shared secret every daemon, executor and driver must prove) and
``spark.network.crypto.enabled`` (its RPC encrypted with keys derived from it). The secret is made once, kept in
the group's secrets directory (``spark.secret``, 0600, cfemu.credentials) and reaches the daemons through a
properties file (0600) in the cluster's directory: never a command line, where ``ps`` would show it. Executors
get it from their worker's environment, as Spark does. Its web UIs (read-only status) are on loopback ports.

The directory holds ``spark.json`` (pids, ports, URLs), ``spark.properties`` (0600), ``logs/`` (each daemon's
output) and ``work/`` (the workers' work directories: executors' stderr). Processes are started in sessions of
their own when detached (they outlive ``cfemu cluster up``), else tied to the starting process (they die with it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cfemu import credentials
from cfemu.private_files import private_dir, write_private
from cfemu.procs import free_port, log_tail, pid_alive, popen_tied, wait_gone
from restore.spark_conf import driver_conf, security_conf

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
STATE_FILE = "spark.json"
PROPERTIES_FILE = "spark.properties"
HOST = "127.0.0.1"


class SparkClusterError(RuntimeError):
    """The Spark cluster cannot be started as asked (no pyspark, no java, a daemon that died at start)."""


def spark_home() -> Path:
    """pyspark's directory: Spark's jars and bin/spark-class."""
    try:
        import pyspark
    except ImportError:
        raise SparkClusterError("pyspark is not installed (pip install 'cfemu[spark]')") from None
    home = Path(pyspark.__file__).resolve().parent
    if not (home / "bin" / "spark-class").is_file():
        raise SparkClusterError(f"{home} has no bin/spark-class: this pyspark cannot run a standalone cluster")
    return home


def _java() -> str:
    java = shutil.which("java") or (os.path.join(os.environ["JAVA_HOME"], "bin", "java")
                                    if os.environ.get("JAVA_HOME") else None)
    if not java or not os.access(java, os.X_OK):
        raise SparkClusterError("no java on the PATH (nor $JAVA_HOME): Spark needs a JRE 17 or later")
    return java


def _is_ours(pid: int | None, marker: bytes) -> bool:
    """Alive and still the java process started (its command line names the class): guards against pid reuse."""
    if not pid or not pid_alive(pid):
        return False
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    """The pids whose parent is pid (from /proc)."""
    out = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat_file.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat_file.parent.name))
    return out


class SparkStandalone:
    """A master and its workers, as described by DIR/spark.json."""

    def __init__(self, directory: Path, state: dict[str, Any]) -> None:
        self.dir = directory
        self.state = state
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def master_url(self) -> str:
        return str(self.state["master_url"])

    @property
    def secret_file(self) -> Path:
        return Path(self.state["secret_file"])

    def driver_conf(self) -> dict[str, str]:
        """What a driver on this machine sets to use the cluster: the shared secret and loopback addresses."""
        return driver_conf(self.master_url, self.secret_file.parent)

    # --- start ---------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, directory: str | os.PathLike[str], workers: int = 2, *, secrets_dir: str | os.PathLike[str],
              cores: int = 1, memory: str = "2g", detach: bool = False, timeout: float = 180.0) -> SparkStandalone:
        """Start a master and `workers` workers (each offering `cores` cores and `memory`), and wait until every
        worker has registered with the master. secrets_dir: where the cluster's secret is kept (made once).
        On any failure whatever was started is stopped again."""
        if not 1 <= workers <= 16:
            raise SparkClusterError(f"--spark must be 1-16 workers, not {workers}")
        home, java = spark_home(), _java()
        d = private_dir(Path(directory).resolve())
        for sub in ("logs", "work", "conf"):
            private_dir(d / sub)
        secret_file = credentials.spark_secret_file(Path(secrets_dir))
        props = d / PROPERTIES_FILE
        write_private(props, "".join(f"{k} {v}\n" for k, v in {
            **security_conf(credentials.spark_secret(secret_file.parent) or ""),
            "spark.worker.cleanup.enabled": "true",  # executors' files of finished applications are removed
            # The REST submission server takes jobs with no authentication at all (and on a fixed port): off.
            "spark.master.rest.enabled": "false",
        }.items()).encode())
        port, ui = free_port(HOST), free_port(HOST)
        state: dict[str, Any] = {
            "dir": str(d), "master_url": f"spark://{HOST}:{port}", "master_port": port, "master_ui": ui,
            "secret_file": str(secret_file), "detached": detach, "spark_home": str(home), "java": java,
            "master_pid": None, "workers": [], "cores": cores, "memory": memory,
        }
        cluster = cls(d, state)
        try:
            state["master_pid"] = cluster._spawn("master", [MASTER_CLASS, "--host", HOST, "--port", str(port),
                                                            "--webui-port", str(ui), "--properties-file", str(props)])
            cluster._wait_port(port, state["master_pid"], "master", timeout)
            for i in range(1, workers + 1):
                wui = free_port(HOST)
                work = private_dir(d / "work" / f"worker-{i}")
                pid = cluster._spawn(f"worker-{i}", [WORKER_CLASS, state["master_url"], "--host", HOST,
                                                     "--webui-port", str(wui), "--cores", str(cores), "--memory",
                                                     memory, "--work-dir", str(work), "--properties-file",
                                                     str(props)])
                state["workers"].append({"name": f"worker-{i}", "pid": pid, "ui": wui})
            cluster._wait_workers(workers, timeout)
        except BaseException:
            cluster.stop(timeout=5.0)
            raise
        cluster._save()
        return cluster

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> SparkStandalone | None:
        d = Path(directory).resolve()
        try:
            return cls(d, dict(json.loads((d / STATE_FILE).read_text())))
        except (OSError, ValueError):
            return None

    def _save(self) -> None:
        write_private(self.dir / STATE_FILE, (json.dumps(self.state, indent=2) + "\n").encode())

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"SPARK_HOME": self.state["spark_home"], "SPARK_LOCAL_IP": HOST,
                    "SPARK_LOG_DIR": str(self.dir / "logs"), "SPARK_CONF_DIR": str(self.dir / "conf"),
                    "PYSPARK_PYTHON": sys.executable, "SPARK_NO_DAEMONIZE": "1"})
        env.pop("SPARK_MASTER_OPTS", None)
        env.pop("SPARK_WORKER_OPTS", None)
        return env

    def _spawn(self, name: str, args: list[str]) -> int:
        cmd = [str(Path(self.state["spark_home"]) / "bin" / "spark-class"), *args]
        with open(self.dir / "logs" / f"{name}.log", "ab") as out:
            kw: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": out, "stderr": subprocess.STDOUT,
                                  "env": self._env(), "close_fds": True, "cwd": str(self.dir)}
            # spark-class execs java: the pid is the daemon's own
            proc = subprocess.Popen(cmd, start_new_session=True, **kw) if self.state["detached"] \
                else popen_tied(cmd, **kw)
        self._procs[proc.pid] = proc
        return proc.pid

    def _wait_port(self, port: int, pid: int, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not pid_alive(pid) or (pid in self._procs and self._procs[pid].poll() is not None):
                raise SparkClusterError(f"the Spark {name} died at start: "
                                        f"{log_tail(self.dir / 'logs' / f'{name}.log', 5)}")
            with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
                return
            time.sleep(0.2)
        raise SparkClusterError(f"the Spark {name} did not listen on {HOST}:{port} within {timeout:.0f}s")

    def master_status(self) -> dict[str, Any] | None:
        """The master's own view (its web UI's /json), or None when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.state['master_ui']}/json/", timeout=2.0) as r:
                return dict(json.loads(r.read()))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def alive_workers(self) -> int:
        doc = self.master_status() or {}
        return sum(1 for w in doc.get("workers", []) if w.get("state") == "ALIVE")

    def _wait_workers(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for w in self.state["workers"]:
                if not pid_alive(w["pid"]) or self._procs[w["pid"]].poll() is not None:
                    raise SparkClusterError(f"Spark {w['name']} died at start: "
                                            f"{log_tail(self.dir / 'logs' / (w['name'] + '.log'), 5)}")
            if self.alive_workers() >= n:
                return
            time.sleep(0.3)
        raise SparkClusterError(f"{n} Spark workers did not register with the master within {timeout:.0f}s "
                                f"(logs in {self.dir / 'logs'})")

    # --- status and stop -------------------------------------------------------------------------------------
    def processes(self) -> list[dict[str, Any]]:
        """One row per daemon: process, pid, alive, address."""
        rows = [{"process": "spark-master", "pid": self.state.get("master_pid"),
                 "alive": _is_ours(self.state.get("master_pid"), MASTER_CLASS.encode()),
                 "address": self.master_url, "metrics": f"{HOST}:{self.state['master_ui']}"}]
        for w in self.state["workers"]:
            rows.append({"process": f"spark-{w['name']}", "pid": w.get("pid"),
                         "alive": _is_ours(w.get("pid"), WORKER_CLASS.encode()),
                         "address": f"{self.state['cores']} core(s), {self.state['memory']}",
                         "metrics": f"{HOST}:{w['ui']}"})
        return rows

    def running(self) -> dict[str, int]:
        return {r["process"]: int(r["pid"]) for r in self.processes() if r["alive"]}

    def stop(self, timeout: float = 10.0) -> dict[str, int]:
        """SIGTERM the workers, then the master; SIGKILL what is left after timeout. Each by its pid, and only
        while it is still the daemon started (its command line names its class). Returns what was killed."""
        targets = [(f"spark-{w['name']}", w.get("pid"), WORKER_CLASS) for w in self.state["workers"]]
        targets.append(("spark-master", self.state.get("master_pid"), MASTER_CLASS))
        # Executors are the workers' children: a worker killed (not stopped) may leave them behind.
        executors = [(f"executor-{c}", c) for _, pid, _ in targets if pid for c in _children(pid)]
        live = [(name, pid) for name, pid, cls in targets
                if pid and (pid in self._procs and self._procs[pid].poll() is None or _is_ours(pid, cls.encode()))]
        for _, pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        killed: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        for name, pid in live:
            if not self._wait_gone(pid, max(0.1, deadline - time.monotonic())):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._wait_gone(pid, 10.0)
                killed[name] = pid
        for name, pid in executors:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._wait_gone(pid, 10.0)
                killed[name] = pid
        self.state["master_pid"] = None
        for w in self.state["workers"]:
            w["pid"] = None
        if self.dir.exists():
            self._save()
        return killed

    def _wait_gone(self, pid: int, timeout: float) -> bool:
        return wait_gone(pid, timeout, self._procs.get(pid), poll_s=0.05)
