"""A load is refused by a target structure that runs from a WARM start (docs/migration.md, "The handshake";
docs/pstore.md): its persistent content is in its group's backups and logs, kept for its HOT start, and a load
would replace its header (the WARM start's mark) and make it serve the migration's messages instead, with no HOT
start possible any more (an ACTIVE structure not started WARM is not started again). As the unload refuses a WARM
source. Real redis-servers, real members' puts, a real backup of the target, the target CF lost with FLUSHALL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backup import migrate
from backup.migrate_target import TARGET_FILE
from cfemu.cf import CF
from restore.start_modes import start
from tests.support.group import start_qm
from tests.support.harness import lose_cf
from tests.support.messages import drained
from tests.support.unloads import backed_up_target, unloaded


def test_a_structure_running_from_a_warm_start_is_not_loaded_into(redis_url: str, redis_factory: Any,
                                                                   tmp_path: Path) -> None:
    unloaded(redis_url, tmp_path, [b"migrated"])
    target = redis_factory()
    logs2, backups2 = tmp_path / "logs2", tmp_path / "backups2"
    backed_up_target(target, logs2, backups2, b"kept for the HOT start").stop()
    lose_cf(target.client())
    start(target.client(), "APP1", "WARM", backup_root=backups2, log_root=logs2)

    with pytest.raises(migrate.HandshakeError, match=r"^structure APP1 in the target runs from a WARM start: [^\n]*"
                                                     r"start it HOT or COLD first[^\n]*$"):
        migrate.load(target.client(), tmp_path / "mig", log_root=logs2)
    assert CF(target.client()).structure("APP1").pstore().started == "WARM"  # as it was
    assert not (tmp_path / "mig" / TARGET_FILE).exists() and not (tmp_path / "mig" / migrate.LOAD_REPORT).exists()

    start(target.client(), "APP1", "HOT", backup_root=backups2, log_root=logs2)  # what the WARM start kept for
    member = start_qm(target.url, logs2, "QM1", background=False)
    try:
        assert drained(member.connect(), "Q1") == [b"kept for the HOT start"]
    finally:
        member.stop()
