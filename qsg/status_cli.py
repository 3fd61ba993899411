"""`cfemu status`: the group's structures (state, depth by state, capacity, last backup, RECAUTO), queues and
members (lease, epoch, log range, UOWs), as tables or one JSON document.

`cfemu status QUEUE` is DISPLAY QSTATUS of one queue: from the CF its depth, its uncommitted puts and gets, its
expired messages and the age of its oldest message; from the members' services (--server, else the local
cluster's; the operator's ``connections`` operation) its handle count, the connections open now on any member that
put to, got from or browsed it, and the last put and the last get through any member (each member keeps its own in
memory, no CF call per put: the newest of them is shown; a member's restart forgets its own)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from cfemu import keys, rcluster
from cfemu.admin import Admin, AdminError, StructureDef
from cfemu.cf import CF, Structure
from cfemu.clitools import CLIError, Output, cf_name, settings
from cfemu.repository import GroupRepository, RepositoryError
from qsg.cli_common import Parents, Parser, admin_client
from qsg.conn_cli import ask_members, endpoints, member_arguments
from sqm.log import LogFormatError, LogReader
from sqm.service.metrics import last_backup_age


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"



def _backup_mark(s: Structure) -> tuple[str | None, str | None]:
    """(the backup running, a stale mark's backup): a mark whose lease has ended is no backup running (its backup
    died or stalled and cannot end well; the next backup takes it over, 'cfbackup cancel' ends it)."""
    mark = s.backup_mark()
    if mark is None:
        return None, None
    return (mark.backup, None) if not mark.stale else (None, mark.backup)


def _structure_rows(admin: Admin, cf: CF, name: str, sdef: StructureDef, migrated: Any, qdefs: dict[str, Any],
                    structures: list[dict[str, Any]], queues: list[dict[str, Any]],
                    uows_by_member: dict[str, int]) -> None:
    """One structure's row, its queues' rows, and its UOWs counted by member."""
    s = cf.structure(name)
    info = s.info()
    in_cf = bool(info)
    depths = s.depths() if in_cf else {}
    state = admin.state(name) if in_cf else ("MIGRATED" if name in migrated else "FAILED")
    running, stale = _backup_mark(s) if in_cf else (None, None)
    last = info.get("last_backup")
    structures.append({"name": name, "state": state, "in_cf": in_cf, "recauto": sdef.recauto,
                       "recovering_by": admin.structure_recovery_holder(name),
                       "depth": {st: sum(d.get(st, 0) for d in depths.values()) for st in keys.STATES}
                       if in_cf else None,
                       "entries": int(info.get("entries", 0)), "max_entries": sdef.max_entries,
                       "bytes": int(info.get("bytes", 0)), "max_bytes": sdef.max_bytes,
                       "backup_running": running, "stale_backup_mark": stale, "last_backup": last,
                       "last_backup_age_s": last_backup_age(admin, name)})
    if rcluster.is_cluster(admin.redis):  # which master of a Redis Cluster CF holds it (its slot's)
        structures[-1].update(slot=rcluster.slot_of(name), master=rcluster.master_of(admin.redis, name))
    for qname, by_state in depths.items():
        q = qdefs.get(qname)
        queues.append({"name": qname, "structure": name, "depth": by_state,
                       "backout_threshold": q.backout_threshold if q else None,
                       "backout_queue": q.backout_queue if q else None})
    if in_cf:
        for member in admin.members():
            uows_by_member[member] = uows_by_member.get(member, 0) + len(s.member_uows(member))


def gather_status(admin: Admin, root: Path) -> dict[str, Any]:
    """Structures (state, depth by state, capacity, last backup), queues, and members (lease, epoch, log range,
    UOWs) as one document. Every structure the CF or the group repository (under root) defines has a row: one the
    CF does not hold (lost with it, never restored) is FAILED with in_cf false, or MIGRATED when the repository
    records it migrated; its depth is unknown (null). ``bad_records``: a line for each definition that cannot be
    read (a bad name, a malformed value), skipped so that one bad record hides nothing else."""

    cf = CF(admin.redis)
    structures: list[dict[str, Any]] = []
    queues: list[dict[str, Any]] = []
    members: list[dict[str, Any]] = []
    bad_records: list[str] = []
    uows_by_member: dict[str, int] = {}
    repo = GroupRepository(root)
    try:
        repo_structures, repo_queues, migrated = repo.structures(), repo.queues(), repo.migrated()
    except RepositoryError:  # an unreadable repository: the CF's definitions are still worth showing
        repo_structures, repo_queues, migrated = {}, [], {}
    qdefs = {q.name: q for q in repo_queues}
    qdefs.update({q.name: q for q in admin.queues()})
    sdefs = {**repo_structures, **{sdef.name: sdef for sdef in admin.structures()}}
    for name, sdef in sorted(sdefs.items()):
        kept = len(structures), len(queues)
        try:
            _structure_rows(admin, cf, name, sdef, migrated, qdefs, structures, queues, uows_by_member)
        except (ValueError, TypeError, KeyError) as e:  # a malformed record; the CF answered: the others stand
            del structures[kept[0]:], queues[kept[1]:]
            bad_records.append(f"structure {name!r} skipped: {' '.join(str(e).split())}")
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
                        "host": m.get("host"), "log": str(log_dir), "log_range": log_range, "uows": uows_by_member.get(name, 0)})
    bad_records += [f"{where}[{field!r}] skipped: {why}" for (where, field), why in sorted(admin.bad_entries.items())]
    for qname, q in qdefs.items():
        if not any(x["name"] == qname for x in queues):
            queues.append({"name": qname, "structure": q.structure, "depth": None,
                           "backout_threshold": q.backout_threshold, "backout_queue": q.backout_queue})
    return {"group": admin.group_name(), "structures": structures, "queues": sorted(queues, key=lambda q: q["name"]),
            "members": members, "bad_records": bad_records}


def _state(s: dict[str, Any]) -> str:
    """A structure's state as the table shows it, with what is going on beside it."""
    text = s["state"] + ("" if s["in_cf"] else " (not in CF)")
    if s["backup_running"]:
        text += " (backup running)"
    elif s["stale_backup_mark"]:
        text += " (stale backup mark)"
    return text + (f" (recovery by {s['recovering_by']})" if s["recovering_by"] else "")


