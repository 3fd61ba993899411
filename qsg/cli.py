"""cfemu: the operator's command line for the queue-sharing group.

  cfemu cf start|stop|status                    an embedded CF (redis-server) running detached in a directory
  cfemu define structure APP1 [--max-entries N] [--max-bytes N] [--recauto|--no-recauto]
  cfemu alter structure APP1 [--max-entries N] [--max-bytes N] [--recauto|--no-recauto]
  cfemu define queue Q1 --structure APP1 [--backout-threshold N --backout-queue BQ]
  cfemu define queue SVC --structure APP1 --uow [--max-uows N --max-messages N ...]   a service (docs/uow.md)
  cfemu status                                  structures, queues, members (lease, epoch, log range, UOWs)
  cfemu put Q1 MESSAGE... | get Q1 | browse Q1  in process (a short-lived SQM), or --server HOST:PORT
  cfemu indoubt list | resolve UOW --commit|--backout --server HOST:PORT
  cfemu uow query UOWID | last | set-status UOWID STATUS | delete UOWID --server HOST:PORT [--user U]
  cfemu backup ... | restore ...                cfbackup / cfrestore
  cfemu cluster up|status|down                  a local group: CF (restarted when it dies), SQM servers, backups
  cfemu demo                                    the end-to-end demonstration
  cfemu chaos run|soak|check|kinds              the chaos test suite (docs/chaos.md)

The CF, the log root and the servers' token are found as by every command (cfemu.settings): the flag, else the
environment ($REDIS_URL, $CFEMU_LOG_ROOT, $SQM_TOKEN), else the nearest cluster (--cluster-dir, $CFEMU_CLUSTER_DIR
or var/cluster here or above), else the CF of 'cfemu cf start' (--cf-dir, $CFEMU_CF_DIR or var/cf), else the
default. Tables are rich on a terminal and plain otherwise; --json prints one JSON document. Errors are one line
on stderr (exit 2); --verbose adds the traceback (cfemu.clitools.run_command).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import msgpack
import redis

from cfemu import cluster_cf, credentials, keys, repository
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.clitools import CLIError, Output, add_settings_arguments, require_url, run_command, settings
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis, ServerError
from cfemu.errors import NoMessageError
from cfemu.limits import DEFAULT_MSG_LENGTH, MAX_MSG_LENGTH
from cfemu.private_files import write_private
from cfemu.settings import find_cf_dir, find_cluster_dir
from cfemu.uow_attributes import CONTROL_SUFFIX, DATA_SUFFIX
from sqm.conversations.uowcontrols import LAST_LETTER
from sqm.conversations.uowstatus import Control
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.log import LogFormatError, LogReader
from sqm.service.client import Client
from sqm.service.metrics import last_backup_age
from sqm.wings import WINGS

OPERATOR_QM = "OPS"  # the short-lived in-process queue manager of one-shot put/get

# Beyond clitools.COMMON_ERRORS: the embedded CF's and the cluster's errors (ClusterError is a RuntimeError).
EXPECTED_ERRORS = (ServerError, RuntimeError)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _body_text(body: bytes, limit: int = 60) -> str:
    try:
        text = body.decode()
    except UnicodeDecodeError:
        text = body.hex()
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- finding the CF, the logs, the servers ---------------------------------------------------------------------
@contextmanager
def admin_client(args: argparse.Namespace) -> Iterator[Admin]:
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


class MessagingHandle(Protocol):
    """What put/get/browse need: sqm.core.connection.Connection and sqm.service.client.Client both have it."""

    def put(self, queue: str, body: bytes, *, persistent: bool = ..., priority: int = ...,
            correlid: bytes = ...) -> Any: ...

    def get(self, queue: str, *, wait_ms: int = ...) -> Any: ...

    def browse(self, queue: str, limit: int = ...) -> list[Any]: ...

    def commit(self) -> None: ...

    def backout(self) -> None: ...


@contextmanager
def messaging(args: argparse.Namespace) -> Iterator[MessagingHandle]:
    """A client of --server endpoints, or a short-lived in-process SQM (OPS) whose log goes to the log root, so
    restore sees what it did. Whatever is left uncommitted when the block fails is backed out."""
    found = settings(args)
    if args.server:
        client = Client(args.server, token=found.token, role=found.token_role, client_name="cfemu")
        try:
            yield client
        finally:
            client.close()
        return

    qm = QueueManager(QueueManagerConfig(name=args.qm_name, log_root=found.log_root, redis_url=require_url(found),
                                         background=False), wings=WINGS)
    qm.start()
    try:
        conn = qm.connect()
        try:
            yield conn
        finally:
            conn.close()
    finally:
        qm.stop()


# --- commands ----------------------------------------------------------------------------------------------------
def cmd_cf(args: argparse.Namespace, out: Output) -> int:
    cf_dir = find_cf_dir(args.cf_dir)
    if args.action == "start":
        try:
            running: EmbeddedRedis | None = EmbeddedRedis.attach(cf_dir)
        except ServerError:
            running = None
        if running is not None:
            raise CLIError(f"a CF already runs from {cf_dir} at {running.url} (pid {running.pid})")
        # Secured from its first start: the default user off, one user per role, passwords in cf_dir/secrets.
        passwords = credentials.create(cf_dir / credentials.SECRETS_DIR)
        srv = EmbeddedRedis(port=args.port, data_dir=cf_dir, appendonly=args.appendonly, detach=True,
                            acl_users=credentials.acl_lines(passwords)).start()
        info = {"url": srv.url, "pid": srv.pid, "dir": str(srv.data_dir),
                "secrets": str((cf_dir / credentials.SECRETS_DIR).resolve())}
    elif args.action == "stop":
        srv = EmbeddedRedis.attach(cf_dir)
        srv.stop()
        info = {"stopped": srv.url, "dir": str(cf_dir)}
    else:
        try:
            srv = EmbeddedRedis.attach(cf_dir)
            info = {"running": True, "url": srv.url, "pid": srv.pid, "dir": str(cf_dir)}
        except ServerError:
            info = {"running": False, "dir": str(cf_dir)}
    if args.json:
        out.json(info)
    else:
        out.table(f"CF ({args.action})", ["field", "value"], sorted(info.items()))
    return 0 if args.action != "status" or info.get("running") else 1


def cmd_secrets(args: argparse.Namespace, out: Output) -> int:
    """cfemu secrets init: the group's secrets in DIR (kept when they exist), and optionally the CF's ACL file for
    them (for a CF this command does not start: docker-compose's redis-server, or an external Redis)."""
    directory = Path(args.dir)
    passwords = credentials.create(directory)
    info: dict[str, Any] = {"dir": str(directory.resolve()), "files": sorted(p.name for p in directory.iterdir())}
    if args.acl_file:
        acl = Path(args.acl_file)
        write_private(acl, "".join(line + "\n" for line in credentials.acl_lines(passwords)).encode())
        if args.acl_owner is not None:  # the redis-server that reads it may run as another user (its image's)
            os.chown(acl, args.acl_owner, -1)
        info["acl_file"] = str(acl.resolve())
    if args.json:
        out.json(info)
    else:
        out.table("group secrets (values are never printed)", ["field", "value"],
                  [(k, ", ".join(v) if isinstance(v, list) else v) for k, v in sorted(info.items())])
    return 0


def cmd_define(args: argparse.Namespace, out: Output) -> int:
    """In the CF and, durably, in the group repository under the log root (cfemu.repository)."""
    with admin_client(args) as admin:
        repo = repository.open_group_repository(admin, settings(args).log_root, who=f"cfemu define {args.kind}")
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
               "postpone_attempts": "postpone_attempts", "postpone_delay": "postpone_delay_s"}


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


