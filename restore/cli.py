"""cfrestore: RECOVER CFSTRUCT.

  cfrestore run STRUCTURE [--backup ID] [--engine columnar|local|spark] [--dry-run] [--mark-failed] [--report FILE]
                          [--memory-limit SIZE] [--workers N] [--metrics-file PATH]
                                              rebuild a failed structure from a backup plus every member's log
                                              (--metrics-file: the run as Prometheus gauges, docs/metrics.md)
  cfrestore plan STRUCTURE [--backup ID]      what run would do (= run --dry-run): touches nothing
  cfrestore purge STRUCTURE [--mark-failed]   RECOVER CFSTRUCT TYPE(PURGE): empty it and make it usable again
  cfrestore mark-failed STRUCTURE             fail an ACTIVE structure (work on it then fails: MQRC_CF_STRUC_FAILED)
  cfrestore archive --archive-dir DIR         copy the closed log segments to Parquet, each sealed with the
                                              group's backup key (docs/spark.md)
  cfrestore audit ENTRY_ID --archive-dir DIR  where did message ENTRY_ID go? its records in the archive

Spark engine options (docs/spark.md): --master URL (default $CFEMU_SPARK_MASTER, else the Spark master of the
cluster's 'cfemu cluster up --spark N' while it runs, else local[*]), --conf KEY=VALUE (repeatable), --archive-dir
DIR (read archived segments from there: only those whose seals verify, docs/security.md). A spark:// master gets
the group's Spark secret (spark.secret in its secrets directory) in the driver's settings, in process, when there
is one.

The CF, the members' logs and the backup root are found as by every command (cfemu.settings): --redis-url,
--log-root, --backup-dir, else the environment ($REDIS_URL, $CFEMU_LOG_ROOT, $CFEMU_BACKUP_DIR), else the nearest
'cfemu cluster' directory (--cluster-dir, $CFEMU_CLUSTER_DIR, var/cluster here or above), else the CF of
'cfemu cf start', else var/logs and var/backups. So is the group's backup key (backup.key in its secrets
directory), which checks the backup restore starts from and signs the restore point it writes: a backup that is
not signed with it is refused, one taken before backups were signed only used with --accept-unsigned (logged).
--json prints machine-readable output. Errors are one line on stderr (exit 2); --verbose adds the traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from backup.files import BackupError
from cfemu.admin import Admin
from cfemu.bulk import NotOwnerError
from cfemu.clitools import (
    Output,
    Parser,
    PhaseBars,
    add_settings_arguments,
    cf_name,
    directory,
    output_file,
    output_file_in_new_directory,
    require_url,
    run_command,
    settings,
    styled_table,
)
from cfemu.connection import connect
from cfemu.durable import disk_full_named
from cfemu.settings import ENV_SPARK_MASTER, Settings
from restore.engine import default_engine, engine_names
from restore.load import LoadVerifyError
from restore.report import purge_summary, summary
from restore.run import RestoreError, run_purge, run_restore
from restore.spark_conf import driver_conf
from sqm.log import LogCorruptError, LogFormatError

# Beyond clitools.COMMON_ERRORS.
EXPECTED_ERRORS = (RestoreError, BackupError, LogCorruptError, LogFormatError, LoadVerifyError, NotOwnerError)


def _bars(out: Output) -> PhaseBars:
    return PhaseBars(out.console, disabled=out.as_json or not out.console.is_terminal)


def cmd_run(args: argparse.Namespace, out: Output, *, dry_run: bool = False) -> int:
    t0 = time.monotonic()
    result = None
    try:  # a refusal before the restore starts is a failed run for the metrics file too
        found = settings(args)
        options = _engine_options(args, found)  # a bad --memory-limit is refused before anything is read
        client = connect(require_url(found))
        with _bars(out) as bars, disk_full_named(found.backup_dir, f"the restore did not finish: structure "
                                                 f"{args.structure} is not restored (it stays as 'cfemu status' "
                                                 "shows it); free space there and run it again"):
            result = run_restore(client, args.structure, backup_root=found.backup_dir, log_root=found.log_root,
                                 backup_id=args.backup, engine=args.engine, dry_run=dry_run or args.dry_run,
                                 mark_failed=args.mark_failed, progress=bars,
                                 report_path=Path(args.report) if args.report else None,
                                 engine_options=options,
                                 from_logs=bool(getattr(args, "from_logs", False)),
                                 backup_keys=found.backup_keys(accept_unsigned=args.accept_unsigned))
    finally:
        if getattr(args, "metrics_file", None):  # the run, good or not, for node_exporter (docs/metrics.md)
            from cfemu import exposition  # prometheus_client: only for a run that asks

            exposition.write_last_run(
                args.metrics_file, "cfrestore_", args.structure, ok=result is not None,
                seconds=time.monotonic() - t0, phases=result.timings if result is not None else {},
                values={"last_run_loaded_entries": ("Entries the last good restore loaded", result.loaded_entries),
                        "last_run_peak_rss_bytes": ("Peak resident memory of the last good restore",
                                                    result.peak_rss_bytes)} if result is not None else None)
    if out.as_json:
        out.json(result.to_json())
    else:
        out.print(summary(result, out.console))
    return 0


def _engine_options(args: argparse.Namespace, found: Settings | None = None) -> dict[str, Any]:
    """The engine's options. Local: its working memory (--memory-limit) and worker processes (--workers). Spark: the master (the flag, else the
    settings' Spark master, else local[*]), its settings (what joining that master needs,
    spark_conf.driver_conf, then the --conf given, which win) and the memory limit (its memory settings are
    derived from it: spark_conf.memory_conf)."""
    args.engine = args.engine or default_engine()
    if args.engine in ("local", "columnar"):
        chosen = found or settings(args)
        return {"memory": chosen.memory_limit(), "workers": chosen.restore_workers()}
    if args.engine != "spark":
        return {}
    master = args.master or (found.spark_master if found is not None else None) or "local[*]"
    conf = {**driver_conf(master, found.secrets_dir if found is not None else None), **dict(args.conf)}
    options: dict[str, Any] = {"master": master, "conf": conf, "memory": (found or settings(args)).memory_limit()}
    if args.archive_dir:
        options["archive_dir"] = Path(args.archive_dir)  # checked by the restore (restore.run, restore.archive)
    return options


def _key_value(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"--conf expects KEY=VALUE, not {text!r}")
    return key, value


def cmd_archive(args: argparse.Namespace, out: Output) -> int:
    """Archive the closed segments with a progress bar, then a one-line summary."""
    from restore.archive import archive_logs  # pyarrow: imported only by the verbs that use it

    archive_dir = Path(args.archive_dir)
    found = settings(args)
    with _bars(out) as bars:
        result = archive_logs(found.log_root, archive_dir, bars, backup_keys=found.backup_keys())
    if out.as_json:
        out.json({"archived": [str(p) for p in result.archived], "skipped": result.skipped,
                  "records": result.records})
    else:
        out.line(f"archived {len(result.archived)} segments ({result.records} records) into {archive_dir}; "
                 f"{result.skipped} already archived")
    return 0


def cmd_audit(args: argparse.Namespace, out: Output) -> int:
    """The records of one message, a table in LRSN order; exit status 1 when no archived record names it."""
    from restore.archive import archive_files, audit_message
    from sqm.core.records import describe

    archive_dir = Path(args.archive_dir)
    if not archive_files(archive_dir):
        raise FileNotFoundError(f"{archive_dir}: no archived segments here (run cfrestore archive first)")
    found = audit_message(archive_dir, args.entry_id, backup_keys=settings(args).backup_keys())
    rows = [{"lrsn": r["l"], "member": r["m"], "kind": r["k"], "uow": r.get("u", ""), "what": describe(r)}
            for r in found]
    if out.as_json:
        out.json(rows)
    elif not found:
        out.line(f"no archived record names message {args.entry_id}")
    else:
        table = styled_table(out.console, "LRSN", "member", "kind", "UOW", "what", title=f"message {args.entry_id}")
        for row in rows:
            table.add_row(*(str(v) for v in row.values()))
        out.print(table)
    return 0 if found else 1


def cmd_plan(args: argparse.Namespace, out: Output) -> int:
    return cmd_run(args, out, dry_run=True)


def cmd_purge(args: argparse.Namespace, out: Output) -> int:
    found = settings(args)
    result = run_purge(connect(require_url(found)), args.structure, backup_root=found.backup_dir,
                       log_root=found.log_root, mark_failed=args.mark_failed,
                       backup_keys=found.backup_keys(accept_unsigned=args.accept_unsigned))
    if out.as_json:
        out.json(vars(result))
    else:
        out.print(purge_summary(result, out.console))
    return 0


def cmd_mark_failed(args: argparse.Namespace, out: Output) -> int:
    admin = Admin(connect(require_url(settings(args))))
    before = admin.state(args.structure)
    admin.set_state(args.structure, "FAILED")
    if out.as_json:
        out.json({"structure": args.structure, "state_before": before, "state": "FAILED"})
    else:
        out.line(f"structure {args.structure}: {before} -> FAILED")
    return 0


def build_parser(prog: str = "cfrestore") -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    add_settings_arguments(common, "redis_url", "cluster_dir", "cf_dir")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--verbose", "-v", action="store_true", help="show the traceback of an error")
    restore = Parser(add_help=False)
    restore.add_argument("structure", type=cf_name("structure"))
    add_settings_arguments(restore, "backup_dir", "log_root", "memory_limit", "workers")
    restore.add_argument("--backup", metavar="ID", help="restore from this backup (default: the latest good one)")
    unsigned = Parser(add_help=False)
    unsigned.add_argument("--accept-unsigned", action="store_true",
                          help="use a backup taken before backups were signed (logged); only one you know is the "
                               "group's (docs/security.md)")
    restore.add_argument("--engine", default=None, choices=engine_names(),
                         help="planning engine (default: columnar; local, the reference, where the columnar "
                              "engine's C readers were not built)")
    restore.add_argument("--from-logs", action="store_true",
                         help="start from the relog window of the newest complete relog pass, from the logs alone, "
                              "even when a backup is newer (by default the newer start is used; the report says "
                              "which)")
    restore.add_argument("--report", metavar="FILE", type=output_file_in_new_directory,
                         help="report file (default <backup-dir>/<structure>/restore-<time>.json)")
    restore.add_argument("--mark-failed", action="store_true",
                         help="fail the structure first when it is ACTIVE (its current content is replaced)")
    restore.add_argument("--master", default=None,
                         help=f"spark engine: the Spark master URL (default ${ENV_SPARK_MASTER}, else the cluster's "
                              "Spark master while it runs, else local[*])")
    restore.add_argument("--conf", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                         help="spark engine: a Spark setting (repeatable)")
    restore.add_argument("--archive-dir", help="spark engine: read archived log segments from this directory")

    p = Parser(prog=prog, description="Restore CF structures (RECOVER CFSTRUCT).")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    run = sub.add_parser("run", parents=[common, restore, unsigned], help="restore a structure from a backup and the logs")
    run.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    run.add_argument("--metrics-file", metavar="PATH", type=output_file,
                     help="write the run's metrics (success, duration, each phase's) to PATH for node_exporter's "
                          "textfile collector, replaced atomically (docs/metrics.md)")
    run.set_defaults(func=cmd_run)
    plan = sub.add_parser("plan", parents=[common, restore, unsigned], help="print what run would do; change nothing")
    plan.set_defaults(func=cmd_plan, dry_run=True)
    purge = sub.add_parser("purge", parents=[common, unsigned], help="empty a failed structure and make it usable again")
    purge.add_argument("structure", type=cf_name("structure"))
    add_settings_arguments(purge, "backup_dir", "log_root")
    purge.add_argument("--mark-failed", action="store_true", help="purge an ACTIVE structure too")
    purge.set_defaults(func=cmd_purge)
    mark = sub.add_parser("mark-failed", parents=[common], help="fail an ACTIVE structure")
    mark.add_argument("structure", type=cf_name("structure"))
    mark.set_defaults(func=cmd_mark_failed)
    archive = sub.add_parser("archive", parents=[common], help="copy closed log segments to Parquet")
    add_settings_arguments(archive, "log_root")
    archive.add_argument("--archive-dir", required=True, type=directory("--archive-dir"), help="where the Parquet files go")
    archive.set_defaults(func=cmd_archive)
    audit = sub.add_parser("audit", parents=[common], help="where did a message go? (from the archive)")
    audit.add_argument("entry_id")
    audit.add_argument("--archive-dir", required=True, help="the archive (cfrestore archive)")
    audit.set_defaults(func=cmd_audit)
    p.set_defaults(cf_role="restore")  # the CF user this command connects as (cfemu.credentials)
    return p


def main(argv: list[str] | None = None, *, prog: str = "cfrestore") -> int:
    """The command line; ``prog`` is the name its messages give it (``cfemu restore`` runs it as a verb)."""
    args = build_parser(prog).parse_args(argv)
    return run_command(prog, args, args.func, EXPECTED_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
