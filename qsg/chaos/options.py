"""The options of one chaos run (seed, duration, fault kinds, group size), shared by the runner and the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class ChaosOptions:
    seed: int = 1
    duration: float = 25.0  # seconds of workload (faults included); healing, draining and checking come after
    kinds: tuple[str, ...] = ()
    clients: int = 8
    managers: int = 3
    lease_ms: int = 3000
    backup_interval: float | None = 4.0  # None: no backup scheduler (the demo takes its backup as a fault)
    report_dir: Path = Path("var/chaos")
    keep_cluster: bool = False
    redis_cluster: int = 0  # the CF as a Redis Cluster of this many masters (0: one redis-server)
    serve_within_s: float | None = None  # every member serves again this soon after each fault's heal (None: per kind)
    rest: bool = False  # the workload's mix has the REST kind: puts and gets through the members' REST doors
    kombu: bool = False  # the workload's mix has the kombu kind: publishes and deliveries through the kombu transport

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["report_dir"] = str(self.report_dir)
        d["kinds"] = list(self.kinds)
        return d