def gather_status(admin: Admin, root: Path) -> dict[str, Any]:
    """Structures (state, depth by state, capacity, last backup), queues, and members (lease, epoch, log range,
    UOWs) as one document."""

    cf = CF(admin.redis)
    structures, queues, members = [], [], []
    uows_by_member: dict[str, int] = {}
    qdefs = {q.name: q for q in admin.queues()}
    for sdef in sorted(admin.structures(), key=lambda s: s.name):
        s = cf.structure(sdef.name)
        info = s.info()
        depths = s.depths() if s.exists() else {}
        total = {st: sum(d.get(st, 0) for d in depths.values()) for st in keys.STATES}
        last = info.get("last_backup")
        structures.append({"name": sdef.name, "state": admin.state(sdef.name), "recauto": sdef.recauto,
                           "recovering_by": admin.structure_recovery_holder(sdef.name), "depth": total,
                           "entries": int(info.get("entries", 0)), "max_entries": sdef.max_entries,
                           "bytes": int(info.get("bytes", 0)), "max_bytes": sdef.max_bytes,
                           "backup_running": info.get("backup"), "last_backup": last,
                           "last_backup_age_s": last_backup_age(admin, sdef.name)})
        if cluster_cf.is_cluster(admin.redis):  # which master of a Redis Cluster CF holds it (its slot's)
            structures[-1].update(slot=cluster_cf.slot_of(sdef.name),
                                  master=cluster_cf.master_of(admin.redis, sdef.name))
        for qname, by_state in depths.items():
            q = qdefs.get(qname)
            queues.append({"name": qname, "structure": sdef.name, "depth": by_state,
                           "backout_threshold": q.backout_threshold if q else None,
                           "backout_queue": q.backout_queue if q else None})
        if s.exists():
            for member in admin.members():
                uows_by_member[member] = uows_by_member.get(member, 0) + len(s.member_uows(member))
    for name, m in sorted(admin.members().items()):
        log_range: dict[str, Any] = {}
        log_dir = Path(m.get("log") or root / name)
        try:
            segs = LogReader(log_dir).segments()
            lrsns = [x for seg in segs for x in (seg.min_lrsn, seg.max_lrsn) if x is not None]
            log_range = {"first_lrsn": min(lrsns, default=None), "last_lrsn": max(lrsns, default=None),
                         "records": sum(seg.records for seg in segs), "segments": len(segs)}
        except (LogFormatError, OSError) as e:
            log_range = {"error": str(e)}
        members.append({"name": name, "epoch": m.get("epoch"), "lease_ms": m.get("lease_ms"), "pid": m.get("pid"),
                        "log": str(log_dir), "log_range": log_range, "uows": uows_by_member.get(name, 0)})
    for qname, q in qdefs.items():
        if not any(x["name"] == qname for x in queues):
            queues.append({"name": qname, "structure": q.structure, "depth": None,
                           "backout_threshold": q.backout_threshold, "backout_queue": q.backout_queue})
    return {"group": admin.group_name(), "structures": structures, "queues": sorted(queues, key=lambda q: q["name"]),
            "members": members}


