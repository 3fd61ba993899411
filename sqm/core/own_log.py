"""A member starts only from its own log: one the group knows it had is never begun again by itself.

The group repository records every member that joined (cfemu.repository). A member it records whose log directory
holds no log (its volume not mounted, the wrong --log-root, a disk that died) would otherwise start a new, empty log
there: its in-flight units of work, and the commits it forced but had not applied, would be backed out by its own
restart (a committed unit of work half applied, the rest undone), and restore would replay the new log as the
whole of the member's history. So the start is refused, naming where the log was, until the log is back or the
operator declares it lost for good (``sqm log lost``, GroupRepository.declare_log_lost): then the member begins a
new log, and restore refuses the bases that needed the old one."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cfemu.admin import lease_left_ms
from cfemu.repository import LOG_LOST, GroupRepository, RepositoryError
from sqm.log import holds_log

HOST = socket.gethostname()  # in the member's join info: where an incarnation runs


class OwnLogMissingError(RepositoryError):
    """The group knows this member's log, and its log directory holds none."""


class RunsElsewhereError(RepositoryError):
    """Another incarnation of this member holds a live lease, on another host or from another log."""


def refuse_live_elsewhere(members: Mapping[str, Mapping[str, Any]], member: str, log_dir: Path) -> None:
    """RunsElsewhereError when the CF lists `member` with a live lease joined from another host, or from another log
    directory: a copy of its log volume (a snapshot restored on a standby host, a shared volume whose locks do not
    cross hosts) that the log's writer lock cannot see. Let in, its join would fence the running incarnation and its
    restart back out, from the stale copy, units of work that one is committing: two histories for one member. On
    the same host and log, the writer lock held for this start says the previous incarnation is gone, and its lease
    is only left to lapse. members: the CF's (cfemu.admin.Admin.members)."""
    info = members.get(member)
    left = lease_left_ms(info)
    if info is None or left is None:
        return
    host, log = str(info.get("host") or HOST), str(info.get("log") or "")
    if host == HOST and (not log or Path(log).absolute() == log_dir.absolute()):
        return
    raise RunsElsewhereError(
        f"{member}: another incarnation holds a live lease in the CF ({left} ms left), joined from "
        f"host {host} (pid {info.get('pid', '?')}) with its log at {log or '?'}, not this one's {HOST}:{log_dir}: it "
        "may be running there, and this start would fence it; stop it, or wait for its lease to lapse and start "
        "again")


def join_info(log_dir: Path, pid: int) -> dict[str, Any]:
    """What a member's join records of where it runs (refuse_live_elsewhere reads it)."""
    return {"pid": pid, "log": str(log_dir), "host": HOST}


def begins_anew(repo: GroupRepository, member: str, log_dir: Path) -> bool:
    """Whether `member` may start at `log_dir`: False when it starts from the log there (or joins for the first
    time), True when its log was declared lost and this start begins the new one; OwnLogMissingError otherwise."""
    known = repo.member(member)
    if known is None or holds_log(log_dir):
        return False
    lost = known.get(LOG_LOST) or {}
    if lost.get("pending"):
        return True
    recorded = str(known.get("log") or "")
    where = (f"the group recorded it at {recorded}" if recorded and Path(recorded).absolute() != log_dir.absolute()
             else f"{log_dir} holds none")
    raise OwnLogMissingError(
        f"{member}: the group knows this member's log (joined {known.get('joined_at', '?')}, last "
        f"{known.get('last_joined_at', '?')}) and {where}: its in-flight and committed-not-applied units of work are "
        f"in it, so the member does not start without it; mount the log's volume back at {log_dir} (or copy the log "
        f"there) and start again; only if it is lost for good: 'sqm log lost {member} --confirm {member}', then start "
        "again (a new log begins; its units of work on the CF are backed out)")


__all__ = ["HOST", "OwnLogMissingError", "RunsElsewhereError", "begins_anew", "join_info", "refuse_live_elsewhere"]
