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