def cmd_status(args: argparse.Namespace, out: Output) -> int:
    with admin_client(args) as admin:
        doc = gather_status(admin, settings(args).log_root)
    if args.json:
        out.json(doc)
        return 0
    out.table(f"structures of group {doc['group']}",
              ["structure", "state", "RECAUTO", "UP", "CP", "UG", "EX", "entries", "bytes", "last backup"],
              [(s["name"], s["state"] + (" (backup running)" if s["backup_running"] else "")
                + (f" (recovery by {s['recovering_by']})" if s["recovering_by"] else ""),
                "yes" if s["recauto"] else "no",
                *(s["depth"][st] for st in ("UP", "CP", "UG", "EX")),
                f"{s['entries']}/{s['max_entries'] or 'unlimited'}", f"{s['bytes']}/{s['max_bytes'] or 'unlimited'}",
                f"{s['last_backup']} ({_age(s['last_backup_age_s'])})" if s["last_backup"] else "never")
               for s in doc["structures"]])
    out.table("queues", ["queue", "structure", "UP", "CP", "UG", "EX", "backout threshold", "backout queue"],
              [(q["name"], q["structure"], *((q["depth"] or {}).get(st) for st in ("UP", "CP", "UG", "EX")),
                q["backout_threshold"] or "-", q["backout_queue"] or "-") for q in doc["queues"]])
    out.table("members", ["SQM", "lease", "epoch", "pid", "log LRSN range", "log records", "UOWs"],
              [(m["name"], f"{m['lease_ms']} ms" if (m["lease_ms"] or -1) >= 0 else "lapsed", m["epoch"], m["pid"],
                f"{m['log_range'].get('first_lrsn')}..{m['log_range'].get('last_lrsn')}"
                if "error" not in m["log_range"] else m["log_range"]["error"],
                m["log_range"].get("records"), m["uows"]) for m in doc["members"]])
    return 0


