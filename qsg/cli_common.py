"""What the `cfemu` verbs share (qsg.cli and its verb modules, qsg/*_cli.py): the errors they expect beyond
cfemu.clitools.COMMON_ERRORS, their exit codes, their parsers' class and the argument types of their numbers, the
argument groups their parsers take as parents, and the admin client of the CF the settings find. Nothing here
imports a verb module, so every verb module can import it.

Exit codes of every `cfemu` verb (docs/runbook.md, "Exit codes"):

  0   done
  1   done, and the answer is no (a status with a process down, a get that found no message, ...)
  2   usage or a refusal: a bad argument (one line: ``cfemu put: error: argument --count: ...``), or an error that
      the same command will meet again (no such queue, not authorized, a bad backup, ...): fix the command
  75  retry later (EX_TEMPFAIL): the CF or the members do not answer or are busy, a structure is failed or being
      recovered, a backup is running, a limit is reached for now; the same command may succeed later
  130 interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import redis

from cfemu import credentials
from cfemu.admin import Admin
from cfemu.clitools import (  # noqa: F401 - Parser, seconds and whole: every verb module takes them from here
    CLIError,
    Output,
    Parser,
    add_settings_arguments,
    lease_ms,
    require_url,
    run_command,
    seconds,
    settings,
    whole,
)
from cfemu.connection import connect
from cfemu.embedded import ServerError
from cfemu.errors import MQError, StructureFailedError, StructureMigratedError, StructureNotInCFError

OPERATOR_QM = "OPS"  # the short-lived in-process queue manager of one-shot put/get
# How long a command's client of --server endpoints tries for its first connection, its TLS and its handshake
# included (Client's first_connect_timeout): a server that is not there, or does not answer, is one line within a
# few seconds, naming its address, where the client's retries took 15 s; room enough for a member several hundred
# ms of round trip away (a connection, TLS and the handshake's exchanges: four or five round trips).
FIRST_CONNECT_S = 3.0

# Beyond clitools.COMMON_ERRORS: the embedded CF's and the local group's errors (LocalGroupError is a RuntimeError).
EXPECTED_ERRORS = (ServerError, RuntimeError)

EXIT_USAGE = 2  # argparse's own: a bad command line, or a refusal the same command meets again
EXIT_RETRY_LATER = 75  # EX_TEMPFAIL (sysexits.h): the same command may succeed later

# The MQ reasons of a condition that passes: the CF structure failed or recovering (2373), a local limit or a
# structure taking no new work for now (2102: MQRC_RESOURCE_PROBLEM), a backup running (2362), no queue manager
# available (2059), one shutting down (2161), its connection limit reached (2025).
RETRY_LATER_REASONS = frozenset({2373, 2102, 2362, 2059, 2161, 2025})
# The CF's replies of a server that works but cannot serve now (a script running, loading, a cluster failing over).
RETRY_LATER_REPLIES = ("BUSY", "LOADING", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN")


class RetryLaterError(CLIError):
    """A one-line error for a condition that passes (the CF does not answer): exit EXIT_RETRY_LATER."""


def exit_code(e: BaseException) -> int:
    """The exit status of a verb that failed with e: EXIT_RETRY_LATER when trying again later may succeed, else
    EXIT_USAGE. A call whose outcome is unknown (the reply was lost: it may have been applied) is not 'retry later':
    the operator must look first."""
    if isinstance(e, RetryLaterError):
        return EXIT_RETRY_LATER
    if isinstance(e, StructureFailedError) and (e.maybe_applied or isinstance(e, StructureNotInCFError)):
        return EXIT_USAGE  # not there at all: defined by nobody, or lost with the CF; the operator looks
    if isinstance(e, StructureMigratedError):
        return EXIT_USAGE  # MIGRATED until an operator reopens it: a retry would wait for ever
    if isinstance(e, MQError):
        return EXIT_RETRY_LATER if e.reason in RETRY_LATER_REASONS else EXIT_USAGE
    if isinstance(e, redis.exceptions.ResponseError):
        return EXIT_RETRY_LATER if str(e).startswith(RETRY_LATER_REPLIES) else EXIT_USAGE
    if isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, ConnectionError,
                      TimeoutError)):
        return EXIT_RETRY_LATER
    return EXIT_USAGE


def run_verb(prog: str, args: argparse.Namespace, func: Callable[[argparse.Namespace, Output], int],
             expected: tuple[type[BaseException], ...] = EXPECTED_ERRORS) -> int:
    """cfemu.clitools.run_command with the exit codes above."""
    return run_command(prog, args, func, expected, exit_code)


class Parents(NamedTuple):
    """The argument groups a verb's parser takes as parents (qsg.cli.Verb.parents names them)."""

    common: argparse.ArgumentParser  # --json, --verbose
    where: argparse.ArgumentParser   # the CF, the log root, the cluster or CF directory to take them from
    server: argparse.ArgumentParser  # --server endpoints (else an in-process SQM), their token, --qm-name


def endpoint(text: str) -> str:
    """An argparse type: a member's service as HOST:PORT (sqm.service.client.parse_endpoint's rule), refused in
    one line when it is not one, before the command starts anything."""
    from sqm.service.client import parse_endpoint

    try:
        parse_endpoint(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parents() -> Parents:
    common = Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
    where = Parser(add_help=False)
    add_settings_arguments(where, "redis_url", "log_root", "cluster_dir", "cf_dir")
    server = Parser(add_help=False)
    server.add_argument("--server", action="append", default=[], metavar="HOST:PORT", type=endpoint,
                        help="go through an SQM server (repeat for failover); default: an in-process SQM")
    add_settings_arguments(server, "token")
    server.add_argument("--qm-name", default=OPERATOR_QM, help=f"in-process SQM name (default {OPERATOR_QM})")
    server.add_argument("--lease-ms", type=lease_ms, default=5000,
                        help="in-process SQM: its lease in ms (default 5000; >= 500, as 'sqm run')")
    return Parents(common, where, server)


@contextmanager
def admin_client(args: argparse.Namespace) -> Iterator[Admin]:
    """An Admin of the CF the settings find, which answers (else a one-line error); closed after the block."""
    url = require_url(settings(args))
    client = connect(url)
    try:
        client.ping()
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        raise RetryLaterError(f"the CF at {credentials.redact(url)} does not answer: {e}") from None
    try:
        yield Admin(client)
    finally:
        client.close()
