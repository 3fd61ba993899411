"""An automatic recovery (RECAUTO) that fails after its restore claimed the structure leaves it RECOVERING: the
restore point could not be written (the backup volume full), the load did not verify, the restore process ran out
of memory. The member logs CSQE135E, "retrying in 2 s": the structure must then be recovered again, by this member
once that time has passed or by another. A RECOVERING structure without the automatic recovery's mark is an
operator's restore, which members leave alone: the failed attempt's mark must stay for that. The member's restore
says so by raising StructureLeftRecovering (qsg.member.claimed_failures); an attempt refused because an operator's
restore claimed the structure first leaves the operator's restore alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cfemu import repository
from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.progress import Progress
from sqm.core.config import StructureLeftRecovering
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.wings import WINGS


def test_a_recovery_that_failed_after_its_claim_is_tried_again(redis_url: str, tmp_path: Path) -> None:
    log_root = tmp_path / "logs"
    client = connect(redis_url)
    admin = Admin(client)
    repo = repository.open_group_repository(admin, log_root, who="test")
    repository.ensure_structure(admin, repo, "APP2", ["Q2"])
    calls: list[str] = []

    def recover(structure: str, progress: Progress) -> dict[str, Any]:
        calls.append(structure)
        if len(calls) == 1:
            admin.set_state(structure, "RECOVERING")  # the restore's claim
            raise StructureLeftRecovering("OSError: [Errno 28] No space left on device: the restore point")
        admin.set_state(structure, "ACTIVE")
        return {}

    qm = QueueManager(QueueManagerConfig(name="QM1", log_root=log_root, redis_url=redis_url, background=False,
                                         recover_structure=recover), wings=WINGS)
    qm.start()
    try:
        assert qm.recauto is not None
        admin.set_state("APP2", "FAILED")
        assert qm.recauto.check(now=1e9) == ["APP2"]
        assert qm.recauto.wait(10)
        assert admin.state("APP2") == "RECOVERING" and calls == ["APP2"]
        assert qm.recauto.check(now=1e9) == []  # not before its retry time
        assert qm.recauto.check(now=2e9) == ["APP2"]  # then again
        assert qm.recauto.wait(10)
        assert calls == ["APP2", "APP2"] and admin.state("APP2") == "ACTIVE"
        assert admin.recovery_attempt("APP2") is None  # recovered: no mark left
    finally:
        qm.stop()
        client.close()


def test_an_attempt_refused_because_an_operators_restore_claimed_first_leaves_that_restore_alone(
        redis_url: str, tmp_path: Path) -> None:
    log_root = tmp_path / "logs"
    client = connect(redis_url)
    admin = Admin(client)
    repo = repository.open_group_repository(admin, log_root, who="test")
    repository.ensure_structure(admin, repo, "APP2", ["Q2"])
    calls: list[str] = []

    def recover(structure: str, progress: Progress) -> dict[str, Any]:
        calls.append(structure)
        admin.set_state(structure, "RECOVERING")  # the operator's restore claimed it meanwhile
        raise RuntimeError("restore of APP2 refused: another restore or a purge took the structure over")

    qm = QueueManager(QueueManagerConfig(name="QM1", log_root=log_root, redis_url=redis_url, background=False,
                                         recover_structure=recover), wings=WINGS)
    qm.start()
    try:
        assert qm.recauto is not None
        admin.set_state("APP2", "FAILED")
        assert qm.recauto.check(now=1e9) == ["APP2"]
        assert qm.recauto.wait(10)
        assert admin.recovery_attempt("APP2") is None
        assert qm.recauto.check(now=2e9) == [] and calls == ["APP2"]
    finally:
        qm.stop()
        client.close()
