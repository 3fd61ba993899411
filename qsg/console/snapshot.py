"""One picture of the group, as the console shows it: taken by the console's poller every few seconds (never by
a page request), in a worker thread, one part at a time. A part that cannot be read (the CF lost, a member down)
gives an error line in ``errors`` and leaves the other parts as they are.

The parts: the CF's view (``cfemu status``'s document: structures, queues, members' lease and epoch), each queue's
oldest message, each member's service (health, connections and each one's DISPLAY CONN row, units of work,
counters, in-doubt UOWs), the local
cluster's processes, the backups (age, size, signature) and the restore reports.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backup.bounded_json import read_json_file
from backup.catalog import list_backups
from cfemu.cf import CF
from cfemu.credentials import redact
from qsg.console.source import GroupSource
from qsg.status_cli import gather_status

log = logging.getLogger("qsg.console")

BACKUPS_SHOWN = 10  # per structure, newest first
RESTORES_SHOWN = 10
# The largest restore report read (a bigger one is not shown): a report is about 2 KiB, growing with the members'
# log ranges and the UOWs left in doubt (about 60 bytes each); 4 MiB holds tens of thousands of those, and bounds
# what a file planted in the backup directory costs the poller, which reads them every few seconds.
RESTORE_REPORT_MAX_BYTES = 4 * 2**20


def take(source: GroupSource) -> dict[str, Any]:
    """The group's picture now (see the module doc)."""
    snap: dict[str, Any] = {"at": time.time(), "errors": [], "group": "", "structures": [], "queues": [],
                            "members": [], "connections": [], "indoubt": [], "processes": [], "duplex": None, "backups": [],
                            "restores": [], "cf": {}}
    found = source.settings()
    snap["cf"] = {"url": redact(found.redis_url or ""), "ok": False}
    for part in (_cf_part, _cluster_part, _members_part, _backups_part, _restores_part):
        try:
            part(source, snap)
        except Exception as e:  # noqa: BLE001 - one part that cannot be read must not take the others with it
            why = " ".join(str(e).split()) or type(e).__name__
            snap["errors"].append(f"{part.__name__.strip('_').replace('_part', '')}: {why}")
            log.debug("console: %s failed", part.__name__, exc_info=True)
    return snap


def _cf_part(source: GroupSource, snap: dict[str, Any]) -> None:
    with source.admin() as admin:
        doc = gather_status(admin, source.settings().log_root)
        snap["cf"]["ok"] = True
        snap["errors"] += [f"cf: {line}" for line in doc["bad_records"]]  # named and skipped: the rest is shown
        snap.update(group=doc["group"], structures=doc["structures"], queues=doc["queues"], members=doc["members"])
        now_ms = int(time.time() * 1000)
        cf = CF(admin.redis)
        for q in snap["queues"]:
            q["oldest_age_s"] = None
            if not q["depth"] or not (q["depth"].get("CP") or q["depth"].get("UG")):
                continue
            try:
                oldest = cf.structure(q["structure"]).oldest_put_time(q["name"])
            except Exception:  # noqa: BLE001 - a structure failed since its depth was read
                continue
            q["oldest_age_s"] = max(0.0, (now_ms - oldest) / 1000) if oldest else None
    for s in snap["structures"]:
        s["recovering"] = bool(s["recovering_by"])


def _cluster_part(source: GroupSource, snap: dict[str, Any]) -> None:
    cluster = source.cluster()
    if cluster is None:
        return
    doc = cluster.status()
    snap["processes"] = doc["processes"]
    snap["duplex"] = doc.get("duplex")


