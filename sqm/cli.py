"""The ``sqm`` command: run a shared queue manager as a server, print logs.

    sqm run --name QM1 --port 7001 --redis-url redis://127.0.0.1:6379/0 --log-root ./var/logs
    sqm log print --all          the merged log of every member (sqm.logprint)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sqm.logprint import add_log_parser, run_log_command
from sqm.service.protocol import DEFAULT_MAX_FRAME
from sqm.service.server import EXIT_CONFIG, ServerConfig, configure_logging, serve


def add_run_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("run", help="run a shared queue manager as a network service",
                              description="Run one SQM: a TCP server (msgpack frames) in front of a queue "
                                          "manager. SIGTERM/SIGINT shut it down gracefully with a checkpoint; "
                                          "exit code 3 means peer recovery fenced it (restart it).")
    p.add_argument("--name", required=True, help="queue manager name (its log is LOG_ROOT/NAME)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="TCP port (0: any free port, see --ready-file)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="the CF (default $REDIS_URL)")
    p.add_argument("--log-root", type=Path, default=Path(os.environ.get("CFEMU_LOG_ROOT", "var/logs")),
                   help="directory holding every member's log (default $CFEMU_LOG_ROOT or var/logs)")
    p.add_argument("--token", default=os.environ.get("SQM_TOKEN"),
                   help="shared secret clients must send first (default $SQM_TOKEN)")
    p.add_argument("--tls-cert", help="server certificate (PEM) for TLS")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--tls-ca", help="CA (PEM) for client certificates: turns on mutual TLS")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP port for /healthz, /readyz and /metrics (0: any free port; default: none)")
    p.add_argument("--lease-ms", type=int, default=5000, help="lease in the admin structure (default 5000)")
    p.add_argument("--logload", type=int, default=10000,
                   help="LOGLOAD: take a checkpoint every N log records (default 10000)")
    p.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME, help="largest frame accepted, bytes")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds in-flight requests get at shutdown (default 10)")
    p.add_argument("--cf-wait", type=float, default=30.0, help="seconds to wait for the CF at start")
    p.add_argument("--ready-file", type=Path, help="write {pid, port, metrics_port} here once serving")
    p.add_argument("--clock-skew-ms", type=int, default=0,
                   help="skew this member's LRSN clock source by N ms (tests; the OS clock is not touched)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run_command(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    if not args.redis_url:
        print("sqm run: no CF address: pass --redis-url or set $REDIS_URL", file=sys.stderr)
        return EXIT_CONFIG
    if args.lease_ms < 500 or args.max_frame < 1024 or args.logload < 1:
        print("sqm run: --lease-ms must be >= 500, --max-frame >= 1024 and --logload >= 1", file=sys.stderr)
        return EXIT_CONFIG
    return serve(ServerConfig(
        name=args.name, log_root=args.log_root, redis_url=args.redis_url, host=args.host, port=args.port,
        token=args.token, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        metrics_port=args.metrics_port, lease_ms=args.lease_ms, logload=args.logload, max_frame=args.max_frame,
        shutdown_grace_s=args.shutdown_grace, cf_wait_s=args.cf_wait, ready_file=args.ready_file,
        clock_skew_ms=args.clock_skew_ms))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sqm", description="Shared queue manager (SQM) commands.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_parser(sub)
    add_log_parser(sub)  # sqm log print
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_command(args)
    if args.command == "log":
        return run_log_command(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
