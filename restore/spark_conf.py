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
RESULT_MIN = 64 * MIB


def _mib(n: int) -> str:
    return f"{n // MIB}m"


def memory_conf(master: str, memory: int) -> dict[str, str]:
    """The Spark memory settings derived from the restore's memory limit (`--memory-limit`, bytes): the driver's
    JVM heap and each executor's a quarter of it (at least JVM_MIN; in local[...] masters the executors are the
    driver's JVM); spark.driver.maxResultSize an eighth, so that one fetch of the plan's results
    (restore.spark_fetch: half of it) stays a sixteenth of the limit in the driver; and each Python worker's
    aggregation memory half of it (at least PYTHON_WORKER_MIN: a worker holds the broadcast outcomes and one
    partition's groups, and under 512m PySpark's shuffle writer thinks memory is short and flushes ever smaller
    batches, a 4x slowdown at 1M records). Spark has no limit of its own for the whole: these bound its parts."""
    jvm = _mib(max(JVM_MIN, memory // 4))
    conf = {"spark.driver.memory": jvm, "spark.executor.memory": jvm,
            "spark.driver.maxResultSize": _mib(max(RESULT_MIN, memory // 8)),
            "spark.python.worker.memory": _mib(max(PYTHON_WORKER_MIN, memory // 2))}
    if master.startswith("local"):
        del conf["spark.executor.memory"]  # the driver's JVM runs the tasks
    return conf
