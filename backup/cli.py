"""cfbackup: BACKUP CFSTRUCT and the backup catalog.

  cfbackup run STRUCTURE [--exclint SECONDS]     back up a structure while the group keeps working
  cfbackup list [STRUCTURE] [--deep]             backups, newest first, with their state (ok/corrupt/incomplete)
  cfbackup show ID                               one backup's manifest: LRSN range, steps, files
  cfbackup verify ID                             read everything: every frame's CRC, every file's sha256
  cfbackup prune STRUCTURE --keep N | --older-than AGE
  cfbackup schedule --interval SECONDS [--structure S]...   back up every N seconds (a daemon, until SIGTERM)

Errors are one line on stderr (exit 2); --verbose adds the traceback. --json prints machine-readable output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import redis
from rich import box
from rich.console import Console
from rich.table import Table

from backup.catalog import OK, find_backup, inspect, list_backups, parse_age, prune
from backup.files import BackupError, verify
from backup.run import DEFAULT_BATCH, run_backup
from cfemu.admin import AdminError
from cfemu.clitools import run_command
from cfemu.connection import ConnectionConfigError, connect
from cfemu.errors import MQError

ENV_BACKUP_DIR = "CFEMU_BACKUP_DIR"
ENV_LOG_ROOT = "CFEMU_LOG_ROOT"
DEFAULT_BACKUP_DIR = "./var/backups"

EXPECTED_ERRORS = (BackupError, MQError, AdminError, ValueError, ConnectionConfigError, OSError,
                   redis.exceptions.RedisError)


def _table(console: Console, *columns: str, title: str | None = None) -> Table:
    table = Table(*columns, title=title, box=box.ROUNDED if console.is_terminal else None,
                  title_justify="left")
    return table


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, sort_keys=True, default=str))


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


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    client = connect(args.redis_url)
    log_root = Path(args.log_root) if args.log_root else None
    manifest = run_backup(client, args.structure, Path(args.backup_dir), log_root=log_root,
                          exclint_s=args.exclint, batch=args.batch, progress=console.is_terminal and not args.json)
    path = Path(args.backup_dir) / args.structure / manifest["id"]
    if args.json:
        _print_json({**manifest, "path": str(path)})
        return 0
    console.print(_steps_table(console, manifest))
    console.print(_summary_table(console, manifest, path))
    return 0


def cmd_list(args: argparse.Namespace, console: Console) -> int:
    backups = list_backups(Path(args.backup_dir), args.structure, deep=args.deep)
    if args.json:
        _print_json([b.summary() for b in backups])
        return 0
    if not backups:
        console.print(f"no backups{' of ' + args.structure if args.structure else ''} in {args.backup_dir}")
        return 0
    t = _table(console, "id", "state", "started", "entries", "MiB", "replay from", "end LRSN", "problem")
    for b in backups:
        row = b.summary()
        t.add_row(b.id, b.state, row["started_at"], str(row["entries"] if row["entries"] is not None else "-"),
                  _mib(row["bytes"]), str(row["replay_from"] or "-"), str(row["end_lrsn"] or "-"), b.problem)
    console.print(t)
    return 0


def cmd_show(args: argparse.Namespace, console: Console) -> int:
    info = inspect(find_backup(Path(args.backup_dir), args.id))
    if args.json:
        _print_json({**info.summary(), "manifest": info.manifest})
    elif info.manifest is not None:
        console.print(_summary_table(console, info.manifest, info.path, info.state))
        console.print(_steps_table(console, info.manifest))
    if info.state != OK:
        print(f"cfbackup: backup {info.id} is {info.state}: {info.problem}", file=sys.stderr)
        return 2
    return 0


def cmd_verify(args: argparse.Namespace, console: Console) -> int:
    path = find_backup(Path(args.backup_dir), args.id)
    manifest = verify(path)
    frames = sum(f["frames"] for f in manifest["files"])
    if args.json:
        _print_json({"id": manifest["id"], "state": OK, "entries": manifest["entries"], "frames": frames,
                     "bytes": manifest["bytes"], "files": len(manifest["files"])})
    else:
        console.print(f"backup {manifest['id']} is good: {frames} frames in {len(manifest['files'])} file(s), "
                      f"{_mib(manifest['bytes'])} MiB of data, every CRC and checksum matches")
    return 0


def cmd_prune(args: argparse.Namespace, console: Console) -> int:
    older = parse_age(args.older_than) if args.older_than else None
    url = args.redis_url
    client = connect(url) if url else None
    result = prune(Path(args.backup_dir), args.structure, keep=args.keep, older_than=older, client=client)
    if args.json:
        _print_json({"removed": [b.id for b in result.removed], "kept": [b.id for b in result.kept],
                     "admin_updated": result.admin_updated, "note": result.note})
        return 0
    if not result.removed:
        console.print(f"nothing to prune: {len(result.kept)} backup(s) of {args.structure} kept")
    else:
        t = _table(console, "removed", "state", "started")
        for b in result.removed:
            t.add_row(b.id, b.state, b.started.isoformat())
        console.print(t)
        console.print(f"{len(result.removed)} removed, {len(result.kept)} kept")
    if result.note:
        console.print(f"note: {result.note}")
    return 0


def cmd_schedule(args: argparse.Namespace, console: Console) -> int:
    import logging

    from backup.schedule import run_backup_scheduler

    if args.interval <= 0:
        raise ValueError(f"--interval must be > 0, not {args.interval}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_backup_scheduler(args.interval, args.structure)
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backup-dir", default=os.environ.get(ENV_BACKUP_DIR, DEFAULT_BACKUP_DIR),
                        help=f"backup root (default ${ENV_BACKUP_DIR} or {DEFAULT_BACKUP_DIR})")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--verbose", "-v", action="store_true", help="show the traceback of an error")
    cf = argparse.ArgumentParser(add_help=False)
    cf.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="the CF (default $REDIS_URL)")

    p = argparse.ArgumentParser(prog="cfbackup", description="Fuzzy backup of CF structures (BACKUP CFSTRUCT).")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    run = sub.add_parser("run", parents=[common, cf], help="back up a structure")
    run.add_argument("structure")
    run.add_argument("--log-root", default=os.environ.get(ENV_LOG_ROOT),
                     help=f"the members' logs, to count exception records (default ${ENV_LOG_ROOT})")
    run.add_argument("--exclint", type=int, default=0, metavar="SECONDS",
                     help="leave out messages put less than SECONDS before the backup (restore replays them)")
    run.add_argument("--batch", type=int, default=DEFAULT_BATCH, metavar="N",
                     help=f"entries per pipelined fetch (default {DEFAULT_BATCH}); smaller batches hold up the CF's "
                          "other work for less time, larger ones back up faster")
    run.set_defaults(func=cmd_run)
    ls = sub.add_parser("list", parents=[common], help="list backups, newest first")
    ls.add_argument("structure", nargs="?")
    ls.add_argument("--deep", action="store_true", help="read every frame to decide the state (slow)")
    ls.set_defaults(func=cmd_list)
    show = sub.add_parser("show", parents=[common], help="show one backup")
    show.add_argument("id")
    show.set_defaults(func=cmd_show)
    ver = sub.add_parser("verify", parents=[common], help="read and check a whole backup")
    ver.add_argument("id")
    ver.set_defaults(func=cmd_verify)
    pr = sub.add_parser("prune", parents=[common, cf], help="remove old backups (never the newest good one)")
    pr.add_argument("structure")
    how = pr.add_mutually_exclusive_group(required=True)
    how.add_argument("--keep", type=int, metavar="N", help="keep the N newest backups")
    how.add_argument("--older-than", metavar="AGE", help="remove backups older than AGE (e.g. 7d, 12h)")
    pr.set_defaults(func=cmd_prune)
    sch = sub.add_parser("schedule", parents=[common, cf], help="back up structures every N seconds (a daemon)")
    sch.add_argument("--interval", type=float, required=True, metavar="SECONDS")
    sch.add_argument("--structure", action="append", default=[], help="structure to back up (default: all ACTIVE)")
    sch.set_defaults(func=cmd_schedule)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("cfbackup", args, args.func, EXPECTED_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
