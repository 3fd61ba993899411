"""`cfemu exporter`: the CF's INFO as Prometheus metrics (cfemu.cf_exporter), a daemon of its own for a group
whose CF no `cfemu cluster` supervisor tends (docker-compose, an external Redis): the supervisor of a local group
serves the same metrics already.

  cfemu exporter [--port N] [--host 127.0.0.1] [--redis-url URL | --cluster-dir DIR | --cf-dir DIR]

It reads INFO on each scrape (at most 2 s each, so a hung CF never hangs the scrape) as the operator's CF user,
until SIGTERM or SIGINT. The metrics and the alerts on them: docs/metrics.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

import redis

from cfemu import credentials, exposition
from cfemu.cf_exporter import INFO_TIMEOUT_S, CFInfoCollector
from cfemu.clitools import Output, require_url, settings
from cfemu.connection import connect
from cfemu.signals import handling
from qsg.cli_common import Parents, whole


def cmd_exporter(args: argparse.Namespace, out: Output) -> int:
    url = require_url(settings(args))

    def cf() -> redis.Redis:
        return connect(url, socket_timeout=INFO_TIMEOUT_S, socket_connect_timeout=INFO_TIMEOUT_S)

    stop = threading.Event()
    with handling((signal.SIGTERM, signal.SIGINT), lambda *_: stop.set(), in_thread=True):
        port = exposition.serve([CFInfoCollector(cf)], args.host, args.port)
        where = {"metrics": f"http://{args.host}:{port}/metrics", "cf": credentials.redact(url)}
        if args.json:
            out.json(where)
        else:
            out.line(f"serving the CF's metrics ({where['cf']}) on {where['metrics']} until SIGTERM")
        sys.stdout.flush()  # the address, at once, to whoever started it (a pipe is block-buffered)
        stop.wait()
    return 0


def exporter_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    p.add_argument("--port", type=whole(0, 65535), default=9121,
                   help="the metrics port (default 9121; 0: any free port, printed)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the metrics address (default 127.0.0.1: the metrics have no authentication)")
