"""cfemu pstore: the persistent store of each structure (EntireX's PSTORE; docs/pstore.md).

  cfemu pstore status [STRUCTURE ...]                 each structure's state, start mode, connected or not, and
                                                      whether it takes new units of work
  cfemu pstore disconnect STRUCTURE                   DISCONNECT-PSTORE: persistent work is refused (in-progress
                                                      persistent work is backed out at its commit), non-persistent
                                                      work goes on, lifetimes stand still
  cfemu pstore connect STRUCTURE                      CONNECT-PSTORE: everything resumes
  cfemu pstore no-new-uows STRUCTURE --on|--off       only consuming work (--on); --off also clears the state the
                                                      structure set itself on reaching its capacity
  cfemu pstore mode STRUCTURE HOT|WARM|COLD           the start mode RECAUTO uses after a CF loss (default HOT)
  cfemu pstore start STRUCTURE --mode HOT|WARM|COLD [--yes | --confirm STRUCTURE]
                                                      start a failed or lost structure (or one running from a WARM
                                                      start): HOT restores its content, WARM starts it empty with
                                                      its persistent store disconnected (backups and logs kept for a
                                                      later HOT), COLD starts it empty for good (needs --yes or
                                                      --confirm with the structure's name)

The CF, the logs and the backups are found as by every command (cfemu.settings). --json prints one JSON document.
Errors are one line on stderr (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from backup.files import BackupError
from cfemu import repository
from cfemu.admin import Admin
from cfemu.bulk import NotOwnerError
from cfemu.cf import CF
from cfemu.clitools import CLIError, Output, add_settings_arguments, cf_name, require_url, settings
from cfemu.connection import connect
from cfemu.pstore import COLD, MODES, set_start_mode, status
from qsg.cli_common import Parser, run_verb
from restore.load import LoadVerifyError
from restore.run import RestoreError
from restore.start_modes import start
from sqm.log import LogCorruptError, LogFormatError

# A start runs a restore or a purge: it refuses with their errors, each one line as `cfrestore` gives it (a corrupt
# or foreign log, a load that does not verify, a claim another restore took), never a traceback.
EXPECTED_ERRORS = (RestoreError, BackupError, LogCorruptError, LogFormatError, LoadVerifyError, NotOwnerError)


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def cmd_status(args: argparse.Namespace, out: Output) -> int:
    found = settings(args)
    client = connect(require_url(found))
    try:
        rows = status(Admin(client), repository.GroupRepository(found.log_root))
    finally:
        client.close()
    if args.structures:
        unknown = set(args.structures) - {r.structure for r in rows}
        if unknown:
            raise CLIError(f"structure {', '.join(sorted(unknown))} is not defined")
        rows = [r for r in rows if r.structure in args.structures]
    if out.as_json:
        out.json([r.as_dict() for r in rows])
        return 0
    out.table("persistent stores", ["structure", "state", "start mode", "started", "connected", "no new UOWs",
                                    "entries"],
              [[r.structure, r.state, r.start_mode, r.started or "-", _yes_no(r.connected), r.no_new_uows or "no",
                f"{r.entries}/{r.max_entries or '-'}"] for r in rows])
    return 0


def _change(args: argparse.Namespace, out: Output, action: str, what: str) -> int:
    client = connect(require_url(settings(args)))
    try:
        before = CF(client).structure(args.structure).pstore()
        after = CF(client).structure(args.structure).pstore(action)
    finally:
        client.close()
    doc: dict[str, Any] = {"structure": args.structure, "state": after.state, "connected": after.connected,
                           "no_new_uows": after.no_new_uows, "started": after.started,
                           "changed": before != after}
    if out.as_json:
        out.json(doc)
    else:
        out.line(f"structure {args.structure}: {what}" + ("" if doc["changed"] else " (it was already)"))
    return 0


def cmd_disconnect(args: argparse.Namespace, out: Output) -> int:
    return _change(args, out, "disconnect", "persistent store disconnected: persistent work is refused")


def cmd_connect(args: argparse.Namespace, out: Output) -> int:
    return _change(args, out, "connect", "persistent store connected")


def cmd_no_new_uows(args: argparse.Namespace, out: Output) -> int:
    if args.on == args.off:
        raise CLIError("say --on or --off")
    if args.on:
        return _change(args, out, "nonew-on", "takes no new units of work: only consuming work is allowed")
    return _change(args, out, "nonew-off", "takes new units of work again")


def cmd_mode(args: argparse.Namespace, out: Output) -> int:
    repo = repository.GroupRepository(settings(args).log_root)
    mode = set_start_mode(repo, args.structure, args.mode)
    if out.as_json:
        out.json({"structure": args.structure, "start_mode": mode})
    else:
        out.line(f"structure {args.structure}: start mode {mode} after a CF loss")
    return 0


def cmd_start(args: argparse.Namespace, out: Output) -> int:
    mode = args.mode.upper()
    if mode == COLD and not (args.yes or args.confirm == args.structure):
        raise CLIError(f"a COLD start discards every message of {args.structure} for good: confirm with --yes or "
                       f"--confirm {args.structure}")
    found = settings(args)
    client = connect(require_url(found))
    try:
        done = start(client, args.structure, mode, backup_root=found.backup_dir, log_root=found.log_root,
                     backup_keys=found.backup_keys(accept_unsigned=args.accept_unsigned))
    finally:
        client.close()
    if out.as_json:
        out.json(done)
    else:
        out.line(f"structure {args.structure}: {mode} start: {done['summary']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    add_settings_arguments(common, "redis_url", "cluster_dir", "cf_dir", "log_root")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--verbose", "-v", action="store_true", help="show the traceback of an error")
    p = Parser(prog="cfemu pstore", description="The persistent store of each structure.")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    st = sub.add_parser("status", parents=[common], help="each structure's start mode and availability")
    st.add_argument("structures", nargs="*", metavar="STRUCTURE", type=cf_name("structure"))
    st.set_defaults(func=cmd_status)
    for verb, func, text in (("disconnect", cmd_disconnect, "refuse persistent work (DISCONNECT-PSTORE)"),
                             ("connect", cmd_connect, "accept persistent work again (CONNECT-PSTORE)")):
        v = sub.add_parser(verb, parents=[common], help=text)
        v.add_argument("structure", type=cf_name("structure"))
        v.set_defaults(func=func)
    nn = sub.add_parser("no-new-uows", parents=[common], help="only consuming work (--on), or all work (--off)")
    nn.add_argument("structure", type=cf_name("structure"))
    nn.add_argument("--on", action="store_true")
    nn.add_argument("--off", action="store_true")
    nn.set_defaults(func=cmd_no_new_uows)
    mode = sub.add_parser("mode", parents=[common], help="the start mode RECAUTO uses after a CF loss")
    mode.add_argument("structure", type=cf_name("structure"))
    mode.add_argument("mode", type=str.upper, choices=MODES)
    mode.set_defaults(func=cmd_mode)
    s = sub.add_parser("start", parents=[common], help="start a failed or lost structure HOT, WARM or COLD")
    s.add_argument("structure", type=cf_name("structure"))
    add_settings_arguments(s, "backup_dir")
    s.add_argument("--mode", required=True, type=str.upper, choices=MODES)
    s.add_argument("--yes", action="store_true", help="confirm a COLD start")
    s.add_argument("--confirm", metavar="STRUCTURE", help="confirm a COLD start by naming the structure")
    s.add_argument("--accept-unsigned", action="store_true", help="HOT: use a backup taken before backups were signed")
    s.set_defaults(func=cmd_start, cf_role="restore")
    p.set_defaults(cf_role="operator")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return run_verb("cfemu pstore", args, args.func, EXPECTED_ERRORS)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
