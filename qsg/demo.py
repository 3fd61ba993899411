"""cfemu demo: the end-to-end demonstration (what `make demo` runs).

A queue-sharing group of three queue-manager servers over an embedded CF works under the chaos suite's client
workload; a fuzzy backup of every structure is taken while it works; the CF's redis-server is killed (everything
in it is lost), restarted empty and every structure restored from its backup plus the merged logs; the clients
carry on through the same servers (no restart); then in-doubt work is resolved, every queue drained, and the
whole history checked by the chaos checker against what the clients were told (docs/chaos.md defines each
finding: lost, duplicated, phantom, atomicity, corrupted, order, resurrected, expired).

The demo is a scripted chaos run: the same workload, fault mechanisms, drain and checker as `cfemu chaos run`,
with two scripted faults (``backup``, then ``cf-kill``) instead of a seeded schedule, so that the two can never
disagree about what "nothing lost" means.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cfemu.clitools import Output, directory
from qsg.chaos.checker import FINDING_KINDS, MUST_BE_ZERO
from qsg.chaos.faults import COST_S, FaultSpec
from qsg.chaos.history import load_history
from qsg.chaos.options import ChaosOptions
from qsg.chaos.report import commit_times
from qsg.chaos.runner import run_chaos
from qsg.cli_common import Parser, run_verb, seconds, whole

WARMUP_S = 1.0


def demo_faults(work_s: float) -> list[FaultSpec]:
    """A backup under load after work_s seconds, the CF lost half a work phase later."""
    return [FaultSpec(1, round(WARMUP_S + work_s, 2), "backup", "", 0.0),
            FaultSpec(2, round(WARMUP_S + work_s * 1.5 + COST_S["backup"], 2), "cf-kill", "", 1.0)]


def run_demo(directory: Path, *, managers: int = 3, clients: int = 6, work_s: float = 6.0, seed: int = 1,
             console: Console | None = None, redis_cluster: int = 0) -> dict[str, Any]:
    """redis_cluster: the CF as a Redis Cluster of that many masters; the CF loss kills every one of them."""
    faults = demo_faults(work_s)
    duration = faults[-1].at + COST_S["cf-kill"] + work_s / 2
    opts = ChaosOptions(seed=seed, duration=duration, kinds=tuple(f.kind for f in faults), clients=clients,
                        managers=managers, lease_ms=3000, backup_interval=None, report_dir=directory,
                        redis_cluster=redis_cluster)
    summary = run_chaos(opts, console or Console(stderr=True), specs=faults)
    return demo_result(summary, load_history(directory / "history.jsonl"))


def demo_result(summary: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The demo's figures, from the chaos run's summary and history."""
    by_kind = {f["kind"]: f for f in summary["faults"]}
    backup, loss = by_kind.get("backup", {}), by_kind.get("cf-kill", {})
    recovered = loss.get("recovered")
    findings = summary["findings"]
    return {
        "operations": summary["operations"],
        "committed_uows": summary["committed_uows"],
        "messages_put": summary["messages_put"],
        "backup_entries": sum(v for k, v in backup.get("timings", {}).items() if k.endswith("_entries")),
        "restore_s": loss.get("timings", {}).get("restore_s"),
        "service_after_cf_loss_s": loss.get("service_s"),
        "commits_after_restore": sum(1 for t in commit_times(events) if recovered is not None and t > recovered),
        "drained": summary["extra"].get("drained", 0),
        "fault_errors": summary["fault_errors"],
        "stopped": summary["extra"].get("stopped", ""),  # why the run ended early (a structure left FAILED)
        **{k: findings.get(k, 0) for k in FINDING_KINDS},
        "findings": summary["finding_details"][:20],
        "report_dir": summary["report_dir"],
    }


def summary_table(r: dict[str, Any]) -> Table:
    t = Table(title="cfemu demo: queue-sharing group, fuzzy backup, CF lost, restored")
    t.add_column("what")
    t.add_column("count", justify="right")
    rows = [("operations", "client operations"), ("committed_uows", "units of work committed"),
            ("messages_put", "messages put"), ("backup_entries", "messages in the fuzzy backups"),
            ("restore_s", "restore after the CF loss (s)"), ("service_after_cf_loss_s", "CF loss to full service (s)"),
            ("commits_after_restore", "commits after the restore (no restart)"),
            ("drained", "messages drained at the end")]
    for key, label in rows:
        t.add_row(label, str(r[key]))
    for key in FINDING_KINDS:
        t.add_row(key.upper(), str(r[key]), style="bold red" if r[key] else None)
    return t


def failed(r: dict[str, Any]) -> bool:
    return bool(r["fault_errors"]) or any(r[k] for k in (*MUST_BE_ZERO, "resurrected", "expired"))


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="cfemu demo", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--managers", type=whole(1, 32), default=3)
    p.add_argument("--clients", type=whole(1), default=6)
    p.add_argument("--seed", type=int, default=1, help="the workload's seed (default 1)")
    p.add_argument("--seconds", type=seconds(above=True), default=8.0, help="length of the first work phase")
    p.add_argument("--quick", action="store_true", help="a short run (for tests)")
    p.add_argument("--dir", type=directory("--dir"), help="where the cluster and the report live (default: a temporary directory)")
    p.add_argument("--redis-cluster", type=whole(0, 16), default=0, metavar="N",
                   help="the CF as a Redis Cluster of N masters (3-16), the structures spread over them")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("-v", "--verbose", action="store_true", help="the traceback of an error")
    return p


def main(argv: list[str] | None = None) -> int:
    # The demo drives real processes: any failure of it is one line (the traceback with --verbose).
    return run_verb("cfemu demo", build_parser().parse_args(argv), cmd_demo, (Exception,))


def cmd_demo(args: argparse.Namespace, out: Output) -> int:
    if args.redis_cluster and not 3 <= args.redis_cluster <= 16:
        raise ValueError(f"--redis-cluster must be 3-16 masters, not {args.redis_cluster}")
    # Clients report failovers and refusals as warnings; the demo counts them in its table instead.
    logging.getLogger("sqm").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="cfemu-demo-") as tmp:
        result = run_demo(args.dir or Path(tmp), managers=args.managers, clients=args.clients,
                          work_s=3.0 if args.quick else args.seconds, seed=args.seed,
                          redis_cluster=args.redis_cluster)
    if out.as_json:
        print(json.dumps(result))
    else:
        out.print(summary_table(result))
        if result["fault_errors"]:
            out.line(f"faults that failed: {'; '.join(result['fault_errors'])}")
        if result["stopped"]:
            out.line(f"the demo stopped early: {result['stopped']}")
    return 1 if failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
