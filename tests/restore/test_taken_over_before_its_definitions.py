"""A restore of a structure the CF lost defines it again once it has claimed it (restore.run._redefine). Another
restore or a purge may take the structure over in between (the restore paused: a stalled host, a long garbage
collection), and finish it: ACTIVE, with members' work on it. The paused restore stops at its next guarded write,
having written nothing more; what it writes before that must not touch the structure either: its header said
RECOVERING again, without the taker's token, so every member was refused on a structure nobody restores
(RECAUTO leaves an operator's RECOVERING structure alone), until an operator ran a restore again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import restore.run
from backup.run import run_backup
from cfemu import bulk, keys
from cfemu.admin import Admin
from cfemu.repository import GroupRepository
from restore.run import RestoreStoppedError, run_purge, run_restore
from tests.restore.test_restore import S
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf


def test_a_restore_taken_over_before_it_defined_the_structure_again_leaves_the_takers_structure_as_it_is(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    conn = qm.connect()
    for i in range(5):
        conn.put("Q1", f"m{i}".encode())
    conn.commit()
    run_backup(client, S, backups, log_root=logs)
    qm.stop()
    assert GroupRepository(logs).structure(S) is not None  # a purge defines it from there
    lose_cf(client)

    claimed, go = threading.Event(), threading.Event()
    real = restore.run._redefine

    def paused(*args: Any, **kwargs: Any) -> None:
        claimed.set()  # the restore owns the structure; it is paused before it defines it again
        assert go.wait(60)
        real(*args, **kwargs)

    monkeypatch.setattr(restore.run, "_redefine", paused)
    failed: list[BaseException] = []

    def restoring() -> None:
        try:
            run_restore(client, S, backup_root=backups, log_root=logs)
        except BaseException as e:  # noqa: BLE001 - judged by the test
            failed.append(e)

    first = threading.Thread(target=restoring)
    first.start()
    assert claimed.wait(60)
    monkeypatch.setattr(restore.run, "_redefine", real)  # the purge's own definitions are not held up
    run_purge(client, S, backup_root=backups, log_root=logs)  # takes the structure over, and finishes
    token = bulk.observe(client, S).token
    assert Admin(client).state(S) == "ACTIVE"
    go.set()
    first.join(60)
    assert len(failed) == 1 and isinstance(failed[0], RestoreStoppedError), failed
    assert "took the structure over" in str(failed[0])
    # The purge's structure, as it left it: ACTIVE under its own token.
    assert Admin(client).state(S) == "ACTIVE"
    assert bulk.observe(client, S).token == token
    assert client.hget(keys.meta(S), "state") == b"ACTIVE"
