"""`cfemu migrate`: move a structure from one CF to another through files (EntireX's PSTORE-UNLOAD / PSTORE-LOAD,
backup.migrate), with a report of every record on both sides and their comparison (backup.migrate_report).

    cfemu migrate unload STRUCT --to DIR [--redis-url SOURCE] [--log-root DIR] [--wait SECONDS]   the source ends
                                   MIGRATED; a running backup is waited for (default 120 s); DIR new, empty, or
                                   holding only a killed unload of STRUCT (replaced)
    cfemu migrate load DIR --redis-url TARGET [--structure NAME] [--group NAME] [--restart] [--report FILE]
                           [--source-keys-dir DIR]
    cfemu migrate compare UNLOAD_REPORT LOAD_REPORT [--keys-dir DIR]  equal, or each difference (exit status 1)
    cfemu migrate status STRUCT [--redis-url URL] [--log-root DIR]
    cfemu migrate reopen STRUCT --confirm STRUCT [--redis-url SOURCE] [--log-root DIR] [--target-given-up]
                                                                     the source serves again (deliberately)

--log-root names the source group's log root, whose group repository records the migration (default: the one
the CF records; after a loss of the source CF: the settings' log root).

Every verb takes --json; errors are one line on stderr with exit status 2 (docs/migration.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import redis

from backup import migrate
from backup.files import BackupError
from backup.migrate_report import ReportError, compare, read_report
from backup.run import DEFAULT_WAIT_S
from cfemu import credentials
from cfemu.admin import Admin
from cfemu.clitools import (
    CLIError,
    Output,
    PhaseBars,
    add_settings_arguments,
    cf_name,
    directory,
    output_file,
    require_url,
    settings,
)
from cfemu.connection import connect
from cfemu.settings import Settings
from qsg.cli_common import Parser, run_verb, seconds, whole

REPO_HELP = ("the source group's log root, whose group repository records the migration (default: the one the CF "
             "records, else the settings' log root)")
EXPECTED_ERRORS = (migrate.MigrationError, BackupError, ReportError)


def _bars(out: Output) -> PhaseBars:
    return PhaseBars(out.console, disabled=out.as_json or not out.console.is_terminal)


def _counts_rows(by_type: dict[str, int]) -> list[list[object]]:
    return [[t, n] for t, n in sorted(by_type.items())]


def _show_moved(out: Output, done: migrate.Unloaded | migrate.Loaded, what: str, side: str, where: str) -> int:
    """An unload's or a load's result: its JSON; or what moved, how much and how fast, the side's state now
    (``side`` names it), the records moved by type, and ``where`` they are."""
    if out.as_json:
        out.json(done.to_dict())
        return 0
    out.line(f"{what}: {done.entries} entries, {done.bytes} bytes in {done.seconds:.2f} s; {side} {done.state}")
    out.table("records", ["type", "entries"], _counts_rows(done.by_type))
    out.line(where)
    return 0


def _log_root(args: argparse.Namespace, found: Settings, client: redis.Redis) -> Path | None:
    """--log-root, else the CF's record of the group repository (None: backup.migrate finds it), else the
    settings' log root (a CF that records none: lost since, or never joined)."""
    if args.log_root:
        return Path(args.log_root)
    return None if Admin(client).repository() is not None else found.log_root


def cmd_unload(args: argparse.Namespace, out: Output) -> int:
    found = settings(args)
    client = connect(require_url(found))
    with _bars(out) as bars:
        done = migrate.unload(client, args.structure, args.to, backup_keys=found.backup_keys(), progress=bars,
                              log_root=_log_root(args, found, client), wait_s=args.wait)
    d = done.to_dict()
    return _show_moved(out, done, f"unloaded structure {done.structure} of group {done.group} (migration "
                       f"{done.migration})", "the source is now", f"unload: {d['unload']}  report: {d['report']}")


def cmd_load(args: argparse.Namespace, out: Output) -> int:
    if not args.redis_url:
        raise CLIError("migrate load needs --redis-url: the target CF, named explicitly (never a default that may "
                       "be the source's)")
    found = settings(args)
    client = connect(require_url(found))
    source_keys = credentials.backup_keys(Path(args.source_keys_dir)) if args.source_keys_dir else None
    with _bars(out) as bars:
        done = migrate.load(client, args.dir, structure=args.structure, group=args.group, restart=args.restart,
                            report=args.report, backup_keys=found.backup_keys(), source_keys=source_keys,
                            batch=args.batch, progress=bars, log_root=args.log_root,
                            default_log_root=found.log_root)
    return _show_moved(out, done, f"loaded migration {done.migration} as structure {done.structure} of group "
                       f"{done.group}", "the target is",
                       f"report: {done.report}  (compare it: cfemu migrate compare UNLOAD_REPORT {done.report})")


def cmd_compare(args: argparse.Namespace, out: Output) -> int:
    keys = settings(args).backup_keys()
    if args.keys_dir:
        keys = migrate.with_keys(keys, credentials.backup_keys(Path(args.keys_dir)))
    result = compare(read_report(args.unload_report, backup_keys=keys),
                     read_report(args.load_report, backup_keys=keys))
    if out.as_json:
        out.json(result.to_dict())
    else:
        out.table("records", ["type", "unloaded", "loaded"],
                  [[t, v[0], v[1]] for t, v in sorted(result.by_type.items())])
        if result.equal:
            out.line(f"equal: the {result.loaded} records loaded are the {result.unloaded} unloaded, each with the "
                     "same content at the same place")
        else:
            out.table(f"{len(result.differences)} differences", ["difference"], [[d] for d in result.differences])
    return 0 if result.equal else 1


