"""What the `cfemu` verbs share (qsg.cli and its verb modules, qsg/*_cli.py): the errors they expect beyond
cfemu.clitools.COMMON_ERRORS, the argument groups their parsers take as parents, and the admin client of the CF
the settings find. Nothing here imports a verb module, so every verb module can import it."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import redis

from cfemu import credentials
from cfemu.admin import Admin
from cfemu.clitools import CLIError, add_settings_arguments, require_url, settings
from cfemu.connection import connect
from cfemu.embedded import ServerError

OPERATOR_QM = "OPS"  # the short-lived in-process queue manager of one-shot put/get

# Beyond clitools.COMMON_ERRORS: the embedded CF's and the local group's errors (LocalGroupError is a RuntimeError).
EXPECTED_ERRORS = (ServerError, RuntimeError)


class Parents(NamedTuple):
    """The argument groups a verb's parser takes as parents (qsg.cli.Verb.parents names them)."""

    common: argparse.ArgumentParser  # --json, --verbose
    where: argparse.ArgumentParser   # the CF, the log root, the cluster or CF directory to take them from
    server: argparse.ArgumentParser  # --server endpoints (else an in-process SQM), their token, --qm-name


def parents() -> Parents:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
    where = argparse.ArgumentParser(add_help=False)
    add_settings_arguments(where, "redis_url", "log_root", "cluster_dir", "cf_dir")
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument("--server", action="append", default=[], metavar="HOST:PORT",
                        help="go through an SQM server (repeat for failover); default: an in-process SQM")
    add_settings_arguments(server, "token")
    server.add_argument("--qm-name", default=OPERATOR_QM, help=f"in-process SQM name (default {OPERATOR_QM})")
    return Parents(common, where, server)


@contextmanager
def admin_client(args: argparse.Namespace) -> Iterator[Admin]:
    """An Admin of the CF the settings find, which answers (else a one-line error); closed after the block."""
    url = require_url(settings(args))
    client = connect(url)
    try:
        client.ping()
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        raise CLIError(f"the CF at {credentials.redact(url)} does not answer: {e}") from None
    try:
        yield Admin(client)
    finally:
        client.close()
