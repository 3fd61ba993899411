"""``sqm log status|archive|prune``: the operator's view and manual control of the active and inactive log (seed
002; docs/log-management.md).

    sqm log status [--member QM1 | --all] [--json]   each segment: LRSN range, active/inactive/archived, why kept
    sqm log archive [--member QM1 | --all] [--archive-dir DIR]
    sqm log prune [--member QM1 | --all] [--below N]
    sqm log lost MEMBER --confirm MEMBER             declare a member's log lost for good (sqm.core.own_log)

What is needed is computed by sqm.core.retention from the log and the CF (its backup catalog, the structures): a
segment is kept while a restart, a peer's recovery, an active or in-doubt unit of work, or a structure's CF
recovery needs it. archive and prune act only on a log whose member is not running (a running member archives by
itself at each checkpoint, or reuses its ring); prune refuses to remove a needed segment and says what needs it.
When the CF cannot be asked, every segment is needed (the structures' recovery starts are unknown).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import redis

from cfemu.admin import Admin, lease_left_ms
from cfemu.clitools import CLIError, Output, add_settings_arguments, cf_name, require_url, settings, whole
from cfemu.connection import connect
from cfemu.repository import GroupRepository, now_lrsn
from sqm.core.retention import Retention, log_retention
from sqm.log import LogLockedError, LogReader, RecordLog, find_log_dirs, holds_log
from sqm.log.format import archived_segments, read_manifest

ACTIVE, INACTIVE, ARCHIVED = "active", "inactive", "archived"
MAX_SEGMENT = 2**32 - 1  # a segment's number is a 32-bit field of its header (sqm.log.format)


def segment_rows(log_dir: Path, ret: Retention) -> list[dict[str, Any]]:
    """Each segment of one log with its state and why it is kept (empty: nothing needs it)."""
    reader = LogReader(log_dir)
    archived = {i.segment for i in archived_segments(read_manifest(log_dir))}
    segs = reader.segments()
    below = ret.inactive_below(segs)
    rows = []
    for info in segs:
        state = ARCHIVED if info.segment in archived else (INACTIVE if info.segment < below else ACTIVE)
        rows.append({"member": reader.member, "segment": info.segment, "path": str(info.path),
                     "min_lrsn": info.min_lrsn, "max_lrsn": info.max_lrsn, "records": info.records,
                     "state": state, "kept_for": [] if info.segment < below else ret.kept_for(info)})
    return rows


def _dirs(args: argparse.Namespace, log_root: Path) -> list[Path]:
    dirs = find_log_dirs(log_root)
    if not dirs:
        raise CLIError(f"no record logs under {log_root} (set --log-root or $CFEMU_LOG_ROOT)")
    if args.member:
        found = [d for d in dirs if d.name == args.member]
        if not found:
            raise CLIError(f"no log for member {args.member} under {log_root} (members: "
                           f"{', '.join(d.name for d in dirs)})")
        return found
    return dirs


def _admin(args: argparse.Namespace) -> tuple[Admin, Path]:
    found = settings(args)
    args.archive_root = found.log_archive_dir
    return Admin(connect(require_url(found))), found.log_root


def cmd_status(args: argparse.Namespace, out: Output) -> int:
    admin, log_root = _admin(args)
    rows: list[dict[str, Any]] = []
    members = []
    lost = [{"member": m, **rec} for m, rec in sorted(GroupRepository(log_root).lost_logs().items())
            if not args.member or m == args.member]
    try:
        dirs = _dirs(args, log_root)
    except CLIError:
        if not lost:  # no log at all, and none declared lost: the log root is the wrong one
            raise
        dirs = []
    for d in dirs:
        ret = log_retention(d, admin, log_root)
        members.append({"member": ret.member, "needed_from_lrsn": ret.lrsn, "unknown": ret.unknown,
                        "needs": [{"kind": n.kind, "lrsn": n.lrsn, "why": n.why} for n in ret.needs]})
        rows += segment_rows(d, ret)
    if out.as_json:
        out.json({"log_root": str(log_root), "members": members, "segments": rows, "lost_logs": lost})
        return 0
    out.table(f"log segments under {log_root}", ["member", "segment", "LRSN range", "records", "state", "kept for"],
              [[r["member"], r["segment"], f"{r['min_lrsn']}..{r['max_lrsn']}" if r["records"] else "empty",
                r["records"], r["state"], "; ".join(r["kept_for"]) or "-"] for r in rows])
    if lost:
        out.table("logs declared lost for good (sqm log lost): a HOT restore from a base begun before is refused",
                  ["member", "declared", "LRSN", "since"],
                  [[r["member"], r.get("declared_at", "?"), r.get("lrsn", "?"), _since(r)] for r in lost])
    return 0


def _since(lost: dict[str, Any]) -> str:
    """What a member whose log was declared lost did since (GroupRepository.record_member)."""
    if lost.get("pending"):
        return "no log yet: purges, COLD and WARM starts go on without it"
    if lost.get("new_log_at"):
        return f"a new log begun {lost['new_log_at']}"
    return f"its log back {lost.get('log_back_at', '?')}"


def _open_stopped(d: Path) -> RecordLog:
    manifest = read_manifest(d) or {}
    try:
        return RecordLog(d, LogReader(d).member, create=False,
                         segment_bytes=int(manifest.get("segment_bytes") or 64 * 2**20),
                         ring=int(manifest.get("ring") or 0))
    except LogLockedError:
        raise CLIError(f"the log {d} is open by its running member: a running member archives (linear logging) or "
                       "reuses (circular) its inactive segments itself at each checkpoint; stop it to do it by "
                       "hand") from None


def cmd_archive(args: argparse.Namespace, out: Output) -> int:
    admin, log_root = _admin(args)
    done: list[dict[str, Any]] = []
    for d in _dirs(args, log_root):
        with _open_stopped(d) as rlog:
            ret = log_retention(d, admin, log_root)
            if rlog.ring:
                raise CLIError(f"the log {d} is circular: its inactive segments are reused, not archived")
            target = Path(args.archive_root) / rlog.member if args.archive_root else d / "archive"
            for a in rlog.archive(ret.inactive_below(rlog.segments()), target):
                done.append({"member": rlog.member, "segment": a.segment, "path": str(a.path), "records": a.records,
                             "bytes": a.bytes})
    if out.as_json:
        out.json({"archived": done})
    else:
        out.line(f"archived {len(done)} segment(s)" + "".join(f"\n  {r['member']} segment {r['segment']} -> "
                                                            f"{r['path']}" for r in done))
    return 0


def prune_log(d: Path, admin: Admin, log_root: Path, below: int | None = None) -> list[int]:
    """Remove for good the segments of a stopped member's log that no recovery needs (all of them, or those
    numbered below `below`, refused with what needs it when one is needed). Returns the segments removed."""
    with _open_stopped(d) as rlog:
        ret = log_retention(d, admin, log_root)
        segs = [*rlog.archived(), *rlog.segments()]
        bound = ret.inactive_below(segs)
        if below is not None:
            if below > bound:
                first = next(i for i in segs if i.segment == bound)
                raise CLIError(f"{rlog.member}: segment {bound} is still needed, by "
                               f"{'; '.join(ret.kept_for(first))}: nothing removed (segments below {bound} "
                               "may be pruned)")
            bound = below
        return rlog.prune(bound)


def cmd_prune(args: argparse.Namespace, out: Output) -> int:
    admin, log_root = _admin(args)
    removed: list[dict[str, Any]] = []
    for d in _dirs(args, log_root):
        member = LogReader(d).member
        for n in prune_log(d, admin, log_root, args.below):
            removed.append({"member": member, "segment": n})
    if out.as_json:
        out.json({"pruned": removed})
    else:
        out.line(f"pruned {len(removed)} segment(s)" + "".join(f"\n  {r['member']} segment {r['segment']}"
                                                            for r in removed))
    return 0


def cmd_lost(args: argparse.Namespace, out: Output) -> int:
    """Declare a member's log lost for good (sqm.core.own_log): its next start begins a new log, purges and COLD and
    WARM starts go on without it, and restore refuses every base whose replay starts below now."""
    member, log_root = args.lost_member, settings(args).log_root
    if args.confirm != member:
        raise CLIError(f"declaring {member}'s log lost gives up its in-flight and committed-not-applied units of work "
                       f"and every restore from a base taken before now: confirm with --confirm {member}")
    repo = GroupRepository(log_root)
    known = repo.member(member)
    if known is None:
        raise CLIError(f"the group under {log_root} has no member {member} (members: "
                       f"{', '.join(sorted(repo.members())) or 'none'})")
    log_dir = log_root / member
    if holds_log(log_dir):
        raise CLIError(f"{log_dir} holds {member}'s log: it is not lost, and the member starts from it")
    left = _lease_left_ms(args, member)
    if left is not None:
        raise CLIError(f"{member} holds a live lease in the CF ({left} ms left): it runs, its log where this host "
                       "cannot see it, or it died less than a lease ago: stop it, or wait for its lease to lapse")
    # Above every LRSN the group may have logged: the LRSNs of the logs that are left, and the physical clock every
    # LRSN clock starts from. A base whose replay starts below it may need the lost log's records.
    top = max((s.max_lrsn for d in find_log_dirs(log_root) for s in LogReader(d).segments()
               if s.max_lrsn is not None), default=0)
    declared = repo.declare_log_lost(member, max(now_lrsn(), top + 1))
    if out.as_json:
        out.json({"member": member, "log_dir": str(log_dir), **declared})
    else:
        out.line(f"{member}'s log declared lost for good (LRSN {declared['lrsn']}): its next start begins a new log "
                 f"at {log_dir} and backs its units of work on the CF out; purges and COLD and WARM starts go on "
                 "without it; a HOT restore from a base begun before now is refused")
    return 0


def _lease_left_ms(args: argparse.Namespace, member: str) -> int | None:
    """What is left of `member`'s lease in the CF (joined, not lapsed), or None: no lease, no CF given, or the CF
    does not answer (a CF lost is the usual reason to declare a log lost, and no member runs without it)."""
    url = settings(args).redis_url
    if not url:
        return None
    try:
        return lease_left_ms(Admin(connect(url)).members().get(member))
    except (redis.exceptions.RedisError, OSError):
        return None


def add_lost_parser(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    text = ("declare a member's log lost for good (its volume gone): the member then starts with a new log, and "
            "restores from bases taken before are refused")
    p = verbs.add_parser("lost", help=text, description=text[0].upper() + text[1:] + ".")
    p.add_argument("lost_member", metavar="MEMBER", type=cf_name("member"))
    p.add_argument("--confirm", metavar="MEMBER", required=True, type=cf_name("member"), help="the member's name again")
    add_settings_arguments(p, "redis_url", "log_root", "cluster_dir", "cf_dir")
    p.add_argument("--json", action="store_true", help="JSON instead of a line")
    p.add_argument("-v", "--verbose", action="store_true", help="a traceback with errors")
    p.set_defaults(func=cmd_lost)


def add_log_admin_parsers(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``status``, ``archive``, ``prune`` and ``lost`` to ``sqm log``'s verbs."""
    specs = (("status", cmd_status, "each log segment: LRSN range, active/inactive/archived, and why it is kept"),
             ("archive", cmd_archive, "archive the inactive segments of a stopped member's log (copied, verified, "
                                      "fsynced, then removed from the active log)"),
             ("prune", cmd_prune, "remove inactive segments (active or archived) for good; refuses needed ones"))
    for name, func, text in specs:
        p = verbs.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        which = p.add_mutually_exclusive_group()
        which.add_argument("--member", type=cf_name("member"), help="this member's log only")
        which.add_argument("--all", action="store_true", help="every member's log (the default)")
        add_settings_arguments(p, "redis_url", "log_root", "cluster_dir", "cf_dir",
                               *(("log_archive_dir",) if name == "archive" else ()))
        if name == "prune":
            p.add_argument("--below", type=whole(1, MAX_SEGMENT), metavar="N",
                           help=f"remove the segments numbered below N, 1-{MAX_SEGMENT} (refused if any is needed; "
                                "default: every inactive one)")
        p.add_argument("--json", action="store_true", help="JSON instead of a table")
        p.add_argument("-v", "--verbose", action="store_true", help="a traceback with errors")
        p.set_defaults(func=func)
    add_lost_parser(verbs)


__all__ = ["add_log_admin_parsers", "prune_log", "segment_rows"]