def _message_row(m: Any) -> dict[str, Any]:
    return {"queue": m.queue, "msgid": m.msgid.hex(), "correlid": m.correlid.hex(), "priority": m.priority,
            "persistent": m.persistent, "backout_count": m.backout_count, "put_time": m.put_time,
            "body": _body_text(m.body, 10_000), "length": len(m.body), **_uow_of(m)}


def _uow_of(m: Any) -> dict[str, Any]:
    """What a message is to a service (docs/uow.md): a message of a UOW on <SVC>.UOWDATA (the UOW id is its
    correlid; its position, from 1, its ``uow.seq`` property + 1), or a UOW's control entry on <SVC>.UOWCTL (the
    UOW id is its msgid; its status in the body) or a user's LAST pointer there (status LAST, the UOW it points
    to). A plain message: an empty UOW."""
    queue = str(m.queue or "")
    seq = (m.properties or {}).get("uow.seq")
    if queue.endswith(DATA_SUFFIX) and isinstance(seq, int):
        return {"uow": m.correlid.hex(), "uow_position": seq + 1, "uow_status": ""}
    if queue.endswith(CONTROL_SUFFIX):
        try:
            if m.correlid == LAST_LETTER.encode():  # a user's pointer to the last UOW it sent (SYNCPOINT LAST)
                return {"uow": str(msgpack.unpackb(m.body)["uow"]), "uow_position": None, "uow_status": "LAST"}
            return {"uow": m.msgid.hex(), "uow_position": None, "uow_status": Control.unpack(m.body).status}
        except Exception:  # noqa: BLE001 - not a control entry (put there by hand): shown as such, not fatal
            return {"uow": m.msgid.hex(), "uow_position": None, "uow_status": "?"}
    return {"uow": "", "uow_position": None, "uow_status": ""}


def _uow_cell(r: dict[str, Any]) -> str:
    if not r["uow"]:
        return ""
    return f"{r['uow'][:16]} " + (f"#{r['uow_position']}" if r["uow_position"] else r["uow_status"])


def _print_messages(out: Output, title: str, messages: list[Any], as_json: bool) -> None:
    rows = [_message_row(m) for m in messages]
    if as_json:
        out.json({"messages": rows, "count": len(rows)})
        return
    out.table(title, ["#", "priority", "persistent", "backouts", "length", "msgid", "UOW", "body"],
              [(i + 1, r["priority"], "yes" if r["persistent"] else "no", r["backout_count"], r["length"],
                r["msgid"][:16], _uow_cell(r), _body_text(r["body"].encode())) for i, r in enumerate(rows)])


def cmd_put(args: argparse.Namespace, out: Output) -> int:
    bodies = [b.encode() for b in args.messages] * args.count
    with messaging(args) as h:
        try:
            put = [h.put(args.queue, b, persistent=not args.non_persistent, priority=args.priority,
                         correlid=args.correlid.encode()) for b in bodies]
            h.commit()
        except BaseException:
            h.backout()
            raise
    if args.json:
        out.json({"queue": args.queue, "put": len(put), "msgids": [m.msgid.hex() for m in put]})
    else:
        out.line(f"put {len(put)} message(s) on {args.queue} (committed)")
    return 0


def cmd_get(args: argparse.Namespace, out: Output) -> int:
    got: list[Any] = []
    with messaging(args) as h:
        try:
            while args.all or len(got) < args.count:
                try:
                    got.append(h.get(args.queue, wait_ms=args.wait_ms))
                except NoMessageError:
                    break
            h.commit()
        except BaseException:
            h.backout()
            raise
    _print_messages(out, f"got {len(got)} message(s) from {args.queue} (committed)", got, args.json)
    return 0 if got or args.all else 1


def cmd_browse(args: argparse.Namespace, out: Output) -> int:
    with messaging(args) as h:
        msgs = h.browse(args.queue, args.limit)
    more = ", more on the queue" if getattr(msgs, "more", False) else ""
    _print_messages(out, f"{args.queue}: {len(msgs)} message(s) (browsed{more})", msgs, args.json)
    return 0


