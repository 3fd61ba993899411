"""The Spark settings a driver needs to join this project's standalone Spark cluster (qsg.spark_standalone).

Spark standalone has no users: whoever reaches a master may run code on its workers. The project's cluster
therefore runs with spark.authenticate (a shared secret every daemon, executor and driver proves) and
spark.network.crypto.enabled (RPC encrypted with keys derived from it). The secret lives in the group's secrets
directory (cfemu.credentials.SPARK_SECRET_FILE, 0600). A driver gets it in its SparkConf, in process: never on a
command line. No pyspark import here: the launcher and the CLI use this without starting a JVM.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from cfemu import credentials

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def security_conf(secret: str) -> dict[str, str]:
    """What every daemon and driver of one cluster shares: authentication and encrypted RPC."""
    return {"spark.authenticate": "true", "spark.authenticate.secret": secret,
            "spark.network.crypto.enabled": "true"}


def driver_conf(master: str, secrets_dir: Path | None) -> dict[str, str]:
    """The settings for a driver of `master`: none for local[...] masters; for a spark:// master, the group's
    Spark secret when it has one, and loopback driver addresses when the master is on loopback (the executors
    connect back to the driver there, and nothing else can)."""
    if not master.startswith("spark://"):
        return {}
    conf: dict[str, str] = {}
    secret = credentials.spark_secret(secrets_dir) if secrets_dir is not None else None
    if secret:
        conf.update(security_conf(secret))
    host = urlsplit(master.split(",")[0]).hostname or ""
    if host in LOOPBACK:
        conf.update({"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"})
    return conf


MIB = 2**20
JVM_MIN = 512 * MIB  # below about this a Spark JVM refuses to start (its reserved memory is 300 MiB)
PYTHON_WORKER_MIN = 512 * MIB
RESULT_MIN = 32 * MIB
SPARK_RESERVED = 300 * MIB  # of a JVM's heap, what Spark keeps for itself (spark.testing.reservedMemory)


def _mib(n: int) -> str:
    return f"{n // MIB}m"


def memory_conf(master: str, memory: int) -> dict[str, str]:
    """The Spark memory settings derived from the restore's memory limit (`--memory-limit`, bytes). Spark has no
    limit of its own for the whole: these bound its parts.

    * Each JVM's heap (at least JVM_MIN): on a cluster the driver's and each executor's a quarter of the limit; in
      local[...] masters the driver's JVM is the executors too (it runs the tasks and keeps their persisted
      chunks), so it has three eighths. Its tasks write the plan into the driver's spill files themselves
      (restore.spill.TaskFiles): no fetch of the plan passes through it. When fetches did, a quarter there (512 MiB
      at 2 GiB) lost their results or ran out of heap at 400,000 messages of 1 KiB, and half left the process tree
      (the JVM beyond its heap, the Python workers, the driver) over the limit.
    * spark.driver.maxResultSize: a quarter of the heap beyond Spark's reserved memory, so that one fetch of the
      plan's results (restore.spark_fetch: half of it) is an eighth of what Spark may use there; the driver holds a
      fetch at least twice over while it serves it to Python.
    * Each Python worker's aggregation memory (at least PYTHON_WORKER_MIN: under 512m PySpark's shuffle writer
      thinks memory is short and flushes ever smaller batches, a 4x slowdown at 1M records): half of the limit on
      a cluster, a quarter in local[2]."""
    local = master.startswith("local")
    heap = max(JVM_MIN, memory * 3 // 8 if local else memory // 4)
    jvm = _mib(heap)
    conf = {"spark.driver.memory": jvm, "spark.executor.memory": jvm,
            "spark.driver.maxResultSize": _mib(max(RESULT_MIN, (heap - SPARK_RESERVED) // 4)),
            "spark.python.worker.memory": _mib(max(PYTHON_WORKER_MIN, memory // (4 if local else 2)))}
    if local:
        del conf["spark.executor.memory"]  # the driver's JVM runs the tasks
    return conf