def _members_part(source: GroupSource, snap: dict[str, Any]) -> None:
    """Each member's service: health, connections (each one's DISPLAY CONN row), UOWs by state, counters, in-doubt
    UOWs (operator role)."""
    by_name = {m["name"]: m for m in snap["members"]}
    processes = {p["process"]: p for p in snap["processes"]}
    for name, endpoint in source.endpoints(source.cluster()).items():
        row = by_name.get(name)
        if row is None:
            row = by_name[name] = {"name": name, "epoch": None, "lease_ms": None, "uows": 0}
            snap["members"].append(row)
        row["endpoint"] = endpoint
        proc = processes.get(name)
        if proc is not None:
            row.update(alive=proc["alive"], ready=proc["ready"], restarts=proc.get("restarts", 0),
                       held=proc.get("held"))
        try:
            with source.member_client(endpoint, timeout_s=3.0) as c:
                status = c.status()
                indoubt = c.indoubt()
                connections = c.connections()["connections"]
                qmgr = c.qmgr
        except Exception as e:  # noqa: BLE001 - a member down is a row that says so
            row["service"] = None
            row["service_error"] = " ".join(str(e).split())[:300]
        else:
            row["service"] = {k: status.get(k) for k in (
                "connections", "unauthenticated", "uows", "pending", "puts", "gets", "commits", "backouts",
                "structure_recoveries_started", "structure_recoveries_completed", "structure_recoveries_failed",
                "peer_recoveries", "fenced", "running", "tls", "lrsn", "log_records", "fsyncs")}
            snap["indoubt"] += [{**u, "qmgr": qmgr, "member": name, "endpoint": endpoint} for u in indoubt]
            snap["connections"] += [{**conn, "member": name} for conn in connections]
        row["health"] = _health(row)
    snap["members"].sort(key=lambda m: m["name"])


def _health(row: dict[str, Any]) -> str:
    """A member's health in a word: serving, fenced, lapsed (its lease ran out), down, not ready, unreachable."""
    service = row.get("service")
    if row.get("alive") is False:
        return "down" + (" (held)" if row.get("held") else "")
    if service is None:
        return "unreachable"
    if service.get("fenced"):
        return "fenced"
    if row.get("lease_ms") is not None and row["lease_ms"] < 0:
        return "lapsed"
    if row.get("ready") is False:
        return "not ready"
    return "serving"


def _backups_part(source: GroupSource, snap: dict[str, Any]) -> None:
    found = source.settings()
    now = datetime.now(UTC)
    shown: dict[str, int] = {}
    for b in list_backups(found.backup_dir, backup_keys=found.backup_keys()):
        if shown.get(b.structure, 0) >= BACKUPS_SHOWN:
            continue
        shown[b.structure] = shown.get(b.structure, 0) + 1
        row = b.summary()
        manifest = b.manifest or {}
        signature = manifest.get("signature") or {}
        started = _parse_time(row["started_at"]) or b.started.replace(tzinfo=UTC)
        row.update(age_s=max(0.0, (now - started).total_seconds()),
                   disk_bytes=None if b.path.is_symlink() else _disk_bytes(b.path),  # a link is never followed
                   signed_by=signature.get("key") if isinstance(signature, dict) else None)
        snap["backups"].append(row)


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _disk_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def _restores_part(source: GroupSource, snap: dict[str, Any]) -> None:
    """The restores' reports (restore.run writes one per restore, RECAUTO's included), newest first."""
    root = source.settings().backup_dir
    reports = sorted(root.glob("*/restore-*.json"), key=lambda p: p.name, reverse=True) if root.is_dir() else []
    for path in reports[:RESTORES_SHOWN]:
        try:
            doc = read_json_file(path, RESTORE_REPORT_MAX_BYTES, "the restore report")
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        snap["restores"].append({
            "report": path.name, "structure": doc.get("structure"), "started_at": doc.get("started_at"),
            "start": doc.get("start") or doc.get("backup_id"), "engine": doc.get("engine"),
            "loaded_entries": doc.get("loaded_entries"), "seconds": round(sum((doc.get("timings") or {}).values()), 2),
            "in_doubt": len(doc.get("in_doubt_uows") or {})})


__all__ = ["take"]
