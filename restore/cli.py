"""cfrestore: RECOVER CFSTRUCT.

  cfrestore run STRUCTURE [--backup ID] [--engine local|spark] [--dry-run] [--mark-failed] [--report FILE]
                                              rebuild a failed structure from a backup plus every member's log
  cfrestore plan STRUCTURE [--backup ID]      what run would do (= run --dry-run): touches nothing
  cfrestore purge STRUCTURE [--mark-failed]   RECOVER CFSTRUCT TYPE(PURGE): empty it and make it usable again
  cfrestore mark-failed STRUCTURE             fail an ACTIVE structure (work on it then fails: MQRC_CF_STRUC_FAILED)
  cfrestore archive --archive-dir DIR         copy the closed log segments to Parquet (docs/spark.md)
  cfrestore audit ENTRY_ID --archive-dir DIR  where did message ENTRY_ID go? its records in the archive

Spark engine options (docs/spark.md): --master URL (default local[*]), --conf KEY=VALUE (repeatable),
--archive-dir DIR (read archived segments from there).

Options: --redis-url (default $REDIS_URL), --backup-dir (default $CFEMU_BACKUP_DIR or ./var/backups),
--log-root (default $CFEMU_LOG_ROOT or ./var/logs), --json (machine-readable output). Errors are one line on
stderr (exit 2); --verbose adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from backup.files import BackupError
from cfemu.admin import Admin, AdminError
from cfemu.clitools import run_command
from cfemu.connection import ConnectionConfigError, connect
from cfemu.errors import MQError
from restore.engine import engine_names
from restore.load import LoadVerifyError
from restore.report import PhaseBars, purge_summary, summary
from restore.run import RestoreError, run_purge, run_restore
from sqm.log import LogCorruptError, LogFormatError

ENV_BACKUP_DIR = "CFEMU_BACKUP_DIR"
ENV_LOG_ROOT = "CFEMU_LOG_ROOT"
DEFAULT_BACKUP_DIR = "./var/backups"
DEFAULT_LOG_ROOT = "./var/logs"

EXPECTED_ERRORS = (RestoreError, BackupError, LogCorruptError, LogFormatError, LoadVerifyError, MQError,
                   AdminError, ValueError, ConnectionConfigError, OSError, redis.exceptions.RedisError)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, sort_keys=True, default=str))


def cmd_run(args: argparse.Namespace, console: Console, *, dry_run: bool = False) -> int:
    client = connect(args.redis_url)
    with PhaseBars(console, disabled=args.json or not console.is_terminal) as bars:
        result = run_restore(client, args.structure, backup_root=Path(args.backup_dir),
                             log_root=Path(args.log_root), backup_id=args.backup, engine=args.engine,
                             dry_run=dry_run or args.dry_run, mark_failed=args.mark_failed, progress=bars,
                             report_path=Path(args.report) if args.report else None,
                             engine_options=_engine_options(args))
    if args.json:
        _print_json(result.to_json())
    else:
        console.print(summary(result, console))
    return 0


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine != "spark":
        return {}
    options: dict[str, Any] = {"master": args.master, "conf": dict(args.conf)}
    if args.archive_dir:
        options["archive_dir"] = Path(args.archive_dir)
    return options


def _key_value(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"--conf expects KEY=VALUE, not {text!r}")
    return key, value


def cmd_archive(args: argparse.Namespace, console: Console) -> int:
    from restore.archive import archive_command

    return archive_command(Path(args.log_root), Path(args.archive_dir), console, as_json=args.json)


def cmd_audit(args: argparse.Namespace, console: Console) -> int:
    from restore.archive import audit_command

    return audit_command(Path(args.archive_dir), args.entry_id, console, as_json=args.json)


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    return cmd_run(args, console, dry_run=True)


def cmd_purge(args: argparse.Namespace, console: Console) -> int:
    result = run_purge(connect(args.redis_url), args.structure, mark_failed=args.mark_failed)
    if args.json:
        _print_json(vars(result))
    else:
        console.print(purge_summary(result, console))
    return 0


def cmd_mark_failed(args: argparse.Namespace, console: Console) -> int:
    admin = Admin(connect(args.redis_url))
    before = admin.state(args.structure)
    admin.set_state(args.structure, "FAILED")
    if args.json:
        _print_json({"structure": args.structure, "state_before": before, "state": "FAILED"})
    else:
        console.print(f"structure {args.structure}: {before} -> FAILED")
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="the CF (default $REDIS_URL)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--verbose", "-v", action="store_true", help="show the traceback of an error")
    restore = argparse.ArgumentParser(add_help=False)
    restore.add_argument("structure")
    restore.add_argument("--backup-dir", default=os.environ.get(ENV_BACKUP_DIR, DEFAULT_BACKUP_DIR),
                         help=f"backup root (default ${ENV_BACKUP_DIR} or {DEFAULT_BACKUP_DIR})")
    restore.add_argument("--log-root", default=os.environ.get(ENV_LOG_ROOT, DEFAULT_LOG_ROOT),
                         help=f"the members' logs (default ${ENV_LOG_ROOT} or {DEFAULT_LOG_ROOT})")
    restore.add_argument("--backup", metavar="ID", help="restore from this backup (default: the latest good one)")
    restore.add_argument("--engine", default="local", choices=engine_names(), help="planning engine")
    restore.add_argument("--report", metavar="FILE",
                         help="report file (default <backup-dir>/<structure>/restore-<time>.json)")
    restore.add_argument("--mark-failed", action="store_true",
                         help="fail the structure first when it is ACTIVE (its current content is replaced)")
    restore.add_argument("--master", default="local[*]", help="spark engine: the Spark master URL")
    restore.add_argument("--conf", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                         help="spark engine: a Spark setting (repeatable)")
    restore.add_argument("--archive-dir", help="spark engine: read archived log segments from this directory")

    p = argparse.ArgumentParser(prog="cfrestore", description="Restore CF structures (RECOVER CFSTRUCT).")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    run = sub.add_parser("run", parents=[common, restore], help="restore a structure from a backup and the logs")
    run.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    run.set_defaults(func=cmd_run)
    plan = sub.add_parser("plan", parents=[common, restore], help="print what run would do; change nothing")
    plan.set_defaults(func=cmd_plan, dry_run=True)
    purge = sub.add_parser("purge", parents=[common], help="empty a failed structure and make it usable again")
    purge.add_argument("structure")
    purge.add_argument("--mark-failed", action="store_true", help="purge an ACTIVE structure too")
    purge.set_defaults(func=cmd_purge)
    mark = sub.add_parser("mark-failed", parents=[common], help="fail an ACTIVE structure")
    mark.add_argument("structure")
    mark.set_defaults(func=cmd_mark_failed)
    archive = sub.add_parser("archive", parents=[common], help="copy closed log segments to Parquet")
    archive.add_argument("--log-root", default=os.environ.get(ENV_LOG_ROOT, DEFAULT_LOG_ROOT),
                         help=f"the members' logs (default ${ENV_LOG_ROOT} or {DEFAULT_LOG_ROOT})")
    archive.add_argument("--archive-dir", required=True, help="where the Parquet files go")
    archive.set_defaults(func=cmd_archive)
    audit = sub.add_parser("audit", parents=[common], help="where did a message go? (from the archive)")
    audit.add_argument("entry_id")
    audit.add_argument("--archive-dir", required=True, help="the archive (cfrestore archive)")
    audit.set_defaults(func=cmd_audit)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("cfrestore", args, args.func, EXPECTED_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
