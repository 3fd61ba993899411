"""The durable backup catalog is the backup directory tree itself: <root>/<STRUCTURE>/<backup-id>/.

Listing reads each backup's manifest (its signature checked with the group's backup keys) and checks its files'
presence and sizes; `deep` also reads every frame (CRC32C, digests, frame counts), as `cfbackup verify` does. A
backup is ok, corrupt (damaged: a file, a frame, a checksum), incomplete (no manifest: unfinished), unsigned
(taken before backups were signed: ok only with the operator's override) or untrusted (not the group's backup as
it was written: its signature does not match or is another key's, it names files outside itself, or it is a
symbolic link, which is never read nor removed through). The admin structure keeps a
copy of the catalog (cfemu.admin.Admin.backups) that is lost with the CF; pruning updates it when it can.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import redis

from backup.bounded_json import read_json_file
from backup.files import (
    MANIFEST_MAX_BYTES,
    MANIFEST_NAME,
    BackupError,
    BackupNotFoundError,
    IncompleteBackupError,
    RenamedBackupError,
    UnsignedBackupError,
    UntrustedBackupError,
    parse_backup_id,
    read_backup,
    resolve_keys,
    verify,
)
from backup.points import FUZZY, RESTORE_LOG, kind_of, point_being_written
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.credentials import BackupKeys
from cfemu.pstore import warm_generations
from cfemu.repository import GroupRepository

OK, CORRUPT, INCOMPLETE, UNSIGNED, UNTRUSTED = "ok", "corrupt", "incomplete", "unsigned", "untrusted"

_AGE = re.compile(r"^(\d+)([smhdw])$")
_AGE_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


@dataclass
class BackupInfo:
    id: str
    structure: str
    path: Path
    started: datetime  # from the id (to the second); the manifest's started_at is exact
    state: str  # ok, corrupt, incomplete, unsigned or untrusted
    problem: str = ""  # why it is not ok
    manifest: dict[str, Any] | None = field(default=None, repr=False)
    copy_of: str = ""  # untrusted as a copy under another name: the id its signed manifest names
    # The start_lrsn its manifest says (order_lrsn): checked when ok, else as it still reads (readable_start_lrsn);
    # None when it cannot be read.
    start_lrsn: int | None = None

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly row for listings."""
        m = self.manifest or {}
        return {"id": self.id, "structure": self.structure, "kind": kind_of(m) if m else None,
                "state": self.state, "problem": self.problem,
                "path": str(self.path), "started_at": m.get("started_at", self.started.isoformat()),
                "entries": m.get("entries"), "bytes": m.get("bytes"), "start_lrsn": m.get("start_lrsn"),
                "replay_from": m.get("replay_from"), "end_lrsn": m.get("end_lrsn"),
                "exception_records": m.get("exception_records")}


def inspect(path: Path, *, deep: bool = False, backup_keys: BackupKeys | None = None) -> BackupInfo:
    """The state of the backup directory at `path` (named by its backup id). Whatever goes wrong reading it is this
    backup's state (corrupt, naming the file), never an exception that would stop a listing of the others."""
    structure, started = parse_backup_id(path.name)
    if path.is_symlink():  # never read through: it may lead anywhere
        return BackupInfo(path.name, structure, path, started, UNTRUSTED, _LINK_PROBLEM.format(path=path))
    try:
        info = _inspect(path, structure, started, deep, backup_keys)
    except Exception as e:  # noqa: BLE001 - one unreadable backup is a corrupt row, the others are still listed
        info = BackupInfo(path.name, structure, path, started, CORRUPT,
                          f"{path}: cannot be read ({type(e).__name__}: {e})")
    info.start_lrsn = (int(info.manifest.get("start_lrsn") or 0) if info.manifest is not None
                       else readable_start_lrsn(path))
    return info