def status_arguments(parser: Parser, parents: Parents) -> None:
    parser.add_argument("queue", nargs="?", metavar="QUEUE", type=cf_name("queue"),
                        help="DISPLAY QSTATUS of this queue: depth, uncommitted puts and gets, oldest message age, "
                             "handles and last put/get (the members' own, through their services)")
    member_arguments(parser)


def queue_status(admin: Admin, queue: str, members: list[dict[str, Any]]) -> dict[str, Any]:
    """DISPLAY QSTATUS of one queue: the CF's counts and oldest message, and the members' handles and last put and
    get (``members``: their ``connections`` replies, sqm.service.conn_ops)."""
    try:
        qdef = admin.queue_def(queue)
    except AdminError:
        known = ", ".join(q.name for q in admin.queues()) or "none"
        raise CLIError(f"no queue {queue!r} is defined (queues: {known})") from None
    s = CF(admin.redis).structure(qdef.structure)
    depth = s.depths().get(queue) if s.exists() else None
    oldest = s.oldest_put_time(queue) if depth is not None else None
    answered = [m for m in members if "error" not in m]
    per_member = {m["qmgr"]: m["queues"].get(queue, {}) for m in answered}
    puts = [a["last_put"] for a in per_member.values() if a.get("last_put")]
    gets = [a["last_get"] for a in per_member.values() if a.get("last_get")]
    return {"queue": queue, "structure": qdef.structure, "in_cf": depth is not None,
            "depth": None if depth is None else depth["CP"],
            "uncommitted": None if depth is None else {"puts": depth["UP"], "gets": depth["UG"]},
            "expired": None if depth is None else depth["EX"],
            "oldest_message_age_s": None if oldest is None else round(max(0.0, time.time() - oldest / 1000), 3),
            "handles": sum(a.get("handles", 0) for a in per_member.values()) if answered else None,
            "handles_by_member": {name: a.get("handles", 0) for name, a in per_member.items()},
            "last_put": max(puts, default=None), "last_get": max(gets, default=None),
            "members_asked": [m["server"] for m in members],
            "unreachable": [{"server": m["server"], "error": m["error"]} for m in members if "error" in m]}


