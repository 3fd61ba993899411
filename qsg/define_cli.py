"""`cfemu define` and `cfemu alter`: structures and queues, in the CF and, durably, in the group repository under
the log root (cfemu.repository).

  cfemu define structure APP1 [--max-entries N] [--max-bytes N] [--recauto|--no-recauto]
  cfemu alter structure APP1 [--max-entries N] [--max-bytes N] [--recauto|--no-recauto]
  cfemu define queue Q1 --structure APP1 [--backout-threshold N --backout-queue BQ]
  cfemu define queue SVC --structure APP1 --uow [--max-uows N --max-messages N ...]   a service (docs/uow.md)
  cfemu define uow-defaults [--uow-store|--no-uow-store] [--max-uows N] [--status-lifetime N]   the group's
"""

from __future__ import annotations

import argparse
from typing import Any

from cfemu import repository
from cfemu.clitools import CLIError, Output, cf_name, settings
from cfemu.limits import DEFAULT_MSG_LENGTH, MAX_DEFINED, MAX_MSG_LENGTH
from cfemu.uow_attributes import CONTROL_SUFFIX, DATA_SUFFIX, GROUP_FIELDS
from qsg.cli_common import Parents, admin_client, whole


def cmd_define(args: argparse.Namespace, out: Output) -> int:
    """In the CF and, durably, in the group repository under the log root (cfemu.repository)."""
    with admin_client(args) as admin:
        repo = repository.open_group_repository(admin, settings(args).log_root, who=f"cfemu define {args.kind}")
        if args.kind == "uow-defaults":
            given = {attr: getattr(args, opt) for opt, attr in UOW_OPTIONS.items()
                     if attr in GROUP_FIELDS and getattr(args, opt) is not None}
            defaults = repository.define_uow_defaults(admin, repo, given).to_dict()
            if args.json:
                out.json({"kind": args.kind, **defaults})
            else:
                out.table("the group's defaults for its services (a service's own attributes come first)",
                          ["attribute", "value"], sorted(defaults.items()))
            return 0
        if args.kind == "structure":
            d: Any = repository.define_structure(admin, repo, args.name, max_entries=args.max_entries,
                                                 max_bytes=args.max_bytes, replace=args.replace,
                                                 recauto=args.recauto)
        else:
            d = repository.define_queue(admin, repo, args.name, args.structure,
                                        backout_threshold=args.backout_threshold, backout_queue=args.backout_queue,
                                        max_msg_length=args.max_msg_length, replace=args.replace,
                                        uow=_uow_attributes(args))
    fields = dict(vars(d))
    if args.json:
        out.json({"kind": args.kind, **fields})
    else:
        uow = fields.pop("uow", None) or {}
        title = f"{'service' if uow else args.kind} {args.name} defined"
        if uow:
            title += f" (with {args.name}{DATA_SUFFIX} and {args.name}{CONTROL_SUFFIX})"
        out.table(title, ["attribute", "value"],
                  sorted(fields.items()) + sorted((f"uow.{k}", v) for k, v in uow.items()))
    return 0


# cfemu define queue's UOW options -> cfemu.uow_attributes.UowAttributes fields (seconds stay seconds).
UOW_OPTIONS = {"uow_store": "store", "max_uows": "max_uows", "max_messages": "max_messages",
               "uow_lifetime": "lifetime_s", "status_lifetime": "status_lifetime",
               "postpone_attempts": "postpone_attempts", "postpone_delay": "postpone_delay_s",
               "conv_nonact": "conv_nonact_s"}


def _uow_attributes(args: argparse.Namespace) -> dict[str, Any] | None:
    """The service attributes given (the rest keep their defaults), or None for a plain queue."""
    given = {attr: getattr(args, opt) for opt, attr in UOW_OPTIONS.items() if getattr(args, opt) is not None}
    if not args.uow:
        if given:
            flags = ", ".join("--" + opt.replace("_", "-") for opt in UOW_OPTIONS if getattr(args, opt) is not None)
            raise CLIError(f"{flags}: unit-of-work attributes need --uow (the queue is then a service)")
        return None
    return given


def cmd_alter(args: argparse.Namespace, out: Output) -> int:
    """ALTER CFSTRUCT: only the attributes given change; a structure the CF lost is altered in the group
    repository (restore recreates it from there)."""
    with admin_client(args) as admin:
        repo = repository.open_group_repository(admin, settings(args).log_root, who="cfemu alter structure")
        d = repository.alter_structure(admin, repo, args.name, max_entries=args.max_entries,
                                       max_bytes=args.max_bytes, recauto=args.recauto)
    fields = dict(vars(d))
    if args.json:
        out.json({"kind": "structure", **fields})
    else:
        out.table(f"structure {args.name} altered", ["attribute", "value"], sorted(fields.items()))
    return 0



