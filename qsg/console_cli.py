"""`cfemu console`: the group's web console (qsg.console; docs/console.md), served until SIGTERM or Ctrl-C.

  cfemu console [--port 8470] [--host 127.0.0.1] [--tls-cert F --tls-key F] [--server HOST:PORT ...]
                [--server-ca F] [--interval 2] [--ready-file F]

The group is found as by every cfemu command (the nearest cluster, --cluster-dir, --redis-url ...). The operator
logs in with the group's operator token. Serving on another address than loopback needs TLS: a token typed into
the login form must not cross a network in clear. A cluster's members that serve TLS (their --tls-cert) are
checked against --server-ca, else against their own certificate (read from the cluster's settings: pinned); the
console serves TLS with the members' certificate when it is given none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import ssl
from typing import Any

from cfemu.clitools import (
    CLIError,
    Output,
    add_settings_arguments,
    configure_logging,
    output_file,
    tls_server_context,
)
from cfemu.connection import check_url
from cfemu.settings import find_cluster_dir, read_cluster_file
from qsg.cli_common import Parents, endpoint, seconds, whole
from sqm.service.client import client_tls_context
from sqm.service.config import is_loopback_host

DEFAULT_PORT = 8470
WHERE = ("redis_url", "log_root", "backup_dir", "cluster_dir", "cf_dir")


# A DNS name as a browser sends it in a Host header: dot-separated labels of letters, digits and hyphens, no label
# starting or ending with a hyphen, at most 63 characters a label and 253 in all.
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


def host_name(text: str) -> str:
    """An argument type: a DNS name (--allow-host), lower case; an address, a port, a URL or a blank is refused."""
    name = text.strip().lower().rstrip(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")) or \
            name.replace(".", "").isdigit():
        raise argparse.ArgumentTypeError(f"must be a DNS name such as console.example.com (no port, scheme or "
                                         f"path; an IP address is always allowed), not {text!r}")
    return name


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``name VALUE`` in a member's arguments (the cluster's manager_args), if there."""
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _tls(args: argparse.Namespace) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(the console's server context, the context that checks the members' certificates)."""
    state = read_cluster_file(find_cluster_dir(args.cluster_dir)) or {}
    member_args = [str(a) for a in state.get("manager_args") or []]
    cert = args.tls_cert or _flag(member_args, "--tls-cert")
    key = args.tls_key or _flag(member_args, "--tls-key")
    if bool(cert) != bool(key):
        raise CLIError("TLS needs both --tls-cert and --tls-key")
    served = None
    if cert and key:
        served = tls_server_context(cert, key)
    members = None
    if args.server_ca:
        members = client_tls_context(args.server_ca)
    elif _flag(member_args, "--tls-cert"):
        # The cluster's members serve TLS with a certificate on this host: trust exactly that one (pinned: it
        # is the trust anchor itself, whoever signed it).
        members = client_tls_context(_flag(member_args, "--tls-cert"))
        members.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return served, members


def cmd_console(args: argparse.Namespace, out: Output) -> int:
    from qsg.console.app import Console  # aiohttp and jinja2: only for this verb
    from qsg.console.source import GroupSource

    configure_logging(args.verbose)
    served, member_tls = _tls(args)
    if served is None and not is_loopback_host(args.host):
        raise CLIError(f"--host {args.host} is not loopback: the console serves it only with TLS (--tls-cert and "
                       "--tls-key), since the operator's token is typed into its login form")
    source = GroupSource({k: getattr(args, k) for k in WHERE if getattr(args, k, None)}, tuple(args.server),
                         member_tls)
    url = source.settings().redis_url
    if not url:
        raise CLIError("no CF found: pass --redis-url or --cluster-dir, set $REDIS_URL, or start one ('cfemu "
                       "cluster up' or 'cfemu cf start')")
    check_url(url)
    if not source.operator_token():
        raise CLIError("the group has no operator token, so nobody could log in: 'cfemu secrets init' makes one "
                       "(operator.token in the secrets directory), or set $SQM_OPERATOR_TOKEN")
    console = Console(source, interval_s=args.interval, allowed_hosts=args.allow_host)
    return asyncio.run(_serve(console, args, served, out))


async def _serve(console: Any, args: argparse.Namespace, served: ssl.SSLContext | None, out: Output) -> int:
    from sqm.http_guard import HttpLimits

    limits = HttpLimits(head_timeout_s=args.head_timeout, keepalive_timeout_s=args.keepalive_timeout,
                        max_connections=args.max_connections, max_connections_per_peer=args.max_connections_per_peer)
    runner = await console.serve(args.host, args.port, served, limits)
    port = int(runner.addresses[0][1])
    url = f"{'https' if served else 'http'}://{args.host}:{port}/"
    doc = {"pid": os.getpid(), "url": url, "port": port, "host": args.host, "tls": served is not None}
    if args.ready_file:
        tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, args.ready_file)
    if args.json:
        out.json(doc)
    else:
        out.line(f"console serving on {url} (log in with the group's operator token; Ctrl-C stops it)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


def console_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    add_settings_arguments(p, "backup_dir")
    p.add_argument("--host", default="127.0.0.1", help="the address to serve on (default 127.0.0.1; another needs TLS)")
    p.add_argument("--port", type=whole(0, 65535), default=DEFAULT_PORT,
                   help=f"the port (default {DEFAULT_PORT}; 0: any free one, see --ready-file)")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (default: the cluster members' own)")
    p.add_argument("--tls-key", help="the certificate's private key")
    p.add_argument("--server", action="append", default=[], metavar="HOST:PORT", type=endpoint,
                   help="a member's service endpoint (repeat; a local cluster's are found in its cluster.json)")
    p.add_argument("--server-ca", help="the CA that signed the members' certificates, when their service has TLS")
    p.add_argument("--interval", type=seconds(0.2, 3600), default=2.0,
                   help="seconds between two readings of the group (default 2)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME", type=host_name,
                   help="a DNS name the browser may use for the console besides its --host, localhost and this "
                        "machine's name (repeat); requests naming another are refused (DNS rebinding)")
    p.add_argument("--head-timeout", type=seconds(0, above=True), default=10.0,
                   help="seconds a new connection has to send a whole request head, else it is closed (default 10)")
    p.add_argument("--keepalive-timeout", type=seconds(0, above=True), default=30.0,
                   help="seconds a connection may stay idle between requests (default 30)")
    p.add_argument("--max-connections", type=whole(1), default=64,
                   help="connections open at once; past it a new one is closed at once (default 64)")
    p.add_argument("--max-connections-per-peer", type=whole(1), default=32,
                   help="connections open at once from one address (default 32)")
    p.add_argument("--ready-file", type=output_file, help="write {pid, url, port} here once serving")