def cmd_status(args: argparse.Namespace, out: Output) -> int:
    found = settings(args)
    client = connect(require_url(found))
    st = migrate.status(client, args.structure, log_root=_log_root(args, found, client))
    if out.as_json:
        out.json(st)
    else:
        out.table("migration status", ["structure", "state", "migration", "entries", "meaning"],
                  [[st["structure"], st["state"], st["migration"] or "-", st["entries"], st["meaning"]]])
    return 0


def cmd_reopen(args: argparse.Namespace, out: Output) -> int:
    if args.confirm != args.structure:
        raise CLIError(f"reopening {args.structure} makes it serve again (or, its CF lost, be restored): if its "
                       f"target serves too, applications get the same messages twice; confirm with --confirm "
                       f"{args.structure}")
    found = settings(args)
    client = connect(require_url(found))
    st = migrate.reopen(client, args.structure, log_root=_log_root(args, found, client),
                        target_given_up=args.target_given_up)
    if out.as_json:
        out.json(st)
    elif st["restore_needed"]:
        out.line(f"structure {st['structure']}: migration {st['migration']} forgotten; the structure is "
                 f"{st['state']} (its CF was lost): RECAUTO or 'cfrestore run {st['structure']}' now restores it "
                 "from its backups and logs, and it serves again: its target must not")
    else:
        out.line(f"structure {st['structure']}: {st['state_before']} -> ACTIVE (migration {st['migration']} "
                 "forgotten); its members' work is accepted again: its target must not serve")
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    add_settings_arguments(common, "cluster_dir")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--verbose", "-v", action="store_true", help="show the traceback of an error")
    cf = Parser(add_help=False)
    add_settings_arguments(cf, "redis_url", "cf_dir")

    p = Parser(prog="cfemu migrate", description="Migrate a structure to another CF through files "
                                "(unload, load, compare the reports; docs/migration.md).")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    un = sub.add_parser("unload", parents=[common, cf], help="unload a structure into a directory (it ends MIGRATED)")
    un.add_argument("structure", type=cf_name("structure"))
    un.add_argument("--to", required=True, metavar="DIR", type=directory("--to"), help="a new or empty directory (or one holding only what a "
                    "killed unload of the structure left: replaced)")
    un.add_argument("--log-root", metavar="DIR", help=REPO_HELP)
    un.add_argument("--wait", type=seconds(), default=DEFAULT_WAIT_S, metavar="SECONDS",
                    help=f"while a backup of the structure runs (the scheduler's), wait for it to end, at most SECONDS "
                         f"(default {DEFAULT_WAIT_S:g}; 0: refuse at once)")
    un.set_defaults(func=cmd_unload, cf_role="operator")
    ld = sub.add_parser("load", parents=[common, cf], help="load an unload into another CF (an empty structure)")
    ld.add_argument("dir", metavar="DIR", help="the unload's directory (cfemu migrate unload --to DIR)")
    ld.add_argument("--structure", type=cf_name("structure"), help="the structure's name in the target (default: the source's)")
    ld.add_argument("--group", help="the target's group: set on a CF that has none, refused when it has another")
    ld.add_argument("--restart", action="store_true", help="start a partial load of this migration over")
    ld.add_argument("--report", metavar="FILE", type=output_file, help=f"the load report (default DIR/{migrate.LOAD_REPORT})")
    ld.add_argument("--source-keys-dir", metavar="DIR",
                    help="the source group's secrets directory, to check an unload another group signed")
    ld.add_argument("--log-root", metavar="DIR", help="the target group's log root: its group repository then "
                    "defines the structure and its queues too (RECAUTO and restore need them after a CF loss)")
    ld.add_argument("--batch", type=whole(1), default=1000, metavar="N", help="entries per guarded transaction")
    ld.set_defaults(func=cmd_load, cf_role="restore")
    cmp = sub.add_parser("compare", parents=[common], help="compare an unload report with a load report")
    cmp.add_argument("unload_report")
    cmp.add_argument("load_report")
    cmp.add_argument("--keys-dir", metavar="DIR", help="another group's secrets directory (its backup key)")
    cmp.set_defaults(func=cmd_compare, cf_role="operator")
    stp = sub.add_parser("status", parents=[common, cf], help="a structure's migration state")
    stp.add_argument("structure", type=cf_name("structure"))
    stp.add_argument("--log-root", metavar="DIR", help=REPO_HELP)
    stp.set_defaults(func=cmd_status, cf_role="operator")
    ro = sub.add_parser("reopen", parents=[common, cf], help="give a migrated source back: it serves again (or, its "
                        "CF lost, is restored again)")
    ro.add_argument("structure", type=cf_name("structure"))
    ro.add_argument("--confirm", metavar="STRUCT", default="", help="the structure's name again")
    ro.add_argument("--log-root", metavar="DIR", help=REPO_HELP)
    ro.add_argument("--target-given-up", action="store_true",
                    help="the unload was loaded, and its target no longer serves it (its structure deleted, its CF "
                         "retired): reopen anyway (refused without it once the unload is loaded)")
    ro.set_defaults(func=cmd_reopen, cf_role="operator")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "batch", 1) < 1:
        print(f"cfemu migrate: error: --batch must be at least 1, not {args.batch}", file=sys.stderr)
        return 2
    return run_verb("cfemu migrate", args, args.func, EXPECTED_ERRORS)
