"""``cfemu chaos``: run the chaos suite against a local group of real processes.

    cfemu chaos run [--seed N] [--duration S] [--faults all|short|none|k1,k2] [--clients N] [--managers N]
    cfemu chaos soak --seeds 20 [--first-seed N] [--duration S] [--faults ...]
    cfemu chaos check HISTORY.jsonl          re-check a recorded history
    cfemu chaos kinds                        the fault kinds and what they do

Exit status: 0 no findings, 1 findings (or a fault that could not be carried out), 2 bad usage or a failure (one
line on stderr, the traceback with --verbose: cfemu.clitools.run_command). --json prints the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from rich.console import Console

from cfemu.clitools import Output, Parser, directory, lease_ms, run_command, seconds, whole
from qsg.chaos.checker import FINDING_KINDS, check
from qsg.chaos.faults import (
    CF_LINK_KINDS,
    CLUSTER_SHORT_KINDS,
    DUPLEX_KINDS,
    KINDS,
    ROWS,
    SHORT_KINDS,
    parse_kinds,
)
from qsg.chaos.history import load_history


def _kinds(text: str) -> tuple[str, ...]:
    try:
        return parse_kinds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


DAY_S = 86_400.0  # the longest a run's durations may be: a NaN, an infinity or 1e30 ran a workload without end


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="cfemu chaos", description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = p.add_subparsers(dest="command", required=True)
    common = Parser(add_help=False)
    common.add_argument("--duration", type=seconds(0, DAY_S, above=True), default=25.0, help="seconds of workload per seed (25)")
    common.add_argument("--faults", type=_kinds, default=parse_kinds("all"), metavar="KINDS",
                        help="all (default: every kind but the duplexed CF's), short, none, or a comma-separated "
                             "list (see 'cfemu chaos kinds')")
    common.add_argument("--clients", type=whole(1, 1000), default=8, help="client threads (8)")
    common.add_argument("--managers", type=whole(1, 9), default=3, help="SQM servers (3)")
    common.add_argument("--lease-ms", type=lease_ms, default=3000, help="SQM lease (3000)")
    common.add_argument("--backup-interval", type=seconds(0, DAY_S, above=True), default=4.0, help="seconds between backups (4)")
    common.add_argument("--dir", type=directory("--dir"), default=Path("var/chaos"), help="report directory (var/chaos)")
    common.add_argument("--keep-cluster", action="store_true", help="keep the cluster's logs and backups")
    common.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                        help="the CF as a Redis Cluster of N masters (3-16); without the cf-link kinds, and "
                             "'short' is then: " + ",".join(CLUSTER_SHORT_KINDS))
    common.add_argument("--serve-within", type=seconds(0, DAY_S, above=True), default=None, metavar="SECONDS",
                        help="every member must serve again this soon after each fault's heal (default per kind: "
                             "twice the lease + 20 s + the kind's allowance); later is a liveness finding")
    common.add_argument("--rest", action="store_true",
                        help="the REST kind in the workload's mix: every member serves the messaging REST API and "
                             "some client actions put and get through it (docs/chaos.md)")
    common.add_argument("--kombu", action="store_true",
                        help="the kombu kind in the workload's mix: some client actions publish and consume through "
                             "the kombu transport Celery applications use (docs/chaos.md)")
    common.add_argument("--json", action="store_true", help="print the summary as JSON")
    common.add_argument("-v", "--verbose", action="store_true", help="tracebacks and the suite's own log")
    run = sub.add_parser("run", parents=[common], help="one seed")
    run.add_argument("--seed", type=int, default=1)
    soak = sub.add_parser("soak", parents=[common], help="many seeds, every fault kind by default")
    soak.add_argument("--seeds", type=whole(1, 100_000), default=20, help="how many seeds (20)")
    soak.add_argument("--first-seed", type=int, default=1)
    chk = sub.add_parser("check", help="check a recorded history file")
    chk.add_argument("history", type=Path)
    chk.add_argument("--json", action="store_true", help="print the result as JSON")
    chk.add_argument("-v", "--verbose", action="store_true", help="the traceback of an error")
    kinds = sub.add_parser("kinds", help="list the fault kinds")
    kinds.add_argument("--json", action="store_true", help="the kinds as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The suite drives real processes: any failure of it is reported as one line (the traceback with --verbose).
    return run_command("cfemu chaos", args, cmd_chaos, (Exception,))


def cmd_chaos(args: argparse.Namespace, out: Output) -> int:
    console = Console(stderr=True)
    if args.command == "kinds":
        if args.json:
            out.json({"kinds": list(KINDS), "short": list(SHORT_KINDS), "duplex": list(DUPLEX_KINDS)})
        else:
            width = max(map(len, KINDS))
            print("\n".join(f"{k:<{width}}  {row.doc}" for k, row in ROWS.items()))
        return 0
    if args.command == "check":
        result = check(load_history(args.history))
        found = {"findings": result.summary(), "counts": result.counts,
                 "details": [f.to_json() for f in result.findings]}
        if args.json:
            print(json.dumps(found))
        else:
            for f in result.findings:
                print(f"{f.kind}: {', '.join(f.msgs)} {f.uow}: {f.detail}")
            print(json.dumps(found["findings"]))
        return 1 if result.findings else 0
    kinds = args.faults
    if args.redis_cluster:
        if not 3 <= args.redis_cluster <= 16:
            raise ValueError(f"--redis-cluster must be 3-16 masters, not {args.redis_cluster}")
        if kinds == SHORT_KINDS:
            kinds = CLUSTER_SHORT_KINDS
        elif kinds == KINDS:
            kinds = tuple(k for k in KINDS if k not in CF_LINK_KINDS)
        refused = [k for k in kinds if k in CF_LINK_KINDS]
        if refused:
            raise ValueError(f"fault kind {', '.join(refused)} needs a proxy between each SQM and the CF, which a "
                             "Redis Cluster CF cannot have (its clients follow the cluster to the nodes): leave it out")
    from qsg.chaos import report
    from qsg.chaos.runner import ChaosOptions, run_chaos, run_soak

    # The clients log every failover as a warning; the history and the report have them all.
    logging.basicConfig(level=logging.INFO if args.verbose else logging.CRITICAL)
    opts = ChaosOptions(duration=args.duration, kinds=kinds, clients=args.clients, managers=args.managers,
                        lease_ms=args.lease_ms, backup_interval=args.backup_interval, report_dir=args.dir,
                        keep_cluster=args.keep_cluster, redis_cluster=args.redis_cluster,
                        serve_within_s=args.serve_within, rest=args.rest, kombu=args.kombu)
    if args.command == "run":
        opts.seed = args.seed
        summary = run_chaos(opts, console)
        if args.json:
            print(json.dumps({k: v for k, v in summary.items() if k != "finding_details"}))
        else:
            out.print(report.summary_table(summary))
            console.print(f"report: {args.dir / 'report.md'}")
        return 0 if summary["ok"] and not summary["fault_errors"] else 1
    soak = run_soak(opts, list(range(args.first_seed, args.first_seed + args.seeds)), console)
    if args.json:
        print(json.dumps({k: v for k, v in soak.items() if k != "runs"}))
    else:
        out.print(report.soak_table(soak))
        console.print(f"report: {args.dir / 'soak.md'}")
    bad = any(soak["findings"][k] for k in FINDING_KINDS)
    return 1 if bad or soak["fault_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
