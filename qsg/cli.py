"""cfemu: the operator's command line for the queue-sharing group.

  cfemu cf start|stop|status                    an embedded CF (Valkey or Redis) detached in a directory
  cfemu secrets init --dir DIR [--acl-file F]   the group's secrets, for a CF this command does not start
  cfemu define structure APP1 [--max-entries N] [--max-bytes N] [--recauto|--no-recauto]
  cfemu alter structure APP1 [--max-entries N] [--max-bytes N] [--recauto|--no-recauto]
  cfemu define queue Q1 --structure APP1 [--backout-threshold N --backout-queue BQ]
  cfemu define queue SVC --structure APP1 --uow [--max-uows N --max-messages N ...]   a service (docs/uow.md)
  cfemu status [QUEUE]                          structures, queues, members (lease, epoch, log range, UOWs);
                                                with QUEUE, its DISPLAY QSTATUS (handles, uncommitted, age, last put/get)
  cfemu conn [--member QM] [--server HOST:PORT]   every member's connections (DISPLAY CONN)
  cfemu put Q1 MESSAGE... | get Q1 | browse Q1  in process (a short-lived SQM), or --server HOST:PORT
  cfemu indoubt list | resolve UOW --commit|--backout --server HOST:PORT
  cfemu uow query UOWID | last | set-status UOWID STATUS | delete UOWID --server HOST:PORT [--user U]
  cfemu topic define|list, sub add|remove|list, publish TOPIC MESSAGE...   publish/subscribe (docs/pubsub.md)
  cfemu pstore status|connect|disconnect|no-new-uows|mode|start   each structure's persistent store (docs/pstore.md)
  cfemu backup ... | restore ...                cfbackup / cfrestore
  cfemu migrate unload|load|compare|status|reopen   a structure to another CF through files (docs/migration.md)
  cfemu exporter [--port N]                     the CF's INFO as Prometheus metrics, until stopped (docs/metrics.md)
  cfemu cluster up|status|down|restart|stop     a local group: CF and SQM servers (restarted when they die), backups
  cfemu console [--port N] [--tls-cert F --tls-key F]   the group's web console (docs/console.md)
  cfemu demo                                    the end-to-end demonstration
  cfemu chaos run|soak|check|kinds              the chaos test suite (docs/chaos.md)

Every verb is one row of ``VERBS``, which both the parser (``cfemu --help``) and the dispatch read. A verb cfemu
parses itself lives in a module of its family (qsg/*_cli.py) with the function that adds its arguments; a delegate
is another command line's ``main(argv)`` (everything after the verb is its own, --help included), imported only
when its verb runs, so that `cfemu status` does not load Spark's or the chaos suite's imports.

The CF, the log root and the servers' token are found as by every command (cfemu.settings): the flag, else the
environment ($REDIS_URL, $CFEMU_LOG_ROOT, $SQM_TOKEN), else the nearest cluster (--cluster-dir, $CFEMU_CLUSTER_DIR
or var/cluster here or above), else the CF of 'cfemu cf start' (--cf-dir, $CFEMU_CF_DIR or var/cf), else the
default. Tables are rich on a terminal and plain otherwise; --json prints one JSON document. Errors are one line
on stderr; --verbose adds the traceback (cfemu.clitools.run_command). Exit codes (qsg.cli_common): 2 a usage error or
a refusal, 75 retry later (the CF or a member unavailable or busy, a backup running), 1 a negative answer.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Any

from qsg.cli_common import Parser, parents, run_verb


@dataclass(frozen=True)
class Command:
    """A verb cfemu parses: ``run`` is "module:function" taking (args, out) (cfemu.clitools.run_command runs it),
    ``parents`` the argument groups of qsg.cli_common.Parents its parser takes, ``arguments`` "module:function"
    adding its own arguments (and sub-verbs) to its parser."""

    help: str
    run: str
    parents: tuple[str, ...] = ()
    arguments: str | None = None


@dataclass(frozen=True)
class Delegate:
    """A verb that is another command line: ``main`` is "module:function" taking argv (everything after the verb,
    --help included, after ``argv_prefix``: one main may serve several verbs)."""

    help: str
    main: str
    argv_prefix: tuple[str, ...] = ()
    prog: str | None = None  # given: passed to ``main`` as prog=, the name its usage and errors show


Verb = Command | Delegate

# Every verb of `cfemu`, in the order `cfemu --help` lists them.
VERBS: dict[str, Verb] = {
    "cf": Command("an embedded CF (redis-server) running detached", "qsg.cf_cli:cmd_cf", ("common",),
                  "qsg.cf_cli:cf_arguments"),
    "secrets": Command("the group's secrets (CF users, the service's application and operator tokens)",
                       "qsg.cf_cli:cmd_secrets", ("common",), "qsg.cf_cli:secrets_arguments"),
    "define": Command("define a structure or a queue", "qsg.define_cli:cmd_define", (),
                      "qsg.define_cli:define_arguments"),
    "alter": Command("change attributes of a defined structure (ALTER CFSTRUCT)", "qsg.define_cli:cmd_alter", (),
                     "qsg.define_cli:alter_arguments"),
    "status": Command("structures, queues and members; with QUEUE, its DISPLAY QSTATUS", "qsg.status_cli:cmd_status",
                      ("common", "where"), "qsg.status_cli:status_arguments"),
    "conn": Command("every member's connections: application, peer, TLS, requests, open UOW (DISPLAY CONN)",
                    "qsg.conn_cli:cmd_conn", ("common", "where"), "qsg.conn_cli:conn_arguments"),
    "put": Command("put messages (one UOW, committed)", "qsg.messages_cli:cmd_put", ("common", "where", "server"),
                   "qsg.messages_cli:put_arguments"),
    "get": Command("get messages (one UOW, committed)", "qsg.messages_cli:cmd_get", ("common", "where", "server"),
                   "qsg.messages_cli:get_arguments"),
    "browse": Command("browse messages (no UOW)", "qsg.messages_cli:cmd_browse", ("common", "where", "server"),
                      "qsg.messages_cli:browse_arguments"),
    "indoubt": Command("list or resolve in-doubt units of work (through the servers)", "qsg.uow_cli:cmd_indoubt",
                       (), "qsg.uow_cli:indoubt_arguments"),
    "uow": Command("a unit of work's status, through a member's service (docs/uow.md)", "qsg.uow_cli:cmd_uow", (),
                   "qsg.uow_cli:uow_arguments"),
    "topic": Delegate("define or list topics (docs/pubsub.md)", "qsg.pubsub_cli:main", ("topic",)),
    "sub": Delegate("subscriptions to a topic, through a member's service", "qsg.pubsub_cli:main", ("sub",)),
    "publish": Delegate("publish one publication to a topic, through a member's service", "qsg.pubsub_cli:main",
                        ("publish",)),
    "pstore": Delegate("each structure's persistent store: status, connect, disconnect, start modes "
                       "(docs/pstore.md)", "qsg.pstore_cli:main"),
    "backup": Delegate("cfbackup (same arguments)", "backup.cli:main", prog="cfemu backup"),
    "restore": Delegate("cfrestore (same arguments)", "restore.cli:main", prog="cfemu restore"),
    "migrate": Delegate("move a structure to another CF through files (docs/migration.md)", "qsg.migrate_cli:main"),
    "exporter": Command("serve the CF's INFO as Prometheus metrics, until stopped (docs/metrics.md)",
                        "qsg.exporter_cli:cmd_exporter", ("common", "where"), "qsg.exporter_cli:exporter_arguments"),
    "cluster": Command("a local group of processes", "qsg.cluster_cli:cmd_cluster", ("common",),
                       "qsg.cluster_cli:cluster_arguments"),
    "console": Command("the group's web console: status, charts and operator actions (docs/console.md)",
                       "qsg.console_cli:cmd_console", ("common", "where"), "qsg.console_cli:console_arguments"),
    "demo": Delegate("the end-to-end demonstration", "qsg.demo:main"),
    "chaos": Delegate("the chaos test suite (run, soak, check, kinds)", "qsg.chaos.cli:main"),
}


def load(target: str) -> Any:
    """The function a "module:function" target names (its module imported now)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def build_parser() -> argparse.ArgumentParser:
    shared = parents()
    parser = Parser(prog="cfemu", description="Operate a coupling-facility queue-sharing group.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB")
    for name, verb in VERBS.items():
        if isinstance(verb, Delegate):  # listed with its help; its arguments are its own command line's
            p = sub.add_parser(name, help=verb.help, add_help=False)
            p.add_argument("rest", nargs=argparse.REMAINDER)
            continue
        p = sub.add_parser(name, help=verb.help, parents=[getattr(shared, group) for group in verb.parents])
        if verb.arguments:
            load(verb.arguments)(p, shared)
    parser.set_defaults(cf_role="operator")  # the CF user this command connects as (cfemu.credentials)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = VERBS.get(argv[0]) if argv else None
    if isinstance(verb, Delegate):  # everything after the verb belongs to the delegate, --help included
        named = {"prog": verb.prog} if verb.prog else {}
        return int(load(verb.main)([*verb.argv_prefix, *argv[1:]], **named) or 0)
    args = build_parser().parse_args(argv)
    command = VERBS[args.command]
    assert isinstance(command, Command)
    return run_verb("cfemu", args, load(command.run))


__all__ = ["VERBS", "Command", "Delegate", "Verb", "build_parser", "load", "main"]


if __name__ == "__main__":
    sys.exit(main())
