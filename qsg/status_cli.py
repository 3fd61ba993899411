"""`cfemu status`: the group's structures (state, depth by state, capacity, last backup, RECAUTO), queues and
members (lease, epoch, log range, UOWs), as tables or one JSON document."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cfemu import keys, rcluster
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.clitools import Output, settings
from qsg.cli_common import admin_client
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
        if rcluster.is_cluster(admin.redis):  # which master of a Redis Cluster CF holds it (its slot's)
            structures[-1].update(slot=rcluster.slot_of(sdef.name),
                                  master=rcluster.master_of(admin.redis, sdef.name))
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
