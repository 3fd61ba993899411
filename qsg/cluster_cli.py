"""`cfemu cluster up|status|down|restart|stop`: a local group of processes (qsg.local_group): the CF and the SQM
servers (restarted by the group's supervisor when they die, hang or are fenced: qsg.group_supervisor), the backup
scheduler, optionally a duplexed CF, a Redis Cluster CF or Spark.

  cfemu cluster restart QM2   an operator's restart: SIGTERM (a shutdown checkpoint), SIGKILL after --timeout,
                              started again on its ports; returns once it serves, with how long it took
  cfemu cluster stop QM2      stopped the same way and held: the supervisor does not restart it until
                              'cfemu cluster restart QM2'
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from backup.catalog import parse_age
from cfemu.clitools import CLIError, Output, cf_name, check_directory_settings, lease_ms
from cfemu.settings import find_cluster_dir, parse_size
from qsg.cli_common import Parents, seconds, whole


def age(text: str) -> str:
    """An age as cfbackup takes it (7d, 12h, 30m), checked here so that a bad one fails before anything starts."""
    parse_age(text)
    return text


def spark_memory(text: str) -> str:
    """An argument type: a Spark worker's memory, a size as cfemu.settings.parse_size reads it, in Spark's units
    (whole MiB), so that a bad one is refused before anything is started."""
    try:
        size = parse_size(text, what="--spark-memory")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--spark-memory: ")) from None
    if size < 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} is below the least a Spark worker can offer, 1 MiB")
    return f"{size >> 20}m"


def cmd_cluster(args: argparse.Namespace, out: Output) -> int:
    from qsg.local_group import LocalGroup

    check_directory_settings(args, "cluster_dir")
    d = find_cluster_dir(args.cluster_dir)
    if args.action == "up":
        t0 = time.monotonic()
        with out.console.status("starting the CF, the SQM servers, the backup scheduler"
                                + (f" and a Spark master with {args.spark} worker(s)" if args.spark else "") + "...",
                                spinner="dots") if not args.json and out.console.is_terminal else _nothing():
            cluster = LocalGroup.up(d, managers=args.managers, backup_interval=args.backup_interval or None,
                                    lease_ms=args.lease_ms, token=args.token, detach=True,
                                    structure=args.structure or None, queues=args.queue or ("Q1", "Q2"),
                                    restart_cf=args.cf_restart, recauto=args.recauto, spark_workers=args.spark,
                                    spark_cores=args.spark_cores, spark_memory=args.spark_memory,
                                    duplex=args.duplex, redis_cluster=args.redis_cluster,
                                    restart_members=args.member_restart, rest=args.rest,
                                    backup_keep=args.backup_keep, backup_keep_age=args.backup_keep_age,
                                    console=args.console, cf_socket=args.cf_socket)
        doc = cluster.status()
        doc["seconds"] = round(time.monotonic() - t0, 2)
    elif args.action == "down":
        cluster = LocalGroup.load(d)
        killed = cluster.down(timeout=args.timeout, purge=args.purge)
        left = {} if args.purge else cluster.running_processes()
        doc = {"dir": str(d), "killed_after_timeout": killed, "still_running": left, "purged": args.purge}
        if args.json:
            out.json(doc)
        else:
            out.line(f"cluster in {d} is down" + (" and purged" if args.purge else "")
                     + (f"; SIGKILLed after {args.timeout:g}s: {', '.join(killed)}" if killed else ""))
        return 0 if not left else 1
    elif args.action in ("restart", "stop"):
        return _member_action(LocalGroup.load(d), args, out)
    else:
        doc = LocalGroup.load(d).status()
    if args.json:
        out.json(doc)
    else:
        rest = any(p.get("rest") for p in doc["processes"])
        out.table(f"cluster {doc['dir']}", ["process", "pid", "alive", "ready", "address", "metrics",
                                            *(["REST"] if rest else []), "restarts", "last restart"],
                  [(p["process"], p["pid"], "yes" if p["alive"] else "NO", "yes" if p["ready"] else "no",
                    p["address"], p.get("metrics"), *([p.get("rest", "")] if rest else []), p.get("restarts", ""),
                    _last_restart(p))
                   for p in doc["processes"]])
        out.line(f"CF {doc['redis_url']}" + (f" and unix://{doc['cf_socket']}" if doc.get("cf_socket") else "")
                 + f"   logs {doc['log_root']}   backups {doc['backup_dir']}"
                 + (f"   Spark {doc['spark_master']}" if doc.get("spark_master") else ""))
        if doc.get("cf_server"):
            server = doc["cf_server"]
            out.line(f"CF server {server['server']} {server['version']} ({server['binary']})")
        console = next((p for p in doc["processes"] if p["process"] == "console"), None)
        if console is not None:
            out.line(f"console {console['address']} (log in with the token in {doc['dir']}/secrets/operator.token)")
        if doc.get("duplex"):
            pair = doc["duplex"]
            out.line(f"duplexed CF: {pair['mode']} (generation {pair['generation']}), primary {pair['primary']}, "
                     f"secondary {pair['secondary'] or '-'} {pair['secondary_state']}; promotions "
                     f"{pair['promotions']}, degrades {pair['degrades']}, resyncs {pair['resyncs']}")
    return 0 if all(p["alive"] for p in doc["processes"]) else 1


def _member_action(cluster: Any, args: argparse.Namespace, out: Output) -> int:
    if not args.member:
        raise CLIError(f"cfemu cluster {args.action}: name the member (one of {', '.join(cluster.names)})")
    if not cluster.cf_alive():  # a member started now would only fail to join, its whole log in the error
        raise CLIError(f"cfemu cluster {args.action} {args.member}: the cluster in {cluster.dir} is down (its CF does "
                       f"not run): 'cfemu cluster up --dir {cluster.dir}' starts it, members included")
    if args.action == "stop":
        doc = cluster.stop_member(args.member, timeout=args.timeout)
        text = (f"{doc['member']} stopped ({doc['stopped_by']}, {doc['stop_seconds']:g}s); the supervisor leaves it "
                f"stopped until 'cfemu cluster restart {doc['member']}'")
    else:
        doc = cluster.restart_member(args.member, timeout=args.timeout, start_timeout=args.start_timeout)
        text = (f"{doc['member']} restarted in {doc['seconds']:g}s: stopped ({doc['stopped_by']}) in "
                f"{doc['stop_seconds']:g}s, serving {doc['start_seconds']:g}s after its start; pid {doc['old_pid']} "
                f"-> {doc['pid']}")
    if args.json:
        out.json(doc)
    else:
        out.line(text)
    return 0


def _last_restart(row: dict[str, Any]) -> str:
    """When and why the supervisor last restarted a process, and why an operator holds a member."""
    last = row.get("last_restart")
    text = (time.strftime("%H:%M:%S", time.localtime(last["at"])) + f" {last['reason']}") if last else ""
    if row.get("held"):
        text = f"{row['held']}" + (f"; {text}" if text else "")
    return text


@contextmanager
def _nothing() -> Iterator[None]:
    yield



def cluster_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    p.add_argument("action", choices=["up", "status", "down", "restart", "stop"])
    p.add_argument("member", nargs="?", help="restart, stop: the member (QM1, ...)")
    p.add_argument("--cluster-dir", "--dir", dest="cluster_dir",
                   help="its directory (default $CFEMU_CLUSTER_DIR, else the nearest var/cluster, else var/cluster)")
    p.add_argument("--managers", type=whole(1, 32), default=3)
    p.add_argument("--backup-interval", type=seconds(), default=10.0, help="seconds between backups (0: none)")
    p.add_argument("--backup-keep", type=whole(0), default=5, metavar="N",
                   help="the scheduler keeps the newest N good backups of each structure (0: all) and removes "
                        "older ones no restore can need")
    p.add_argument("--backup-keep-age", type=age, metavar="AGE",
                   help="the scheduler also keeps every good backup started within AGE (e.g. 7d, 12h)")
    p.add_argument("--lease-ms", type=lease_ms, default=5000)
    p.add_argument("--token", help="the application token clients must prove they hold (default: the group's "
                                   "service.token, made at the first 'up')")
    p.add_argument("--structure", default="APP1", type=cf_name("structure", empty=True), help="structure to define if missing ('' for none)")
    p.add_argument("--queue", action="append", type=cf_name("queue"), help="queue to define on it (default Q1, Q2)")
    p.add_argument("--no-cf-restart", dest="cf_restart", action="store_false",
                   help="up: no supervisor restarting a dead CF (default: restarted, empty, on the same port)")
    p.add_argument("--no-member-restart", dest="member_restart", action="store_false",
                   help="up: the supervisor does not restart a member that died or was fenced (default: restarted, "
                        "after 1 s doubling to 30 s)")
    p.add_argument("--no-recauto", dest="recauto", action="store_false",
                   help="up: define the structure with RECAUTO off (a lost structure waits for 'cfrestore run')")
    p.add_argument("--spark", type=whole(0), default=0, metavar="N",
                   help="up: also a standalone Spark master and N workers on 127.0.0.1, from the installed pyspark "
                        "(cfrestore run --engine spark then uses it; docs/spark.md)")
    p.add_argument("--spark-cores", type=whole(1), default=1, help="up: cores each Spark worker offers")
    p.add_argument("--spark-memory", type=spark_memory, default="2g", metavar="SIZE",
                   help="up: memory each Spark worker offers, e.g. 2g, 512m or 3GiB (k, m, g: binary units, as "
                        "Spark reads them; at least 1 MiB)")
    p.add_argument("--rest", action="store_true",
                   help="up: give each member the IBM MQ messaging REST API on a loopback port (docs/rest.md), "
                        "shown by 'cfemu cluster status'")
    p.add_argument("--console", action="store_true",
                   help="up: also the group's web console on a loopback port (docs/console.md), shown by "
                        "'cfemu cluster status'; log in with the operator token (secrets/operator.token)")
    p.add_argument("--duplex", action="store_true",
                   help="up: a duplexed CF, a second redis-server holding a synchronous copy (promoted when the "
                        "primary is lost; docs/runbook.md)")
    p.add_argument("--redis-cluster", type=whole(0, 16), default=0, metavar="N",
                   help="up: the CF as a Redis Cluster of N masters (3-16): the structures spread over them")
    p.add_argument("--no-cf-socket", dest="cf_socket", action="store_false",
                   help="up: the group's processes reach the CF over loopback TCP (default: over the CF's Unix-domain "
                        "socket, cf/cf.sock, which costs less CPU a call; its TCP port serves either way)")
    p.add_argument("--timeout", type=seconds(), default=10.0, help="down, restart, stop: seconds before SIGKILL")
    p.add_argument("--start-timeout", type=seconds(above=True), default=60.0,
                   help="restart: seconds the member may take to serve again")
    p.add_argument("--purge", action="store_true", help="down: also delete the directory (logs, backups)")
