"""A member starts only from its own log: one the group knows it had is never begun again by itself.

The group repository records every member that joined (cfemu.repository). A member it records whose log directory
holds no log (its volume not mounted, the wrong --log-root, a disk that died) would otherwise start a new, empty log
there: its in-flight units of work, and the commits it forced but had not applied, would be backed out by its own
restart (a committed unit of work half applied, the rest undone), and restore would replay the new log as the
whole of the member's history. So the start is refused, naming where the log was, until the log is back or the
operator declares it lost for good (``sqm log lost``, GroupRepository.declare_log_lost): then the member begins a
new log, and restore refuses the bases that needed the old one."""

from __future__ import annotations

from pathlib import Path

from cfemu.repository import LOG_LOST, GroupRepository, RepositoryError
from sqm.log import holds_log


class OwnLogMissingError(RepositoryError):
    """The group knows this member's log, and its log directory holds none."""


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


__all__ = ["OwnLogMissingError", "begins_anew"]
