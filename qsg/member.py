"""The ``sqm`` command as installed: sqm.cli with restore wired in, so that a member recovers a failed RECAUTO
structure by itself (sqm.core.recauto). The composition root lives here, on the top floor, because the member's floor
(sqm) may not import restore; ``sqm run``'s command line and behaviour are sqm.cli's, plus the hook.

    sqm run --name QM1 ...          (pyproject [project.scripts]: sqm = "qsg.member:main")
    python -m qsg.member run ...    the same, as ``cfemu cluster`` starts its members

Least privilege (docs/security.md, "RECAUTO"): the member connects to the CF as ``qsg-member``. Only when it is
about to restore a structure does it read the restore role's password from the group's secrets (the same
resolver as ``cfrestore``: role ``restore``) and open one connection as ``qsg-restore`` for that restore, closed
when it ends. A group whose structures all have RECAUTO off never reads it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from cfemu import settings as settings_mod
from cfemu.clitools import SETTINGS_HELP
from cfemu.connection import connect
from cfemu.progress import Progress
from cfemu.pstore import HOT, start_mode
from cfemu.repository import GroupRepository
from cfemu.settings import Settings
from qsg.group_supervisor import EXIT_FILE_ENV, record_exit
from restore.engine import LOAD, PURGING
from restore.run import RestoreStoppedError, run_restore
from restore.start_modes import automatic_start
from sqm import cli as sqm_cli
from sqm.core.recauto import RecoverStructure, StructureLeftRecovering

log = logging.getLogger("qsg.member")
T = TypeVar("T")


def restore_url(args: argparse.Namespace) -> str | None:
    """The CF URL as the restore role finds it: the member's flags and environment, the restore user's password
    (read now, from the group's secrets)."""
    flags = {name: getattr(args, name, None) for name in SETTINGS_HELP}
    return settings_mod.resolve(role="restore", **flags).redis_url


def summary(result: Any) -> str:
    """One line of what a restore did, for CSQE131I."""
    counts = ", ".join(f"{k} {v}" for k, v in sorted(result.counts.items()) if v)
    return (f"{result.loaded_entries} entries loaded ({counts or 'nothing to settle'}), restore point "
            f"{result.restore_point}, report {result.report_path}")


def claimed_failures(restore: Callable[[Progress], T], progress: Progress) -> T:
    """restore(progress), a restore.run.run_restore or a start mode's purge (restore.start_modes.automatic_start): a
    failure that leaves the structure RECOVERING under its claim raised as StructureLeftRecovering, for RECAUTO to
    try it again (sqm.core.recauto): one once its load began (a purge's: once it claimed the structure), or a
    stop because the CF was lost (one restarted from its own data holds the structure so; one restarted empty has
    it FAILED, recovered anyway). A stop because another restore or a purge took the structure over, or an operator
    changed its state, leaves it theirs: the restore's error as it is."""
    loading = False

    def seen(phase: str, done: int, total: int | None) -> None:
        nonlocal loading
        loading = loading or phase in (LOAD, PURGING)
        progress(phase, done, total)

    try:
        return restore(seen)
    except RestoreStoppedError as e:
        if e.cf_lost:
            raise StructureLeftRecovering(f"{type(e).__name__}: {e}") from e
        raise
    except Exception as e:
        if loading:
            raise StructureLeftRecovering(f"{type(e).__name__}: {e}") from e
        raise


def restore_hook(args: argparse.Namespace, found: Settings) -> RecoverStructure:
    """The member's RECAUTO restore: restore.run.run_restore from the latest good backup and every member's log,
    as ``cfrestore run STRUCTURE`` would with this member's settings; or, for a structure whose start mode is WARM
    or COLD (cfemu pstore mode), that start (restore.start_modes, docs/pstore.md)."""
    backup_root, log_root = found.backup_dir, found.log_root
    # The restore reads $CFEMU_RESTORE_MEMORY and $CFEMU_RESTORE_WORKERS when a structure fails: a bad one is refused
    # now, as the member starts, in one line naming it (ValueError: exit 2), not found when the group needs it.
    settings_mod.restore_memory()
    settings_mod.restore_workers()

    def recover(structure: str, progress: Progress) -> Mapping[str, Any]:
        url = restore_url(args) or found.redis_url
        client = connect(url)
        try:
            if start_mode(GroupRepository(log_root), structure) != HOT:
                started = claimed_failures(lambda seen: automatic_start(
                    client, structure, backup_root=backup_root, log_root=log_root, progress=seen,
                    backup_keys=found.backup_keys()), progress)
                return {"backup": "none", "base_kind": f"{started['mode']} start", "replay_from": "-",
                        "summary": started["summary"]}
            result = claimed_failures(lambda seen: run_restore(
                client, structure, backup_root=backup_root, log_root=log_root, progress=seen,
                backup_keys=found.backup_keys()), progress)
        finally:
            client.close()
        return {"backup": result.backup_id, "base_kind": result.base_kind, "replay_from": result.replay_from,
                "summary": summary(result), "report": result.report_path}

    log.info("automatic structure recovery (RECAUTO) available: backups under %s, logs under %s", backup_root,
             log_root)
    return recover


def main(argv: list[str] | None = None) -> int:
    """``sqm`` with restore wired in. Under a local group (qsg.local_group sets $CFEMU_MEMBER_EXIT_FILE) its exit
    status is written to that file as it exits, for the group's supervisor to give as the reason it restarts it
    (a process killed by a signal writes nothing)."""
    exit_file = os.environ.get(EXIT_FILE_ENV)
    code = 1  # an exception escaping main: the interpreter exits 1
    try:
        code = sqm_cli.main(argv, recovery=restore_hook)
        return code
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    finally:
        if exit_file:
            record_exit(exit_file, code)


if __name__ == "__main__":
    sys.exit(main())
