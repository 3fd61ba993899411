"""The ``sqm`` command: run a shared queue manager as a server, print logs.

    sqm run --name QM1 --port 7001 --redis-url redis://127.0.0.1:6379/0 --log-root var/logs
    sqm log print --all          the merged log of every member (sqm.logprint)

The CF, the log root and the token are found as by every command (cfemu.settings): the flag, else $REDIS_URL,
$CFEMU_LOG_ROOT, $SQM_TOKEN, else the nearest 'cfemu cluster' directory, else the CF of 'cfemu cf start', else
var/logs. Errors are one line on stderr (exit 2); --verbose adds the traceback. ``sqm run`` exits with the
server's status (sqm.service.server: 3 fenced, 4 log failed); its --json writes its log lines as JSON.

``sqm run`` recovers a failed structure defined with RECAUTO (sqm.core.recauto) when run as the ``sqm`` command
(qsg.member: restore wired in), from the backups under --backup-dir ($CFEMU_BACKUP_DIR, the cluster's, else
var/backups); ``python -m sqm.cli run`` has no restore and leaves such structures to the operator.

``sqm run`` authenticates every connection (docs/security.md): it needs the application token (--token,
$SQM_TOKEN, the group's service.token) and takes the operator's too ($SQM_OPERATOR_TOKEN, operator.token); with
neither it refuses to start, unless --no-auth, which is refused on a non-loopback address.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

from cfemu.clitools import (
    EXIT_USAGE,
    MAX_MS,
    MAX_SECONDS,
    CLIError,
    Output,
    Parser,
    add_settings_arguments,
    cf_name,
    configure_logging,
    input_file,
    lease_ms,
    number,
    output_file,
    require_url,
    run_command,
    seconds,
    settings,
    whole,
)
from cfemu.limits import MAX_MSG_LENGTH
from cfemu.settings import Settings, operator_token
from sqm.core.recauto import RecoverStructure
from sqm.core.scans import DEFAULT_SCAN_SLOTS, MAX_SCAN_SLOTS
from sqm.core.storereport import DEFAULT_NAME, REPORT_ENV, report_path
from sqm.logadmin import add_log_admin_parsers
from sqm.logprint import LOG_ERRORS, add_log_parser
from sqm.request_slots import LEASE_S, MAX_SLOTS, default_slots
from sqm.service.config import MAX_REST_WORKERS
from sqm.service.protocol import DEFAULT_MAX_FRAME, MAX_FRAME, MIN_FRAME
from sqm.service.server import ServerConfig, StartFailed, is_loopback_host, serve

# The ranges of sqm run's numbers, checked as the command line is parsed: a value out of its range (NaN and
# infinity included) is one line naming the option and the value, exit status 2, before anything is opened or
# written. An upper bound is where a larger value can only be a mistake, or would break later, once the member has
# joined its group.
PORT = whole(0, 65535)  # 0: any free port
# Connections at once (the service's, the REST and metrics doors'): the kernel's default ceiling on one process's
# open files (fs.nr_open); more could never be open.
CONNECTIONS = whole(1, 2**20)
MAX_CF_CONNECTIONS = 10_000  # redis-server's default maxclients: the CF would refuse more
MAX_LOGLOAD = 16_000_000  # IBM MQ's own upper bound of LOGLOAD
# A segment's capacity is a 32-bit field of its header (sqm.log.format): a segment must stay below 4 GiB.
MAX_SEGMENT_MIB = 4095
MAX_LOG_RING = 100_000  # segments in a circular log's ring: 6 TiB at the default 64 MiB a segment
MAX_CPL_ENTRIES = 1000  # checkpoints the CPL keeps: restart and CF recovery read back as many intervals of log
MAX_REQUEST_BUDGET = 2**40  # bytes of requests in flight on one member: a TiB of memory is more than it has

NO_TOKEN = ("no service token found (--token, $SQM_TOKEN, or service.token in the group's secrets directory: "
            "$CFEMU_SECRETS_DIR, the cluster's or the CF's): make one with 'cfemu secrets init --dir DIR' and set "
            "CFEMU_SECRETS_DIR=DIR, or run the queue manager in a cluster ('cfemu cluster up'); --no-auth runs "
            "without authentication, on a loopback address only")


def add_run_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("run", help="run a shared queue manager as a network service",
                              description="Run one SQM: a TCP server (msgpack frames) in front of a queue "
                                          "manager. SIGTERM/SIGINT shut it down gracefully with a checkpoint; "
                                          "exit code 3 means peer recovery fenced it (restart it).")
    p.add_argument("--name", required=True, type=cf_name("member"), help="queue manager name (its log is LOG_ROOT/NAME)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=PORT, default=0, help="TCP port (0: any free port, see --ready-file)")
    add_settings_arguments(p, "redis_url", "log_root", "token", "cluster_dir", "cf_dir", "backup_dir",
                           "log_archive_dir", "max_umsgs")
    p.add_argument("--log-mode", choices=("linear", "circular"), default="linear",
                   help="linear (default): inactive log segments are archived, then removed from the active log; "
                        "circular: a fixed ring of --log-ring segments reused once inactive")
    p.add_argument("--log-ring", type=whole(3, MAX_LOG_RING), default=8,
                   help=f"segments in a circular log's ring (default 8; 3-{MAX_LOG_RING})")
    p.add_argument("--log-segment-mb", type=number(0, MAX_SEGMENT_MIB, above=True), default=64.0,
                   help=f"log segment size in MiB (default 64; above 0, at most {MAX_SEGMENT_MIB})")
    p.add_argument("--checkpoint-interval", type=seconds(0, MAX_SECONDS), default=300.0,
                   help="also take a checkpoint every N seconds (default 300; 0: only by LOGLOAD and log space)")
    p.add_argument("--cpl-entries", type=whole(0, MAX_CPL_ENTRIES), default=3,
                   help="n, the checkpoints the Checkpoint Positioning List keeps: a live message's newest copy is "
                        "never older than n checkpoint intervals (default 3; 0: no relogging)")
    p.add_argument("--pstore-report", choices=("YES", "NO"), default="NO",
                   help="YES: report every persistent record created or deleted, one JSON line each (seed 004's "
                        f"PSTORE-REPORT), to --pstore-report-file, else ${REPORT_ENV}, else {DEFAULT_NAME} in the "
                        "current directory (docs/pstore.md)")
    p.add_argument("--pstore-report-file", type=output_file, metavar="FILE",
                   help="the running store report's file (its directory must exist)")
    p.add_argument("--tls-cert", type=input_file, help="server certificate (PEM) for TLS")
    p.add_argument("--tls-key", type=input_file, help="server private key (PEM)")
    p.add_argument("--tls-ca", type=input_file, help="CA (PEM) for client certificates: turns on mutual TLS")
    p.add_argument("--no-auth", action="store_true",
                   help="no authentication: every connection is an operator (refused on a non-loopback --host)")
    p.add_argument("--auth-timeout", type=seconds(0, MAX_SECONDS, above=True), default=5.0,
                   help="seconds a connection has to authenticate before it is closed (default 5)")
    p.add_argument("--idle-timeout", type=seconds(0, MAX_SECONDS), default=3600.0,
                   help="close an authenticated connection idle this many seconds; its open UOW is backed out "
                        "(default 3600; 0: never)")
    p.add_argument("--max-connections", type=CONNECTIONS, default=512, help="connections at once (default 512)")
    p.add_argument("--max-connections-per-peer", type=CONNECTIONS, default=128,
                   help="connections at once from one address (default 128)")
    p.add_argument("--max-unauthenticated", type=CONNECTIONS, default=64,
                   help="connections at once that have not authenticated yet (default 64)")
    p.add_argument("--max-request-bytes-per-member", type=whole(MIN_FRAME, MAX_REQUEST_BUDGET), default=None,
                   help="bytes of requests in flight at once on this member: a frame over 64 KiB reserves its "
                        "length before its body is read, waits up to --request-budget-wait for it, else is refused with "
                        "MQRC_DATA_LENGTH_ERROR (default: the larger of 256 MiB and 4 frames of --max-frame; at least "
                        "--max-frame)")
    p.add_argument("--request-budget-wait", type=seconds(0, MAX_SECONDS), default=5.0,
                   help="seconds a large request waits for --max-request-bytes-per-member before it is refused "
                        "(default 5)")
    p.add_argument("--metrics-port", type=PORT, default=None,
                   help="HTTP port for /healthz, /readyz and /metrics (0: any free port; default: none)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the HTTP port (default 127.0.0.1: it has no authentication; another address "
                        "lets whoever reaches it read queue names, depths and counters, and is logged)")
    p.add_argument("--rest-port", type=PORT, default=None,
                   help="HTTP(S) port of the IBM MQ messaging REST API (docs/rest.md; 0: any free port; default: "
                        "off); authenticated with the service's tokens, TLS with --tls-cert/--tls-key")
    p.add_argument("--rest-host", default="127.0.0.1",
                   help="address of the REST port (default 127.0.0.1; another address is reachable from the "
                        "network: give it TLS)")
    p.add_argument("--rest-max-body", type=whole(1, MAX_MSG_LENGTH), default=4 * 2**20,
                   help="longest message body a REST put takes, bytes (default 4 MiB)")
    p.add_argument("--rest-workers", type=whole(1, MAX_REST_WORKERS), default=32,
                   help="threads carrying out REST requests that do not wait (puts, browses, gets without wait), and "
                        "as many again for gets that wait: at most N wait at once, at most half of them from one "
                        "address; the others wait in line for no longer than their wait (default 32)")
    p.add_argument("--http-head-timeout", type=seconds(0, MAX_SECONDS, above=True), default=10.0,
                   help="seconds a new REST or metrics connection has to send a whole request head, else it is "
                        "closed (default 10)")
    p.add_argument("--rest-keepalive-timeout", type=seconds(0, MAX_SECONDS, above=True), default=30.0,
                   help="seconds a REST connection may stay idle between requests (default 30)")
    p.add_argument("--rest-max-connections", type=CONNECTIONS, default=256,
                   help="REST connections open at once; past it one without a request under way is closed to "
                        "make room for a new one (default 256)")
    p.add_argument("--rest-max-connections-per-peer", type=CONNECTIONS, default=64,
                   help="REST connections open at once from one address; past it a new one is closed at once "
                        "(default 64)")
    p.add_argument("--metrics-max-connections", type=CONNECTIONS, default=32,
                   help="metrics-port connections open at once; past it one without a whole request head is "
                        "closed to make room for a new one (default 32)")
    p.add_argument("--metrics-max-connections-per-peer", type=CONNECTIONS, default=8,
                   help="metrics-port connections open at once from one address; past it a new one is closed at "
                        "once (default 8)")
    p.add_argument("--metrics-cache", type=seconds(0, MAX_SECONDS), default=1.0,
                   help="seconds a collected /metrics page is served again before the next collection (default 1; "
                        "0: collect for every scrape, one at a time)")
    p.add_argument("--lease-ms", type=lease_ms, default=5000,
                   help="lease in the admin structure (default 5000; at least 500)")
    p.add_argument("--cf-connections", type=whole(4, MAX_CF_CONNECTIONS), default=64,
                   help="connections to the CF; more concurrent requests wait for one (default 64)")
    p.add_argument("--request-slots", type=whole(1, MAX_SLOTS), default=default_slots(),
                   help="requests doing their work at once, each up to its first wait (for the log, a message); "
                        f"the others wait for a slot (default: CPUs + 1, here {default_slots()}; at most {MAX_SLOTS})")
    p.add_argument("--scan-slots", type=whole(1, MAX_SCAN_SLOTS), default=DEFAULT_SCAN_SLOTS,
                   help="calls of multi-call scans (browse pages, peek scans) this member has in the CF at once; the "
                        "others wait for a slot, so that many browsers at once cannot keep the CF busy (default "
                        f"{DEFAULT_SCAN_SLOTS}; at most {MAX_SCAN_SLOTS})")
    p.add_argument("--slot-lease-ms", type=whole(1, MAX_MS), default=int(LEASE_S * 1000),
                   help="a request that holds its slot this long counts as waiting (on a slow CF, a lock), and a "
                        f"queued request takes the slot back (default {int(LEASE_S * 1000)})")
    p.add_argument("--thread-per-connection", action="store_true",
                   help="serve each authenticated plain connection by its own thread, each request alone, rather "
                        "than by the event loop that runs the puts and gets outside syncpoint arriving together as "
                        "one batch (one CF round trip, one fsync; docs/service.md)")
    p.add_argument("--logload", type=whole(1, MAX_LOGLOAD), default=10000,
                   help="LOGLOAD: take a checkpoint every N log records (default 10000)")
    p.add_argument("--max-frame", type=whole(MIN_FRAME, MAX_FRAME), default=DEFAULT_MAX_FRAME,
                   help=f"longest frame accepted or sent after hello, bytes ({MIN_FRAME}-{MAX_FRAME}; the default "
                        "carries any message a queue can hold; less refuses longer messages)")
    p.add_argument("--shutdown-grace", type=seconds(0, MAX_SECONDS), default=10.0,
                   help="seconds in-flight requests get at shutdown (default 10)")
    p.add_argument("--cf-wait", type=seconds(0, MAX_SECONDS), default=30.0,
                   help="seconds to wait for the CF at start (default 30)")
    p.add_argument("--ready-file", type=output_file,
                   help="write {pid, port, metrics_port, rest_port} here once serving (its directory must exist)")
    p.add_argument("--clock-skew-ms", type=whole(-MAX_MS, MAX_MS), default=0,
                   help="skew this member's LRSN clock source by N ms (tests; the OS clock is not touched)")
    p.add_argument("--json", action="store_true", help="log lines as JSON objects")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace, out: Output) -> int:
    # Each number's own range is the parser's (the argument types above); what is left is one option against another.
    budget = args.max_request_bytes_per_member
    if budget is not None and budget < args.max_frame:
        raise CLIError(f"--max-request-bytes-per-member must be at least --max-frame ({args.max_frame}), not {budget}")
    if args.no_auth and not is_loopback_host(args.host):
        raise CLIError(f"--no-auth is refused on --host {args.host}, which is not a loopback address: anyone who "
                       "reaches it could do anything; run with the group's tokens instead")
    found = settings(args)
    max_umsgs = found.max_umsgs()
    url = require_url(found)
    op_token = operator_token(found)
    if not args.no_auth and not (found.token or op_token):
        raise CLIError(NO_TOKEN)
    pstore_report = pstore_report_file(args)
    configure_logging(args.verbose, as_json=out.as_json)
    recovery = args.recovery(args, found) if args.recovery is not None else None
    return serve(ServerConfig(
        name=args.name, log_root=found.log_root, redis_url=url, host=args.host, port=args.port,
        token=found.token, operator_token=op_token, auth=not args.no_auth, auth_timeout_s=args.auth_timeout,
        idle_timeout_s=args.idle_timeout, max_connections=args.max_connections,
        max_connections_per_peer=args.max_connections_per_peer, max_unauthenticated=args.max_unauthenticated,
        max_request_bytes=args.max_request_bytes_per_member, request_budget_wait_s=args.request_budget_wait,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, rest_port=args.rest_port,
        rest_host=args.rest_host, rest_max_body=args.rest_max_body, rest_workers=args.rest_workers, lease_ms=args.lease_ms,
        http_head_timeout_s=args.http_head_timeout, rest_keepalive_timeout_s=args.rest_keepalive_timeout,
        rest_max_connections=args.rest_max_connections,
        rest_max_connections_per_peer=args.rest_max_connections_per_peer,
        metrics_max_connections=args.metrics_max_connections,
        metrics_max_connections_per_peer=args.metrics_max_connections_per_peer, metrics_cache_s=args.metrics_cache,
        cf_connections=args.cf_connections, request_slots=args.request_slots, slot_lease_ms=args.slot_lease_ms,
        scan_slots=args.scan_slots,
        event_loop=not args.thread_per_connection,
        logload=args.logload, max_umsgs=max_umsgs, max_frame=args.max_frame, log_mode=args.log_mode, log_ring=args.log_ring,
        log_archive_dir=found.log_archive_dir, segment_bytes=max(4096, int(args.log_segment_mb * 2**20)),
        checkpoint_interval_s=args.checkpoint_interval, cpl_entries=args.cpl_entries,
        shutdown_grace_s=args.shutdown_grace, cf_wait_s=args.cf_wait, ready_file=args.ready_file,
        clock_skew_ms=args.clock_skew_ms, recover_structure=recovery,
        pstore_report=pstore_report))


def pstore_report_file(args: argparse.Namespace) -> Path | None:
    """The running store report's file (--pstore-report YES), or None. A file from $CFEMU_PSTORE_REPORT is checked as
    --pstore-report-file is (its directory exists): refused at start, not once the member has joined its group."""
    if args.pstore_report != "YES":
        return None
    path = report_path(args.pstore_report_file)
    if args.pstore_report_file is None:
        try:
            output_file(str(path))
        except argparse.ArgumentTypeError as e:
            raise CLIError(f"${REPORT_ENV}: {e}") from None
    return path.absolute()


# How the composition root gives ``sqm run`` its automatic structure recovery (RECAUTO, sqm.core.recauto): from the
# parsed command line and the resolved settings, the restore the member runs (None: none). sqm cannot import
# restore (a higher floor); the ``sqm`` console script is qsg.member.main, which passes one.
RecoveryFactory = Callable[[argparse.Namespace, Settings], RecoverStructure | None]


def build_parser(recovery: RecoveryFactory | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog="sqm", description="Shared queue manager (SQM) commands.")
    # The sub-parsers are Parsers too (one-line usage errors); the helpers that add them take any ArgumentParser's.
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
               parser.add_subparsers(dest="command", required=True))
    add_run_parser(sub)
    add_log_admin_parsers(add_log_parser(sub))  # sqm log print | status | archive | prune
    parser.set_defaults(cf_role="member", recovery=recovery)  # cf_role: the CF user (cfemu.credentials)
    return parser


def main(argv: list[str] | None = None, *, recovery: RecoveryFactory | None = None) -> int:
    """``python -m sqm.cli``: a member without automatic structure recovery (RECAUTO structures wait for an
    operator). The ``sqm`` command is qsg.member.main, this with restore wired in."""
    args = build_parser(recovery).parse_args(argv)
    return run_command("sqm", args, args.func, (*LOG_ERRORS, StartFailed),
                       exit_code=lambda e: e.code if isinstance(e, StartFailed) else EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
