"""`cfemu conn`: DISPLAY CONN, every member's connections, through each member's service (the operator's
``connections`` operation, sqm.service.conn_ops).

  cfemu conn [--member QM1] [--server HOST:PORT ...] [--server-ca CA.pem] [--json]

The members are those given with --server, else the local cluster's (cluster.json). Each connection's row: the
member, its connection number, the application name its client gave (``Client(client_name=...)``), how it
authenticated (its role and the proof: sqm.service.conn_ops), its logged-on user, its peer address, TLS or not (and
the subject of its client certificate under mutual TLS), when it connected, its last request, the requests it made, and its open unit of work (id, state, age). The application
name and the user are marked claimed: they are what the client said, and the table shows them escaped and cut
(a name is any string a client chose: it must not pass for another row, a terminal's escape or the table's
markup). An operator token is needed (an application's is refused the operation); a member that does not answer
has a row of its own saying why, and the exit code is then 75 (retry later).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.markup import escape

from cfemu.clitools import CLIError, Output, add_settings_arguments, settings
from qsg.cli_common import Parents, Parser, endpoint
from qsg.local_group import LocalGroup, LocalGroupError
from qsg.member_answers import Answered, ask_each_member, name_unanswered, raise_if_partial
from sqm.operations import OPERATOR, one_line
from sqm.service.client import Client, client_tls_context

CLAIM_CHARS = 32  # what the table shows of a claimed name at most (the rest is in --json)
# How each way of authenticating reads in the table: what the member verified of the connection.
PROOFS = {"challenge": "token proven", "bearer": "token sent", "none": "member runs --no-auth: nothing proven"}
CLAIMED_NOTE = ("application and user are what each client said, not checked: any holder of the application "
                "token, or a connection still in its handshake, can claim any name. What the member verified: "
                "authenticated (the role's token), peer, TLS and a client certificate (mutual TLS: with one "
                "per application, the name to trust).")


def conn_arguments(parser: Parser, parents: Parents) -> None:
    parser.add_argument("--member", action="append", default=[], metavar="QM",
                        help="only this member's connections (repeat for several)")
    member_arguments(parser)


def member_arguments(parser: argparse.ArgumentParser) -> None:
    """--server and --server-ca: the members' services to ask (default: the local cluster's)."""
    parser.add_argument("--server", action="append", default=[], metavar="HOST:PORT", type=endpoint,
                        help="a member's service (repeat for each); default: every member of the local cluster")
    parser.add_argument("--server-ca", metavar="PEM",
                        help="the CA (or certificate) that signed the members' TLS certificates, when they serve TLS")
    add_settings_arguments(parser, "token")


def endpoints(args: argparse.Namespace, *, required: bool = True) -> list[str]:
    """The members' service endpoints: --server, else the local cluster's (none found: an error when required)."""
    if args.server:
        return list(args.server)
    found = settings(args)
    if found.cluster_dir is not None:
        try:
            return [f"{host}:{port}" for _, host, port in LocalGroup.load(found.cluster_dir).endpoints]
        except LocalGroupError as e:
            raise CLIError(f"cannot read the local cluster in {found.cluster_dir}: {e}") from None
    if not required:
        return []
    raise CLIError("no members to ask: give --server HOST:PORT (each member's service), or run beside a local "
                   "cluster ('cfemu cluster up', --cluster-dir)")


def ask_members(args: argparse.Namespace, servers: list[str] | None = None) -> list[dict[str, Any]]:
    """Each member's ``connections`` reply, with its endpoint; a member that did not answer as
    {"server": ..., "error": ...}. ``servers``: those to ask (default: ``endpoints``). Refused for want of an operator token: a CLIError naming the token to give."""
    found = settings(args)
    if found.token_role != OPERATOR:
        raise CLIError("the members' connections are an operator's to see: give the operator token (--token, "
                       "$SQM_OPERATOR_TOKEN or the group's secrets), not the application's")
    tls = client_tls_context(args.server_ca) if args.server_ca else None
    answers = ask_each_member(endpoints(args) if servers is None else servers, Client.connections,
                              token=found.token, role=OPERATOR, tls=tls)
    return [{**a.reply, "server": a.server} if isinstance(a, Answered) else {"server": a.server, "error": a.error}
            for a in answers]


def _since(t: float | None, now: float) -> str:
    if not t:
        return "-"
    age = max(0.0, now - t)
    stamp = time.strftime("%H:%M:%S", time.localtime(t))
    return f"{stamp} ({age:.0f}s ago)" if age < 3600 else f"{stamp} ({age / 3600:.1f}h ago)"


def claimed(value: str | None) -> str:
    """A name the client gave, as the table shows it: marked claimed, escaped (control characters, the table's
    markup), cut; "-" when it gave none."""
    if not value:
        return "-"
    return escape(one_line(value, CLAIM_CHARS)) + " (claimed)"


def authenticated(row: dict[str, Any]) -> str:
    """What the member verified of the connection's role: NO while it is still in its handshake."""
    method = row.get("auth")
    if row["role"] is None:
        return "NO (handshake)"
    return f"{row['role']} ({PROOFS.get(str(method), 'proof unknown')})"


def tls(row: dict[str, Any]) -> str:
    """TLS or not, and the subject of the client certificate the member verified (mutual TLS)."""
    if not row["tls"]:
        return "no"
    cert = row.get("certificate")
    return f"yes, cert {escape(one_line(cert, 64))} (verified)" if cert else "yes"


def _uow(u: dict[str, Any] | None) -> str:
    return "-" if u is None else f"{u['id']} {u['state']} {u['age_s']:.0f}s"


def cmd_conn(args: argparse.Namespace, out: Output) -> int:
    docs = ask_members(args)
    if args.member:
        known = {d.get("qmgr") for d in docs} | {d["server"] for d in docs}
        unknown = [m for m in args.member if m not in known]
        if unknown:
            names = ", ".join(sorted(str(d.get("qmgr")) for d in docs if "qmgr" in d)) or "none answered"
            raise CLIError(f"no member {unknown[0]} among those asked (members: {names})")
        docs = [d for d in docs if d.get("qmgr") in args.member or d["server"] in args.member]
    rows = [{"qmgr": d["qmgr"], "server": d["server"], **c} for d in docs if "error" not in d
            for c in d["connections"]]
    failed = [{"server": d["server"], "error": d["error"]} for d in docs if "error" in d]
    if args.json:
        out.json({"connections": rows, "unreachable": failed})
    else:
        now = time.time()
        out.table("connections", ["SQM", "conn", "application", "authenticated", "user", "peer", "TLS",
                                  "connected", "last request", "requests", "open UOW"],
                  [(r["qmgr"], r["connection"], claimed(r["application"]), authenticated(r), claimed(r["user"]),
                    r["peer"], tls(r), _since(r["connected"], now),
                    _since(r["last_request"], now), r["requests"], _uow(r["uow"])) for r in rows])
        if rows:
            out.line(CLAIMED_NOTE)
        name_unanswered(out, failed)
    raise_if_partial(failed)
    return 0


__all__ = ["ask_members", "cmd_conn", "conn_arguments", "endpoints", "member_arguments"]
