"""`cfemu indoubt` and `cfemu uow`: units of work through the members' services.

  cfemu indoubt list | resolve UOW --commit|--backout [--server HOST:PORT ...]   (default: the local cluster's members)
  cfemu uow query UOWID | last | set-status UOWID STATUS | delete UOWID --server HOST:PORT [--user U]
  cfemu uow set-uow-status UOWID ACCEPTED|CANCELLED --server HOST:PORT          (the operator's SET-UOW-STATUS)
"""

from __future__ import annotations

import argparse
from typing import Any

from cfemu.clitools import CLIError, Output, settings
from qsg.cli_common import FIRST_CONNECT_S, Parents, Parser, RetryLaterError
from qsg.conn_cli import endpoints
from qsg.member_answers import Answered, ask_each_member, name_unanswered, raise_if_partial, unanswered
from sqm.conversations.operator_status import TARGETS
from sqm.service.client import Client


def cmd_indoubt(args: argparse.Namespace, out: Output) -> int:
    """In-doubt UOWs of every member asked (--server, else every member of the local cluster: each member holds its
    own), and their resolution. A member that does not answer is named after the rows of those that did, and the
    exit status says the list is partial (75): an empty list must mean that nothing is in doubt."""
    found = settings(args)
    token, role = found.token, found.token_role
    servers = endpoints(args)
    rows, failed = ([], []) if args.action == "resolve" and args.server else _indoubt_rows(servers, token, role)
    if args.action == "resolve":
        if not args.server:  # the cluster's members: resolved on the one holding it (each resolves only its own)
            holders = [r["server"] for r in rows if r["uow"] == args.uow]
            if not holders:
                if failed:
                    raise RetryLaterError(f"unit of work {args.uow} is not in doubt on the members that answered, "
                                          f"and {len(failed)} did not: {failed[0]['server']}: {failed[0]['error']}")
                raise CLIError(f"unit of work {args.uow} is not in doubt on any member of the local cluster "
                               "('cfemu indoubt list' lists those that are)")
            servers = holders[:1]
        with Client(servers, token=token, role=role, client_name="cfemu", first_connect_timeout=FIRST_CONNECT_S) as c:
            c.resolve(args.uow, args.commit)
            where = c.qmgr
        outcome = "committed" if args.commit else "backed out"
        if args.json:
            out.json({"uow": args.uow, "outcome": outcome, "qmgr": where})
        else:
            out.line(f"unit of work {args.uow} {outcome} on {where}")
        return 0
    if args.json:
        out.json({"indoubt": rows, "unreachable": failed})
    else:
        out.table("in-doubt units of work", ["SQM", "UOW", "XID", "structures"],
                  [(r["qmgr"], r["uow"], r["xid"], ", ".join(r["structures"])) for r in rows])
        name_unanswered(out, failed)
    raise_if_partial(failed, "their in-doubt units of work are not listed")
    return 0


def _indoubt_rows(servers: list[str], token: str | None, role: str
                  ) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Each member's in-doubt UOWs (with its name and endpoint), and the members that did not answer."""
    answers = ask_each_member(servers, lambda c: [{**u, "qmgr": c.qmgr} for u in c.indoubt()], token=token,
                              role=role)
    rows = [{**u, "server": a.server} for a in answers if isinstance(a, Answered) for u in a.reply]
    return rows, unanswered(answers)


# What cfemu uow prints of a UOW's status (sqm.conversations.uowstatus.Control.public), in this order; the rest after.
UOW_FIELDS = ("uow", "service", "status", "user_status", "sender", "receiver", "messages", "bytes", "persistent",
              "persistent_status", "status_lifetime", "deliveries", "postponements", "conversation", "eoc",
              "lifetime_ms", "age_ms", "committed_ms", "deleted")