def _when(t: float | None) -> str:
    if not t:
        return "never (on the members asked)"
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))} ({_age(time.time() - t)})"


def cmd_queue_status(args: argparse.Namespace, out: Output) -> int:
    servers = endpoints(args, required=False)
    members = ask_members(args, servers) if servers else []
    with admin_client(args) as admin:
        doc = queue_status(admin, args.queue, members)
    if args.json:
        out.json(doc)
        return 0
    age = doc["oldest_message_age_s"]
    handles = doc["handles"]
    by_member = ", ".join(f"{k} {v}" for k, v in sorted(doc["handles_by_member"].items()))
    unc = doc["uncommitted"] or {}
    out.table(f"queue {doc['queue']} (DISPLAY QSTATUS)", ["field", "value"], [
        ("structure", doc["structure"] + ("" if doc["in_cf"] else " (not in CF)")),
        ("current depth (committed)", doc["depth"] if doc["depth"] is not None else "-"),
        ("uncommitted puts (UP)", unc.get("puts", "-")), ("uncommitted gets (UG)", unc.get("gets", "-")),
        ("expired, not yet removed", doc["expired"] if doc["expired"] is not None else "-"),
        ("oldest message age", "no messages" if age is None else f"{age:.1f}s"),
        ("handles (open connections that used it)",
         "members not asked (give --server)" if handles is None else f"{handles} ({by_member})"),
        ("last put", _when(doc["last_put"])), ("last get", _when(doc["last_get"]))])
    for u in doc["unreachable"]:
        out.line(f"{u['server']}: no answer: {u['error']}")
    return 0


def cmd_status(args: argparse.Namespace, out: Output) -> int:
    if getattr(args, "queue", None):
        return cmd_queue_status(args, out)
    with admin_client(args) as admin:
        doc = gather_status(admin, settings(args).log_root)
    if args.json:
        out.json(doc)
        return 0
    for line in doc["bad_records"]:
        out.line(f"warning: {line}")
    out.table(f"structures of group {doc['group']}",
              ["structure", "state", "RECAUTO", "UP", "CP", "UG", "EX", "entries", "bytes", "last backup"],
              [(s["name"], _state(s), "yes" if s["recauto"] else "no",
                *((s["depth"] or {}).get(st, "-") for st in ("UP", "CP", "UG", "EX")),
                f"{s['entries']}/{s['max_entries'] or 'unlimited'}", f"{s['bytes']}/{s['max_bytes'] or 'unlimited'}",
                f"{s['last_backup']} ({_age(s['last_backup_age_s'])})" if s["last_backup"] else "never")
               for s in doc["structures"]])
    out.table("queues", ["queue", "structure", "UP", "CP", "UG", "EX", "backout threshold", "backout queue"],
              [(q["name"], q["structure"], *((q["depth"] or {}).get(st) for st in ("UP", "CP", "UG", "EX")),
                q["backout_threshold"] or "-", q["backout_queue"] or "-") for q in doc["queues"]])
    out.table("members", ["SQM", "lease", "epoch", "host", "pid", "log LRSN range", "log records", "UOWs"],
              [(m["name"], f"{m['lease_ms']} ms" if (m["lease_ms"] or -1) >= 0 else "lapsed", m["epoch"],
                m["host"] or "-", m["pid"],
                f"{m['log_range'].get('first_lrsn')}..{m['log_range'].get('last_lrsn')}"
                if "error" not in m["log_range"] else m["log_range"]["error"],
                m["log_range"].get("records"), m["uows"]) for m in doc["members"]])
    return 0
