"""Starting a structure after a CF loss in one of EntireX's persistent-store start modes (docs/pstore.md):

  HOT   restore its content from the latest good backup and every member's log (restore.run.run_restore: today's
        restore, what RECAUTO did before start modes existed);
  COLD  start it empty (restore.run.run_purge, RECOVER CFSTRUCT TYPE(PURGE)): its messages are gone for good, the
        purge's restore point keeps any later restore from bringing them back;
  WARM  start it empty *without* a restore point, its persistent store disconnected (header flags pstore =
        DISCONNECTED, started = WARM, set in the same switch that makes it ACTIVE): non-persistent work goes on at
        once, every persistent put, get and commit is refused, and the backups and logs stay the truth of its
        persistent content, so that a later HOT start restores it with nothing committed lost. Why refuse
        persistent work meanwhile: what it committed would be logged in a generation that the later restore, which
        starts from the backup taken before the loss, would have to merge with the lost one; and the empty store
        would answer "no message" for messages that exist. The units of work whose COMMIT their owner logged but
        had not applied when the CF was lost get a 'P' tombstone (as a purge gives them), so that the owner's retry
        is a no-op here and not a backout: the later HOT restore replays their COMMIT. A WARM structure is never
        simply connected (pstore.lua refuses): it is started HOT or COLD. No backup of it is taken meanwhile
        (backup_begin.lua refuses), and its generation is recorded in the group repository
        (cfemu.pstore.record_warm_generation), so that a restore never starts from a base taken in it.

Besides a WARM generation, a started structure records nothing: RECAUTO (qsg.member) runs `automatic_start` with
the structure's mode from the group repository (cfemu.pstore.start_mode)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis

from backup.files import resolve_keys
from backup.run import rebuild_catalog
from cfemu import bulk, keys
from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.credentials import BackupKeys
from cfemu.errors import StructureFailedError
from cfemu.private_files import refuse_others_writing
from cfemu.progress import Progress, no_progress
from cfemu.pstore import COLD, HOT, WARM, check_mode, record_warm_generation, start_mode
from cfemu.repository import GroupRepository
from restore.run import (
    RestoreError,
    _definitions_without_backup,
    _group_of,
    purge_claimed,
    refuse_migrated,
    refuse_missing_member_logs,
    run_purge,
    run_restore,
)

WARM_FLAGS = {"pstore": "DISCONNECTED", "started": WARM}


def _started(client: redis.Redis, structure: str) -> str:
    try:
        return CF(client).structure(structure).pstore().started
    except StructureFailedError:
        return ""


def start(client: redis.Redis, structure: str, mode: str, *, backup_root: Path, log_root: Path,
          backup_keys: BackupKeys | None = None, progress: Progress = no_progress) -> dict[str, Any]:
    """Start `structure` in `mode` (HOT, WARM or COLD); returns what was done. A structure that is ACTIVE is
    started again only when it runs from a WARM start (HOT restores it, COLD empties it); else RestoreError. A store
    migration's source (MIGRATING, MIGRATED, or recorded migrated in the group repository) is refused in every
    mode (restore.run.refuse_migrated): only 'cfemu migrate reopen' gives it back."""
    mode = check_mode(mode)
    keys.check_name("structure", structure)
    admin = Admin(client)
    # What the start decides on: the purge of COLD and WARM claims the structure only if nothing took it over since
    # (a HOT restore that completed meanwhile is not emptied).
    seen = bulk.observe(client, structure)
    state = seen.state or "FAILED"  # a structure missing from the CF counts as FAILED (Admin.state)
    refuse_migrated(structure, state, Path(log_root), f"starting ({mode})")
    warm = state == "ACTIVE" and _started(client, structure) == WARM
    if state == "ACTIVE" and not warm:
        raise RestoreError(f"structure {structure} is ACTIVE: a start mode applies to a structure that failed or "
                           f"was lost with the CF (or that runs from a WARM start)")
    _refuse_another_groups_root(admin, structure, Path(log_root))
    # Every mode reads every member's log, and refuses before anything changes when one is missing: HOT's restore
    # to replay it, COLD's purge and the WARM start for the tombstones of the commits logged and not applied.
    out: dict[str, Any] = {"structure": structure, "mode": mode, "state_before": state,
                           "started_before": WARM if warm else ""}
    if mode == HOT:
        r = run_restore(client, structure, backup_root=backup_root, log_root=log_root, mark_failed=warm,
                        progress=progress, backup_keys=backup_keys)
        out.update(backup=r.backup_id, base_kind=r.base_kind, replay_from=r.replay_from,
                   loaded_entries=r.loaded_entries, restore_point=r.restore_point, report=str(r.report_path),
                   summary=f"{r.loaded_entries} entries restored from {r.backup_id or 'the logs'}")
    elif mode == COLD:
        p = run_purge(client, structure, backup_root=backup_root, log_root=log_root, mark_failed=warm,
                      backup_keys=backup_keys, seen=seen, progress=progress)
        out.update(discarded=p.discarded, gen=p.gen, restore_point=p.restore_point,
                   summary=f"started empty ({p.discarded} entries discarded), restore point {p.restore_point}")
    else:
        if warm:
            raise RestoreError(f"structure {structure} runs from a WARM start already")
        gen = warm_start(client, structure, backup_root=backup_root, log_root=log_root, backup_keys=backup_keys,
                         seen=seen, progress=progress)
        out.update(gen=gen, summary="started empty with its persistent store disconnected; its backups and logs "
                                    "are kept for a later HOT start")
    return out


def _refuse_another_groups_root(admin: Admin, structure: str, log_root: Path) -> None:
    """A log root whose group repository is not the one the CF records as the group's is another group's (or a
    wrong --log-root): its repository would record the WARM generation, and its logs would decide the tombstones."""
    recorded = admin.repository()
    here = GroupRepository(log_root).id
    if recorded is not None and here != recorded["id"]:
        raise RestoreError(f"starting {structure}: the log root {log_root} is not the group's (its group repository "
                           f"is {here or 'missing'}, the CF's group has {recorded['id']} at {recorded['path']}): "
                           "name the group's log root")


def warm_start(client: redis.Redis, structure: str, *, backup_root: Path, log_root: Path,
               backup_keys: BackupKeys | None = None, seen: bulk.Seen | None = None,
               progress: Progress = no_progress) -> int:
    """The WARM start (module doc): the structure empty and ACTIVE in a new generation, persistent store
    disconnected, no restore point. Returns the generation. seen: the structure as the caller saw it when it chose
    the start (bulk.observe; default: now): a restore that completed since is refused, not emptied."""
    # Refused before anything is read, as a purge and a restore refuse it: whoever can write the log root could hand
    # the start definitions of their own (a lost CF's come from its group repository) and logs whose commits decide
    # its tombstones, and the start records its generation in that repository.
    refuse_others_writing(Path(log_root))
    admin = Admin(client)
    repo = GroupRepository(log_root)
    seen = seen if seen is not None else bulk.observe(client, structure)
    if seen.state == "ACTIVE":  # serving, with its messages: a WARM start would empty it (start() says when one may)
        raise RestoreError(f"structure {structure} is ACTIVE: a WARM start applies to a structure that failed or was "
                           "lost with the CF")
    sdef, queues, lost = _definitions_without_backup(admin, repo, structure)
    refuse_missing_member_logs(admin, structure, "a WARM start", Path(log_root))
    keys_ = resolve_keys(backup_keys)
    group = _group_of(admin, backup_root, structure, lost, keys_)
    purged = purge_claimed(client, sdef, queues, group=group, lost=lost, log_root=Path(log_root),
                           backup_root=Path(backup_root), backup_keys=keys_, seen=seen, flags=WARM_FLAGS,
                           progress=progress)
    # Before anything else reads the new generation as a base: a restore never starts from it (cfemu.pstore).
    record_warm_generation(repo, structure, purged.gen)
    rebuild_catalog(admin, backup_root, structure, backup_keys=keys_)
    return purged.gen


def automatic_start(client: redis.Redis, structure: str, *, backup_root: Path, log_root: Path,
                    backup_keys: BackupKeys | None = None, progress: Progress = no_progress) -> Mapping[str, Any]:
    """RECAUTO's start of a failed structure in the mode the group repository gives it (HOT: today's restore).
    COLD is the operator's choice made in advance (setting it is the confirmation, as EntireX's PSTORE=COLD)."""
    mode = start_mode(GroupRepository(log_root), structure)
    return start(client, structure, mode, backup_root=backup_root, log_root=log_root, backup_keys=backup_keys,
                 progress=progress)


__all__ = ["WARM_FLAGS", "automatic_start", "start", "warm_start"]