def _inspect(path: Path, structure: str, started: datetime, deep: bool,
             backup_keys: BackupKeys | None) -> BackupInfo:
    try:
        manifest = (verify(path, backup_keys=backup_keys) if deep
                    else read_backup(path, backup_keys=backup_keys).manifest)
    except IncompleteBackupError as e:
        return BackupInfo(path.name, structure, path, started, INCOMPLETE, str(e))
    except UnsignedBackupError as e:
        return BackupInfo(path.name, structure, path, started, UNSIGNED, str(e))
    except RenamedBackupError as e:
        return BackupInfo(path.name, structure, path, started, UNTRUSTED, str(e), copy_of=e.copy_of)
    except UntrustedBackupError as e:
        return BackupInfo(path.name, structure, path, started, UNTRUSTED, str(e))
    except BackupError as e:
        return BackupInfo(path.name, structure, path, started, CORRUPT, str(e))
    if manifest["id"] != path.name or manifest["structure"] != structure:
        return BackupInfo(path.name, structure, path, started, CORRUPT,
                          f"{path}: the manifest names backup {manifest['id']} of {manifest['structure']}")
    return BackupInfo(path.name, structure, path, started, OK, manifest=manifest)


_LINK_PROBLEM = ("{path}: a symbolic link, which no backup is (it may lead outside the backup directory): neither "
                 "read nor removed; remove it having checked where it leads")


def _readable_manifest(path: Path) -> dict[str, Any] | None:
    """A damaged backup's manifest as it still reads, signature unchecked; None when it cannot be read as a
    manifest within the bound (too big, too deep, not JSON, a link, missing)."""
    try:
        manifest = read_json_file(Path(path) / MANIFEST_NAME, MANIFEST_MAX_BYTES, "the manifest")
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def readable_kind(path: Path) -> str:
    """The kind (backup.points) a damaged backup's manifest still says, signature unchecked: "" when it cannot be
    read. For the choice of a restore's base, which must not pass over what may be a restore or purge point."""
    manifest = _readable_manifest(path)
    return kind_of(manifest) if manifest is not None else ""


def readable_start_lrsn(path: Path) -> int | None:
    """The start_lrsn a damaged backup's manifest still says, signature unchecked (None when it cannot be read):
    where it stands in its structure's history, for the choice of a restore's base."""
    manifest = _readable_manifest(path)
    try:
        return int(manifest["start_lrsn"]) if manifest is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def order_lrsn(b: BackupInfo) -> int:
    """Where a backup or restore point stands in its structure's history, as an LRSN: its manifest's start_lrsn,
    which the CF ticked when it began (backup_begin.lua; a restore point's is its restore's LRSN); for one that is
    not ok, as its manifest still says it. The CF's clock never runs back, where the time in an id (the wall clock
    of whoever took it) may: an NTP step back, another host. Log retention (sqm.core.retention) keeps the logs from
    the newest backup by start_lrsn, so every choice of a newest backup must be by it too, or a restore would start
    from a backup whose logs were pruned. Only an entry whose manifest cannot be read has nothing better than its
    id's time: the last microsecond of that second (an LRSN is microseconds since the epoch), so that one begun in
    the same second as a good one counts as newer."""
    if b.start_lrsn is not None:
        return b.start_lrsn
    return int(b.started.timestamp()) * 1_000_000 + 999_999


def _sort_key(b: BackupInfo) -> tuple[int, datetime, str]:
    return order_lrsn(b), b.started, b.id


def list_backups(backup_root: Path, structure: str | None = None, *, deep: bool = False,
                 backup_keys: BackupKeys | None = None) -> list[BackupInfo]:
    """Backups (good or not) of one structure, or of all, newest first (by order_lrsn: the CF's clock, not the
    id's time), checked with backup_keys (default: those this process's settings find)."""
    root = Path(backup_root)
    backup_keys = resolve_keys(backup_keys)
    if structure:
        dirs = [root / structure]
    elif root.is_dir():
        dirs = sorted(p for p in root.iterdir() if p.is_dir())
    else:
        dirs = []
    found: list[BackupInfo] = []
    for d in dirs:
        if not d.is_dir():
            continue
        for p in d.iterdir():
            try:
                sname, _ = parse_backup_id(p.name)
            except ValueError:
                continue  # not a backup (a stray file or folder)
            # lstat: a link named like a backup is listed (untrusted), never followed
            if sname == d.name and (p.is_symlink() or p.is_dir()):
                found.append(inspect(p, deep=deep, backup_keys=backup_keys))
    return sorted(found, key=_sort_key, reverse=True)