def cmd_uow(args: argparse.Namespace, out: Output) -> int:
    """SYNCPOINT QUERY, LAST, SETUSTATUS and DELETE through a member's service, logged on as --user (with
    --user-token): LAST finds that user's last UOW, SETUSTATUS needs its sender or receiver, DELETE its sender.
    SET-UOW-STATUS is the operator's (an operator token), with no logon."""
    if not args.server:
        raise CLIError(f"uow {args.action}: give --server HOST:PORT (a member's service: UOW statuses are read and "
                       "changed through a session on it)")
    found = settings(args)
    with Client(args.server, token=found.token, role=found.token_role, client_name="cfemu",
                first_connect_timeout=FIRST_CONNECT_S) as c:
        if args.action == "set-uow-status":  # the operator's: no logon
            doc = {**c.set_uow_status(args.uow_id, args.status), "qmgr": c.qmgr}
            if args.json:
                out.json(doc)
            else:
                out.line(f"unit of work {args.uow_id}: {doc['was']} -> {doc['status'] or 'no trace kept'} "
                         f"(SET-UOW-STATUS through {doc['qmgr']})"
                         + (f"; its messages moved to {doc['moved_to']}" if doc["moved_to"] else ""))
            return 0
        c.logon(args.user, args.user_token)
        if args.action == "query":
            doc = c.syncpoint("QUERY", args.uow_id)
        elif args.action == "last":
            doc = c.syncpoint("LAST")
        elif args.action == "set-status":
            doc = c.syncpoint("SETUSTATUS", args.uow_id, user_status=args.status.encode())
        else:
            doc = c.syncpoint("DELETE", args.uow_id)
        doc = {**doc, "qmgr": c.qmgr}
    if args.json:
        out.json(doc)
        return 0
    if args.action == "delete":
        out.line(f"unit of work {doc['uow']}: its status is deleted (no trace remains)")
        return 0
    order = [k for k in UOW_FIELDS if k in doc] + sorted(k for k in doc if k not in UOW_FIELDS)
    out.table(f"unit of work {doc.get('uow', '')} ({args.action}, through {doc['qmgr']})", ["field", "value"],
              [(k, "-" if doc[k] is None else doc[k]) for k in order])
    return 0



def indoubt_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    isub = p.add_subparsers(dest="action", required=True)
    il = isub.add_parser("list", parents=[parents.common, parents.server], help="in-doubt UOWs of each --server (default: every member of the local cluster)")
    il.set_defaults(uow=None)
    ir = isub.add_parser("resolve", parents=[parents.common, parents.server],
                         help="commit or back out an in-doubt UOW")
    ir.add_argument("uow")
    outcome = ir.add_mutually_exclusive_group(required=True)
    outcome.add_argument("--commit", dest="commit", action="store_true")
    outcome.add_argument("--backout", dest="commit", action="store_false")


def uow_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    usub = p.add_subparsers(dest="action", required=True)
    anyone, who = Parser(add_help=False), Parser(add_help=False)
    anyone.add_argument("--user", default="cfemu", help="the user id to log on with (default cfemu)")
    who.add_argument("--user", required=True, help="the user id to log on with (1-32 characters)")
    for group in (anyone, who):
        group.add_argument("--user-token", default="", metavar="TOKEN",
                           help="the user's token (with the user id, what LAST finds a user's work by)")
    uq = usub.add_parser("query", parents=[parents.common, parents.server, anyone],
                         help="SYNCPOINT QUERY: a UOW's status by its id")
    uq.add_argument("uow_id", metavar="UOWID")
    usub.add_parser("last", parents=[parents.common, parents.server, who],
                    help="SYNCPOINT LAST: the last UOW --user with --user-token sent")
    us = usub.add_parser("set-status", parents=[parents.common, parents.server, who],
                         help="SYNCPOINT SETUSTATUS: a UOW's user status (by its sender or receiver)")
    us.add_argument("uow_id", metavar="UOWID")
    us.add_argument("status", metavar="STATUS", help="the user status (text, at most 64 bytes)")
    uo = usub.add_parser("set-uow-status", parents=[parents.common, parents.server],
                         help="ETBCMD SET-UOW-STATUS (an operator's token): a POSTPONED UOW ACCEPTED now, or an "
                              "ACCEPTED or POSTPONED one CANCELLED")
    uo.add_argument("uow_id", metavar="UOWID")
    uo.add_argument("status", choices=TARGETS, help="the status to set")
    ud = usub.add_parser("delete", parents=[parents.common, parents.server, who],
                         help="SYNCPOINT DELETE: the kept status of a finished UOW (by its sender)")
    ud.add_argument("uow_id", metavar="UOWID")
