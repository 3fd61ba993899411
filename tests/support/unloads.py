"""Store migrations for tests: a structure unloaded from a real CF, and a target CF with a history of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backup import migrate
from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.connection import connect
from tests.support.group import start_qm


def unloaded(redis_url: str, tmp_path: Path, bodies: list[bytes]) -> Path:
    """APP1 (queue Q1) holding `bodies`, put and committed by a real member (its log under tmp_path/logs), unloaded
    from the CF at redis_url into tmp_path/mig, which is returned."""
    Admin(connect(redis_url)).ensure_structure("APP1", ("Q1",))
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    conn = qm.connect()
    for body in bodies:
        conn.put("Q1", body)
    conn.commit()
    qm.stop()
    migrate.unload(connect(redis_url), "APP1", tmp_path / "mig")
    return tmp_path / "mig"


def backed_up_target(target: Any, logs: Path, backups: Path, body: bytes | None = None, **member: Any) -> Any:
    """A target CF's own APP1 (queue Q1), with `body` (if any) put and committed by its member QM1 (its log root
    `logs`), backed up into `backups`; the member is returned, running, for the caller to use and stop."""
    Admin(target.client()).ensure_structure("APP1", ("Q1",))
    qm = start_qm(target.url, logs, "QM1", background=False, **member)
    if body is not None:
        c = qm.connect()
        c.put("Q1", body)
        c.commit()
    run_backup(target.client(), "APP1", backups, log_root=logs)
    return qm
