"""The local launcher's CF as a Redis Cluster (``cfemu cluster up --redis-cluster N``): N masters in cluster mode
(cfemu.embedded_rcluster), each structure on the master of its slot, recorded in cluster.json under ``cf``:

    "cf": {"dir": ".../cf", "redis_cluster": 3, "nodes": [{"name": "node-0", "port": 30001, "pid": 123}, ...],
           "pid": <a running node's pid, or null when none runs>}

The cluster's URL (``redis+cluster://HOST:PORT/?node=...``, no credentials: each command adds its role's from the
secrets directory) is the cluster's redis_url. The supervisor (qsg.local_group) restarts a dead node, empty, on its
port: the structures it held are FAILED until a member restores them (RECAUTO), the other masters serve theirs
meanwhile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cfemu.embedded_rcluster import EmbeddedCluster
from cfemu.procs import CF_SERVER_MARKERS

KEY = "redis_cluster"  # in cluster.json's "cf": the number of masters (absent: a single redis-server)


def is_cluster_cf(cf_state: dict[str, Any]) -> bool:
    return bool(cf_state.get(KEY))


def embedded(cf_state: dict[str, Any], secrets_dir: Path, host: str, detach: bool) -> EmbeddedCluster:
    """The EmbeddedCluster of the recorded nodes (their ports), or a new one (fresh ports) when none is recorded."""
    ports = [int(n["port"]) for n in cf_state.get("nodes") or []] or None
    return EmbeddedCluster(Path(cf_state["dir"]), masters=int(cf_state[KEY]), ports=ports, secrets_dir=secrets_dir,
                           host=host, detach=detach).adopt()


def record(cf_state: dict[str, Any], cl: EmbeddedCluster) -> str:
    """Write the nodes' ports and pids into the cf state; returns the cluster URL (without credentials)."""
    pids = cl.pids()
    cf_state["nodes"] = [{"name": n, "port": cl.ports[n], "pid": pids[n]} for n in cl.nodes]
    cf_state["pid"] = next((p for p in pids.values() if p), None)
    return cl.bare_url()


def alive(cf_state: dict[str, Any], runs: Any) -> bool:
    """Every node runs (runs(pid, marker) -> bool: qsg.local_group's check that a pid is that process)."""
    nodes = cf_state.get("nodes") or []
    return bool(nodes) and all(runs(n.get("pid"), CF_SERVER_MARKERS) for n in nodes)


def status_rows(cf_state: dict[str, Any], cl: EmbeddedCluster | None) -> list[dict[str, Any]]:
    """One status row per node: its address, pid, role (master/replica/down) and slot ranges."""
    if cl is None:
        return []
    return [{"process": f"CF {row['name']}", "pid": row["pid"], "alive": row["running"], "address": row["address"],
             "role": row["role"], "slots": [f"{lo}-{hi}" for lo, hi in row["slots"]], "ready": row["running"]}
            for row in cl.status()]