def define_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    dsub = p.add_subparsers(dest="kind", required=True)
    ds = dsub.add_parser("structure", parents=[parents.common, parents.where], help="define a CF application structure")
    ds.add_argument("name", type=cf_name("structure"))
    ds.add_argument("--max-entries", type=whole(0, MAX_DEFINED), default=0, help="capacity in entries (0 = unlimited)")
    ds.add_argument("--max-bytes", type=whole(0, MAX_DEFINED), default=0, help="capacity in bytes of data (0 = unlimited)")
    ds.add_argument("--replace", action="store_true", help="change an existing definition")
    ds.add_argument("--recauto", action=argparse.BooleanOptionalAction, default=True,
                    help="RECAUTO: a member restores the structure by itself when it fails or the CF is lost "
                         "(default on, as in MQ)")
    dd = dsub.add_parser("uow-defaults", parents=[parents.common, parents.where],
                         help="the group's defaults for its services' STORE, MAX-UOWS and UWSTATP (docs/uow.md)")
    dd.add_argument("--uow-store", action=argparse.BooleanOptionalAction, default=None,
                    help="STORE: a UOW's messages persistent unless the service or the sender says otherwise")
    dd.add_argument("--max-uows", type=whole(0), default=None, help="MAX-UOWS of a service that gives none")
    dd.add_argument("--status-lifetime", type=whole(0, 254), default=None, metavar="N",
                    help="UWSTATP of a service that gives none: keep a UOW's status N lifetimes (0: not kept)")
    dq = dsub.add_parser("queue", parents=[parents.common, parents.where], help="define a shared queue")
    dq.add_argument("name", type=cf_name("queue"))
    dq.add_argument("--structure", required=True, type=cf_name("structure"))
    dq.add_argument("--backout-threshold", type=whole(0, MAX_DEFINED), default=0)
    dq.add_argument("--backout-queue", default="")
    dq.add_argument("--max-msg-length", type=whole(1, MAX_MSG_LENGTH), default=DEFAULT_MSG_LENGTH,
                    help=f"longest message body, bytes (1-{MAX_MSG_LENGTH}; default {DEFAULT_MSG_LENGTH})")
    dq.add_argument("--replace", action="store_true", help="change an existing definition")
    dq.add_argument("--uow", action="store_true",
                    help="a service: senders send units of work of several messages to it (docs/uow.md); its "
                         "messages and statuses live on NAME.UOWDATA and NAME.UOWCTL, defined with it")
    dq.add_argument("--uow-store", action=argparse.BooleanOptionalAction, default=None,
                    help="STORE: a UOW's messages persistent unless the sender says otherwise (default: the "
                         "group's, cfemu define uow-defaults; on)")
    dq.add_argument("--max-uows", type=whole(0), default=None, help="MAX-UOWS: active UOWs at once (0: none; "
                                                                 "default: the group's; 1000)")
    dq.add_argument("--max-messages", type=whole(1), default=None, help="MAX-MESSAGES-IN-UOW (default 16)")
    dq.add_argument("--uow-lifetime", type=whole(1), default=None, metavar="SECONDS",
                    help="UOW-DATA-LIFETIME, counted in the group's up-time (default 86400)")
    dq.add_argument("--status-lifetime", type=whole(0, 254), default=None, metavar="N",
                    help="UWSTATP: keep a UOW's status N lifetimes after it ends, 1-254, 0 not kept (default: the "
                         "group's; 0)")
    dq.add_argument("--postpone-attempts", type=whole(0), default=None, metavar="N",
                    help="POSTPONE-ATTEMPTS: a receiver's CANCEL postpones the UOW this many times (default 0)")
    dq.add_argument("--postpone-delay", type=whole(0), default=None, metavar="SECONDS",
                    help="POSTPONE-DELAY before a postponed UOW is ACCEPTED again (default 0)")
    dq.add_argument("--conv-nonact", type=whole(1), default=None, metavar="SECONDS",
                    help="CONV-NONACT: a conversation with no active UOW ends after this much idle up-time, and "
                         "its binding to a receiver with it (default 300)")



def alter_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    asub = p.add_subparsers(dest="kind", required=True)
    al = asub.add_parser("structure", parents=[parents.common, parents.where], help="alter a CF application structure")
    al.add_argument("name", type=cf_name("structure"))
    al.add_argument("--max-entries", type=whole(0, MAX_DEFINED), default=None, help="capacity in entries (0 = unlimited)")
    al.add_argument("--max-bytes", type=whole(0, MAX_DEFINED), default=None, help="capacity in bytes of data (0 = unlimited)")
    al.add_argument("--recauto", action=argparse.BooleanOptionalAction, default=None,
                    help="RECAUTO on or off (default: unchanged)")
