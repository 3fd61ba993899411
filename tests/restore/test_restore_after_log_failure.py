"""A restore from a backup and the logs (mark_failed: the live structure restored in place) after a member whose log
cannot be written ended a unit of work holding a persistent get: the member does not back it out without a record
(docs/pstore.md); its message stays locked until the member restarts and backs it out from its log, with a record,
so the restore places the backout where the CF took it. Real redis-server, real logs; the log failure is the
writer's own state after a failed fsync (its later appends refused) and the manager's own reaction to it."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from backup.run import run_backup
from cfemu.errors import BackedOutError, LogFailedError
from restore.run import run_restore
from sqm.core.manager import QueueManager
from tests.restore.test_restore import S, rejoin
from tests.support.group import define_group, start_qm


def view(qm: QueueManager, queue: str = "Q1") -> list[tuple[bytes, int]]:
    """The queue's available messages: (body, backout count), in get order."""
    return [(m.body, m.backout_count) for m in qm.connect().browse(queue, limit=100)]


def fail_log(qm: QueueManager) -> None:
    """The member's log fails as a failed fsync leaves it: the writer refuses every later append, and the member
    reacts (refuses persistent work, dooms its in-flight persistent UOWs)."""
    assert qm.log is not None
    e = OSError(errno.EIO, "Input/output error (injected)")
    qm.log._failed = e
    with pytest.raises(LogFailedError):
        qm.log_failure(e)


@pytest.mark.parametrize("then", ["left", "consumed", "got-again-in-flight"])
def test_a_get_the_failed_log_could_not_back_out_is_backed_out_by_the_restart_and_restored_as_the_cf_holds_it(
        redis_url: str, tmp_path: Path, then: str) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qms = [start_qm(redis_url, logs, f"QM{i}", background=False) for i in (1, 2, 3)]
    qm1, qm2, qm3 = qms
    try:
        a = qm1.connect()
        for body in (b"x", b"y"):
            a.put("Q1", body)
        a.commit()
        run_backup(client, S, backups, log_root=logs)
        b = qm2.connect()
        assert b.get("Q1").body == b"x"  # persistent get in flight
        assert qm2.log is not None
        qm2.log.force()  # its GET record is on disk
        fail_log(qm2)
        with pytest.raises(BackedOutError, match="cannot write its log"):
            b.commit()
        assert view(qm1) == [(b"y", 0)]  # x stays locked: no backout without a record
        qm2.stop(checkpoint=False)  # the operator stops the member, fixes the disk, restarts it
        qms[1] = qm2 = start_qm(redis_url, logs, "QM2", background=False)
        assert sorted(view(qm1)) == [(b"x", 1), (b"y", 0)]  # its restart backed it out, with a record
        c = qm3.connect()
        if then == "consumed":
            assert c.get("Q1").body == b"x"
            c.commit()
        elif then == "got-again-in-flight":
            assert c.get("Q1").body == b"x"
            assert qm3.log is not None
            qm3.log.force()
        for qm in qms:
            assert qm.log is not None
            qm.log.force()
        live: dict[str, Any] = {"Q1": view(qm1)}
        run_restore(client, S, backup_root=backups, log_root=logs, mark_failed=True)
        for qm in qms:
            rejoin(qm)
        if then == "got-again-in-flight":  # restore backs out QM3's in-flight get, as QM3's restart would
            live["Q1"] = sorted(live["Q1"] + [(b"x", 2)])
        assert {"Q1": sorted(view(qm1))} == {"Q1": sorted(live["Q1"])}
    finally:
        for qm in qms:
            qm.stop(checkpoint=False)