def cmd_indoubt(args: argparse.Namespace, out: Output) -> int:
    found = settings(args)
    token, role = found.token, found.token_role
    if args.action == "resolve":
        with Client(args.server, token=token, role=role, client_name="cfemu") as c:
            c.resolve(args.uow, args.commit)
            where = c.qmgr
        outcome = "committed" if args.commit else "backed out"
        if args.json:
            out.json({"uow": args.uow, "outcome": outcome, "qmgr": where})
        else:
            out.line(f"unit of work {args.uow} {outcome} on {where}")
        return 0
    rows: list[dict[str, Any]] = []
    for endpoint in args.server:  # every SQM holds its own in-doubt UOWs
        with Client([endpoint], token=token, role=role, client_name="cfemu") as c:
            rows += [{**u, "qmgr": c.qmgr, "server": endpoint} for u in c.indoubt()]
    if args.json:
        out.json({"indoubt": rows})
    else:
        out.table("in-doubt units of work", ["SQM", "UOW", "XID", "structures"],
                  [(r["qmgr"], r["uow"], r["xid"], ", ".join(r["structures"])) for r in rows])
    return 0


# What cfemu uow prints of a UOW's status (sqm.conversations.uowstatus.Control.public), in this order; the rest after.
UOW_FIELDS = ("uow", "service", "status", "user_status", "sender", "receiver", "messages", "bytes", "persistent",
              "persistent_status", "status_lifetime", "deliveries", "postponements", "conversation", "eoc",
              "lifetime_ms", "age_ms", "committed_ms", "deleted")


def cmd_uow(args: argparse.Namespace, out: Output) -> int:
    """SYNCPOINT QUERY, LAST, SETUSTATUS and DELETE through a member's service, logged on as --user (with
    --user-token): LAST finds that user's last UOW, SETUSTATUS needs its sender or receiver, DELETE its sender."""
    if not args.server:
        raise CLIError(f"uow {args.action}: give --server HOST:PORT (a member's service: UOW statuses are read and "
                       "changed through a session on it)")
    found = settings(args)
    with Client(args.server, token=found.token, role=found.token_role, client_name="cfemu") as c:
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


# The verbs that belong to another command: everything after the verb is theirs, --help included. Each is
# imported only when its verb runs, so that `cfemu status` does not load Spark's or the chaos suite's imports.
def _backup_verb(argv: list[str]) -> int:
    from backup.cli import main as backup_main

    return backup_main(argv)


def _restore_verb(argv: list[str]) -> int:
    from restore.cli import main as restore_main

    return restore_main(argv)


def _demo_verb(argv: list[str]) -> int:
    from qsg.demo import main as demo_main

    return demo_main(argv)


def _chaos_verb(argv: list[str]) -> int:
    from qsg.chaos.cli import main as chaos_main

    return chaos_main(argv)