def find_backup(backup_root: Path, backup_id: str) -> Path:
    """The directory of a backup named by its id; BackupNotFoundError when there is none."""
    try:
        structure, _ = parse_backup_id(backup_id)
    except ValueError as e:
        raise BackupNotFoundError(str(e)) from None
    path = Path(backup_root) / structure / backup_id
    if path.is_symlink():
        raise UntrustedBackupError(_LINK_PROBLEM.format(path=path))
    if not path.is_dir():
        raise BackupNotFoundError(f"no backup {backup_id} in {backup_root}")
    return path


def parse_age(text: str) -> timedelta:
    """'45s', '30m', '12h', '7d', '2w' -> timedelta; ValueError otherwise."""
    m = _AGE.match(text.strip())
    if not m:
        raise ValueError(f"bad age {text!r}: use a number and a unit s, m, h, d or w (e.g. 7d)")
    return timedelta(**{_AGE_UNITS[m[2]]: int(m[1])})


@dataclass
class PruneResult:
    removed: list[BackupInfo]
    kept: list[BackupInfo]
    admin_updated: bool  # False when the CF was not reachable (its catalog copy is rebuilt on restore)
    note: str = ""
    failed: list[tuple[BackupInfo, str]] = field(default_factory=list)  # not removed, and why
    held: list[tuple[BackupInfo, str]] = field(default_factory=list)  # would have gone, kept, and why


def _running_backup(client: redis.Redis, structure: str) -> str | None:
    """The backup the CF says is running: a mark whose lease has ended is not one (its backup cannot end well)."""
    mark = CF(client).structure(structure).backup_mark()
    return mark.backup if mark is not None and not mark.stale else None


def restore_base(backups: list[BackupInfo], repo: GroupRepository | None) -> str | None:
    """The backup a restore of the structure would start from (restore.run.open_backup): the newest good one that
    was not taken while the structure ran from a WARM start (such a backup holds none of the persistent content and
    is never a base). None when there is none."""
    warm = warm_generations(repo, backups[0].structure) if repo is not None and backups else frozenset()
    for b in backups:
        m = b.manifest or {}
        if b.state == OK and not (kind_of(m) == FUZZY and int(m.get("gen", 0) or 0) in warm):
            return b.id
    return None


_BEING_WRITTEN = "a restore point its restore is still writing (the restore runs: it holds {log}'s writer lock)"


def _hold_points_being_written(doomed: list[BackupInfo], log_root: Path | None) -> list[tuple[BackupInfo, str]]:
    """Take out of `doomed` the restore points a running restore is still writing (points.point_being_written):
    removed under it, the restore would fail after its whole load. Returns them, each with why it stays."""
    held = [b for b in doomed if not b.path.is_symlink() and point_being_written(b.path, log_root)]
    for b in held:
        doomed.remove(b)
    where = f"{log_root}/{RESTORE_LOG}" if log_root is not None else f"restore's log ({RESTORE_LOG})"
    return [(b, _BEING_WRITTEN.format(log=where)) for b in held]


