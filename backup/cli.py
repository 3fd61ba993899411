"""cfbackup: BACKUP CFSTRUCT and the backup catalog.

  cfbackup run STRUCTURE [--exclint SECONDS]     back up a structure while the group keeps working; while the
               [--backup-share F]              group works, the backup works F of the time (default 0.05,
               [--lease SECONDS]               $CFEMU_BACKUP_SHARE; backup/pacing.py), on an idle CF all of it;
               [--wait SECONDS]                its mark in the CF lasts SECONDS past its last renewal (default
                                               30): a backup killed without a word blocks the next that long;
                                               another backup running (the scheduler's) is waited for, at most
                                               --wait seconds (default 120; 0: refused at once);
                                               --metrics-file PATH: the run as Prometheus gauges
  cfbackup cancel [--structure S]                end the backup mark of S (of every structure without --structure),
                                                 running or stale: its backup fails at its next renewal
  cfbackup list [STRUCTURE] [--deep]             backups, newest first, with their state (ok/corrupt/incomplete)
  cfbackup show ID                               one backup's manifest: LRSN range, steps, files
  cfbackup verify ID                             read everything: the signature, every frame's CRC, every
                                                 file's digest
  cfbackup sign ID                               sign a backup again with the current key, once all of it checks
                                                 (after a key rotation; with --accept-unsigned, adopt an old one)
  cfbackup prune STRUCTURE --keep N | --older-than AGE
  cfbackup schedule --interval SECONDS [--structure S]... [--keep N]   back up every N seconds (a daemon, until
                    [--keep-age AGE] [--metrics-port PORT]  SIGTERM), keeping the newest N good backups (default 5)
                                                 and those started within AGE;
                                                 Prometheus metrics on 127.0.0.1:PORT

The CF, the members' logs and the backup root are found as by every command (cfemu.settings): the flag, else the
environment ($REDIS_URL, $CFEMU_LOG_ROOT, $CFEMU_BACKUP_DIR), else the nearest 'cfemu cluster' directory, else the
CF of 'cfemu cf start', else var/logs and var/backups. So is the group's backup key (backup.key in its secrets
directory: $CFEMU_SECRETS_DIR, the cluster's, the CF directory's), which signs every backup and without which
none is written or read. A backup taken before backups were signed is refused (state "unsigned") unless
--accept-unsigned is given (list, show, verify, sign), which logs each one it lets through. Errors are one line
on stderr (exit 2); --verbose adds the traceback. --json prints machine-readable output (schedule: its log lines
as JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from backup.catalog import OK, find_backup, inspect, list_backups, parse_age, prune
from backup.files import BackupError, sign_backup, verify
from backup.run import DEFAULT_BATCH, DEFAULT_LEASE_S, DEFAULT_WAIT_S, BackupTerminated, run_backup
from backup.schedule import DEFAULT_KEEP
from cfemu.admin import Admin
from cfemu.cf import CF, BackupCancelled
from cfemu.clitools import (
    MAX_SECONDS,
    Output,
    Parser,
    PhaseBars,
    add_settings_arguments,
    cf_name,
    configure_logging,
    output_file,
    require_url,
    run_command,
    seconds,
    settings,
    whole,
)
from cfemu.clitools import styled_table as _table
from cfemu.connection import check_url, connect
from cfemu.credentials import BackupKeys
from cfemu.errors import StructureFailedError
from cfemu.settings import ENV_BACKUP_DIR, Settings
from cfemu.signals import handling

EXPECTED_ERRORS = (BackupError,)  # beyond clitools.COMMON_ERRORS


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _steps_table(console: Console, manifest: dict[str, Any]) -> Table:
    t = _table(console, "#", "step", "state", "snapshot", "copied", "non-persistent", "vanished", "excluded",
               "MiB", title="steps")
    for s in manifest["steps"]:
        t.add_row(str(s["step"]), s["label"], s["state"], str(s["snapshot"]), str(s["copied"]),
                  str(s["skipped_nonpersistent"]), str(s["vanished"]), str(s.get("excluded", 0)), _mib(s["bytes"]))
    return t


def _summary_table(console: Console, manifest: dict[str, Any], path: Path, state: str = OK) -> Table:
    t = _table(console, "backup", manifest["id"])
    exc = manifest.get("exception_records")
    rows = [("state", state), ("path", str(path)), ("group / structure", f"{manifest['group']} / "
                                                                         f"{manifest['structure']}"),
            ("members", ", ".join(manifest["members"]) or "-"),
            ("LRSN start / end", f"{manifest['start_lrsn']} / {manifest['end_lrsn']}"),
            ("recovery floor / replay from", f"{manifest['floor_lrsn']} / {manifest['replay_from']}"),
            ("started / ended", f"{manifest['started_at']} / {manifest['ended_at']}"),
            ("entries copied", str(manifest["entries"])), ("data MiB", _mib(manifest["bytes"])),
            ("non-persistent skipped", str(manifest["nonpersistent_skipped"])),
            ("EXCLINT s / left out", f"{manifest['exclint_s']} / {manifest.get('excluded', 0)}"),
            ("exception records (BACKOUT with data)", "not counted (no --log-root)" if exc is None else str(exc)),
            ("files", ", ".join(f"{f['name']} ({f['frames']} frames)" for f in manifest["files"]))]
    if "elapsed_s" in manifest:
        rows.append(("elapsed s", str(manifest["elapsed_s"])))
    for k, v in rows:
        t.add_row(k, v)
    return t


def _keys(found: Settings, args: argparse.Namespace) -> BackupKeys:
    """The group's backup keys, as the settings resolver finds them, with the operator's override."""
    return found.backup_keys(accept_unsigned=getattr(args, "accept_unsigned", False))


@contextlib.contextmanager
def _sigterm_ends_the_backup() -> Iterator[None]:
    """SIGTERM (a scheduler stopping, an operator's kill) raises BackupTerminated in the main thread, so that the
    backup ends as failed and clears its mark before the process exits; a second SIGTERM while it does so is
    ignored (the clearing is bounded: backup.run.END_FAILED_RETRY_S)."""
    def on_term(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise BackupTerminated("terminated (SIGTERM)")

    with handling((signal.SIGTERM,), on_term):  # in the main thread alone: signals reach it only
        yield


def cmd_run(args: argparse.Namespace, out: Output) -> int:
    t0 = time.monotonic()
    manifest: dict[str, Any] | None = None
    try:  # a refusal before the backup starts is a failed run for the metrics file too
        found = settings(args)
        client = connect(require_url(found))
        # The members' logs are only read to count exception records: a log root that is not there is no error.
        log_root = found.log_root if found.log_root.is_dir() else None
        with _sigterm_ends_the_backup(), \
                PhaseBars(out.console, disabled=out.as_json or not out.console.is_terminal, width=36) as bars:
            manifest = run_backup(client, args.structure, found.backup_dir, log_root=log_root,
                                  exclint_s=args.exclint, batch=args.batch, progress=bars,
                                  backup_keys=_keys(found, args), share=found.backup_share(), lease_s=args.lease,
                                  wait_s=args.wait)
    except BackupTerminated:
        print(f"cfbackup: terminated (SIGTERM): the backup of {args.structure} ended as failed, its mark cleared "
              "and nothing kept", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if args.metrics_file:  # the run, good or not, for node_exporter's textfile collector (docs/metrics.md)
            from cfemu import exposition  # prometheus_client: only for a run that asks

            exposition.write_last_run(
                args.metrics_file, "cfbackup_", args.structure, ok=manifest is not None,
                seconds=time.monotonic() - t0,
                phases={f"{s['step']} {s['label']}": s["seconds"] for s in (manifest or {}).get("steps", [])},
                values={"last_run_entries": ("Entries the last good backup copied", manifest["entries"]),
                        "last_run_bytes": ("Message bytes in the last good backup", manifest["bytes"])}
                if manifest is not None else None)
    path = found.backup_dir / args.structure / manifest["id"]
    if out.as_json:
        out.json({**manifest, "path": str(path)})
        return 0
    out.print(_steps_table(out.console, manifest))
    out.print(_summary_table(out.console, manifest, path))
    return 0


def cmd_cancel(args: argparse.Namespace, out: Output) -> int:
    found = settings(args)
    client = connect(require_url(found))
    admin = Admin(client)
    names = [args.structure] if args.structure else sorted(sdef.name for sdef in admin.structures())
    if args.structure:
        admin.structure_def(args.structure)  # an unknown structure is an error, not "nothing to cancel"
    cf = CF(client)
    rows = []
    for name in names:
        try:
            cancelled = cf.structure(name).backup_cancel()
        except StructureFailedError:  # not in the CF (lost, never restored): it has no mark
            if args.structure:
                raise
            cancelled = BackupCancelled("", None)
        stale = cancelled.left_ms is not None and cancelled.left_ms <= 0
        rows.append({"structure": name, "backup": cancelled.backup or None,
                     "state": "none" if not cancelled.backup else ("stale" if stale else "running")})
    if out.as_json:
        out.json({"cancelled": [r for r in rows if r["backup"]], "structures": rows})
        return 0
    for r in rows:
        if r["backup"] is None:
            out.line(f"no backup of {r['structure']} to cancel")
        elif r["state"] == "stale":
            out.line(f"cancelled backup {r['backup']} of {r['structure']}: its mark was stale (its lease had "
                     "ended: the backup died or stalled)")
        else:
            out.line(f"cancelled backup {r['backup']} of {r['structure']}: it was running; it fails at its next "
                     "renewal of its lease and keeps nothing")
    if not names:
        out.line("no structures defined: nothing to cancel")
    return 0


def cmd_list(args: argparse.Namespace, out: Output) -> int:
    found = settings(args)
    backup_dir = found.backup_dir
    if not backup_dir.is_dir():  # a mistyped directory is not "no backups": the operator would take it for a loss
        raise ValueError(f"the backup directory {backup_dir} does not exist (check --backup-dir or ${ENV_BACKUP_DIR})")
    backups = list_backups(backup_dir, args.structure, deep=args.deep, backup_keys=_keys(found, args))
    if out.as_json:
        out.json([b.summary() for b in backups])
        return 0
    if not backups:
        out.line(f"no backups{' of ' + args.structure if args.structure else ''} in {backup_dir}")
        return 0
    t = _table(out.console, "id", "kind", "state", "started", "entries", "MiB", "replay from", "end LRSN",
               "problem")
    for b in backups:
        row = b.summary()
        t.add_row(b.id, row["kind"] or "-", b.state, row["started_at"],
                  str(row["entries"] if row["entries"] is not None else "-"), _mib(row["bytes"]),
                  str(row["replay_from"] or "-"), str(row["end_lrsn"] or "-"), b.problem)
    out.print(t)
    return 0


def cmd_show(args: argparse.Namespace, out: Output) -> int:
    found = settings(args)
    info = inspect(find_backup(found.backup_dir, args.id), backup_keys=_keys(found, args))
    if out.as_json:
        out.json({**info.summary(), "manifest": info.manifest})
    elif info.manifest is not None:
        out.print(_summary_table(out.console, info.manifest, info.path, info.state))
        out.print(_steps_table(out.console, info.manifest))
    if info.state != OK:
        print(f"cfbackup: backup {info.id} is {info.state}: {info.problem}", file=sys.stderr)
        return 2
    return 0


def cmd_verify(args: argparse.Namespace, out: Output) -> int:
    found = settings(args)
    path = find_backup(found.backup_dir, args.id)
    manifest = verify(path, backup_keys=_keys(found, args))
    frames = sum(f["frames"] for f in manifest["files"])
    signed = "signature" in manifest
    if out.as_json:
        out.json({"id": manifest["id"], "state": OK, "entries": manifest["entries"], "frames": frames,
                  "bytes": manifest["bytes"], "files": len(manifest["files"]), "signed": signed,
                  "key": manifest["signature"]["key"] if signed else None})
    else:
        how = (f"its signature (key {manifest['signature']['key']}), every CRC and digest match" if signed else
               "UNSIGNED (accepted with --accept-unsigned), every CRC and digest match")
        out.line(f"backup {manifest['id']} is good: {frames} frames in {len(manifest['files'])} file(s), "
                 f"{_mib(manifest['bytes'])} MiB of data; {how}")
    return 0


def cmd_sign(args: argparse.Namespace, out: Output) -> int:
    found = settings(args)
    path = find_backup(found.backup_dir, args.id)
    manifest = sign_backup(path, backup_keys=_keys(found, args))
    if out.as_json:
        out.json({"id": manifest["id"], "key": manifest["signature"]["key"]})
    else:
        out.line(f"backup {manifest['id']} checked and signed with key {manifest['signature']['key']}")
    return 0


def cmd_prune(args: argparse.Namespace, out: Output) -> int:
    older = parse_age(args.older_than) if args.older_than else None
    found = settings(args)
    client = connect(found.redis_url) if found.redis_url else None  # without a CF, only the files are pruned
    result = prune(found.backup_dir, args.structure, keep=args.keep, older_than=older, client=client,
                   backup_keys=_keys(found, args), log_root=found.log_root)
    if out.as_json:
        out.json({"removed": [b.id for b in result.removed], "kept": [b.id for b in result.kept],
                  "admin_updated": result.admin_updated, "note": result.note,
                  "failed": [{"id": b.id, "problem": why} for b, why in result.failed],
                  "held": [{"id": b.id, "why": why} for b, why in result.held]})
        return 2 if result.failed else 0
    if not result.removed:
        out.line(f"nothing to prune: {len(result.kept)} backup(s) of {args.structure} kept")
    else:
        t = _table(out.console, "removed", "state", "started")
        for b in result.removed:
            t.add_row(b.id, b.state, b.started.isoformat())
        out.print(t)
        out.line(f"{len(result.removed)} removed, {len(result.kept)} kept")
    if result.note:
        out.line(f"note: {result.note}")
    for b, why in result.held:
        out.line(f"kept {b.id}: {why}")
    for b, why in result.failed:
        print(f"cfbackup: backup {b.id} of {args.structure} was not removed: {why}", file=sys.stderr)
    return 2 if result.failed else 0


def cmd_schedule(args: argparse.Namespace, out: Output) -> int:
    from backup.schedule import run_backup_scheduler
    from backup.schedule_metrics import SchedulerMetrics
    from cfemu import exposition

    keep_age = parse_age(args.keep_age) if args.keep_age else None
    if keep_age is not None and not args.keep:
        raise ValueError("--keep-age needs a retention: --keep 0 keeps every backup")
    found = settings(args)
    if found.redis_url:  # a URL no connection can be made with is refused before the loop starts
        check_url(found.redis_url)
    configure_logging(args.verbose, as_json=out.as_json)
    metrics = SchedulerMetrics(args.interval, args.keep)
    if args.metrics_port is not None:
        port = exposition.serve([metrics], args.metrics_host, args.metrics_port)
        logging.getLogger("backup.schedule").info("backup scheduler: metrics on http://%s:%d/metrics",
                                                  args.metrics_host, port)
    run_backup_scheduler(args.interval, found, args.structure, keep=args.keep, metrics=metrics,
                         keep_age=keep_age)
    return 0


def build_parser(prog: str = "cfbackup") -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    add_settings_arguments(common, "backup_dir", "cluster_dir")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--verbose", "-v", action="store_true", help="show the traceback of an error")
    cf = Parser(add_help=False)
    add_settings_arguments(cf, "redis_url", "cf_dir")

    unsigned = Parser(add_help=False)
    unsigned.add_argument("--accept-unsigned", action="store_true",
                          help="use backups taken before backups were signed (each is logged); only for backups "
                               "you know are the group's (docs/security.md)")

    p = Parser(prog=prog, description="Fuzzy backup of CF structures (BACKUP CFSTRUCT).")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    run = sub.add_parser("run", parents=[common, cf], help="back up a structure")
    run.add_argument("structure", type=cf_name("structure"))
    add_settings_arguments(run, "log_root", "backup_share")  # log root: to count the exception records
    run.add_argument("--exclint", type=whole(0), default=0, metavar="SECONDS",
                     help="leave out messages put less than SECONDS before the backup (restore replays them)")
    run.add_argument("--batch", type=whole(1), default=DEFAULT_BATCH, metavar="N",
                     help=f"entries per pipelined fetch while the group works (default {DEFAULT_BATCH}; twice as "
                          "many on an idle CF); smaller batches hold up the CF's other work for less time, larger "
                          "ones back up faster")
    run.add_argument("--lease", type=seconds(0, MAX_SECONDS, above=True), default=DEFAULT_LEASE_S, metavar="SECONDS",
                     help=f"the backup's mark in the CF lasts SECONDS past its last renewal (default "
                          f"{DEFAULT_LEASE_S:g}; renewed every fifth of it): a backup killed without a word blocks "
                          "the next backup and 'cfemu migrate unload' that long")
    run.add_argument("--wait", type=seconds(0, MAX_SECONDS), default=DEFAULT_WAIT_S, metavar="SECONDS",
                     help=f"while another backup of the structure runs (the scheduler's), wait for it to end, at "
                          f"most SECONDS (default {DEFAULT_WAIT_S:g}; 0: refuse at once)")
    run.add_argument("--metrics-file", metavar="PATH", type=output_file,
                     help="write the run's metrics (success, duration, each step's) to PATH for node_exporter's "
                          "textfile collector, replaced atomically (docs/metrics.md)")
    run.set_defaults(func=cmd_run)
    cancel = sub.add_parser("cancel", parents=[common, cf],
                            help="end a running or stale backup's mark (a backup stuck or killed): the backup, "
                                 "if it still runs, fails at its next renewal and keeps nothing")
    cancel.add_argument("--structure", metavar="S", type=cf_name("structure"), help="the structure whose backup to cancel (default: every "
                                                         "structure's)")
    cancel.set_defaults(func=cmd_cancel)
    ls = sub.add_parser("list", parents=[common, unsigned], help="list backups, newest first")
    ls.add_argument("structure", nargs="?", type=cf_name("structure"))
    ls.add_argument("--deep", action="store_true", help="read every frame to decide the state (slow)")
    ls.set_defaults(func=cmd_list)
    show = sub.add_parser("show", parents=[common, unsigned], help="show one backup")
    show.add_argument("id")
    show.set_defaults(func=cmd_show)
    ver = sub.add_parser("verify", parents=[common, unsigned], help="read and check a whole backup")
    ver.add_argument("id")
    ver.set_defaults(func=cmd_verify)
    sign = sub.add_parser("sign", parents=[common, unsigned],
                          help="check a whole backup, then sign it with the current key (after a key rotation)")
    sign.add_argument("id")
    sign.set_defaults(func=cmd_sign)
    pr = sub.add_parser("prune", parents=[common, cf, unsigned],
                        help="remove old backups (never the newest good one)")
    add_settings_arguments(pr, "log_root")  # a restore point being written is kept while its restore runs
    pr.add_argument("structure", type=cf_name("structure"))
    how = pr.add_mutually_exclusive_group(required=True)
    how.add_argument("--keep", type=whole(1), metavar="N", help="keep the N newest backups")
    how.add_argument("--older-than", metavar="AGE", help="remove backups older than AGE (e.g. 7d, 12h)")
    pr.set_defaults(func=cmd_prune)
    sch = sub.add_parser("schedule", parents=[common, cf], help="back up structures every N seconds (a daemon)")
    add_settings_arguments(sch, "log_root", "backup_share")  # handed on to every backup it runs
    sch.add_argument("--interval", type=seconds(0, MAX_SECONDS, above=True), required=True, metavar="SECONDS")
    sch.add_argument("--structure", action="append", default=[], type=cf_name("structure"), help="structure to back up (default: all ACTIVE)")
    sch.add_argument("--keep", type=whole(0), default=DEFAULT_KEEP, metavar="N",
                     help=f"after each good backup keep the newest N good backups of the structure (default "
                          f"{DEFAULT_KEEP}; 0: keep all) and remove older ones no restore can need")
    sch.add_argument("--keep-age", metavar="AGE",
                     help="also keep every good backup started within AGE (e.g. 7d, 12h): retention keeps whichever "
                          "of --keep and --keep-age keeps more")
    sch.add_argument("--metrics-port", type=whole(0, 65535), metavar="PORT",
                     help="serve Prometheus metrics on PORT (0: any free port; default: none): what it ran, each "
                          "backup's and step's duration, each structure's last good backup (docs/metrics.md)")
    sch.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                     help="the address of --metrics-port (default 127.0.0.1: the metrics have no authentication)")
    sch.set_defaults(func=cmd_schedule)
    p.set_defaults(cf_role="backup")  # the CF user this command connects as (cfemu.credentials)
    return p


def main(argv: list[str] | None = None, *, prog: str = "cfbackup") -> int:
    """The command line; ``prog`` is the name its messages give it (``cfemu backup`` runs it as a verb)."""
    args = build_parser(prog).parse_args(argv)
    return run_command(prog, args, args.func, EXPECTED_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
