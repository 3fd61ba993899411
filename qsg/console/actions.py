"""The operator actions the console offers, one row each in ``ACTIONS``: what the form sends, how it is checked
against the group as the console last saw it, the sentence the confirmation page asks the operator to confirm,
and what it does (in a job's thread: qsg.console.jobs).

  backup   take a backup of an ACTIVE structure now (cfbackup run; waits for a scheduler's backup to end)
  restore  rebuild a structure from a backup and the logs (cfrestore run; an ACTIVE one is marked FAILED first)
  resolve  commit or back out an in-doubt unit of work on the member that holds it (cfemu indoubt resolve)
  restart  restart a member of the local cluster (cfemu cluster restart): one member at a time (every restart has
           the same target), and never the last member serving (checked against the snapshot, then again
           against the cluster's processes just before the restart), so the group always has one to serve
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from backup.run import run_backup
from cfemu.progress import Progress
from qsg.console.source import GroupSource
from restore.run import run_restore

BACKUP_WAIT_S = 120.0  # a scheduler's backup running: wait this long for it, as 'cfbackup run --wait' does
MAX_FIELD = 128
RESTART_TARGET = "member restart"  # the target of every restart: one member restarts at a time


class ActionError(ValueError):
    """A request for an action that cannot be done as asked (one line, shown to the operator)."""


Params = dict[str, Any]


@dataclass(frozen=True)
class Action:
    name: str
    label: str
    fields: tuple[str, ...]  # the form fields it reads (all required but those check() defaults)
    check: Callable[[Mapping[str, str], dict[str, Any]], Params]  # (form, snapshot) -> params, or ActionError
    confirm: Callable[[Params], str]  # the question the confirmation page asks
    title: Callable[[Params], str]  # the job's title
    target: Callable[[Params], str]  # one job per target at a time
    run: Callable[[GroupSource, Params, Progress], str]  # does it; returns the result's line


def _field(form: Mapping[str, str], name: str, *, required: bool = True) -> str:
    value = (form.get(name) or "").strip()
    if required and not value:
        raise ActionError(f"missing {name}")
    if len(value) > MAX_FIELD:
        raise ActionError(f"{name} is longer than {MAX_FIELD} characters")
    return value


def _structure(form: Mapping[str, str], snap: dict[str, Any]) -> dict[str, Any]:
    name = _field(form, "structure")
    s = next((s for s in snap["structures"] if s["name"] == name), None)
    if s is None:
        raise ActionError(f"no structure {name} in this group")
    return s


# --- backup --------------------------------------------------------------------------------------------------------
def _check_backup(form: Mapping[str, str], snap: dict[str, Any]) -> Params:
    s = _structure(form, snap)
    if s["state"] != "ACTIVE" or not s["in_cf"]:
        raise ActionError(f"structure {s['name']} is {s['state']}: only an ACTIVE structure can be backed up")
    return {"structure": s["name"]}


def _run_backup(source: GroupSource, p: Params, progress: Progress) -> str:
    found = source.settings("backup")
    client = source.cf_client("backup")
    try:
        manifest = run_backup(client, p["structure"], found.backup_dir,
                              log_root=found.log_root if found.log_root.is_dir() else None, progress=progress,
                              backup_keys=found.backup_keys(), share=found.backup_share(), wait_s=BACKUP_WAIT_S)
    finally:
        client.close()
    return f"backup {manifest['id']}: {manifest.get('entries', 0)} entries, {manifest.get('bytes', 0)} bytes"


# --- restore -------------------------------------------------------------------------------------------------------
def _check_restore(form: Mapping[str, str], snap: dict[str, Any]) -> Params:
    s = _structure(form, snap)
    backup = _field(form, "backup", required=False)
    if backup and not any(b["id"] == backup and b["structure"] == s["name"] for b in snap["backups"]):
        raise ActionError(f"no backup {backup} of {s['name']} is listed")
    return {"structure": s["name"], "backup": backup, "mark_failed": s["state"] == "ACTIVE" and s["in_cf"],
            "state": s["state"]}


def _confirm_restore(p: Params) -> str:
    start = f"backup {p['backup']}" if p["backup"] else "its newest good backup"
    text = f"Restore structure {p['structure']} ({p['state']}) from {start} and every member's log?"
    if p["mark_failed"]:
        text += (f" {p['structure']} is ACTIVE: it is marked FAILED first, so work on it fails until the restore "
                 "ends, and what it holds now is replaced by what the backup and the logs say.")
    return text


def _run_restore(source: GroupSource, p: Params, progress: Progress) -> str:
    found = source.settings("restore")
    client = source.cf_client("restore")
    try:
        result = run_restore(client, p["structure"], backup_root=found.backup_dir, log_root=found.log_root,
                             backup_id=p["backup"] or None, mark_failed=p["mark_failed"], progress=progress,
                             engine_options={"memory": found.memory_limit(), "workers": found.restore_workers()},
                             backup_keys=found.backup_keys())
    finally:
        client.close()
    return (f"restored {result.structure} from {result.start or result.backup_id}: {result.loaded_entries} "
            f"entries loaded, {len(result.in_doubt_uows)} UOWs in doubt")


# --- resolve -------------------------------------------------------------------------------------------------------
def _check_resolve(form: Mapping[str, str], snap: dict[str, Any]) -> Params:
    member, uow, outcome = _field(form, "member"), _field(form, "uow"), _field(form, "outcome")
    if outcome not in ("commit", "backout"):
        raise ActionError(f"outcome is commit or backout, not {outcome[:20]!r}")
    held = next((u for u in snap["indoubt"] if u["member"] == member and u["uow"] == uow), None)
    if held is None:
        raise ActionError(f"unit of work {uow} is not in doubt on {member} (resolved already?)")
    return {"member": member, "uow": uow, "commit": outcome == "commit", "endpoint": held["endpoint"],
            "xid": held.get("xid") or ""}


def _run_resolve(source: GroupSource, p: Params, progress: Progress) -> str:
    with source.member_client(p["endpoint"]) as c:
        c.resolve(p["uow"], p["commit"])
        where = c.qmgr
    return f"unit of work {p['uow']} {'committed' if p['commit'] else 'backed out'} on {where}"


# --- restart -------------------------------------------------------------------------------------------------------
def _check_restart(form: Mapping[str, str], snap: dict[str, Any]) -> Params:
    member = _field(form, "member")
    members = {m["name"] for m in snap["members"]}
    if member not in members or not any(p["process"] == member for p in snap["processes"]):
        raise ActionError(f"{member} is not a member of a local cluster this console runs beside: restart it "
                          "where it runs")
    if not any(m["name"] != member and m.get("health") == "serving" for m in snap["members"]):
        raise ActionError(f"{member} is the last serving member: restarting it would stop the group's service "
                          "(bring another member back first)")
    return {"member": member}


def _run_restart(source: GroupSource, p: Params, progress: Progress) -> str:
    cluster = source.cluster()
    if cluster is None:
        raise ActionError("the local cluster is gone")
    managers = {m["name"] for m in cluster.state["managers"]}
    ready = [r["process"] for r in cluster.status()["processes"]
             if r["process"] in managers and r["process"] != p["member"] and r["alive"] and r["ready"]]
    if not ready:
        raise ActionError(f"{p['member']} is the last member ready: restarting it would stop the group's service")
    doc = cluster.restart_member(p["member"])
    return (f"{doc['member']} restarted in {doc['seconds']:g}s (stopped by {doc['stopped_by']}); pid "
            f"{doc['old_pid']} -> {doc['pid']}")


ACTIONS: dict[str, Action] = {a.name: a for a in (
    Action("backup", "Back up now", ("structure",), _check_backup,
           lambda p: f"Take a backup of structure {p['structure']} now?",
           lambda p: f"backup of {p['structure']}", lambda p: f"structure {p['structure']}", _run_backup),
    Action("restore", "Restore", ("structure", "backup"), _check_restore, _confirm_restore,
           lambda p: f"restore of {p['structure']}", lambda p: f"structure {p['structure']}", _run_restore),
    Action("resolve", "Resolve", ("member", "uow", "outcome"), _check_resolve,
           lambda p: (f"{'Commit' if p['commit'] else 'Back out'} unit of work {p['uow']}"
                      + (f" (XID {p['xid']})" if p["xid"] else "") + f", in doubt on {p['member']}?"),
           lambda p: f"{'commit' if p['commit'] else 'backout'} of {p['uow']}", lambda p: f"uow {p['uow']}",
           _run_resolve),
    Action("restart", "Restart", ("member",), _check_restart,
           lambda p: (f"Restart member {p['member']}? It stops (a shutdown checkpoint; SIGKILL after 10 s) and "
                      "starts again on its ports; its applications reconnect to another member meanwhile."),
           lambda p: f"restart of {p['member']}", lambda p: RESTART_TARGET, _run_restart),
)}


__all__ = ["ACTIONS", "Action", "ActionError"]