def retain(backup_root: Path, structure: str, keep: int, *, client: redis.Redis | None = None,
           repo: GroupRepository | None = None, backup_keys: BackupKeys | None = None,
           keep_age: timedelta | None = None, now: datetime | None = None,
           log_root: Path | None = None) -> PruneResult:
    """The scheduler's retention: keep the newest `keep` good backups of `structure`, and with `keep_age` also
    every good backup started within that age (whichever keeps more: a burst of backups never pushes out what an
    age promises, a quiet week never leaves fewer than `keep`), and remove only what no restore can need. What goes is good backups, and incomplete ones (a backup or restore killed mid-way), older
    than the keep-th newest good backup; never the restore base (restore_base: it may be older when the newest are
    taken from a WARM start), never the backup the CF says is running, and never a corrupt, untrusted or unsigned
    one (a restore refuses to pass over some of them, and they are for an operator to look at). A restore or purge
    point goes only with every backup older than it, so that no restore can start below a point it would cross.
    Nor a restore point a running restore is still writing (its restore holds the writer lock of restore's log
    under `log_root`; without one, no unfinished point goes). When `client` reaches the CF, what goes also leaves
    the admin catalog."""
    if keep < 1:
        raise ValueError(f"--keep must be at least 1, not {keep}")
    backups = list_backups(backup_root, structure, backup_keys=backup_keys)
    good = [b for b in backups if b.state == OK]
    if len(good) <= keep:
        return PruneResult([], backups, client is not None)
    cutoff = backups.index(good[keep - 1])
    if keep_age is not None:  # backups are newest first: the oldest young good backup moves the cutoff down
        young = [b for b in good if b.started >= (now or datetime.now(UTC)) - keep_age]
        if young:
            cutoff = max(cutoff, backups.index(young[-1]))
    protected = {restore_base(backups, repo)}
    if client is not None:
        try:
            protected.add(_running_backup(client, structure))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            client = None
    doomed = [b for b in backups[cutoff + 1:] if b.state in (OK, INCOMPLETE) and b.id not in protected]
    kept_older = {b.id for b in backups[cutoff + 1:]} - {b.id for b in doomed}
    # A point stays while anything older than it stays.
    for i, b in enumerate(backups):
        if b in doomed and kind_of(b.manifest or {}) != FUZZY and any(o.id in kept_older for o in backups[i + 1:]):
            doomed.remove(b)
            kept_older.add(b.id)
    held = _hold_points_being_written(doomed, log_root)
    return _with_held(_remove(structure, backups, doomed, client), held)


def _with_held(result: PruneResult, held: list[tuple[BackupInfo, str]]) -> PruneResult:
    result.held = held
    return result


def _remove(structure: str, backups: list[BackupInfo], doomed: list[BackupInfo],
            client: redis.Redis | None) -> PruneResult:
    """Remove `doomed` (of `backups`) from the disk, and from the admin catalog when `client` reaches the CF. One
    that cannot be removed (a symbolic link, never followed; a file the process may not delete) does not stop the
    others: it is named in `failed`, and only what was removed leaves the catalog."""
    removed: list[BackupInfo] = []
    failed: list[tuple[BackupInfo, str]] = []
    for b in doomed:
        if b.path.is_symlink():
            failed.append((b, _LINK_PROBLEM.format(path=b.path)))
            continue
        try:
            shutil.rmtree(b.path)
        except OSError as e:
            if b.path.exists() or b.path.is_symlink():  # else gone all the same (removed by someone meanwhile)
                failed.append((b, f"{b.path}: {e}"))
                continue
        removed.append(b)
    reachable = client is not None
    if client is not None:
        try:
            admin = Admin(client)
            for b in removed:
                admin.forget_backup(structure, b.id)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            reachable = False
    note = "the CF was not reachable: its catalog copy still lists the removed backups" if not reachable and removed \
        else ""
    return PruneResult(removed, [b for b in backups if b not in removed], reachable, note, failed)


def prune(backup_root: Path, structure: str, *, keep: int | None = None, older_than: timedelta | None = None,
          client: redis.Redis | None = None, now: datetime | None = None,
          backup_keys: BackupKeys | None = None, log_root: Path | None = None) -> PruneResult:
    """Remove backups of `structure` beyond the newest `keep`, and/or started more than `older_than` ago.

    The newest good backup is never removed, nor the backup the CF says is running, nor a restore point a running
    restore is still writing (its restore holds the writer lock of restore's log under `log_root`; without one, no
    unfinished point goes). When `client` reaches the CF, the removed backups also leave the admin catalog."""
    if keep is None and older_than is None:
        raise ValueError("say what to prune: keep N newest, or older than an age")
    if keep is not None and keep < 1:
        raise ValueError(f"--keep must be at least 1, not {keep}")
    now = now or datetime.now(UTC)
    backups = list_backups(backup_root, structure, backup_keys=backup_keys)
    newest_good = next((b.id for b in backups if b.state == OK), None)
    running: str | None = None
    reachable = client is not None
    if client is not None:
        try:
            running = _running_backup(client, structure)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            reachable = False
    removed = [b for rank, b in enumerate(backups)
               if ((keep is not None and rank >= keep) or (older_than is not None and b.started < now - older_than))
               and b.id not in (newest_good, running)]
    held = _hold_points_being_written(removed, log_root)
    return _with_held(_remove(structure, backups, removed, client if reachable else None), held)
