"""A loadable unload's source is recorded migrated (docs/migration.md, "Never both, after a loss of the source
CF"): wherever an unload is killed, either nothing of it can be loaded, or the group repository records its source
migrated, so that a loss of the source CF does not make restore (a start mode, RECAUTO) serve it beside the target.
A real `cfemu migrate unload` process, killed with SIGKILL at a chosen line; real redis-servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from backup import migrate
from backup.files import BackupError
from cfemu.connection import connect
from cfemu.embedded import EmbeddedRedis
from restore.run import RestoreError
from restore.start_modes import start
from tests.backup.test_migration import ROOT, S, backed_up_source
from tests.support.harness import lose_cf

# `cfemu migrate unload` killed (SIGKILL) as it is about to record the migration in the group repository.
KILLED_BEFORE_THE_RECORD = """
import os, signal, sys
from cfemu.repository import GroupRepository
GroupRepository.record_migrated = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
from qsg.migrate_cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_unload_killed_before_its_record_is_not_loadable_or_its_source_not_restored(
        fresh_redis: EmbeddedRedis, redis_factory: Any, tmp_path: Path) -> None:
    url = fresh_redis.url
    qm = backed_up_source(url, tmp_path)
    qm.stop()
    r = subprocess.run([sys.executable, "-c", KILLED_BEFORE_THE_RECORD, "unload", S, "--to", str(tmp_path / "mig"),
                        "--redis-url", url], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == -9, (r.returncode, r.stderr)
    lose_cf(fresh_redis.client())  # the source CF is lost: its MIGRATING header with it
    try:
        migrate.load(redis_factory().client(), tmp_path / "mig", group="QSG2")
    except (BackupError, migrate.MigrationError):
        return  # nothing of it loads: the source alone serves its messages
    with pytest.raises(RestoreError, match="was migrated"):  # loaded: its source must not be restored
        start(connect(url), S, "HOT", backup_root=tmp_path / "backups", log_root=tmp_path / "logs")