def _pubsub_verb(verb: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from qsg.pubsub_cli import main as pubsub_main

        return pubsub_main([verb, *argv])
    return run


def _pstore_verb(argv: list[str]) -> int:
    from qsg.pstore_cli import main as pstore_main

    return pstore_main(argv)


def _migrate_verb(argv: list[str]) -> int:
    from qsg.migrate_cli import main as migrate_main

    return migrate_main(argv)


def cmd_cluster(args: argparse.Namespace, out: Output) -> int:
    from qsg.cluster import Cluster

    d = find_cluster_dir(args.cluster_dir)
    if args.action == "up":
        t0 = time.monotonic()
        with out.console.status("starting the CF, the SQM servers, the backup scheduler"
                                + (f" and a Spark master with {args.spark} worker(s)" if args.spark else "") + "...",
                                spinner="dots") if not args.json and out.console.is_terminal else _nothing():
            cluster = Cluster.up(d, managers=args.managers, backup_interval=args.backup_interval or None,
                                 lease_ms=args.lease_ms, token=args.token, detach=True,
                                 structure=args.structure or None, queues=args.queue or ("Q1", "Q2"),
                                 restart_cf=args.cf_restart, recauto=args.recauto, spark_workers=args.spark,
                                 spark_cores=args.spark_cores, spark_memory=args.spark_memory,
                                 duplex=args.duplex, redis_cluster=args.redis_cluster)
        doc = cluster.status()
        doc["seconds"] = round(time.monotonic() - t0, 2)
    elif args.action == "down":
        cluster = Cluster.load(d)
        killed = cluster.down(timeout=args.timeout, purge=args.purge)
        left = {} if args.purge else cluster.running_processes()
        doc = {"dir": str(d), "killed_after_timeout": killed, "still_running": left, "purged": args.purge}
        if args.json:
            out.json(doc)
        else:
            out.line(f"cluster in {d} is down" + (" and purged" if args.purge else "")
                     + (f"; SIGKILLed after {args.timeout:g}s: {', '.join(killed)}" if killed else ""))
        return 0 if not left else 1
    else:
        doc = Cluster.load(d).status()
    if args.json:
        out.json(doc)
    else:
        out.table(f"cluster {doc['dir']}", ["process", "pid", "alive", "ready", "address", "metrics"],
                  [(p["process"], p["pid"], "yes" if p["alive"] else "NO", "yes" if p["ready"] else "no",
                    p["address"], p.get("metrics")) for p in doc["processes"]])
        out.line(f"CF {doc['redis_url']}   logs {doc['log_root']}   backups {doc['backup_dir']}"
                 + (f"   Spark {doc['spark_master']}" if doc.get("spark_master") else ""))
        if doc.get("duplex"):
            pair = doc["duplex"]
            out.line(f"duplexed CF: {pair['mode']} (generation {pair['generation']}), primary {pair['primary']}, "
                     f"secondary {pair['secondary'] or '-'} {pair['secondary_state']}; promotions "
                     f"{pair['promotions']}, degrades {pair['degrades']}, resyncs {pair['resyncs']}")
    return 0 if all(p["alive"] for p in doc["processes"]) else 1


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# --- the parser -----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
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

    parser = argparse.ArgumentParser(prog="cfemu", description="Operate a coupling-facility queue-sharing group.")
    sub = parser.add_subparsers(dest="command", required=True)

    cf = sub.add_parser("cf", parents=[common], help="an embedded CF (redis-server) running detached")
    cf.add_argument("action", choices=["start", "stop", "status"])
    cf.add_argument("--cf-dir", "--dir", dest="cf_dir",
                    help="data directory (default $CFEMU_CF_DIR, else the nearest var/cf, else var/cf)")
    cf.add_argument("--port", type=int, default=None, help="TCP port (default: a free one)")
    cf.add_argument("--appendonly", action="store_true", help="keep an AOF (the CF survives a restart)")

    sec = sub.add_parser("secrets", parents=[common],
                         help="the group's secrets (CF users, the service's application and operator tokens)")
    sec.add_argument("action", choices=["init"])
    sec.add_argument("--dir", required=True, help="the secrets directory (made 0700; files 0600)")
    sec.add_argument("--acl-file", help="also write the CF's ACL file for these secrets here (0600)")
    sec.add_argument("--acl-owner", type=int, default=None, help="uid to own the ACL file (the redis-server's)")

    define = sub.add_parser("define", help="define a structure or a queue")
    dsub = define.add_subparsers(dest="kind", required=True)
    ds = dsub.add_parser("structure", parents=[common, where], help="define a CF application structure")
    ds.add_argument("name")
    ds.add_argument("--max-entries", type=int, default=0, help="capacity in entries (0 = unlimited)")
    ds.add_argument("--max-bytes", type=int, default=0, help="capacity in bytes of data (0 = unlimited)")
    ds.add_argument("--replace", action="store_true", help="change an existing definition")
    ds.add_argument("--recauto", action=argparse.BooleanOptionalAction, default=True,
                    help="RECAUTO: a member restores the structure by itself when it fails or the CF is lost "
                         "(default on, as in MQ)")
    alter = sub.add_parser("alter", help="change attributes of a defined structure (ALTER CFSTRUCT)")
    asub = alter.add_subparsers(dest="kind", required=True)
    al = asub.add_parser("structure", parents=[common, where], help="alter a CF application structure")
    al.add_argument("name")
    al.add_argument("--max-entries", type=int, default=None, help="capacity in entries (0 = unlimited)")
    al.add_argument("--max-bytes", type=int, default=None, help="capacity in bytes of data (0 = unlimited)")
    al.add_argument("--recauto", action=argparse.BooleanOptionalAction, default=None,
                    help="RECAUTO on or off (default: unchanged)")
    dq = dsub.add_parser("queue", parents=[common, where], help="define a shared queue")
    dq.add_argument("name")
    dq.add_argument("--structure", required=True)
    dq.add_argument("--backout-threshold", type=int, default=0)
    dq.add_argument("--backout-queue", default="")
    dq.add_argument("--max-msg-length", type=int, default=DEFAULT_MSG_LENGTH,
                    help=f"longest message body, bytes (1-{MAX_MSG_LENGTH}; default {DEFAULT_MSG_LENGTH})")
    dq.add_argument("--replace", action="store_true", help="change an existing definition")
    dq.add_argument("--uow", action="store_true",
                    help="a service: senders send units of work of several messages to it (docs/uow.md); its "
                         "messages and statuses live on NAME.UOWDATA and NAME.UOWCTL, defined with it")
    dq.add_argument("--uow-store", action=argparse.BooleanOptionalAction, default=None,
                    help="STORE: a UOW's messages persistent unless the sender says otherwise (default on)")
    dq.add_argument("--max-uows", type=int, default=None, help="MAX-UOWS: active UOWs at once (0: none; "
                                                                 "default 1000)")
    dq.add_argument("--max-messages", type=int, default=None, help="MAX-MESSAGES-IN-UOW (default 16)")
    dq.add_argument("--uow-lifetime", type=int, default=None, metavar="SECONDS",
                    help="UOW-DATA-LIFETIME, counted in the group's up-time (default 86400)")
    dq.add_argument("--status-lifetime", type=int, default=None, metavar="N",
                    help="UWSTATP: keep a UOW's status N lifetimes after it ends, 1-254 (default 0: not kept)")
    dq.add_argument("--postpone-attempts", type=int, default=None, metavar="N",
                    help="POSTPONE-ATTEMPTS: a receiver's CANCEL postpones the UOW this many times (default 0)")
    dq.add_argument("--postpone-delay", type=int, default=None, metavar="SECONDS",
                    help="POSTPONE-DELAY before a postponed UOW is ACCEPTED again (default 0)")

    sub.add_parser("status", parents=[common, where], help="structures, queues and members")

    put = sub.add_parser("put", parents=[common, where, server], help="put messages (one UOW, committed)")
    put.add_argument("queue")
    put.add_argument("messages", nargs="+", metavar="MESSAGE")
    put.add_argument("--count", type=int, default=1, help="put the messages this many times")
    put.add_argument("--priority", type=int, default=0)
    put.add_argument("--non-persistent", action="store_true")
    put.add_argument("--correlid", default="")
    get = sub.add_parser("get", parents=[common, where, server], help="get messages (one UOW, committed)")
    get.add_argument("queue")
    how_many = get.add_mutually_exclusive_group()
    how_many.add_argument("--count", type=int, default=1)
    how_many.add_argument("--all", action="store_true", help="until the queue is empty")
    get.add_argument("--wait-ms", type=int, default=0)
    browse = sub.add_parser("browse", parents=[common, where, server], help="browse messages (no UOW)")
    browse.add_argument("queue")
    browse.add_argument("--limit", type=int, default=100)

    indoubt = sub.add_parser("indoubt", help="list or resolve in-doubt units of work (through the servers)")
    isub = indoubt.add_subparsers(dest="action", required=True)
    il = isub.add_parser("list", parents=[common, server], help="in-doubt UOWs of each --server")
    il.set_defaults(uow=None)
    ir = isub.add_parser("resolve", parents=[common, server], help="commit or back out an in-doubt UOW")
    ir.add_argument("uow")
    outcome = ir.add_mutually_exclusive_group(required=True)
    outcome.add_argument("--commit", dest="commit", action="store_true")
    outcome.add_argument("--backout", dest="commit", action="store_false")

    uow = sub.add_parser("uow", help="a unit of work's status, through a member's service (docs/uow.md)")
    usub = uow.add_subparsers(dest="action", required=True)
    anyone, who = argparse.ArgumentParser(add_help=False), argparse.ArgumentParser(add_help=False)
    anyone.add_argument("--user", default="cfemu", help="the user id to log on with (default cfemu)")
    who.add_argument("--user", required=True, help="the user id to log on with (1-32 characters)")
    for p in (anyone, who):
        p.add_argument("--user-token", default="", metavar="TOKEN",
                       help="the user's token (with the user id, what LAST finds a user's work by)")
    uq = usub.add_parser("query", parents=[common, server, anyone], help="SYNCPOINT QUERY: a UOW's status by its id")
    uq.add_argument("uow_id", metavar="UOWID")
    usub.add_parser("last", parents=[common, server, who],
                    help="SYNCPOINT LAST: the last UOW --user with --user-token sent")
    us = usub.add_parser("set-status", parents=[common, server, who],
                         help="SYNCPOINT SETUSTATUS: a UOW's user status (by its sender or receiver)")
    us.add_argument("uow_id", metavar="UOWID")
    us.add_argument("status", metavar="STATUS", help="the user status (text, at most 64 bytes)")
    ud = usub.add_parser("delete", parents=[common, server, who],
                         help="SYNCPOINT DELETE: the kept status of a finished UOW (by its sender)")
    ud.add_argument("uow_id", metavar="UOWID")

    for name, what in (("backup", "cfbackup"), ("restore", "cfrestore")):
        p = sub.add_parser(name, help=f"{what} (same arguments)", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)

    cl = sub.add_parser("cluster", parents=[common], help="a local group of processes")
    cl.add_argument("action", choices=["up", "status", "down"])
    cl.add_argument("--cluster-dir", "--dir", dest="cluster_dir",
                    help="its directory (default $CFEMU_CLUSTER_DIR, else the nearest var/cluster, else var/cluster)")
    cl.add_argument("--managers", type=int, default=3)
    cl.add_argument("--backup-interval", type=float, default=10.0, help="seconds between backups (0: none)")
    cl.add_argument("--lease-ms", type=int, default=5000)
    cl.add_argument("--token", help="the application token clients must prove they hold (default: the group's "
                                    "service.token, made at the first 'up')")
    cl.add_argument("--structure", default="APP1", help="structure to define if missing ('' for none)")
    cl.add_argument("--queue", action="append", help="queue to define on it (default Q1, Q2)")
    cl.add_argument("--no-cf-restart", dest="cf_restart", action="store_false",
                    help="up: no supervisor restarting a dead CF (default: restarted, empty, on the same port)")
    cl.add_argument("--no-recauto", dest="recauto", action="store_false",
                    help="up: define the structure with RECAUTO off (a lost structure waits for 'cfrestore run')")
    cl.add_argument("--spark", type=int, default=0, metavar="N",
                    help="up: also a standalone Spark master and N workers on 127.0.0.1, from the installed pyspark "
                         "(cfrestore run --engine spark then uses it; docs/spark.md)")
    cl.add_argument("--spark-cores", type=int, default=1, help="up: cores each Spark worker offers")
    cl.add_argument("--spark-memory", default="2g", help="up: memory each Spark worker offers (Spark's units)")
    cl.add_argument("--duplex", action="store_true",
                    help="up: a duplexed CF, a second redis-server holding a synchronous copy (promoted when the "
                         "primary is lost; docs/runbook.md)")
    cl.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                    help="up: the CF as a Redis Cluster of N masters (3-16): the structures spread over them")
    cl.add_argument("--timeout", type=float, default=10.0, help="down: seconds before SIGKILL")
    cl.add_argument("--purge", action="store_true", help="down: also delete the directory (logs, backups)")

    demo = sub.add_parser("demo", help="the end-to-end demonstration", add_help=False)
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    chaos = sub.add_parser("chaos", help="the chaos test suite (run, soak, check, kinds)", add_help=False)
    chaos.add_argument("rest", nargs=argparse.REMAINDER)
    parser.set_defaults(cf_role="operator")  # the CF user this command connects as (cfemu.credentials)
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace, Output], int]] = {
    "cf": cmd_cf, "secrets": cmd_secrets, "define": cmd_define, "alter": cmd_alter, "status": cmd_status,
    "put": cmd_put, "get": cmd_get,
    "browse": cmd_browse, "indoubt": cmd_indoubt, "cluster": cmd_cluster, "uow": cmd_uow,
}
DELEGATES: dict[str, Callable[[list[str]], int]] = {"backup": _backup_verb, "restore": _restore_verb,
                                                     "demo": _demo_verb, "chaos": _chaos_verb,
                                                     # issue 14: each in a module of its own (qsg/*_cli.py)
                                                     "topic": _pubsub_verb("topic"), "sub": _pubsub_verb("sub"),
                                                     "publish": _pubsub_verb("publish"), "pstore": _pstore_verb,
                                                     "migrate": _migrate_verb}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in DELEGATES:  # everything after the verb belongs to the delegate, --help included
        return int(DELEGATES[argv[0]](argv[1:]) or 0)
    args = parser.parse_args(argv)
    return run_command("cfemu", args, COMMANDS[args.command], EXPECTED_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
