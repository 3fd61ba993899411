"""Every start mode refuses, before it reads or changes anything, a log root that other users can write
(docs/security.md, "Files"; docs/pstore.md): a WARM start reads the definitions a lost CF no longer has from the group
repository there and the tombstones from the members' logs there, and records its generation in that repository, as
a purge (COLD) and a restore (HOT) read them. Real redis-server lost with FLUSHALL, a real member and its log."""

from __future__ import annotations

from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis
from cfemu.pstore import warm_generations
from cfemu.repository import GroupRepository
from qsg.pstore_cli import main as pstore
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"


@pytest.mark.parametrize("mode", ["WARM", "HOT", "COLD"])
def test_a_start_with_a_log_root_others_can_write_is_refused_before_it_changes_anything(
        fresh_redis: EmbeddedRedis, tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    define_group(fresh_redis.url)
    qm = start_qm(fresh_redis.url, logs, "QM1", background=False)
    c = qm.connect()
    c.put("Q1", b"p0")
    c.commit()
    qm.stop()
    lose_cf(fresh_redis.client())
    mode_before = logs.stat().st_mode & 0o7777
    logs.chmod(0o777)
    try:
        rc = pstore(["start", S, "--mode", mode, "--yes", "--redis-url", fresh_redis.url, "--log-root", str(logs),
                     "--backup-dir", str(backups)])
        err = capsys.readouterr().err
    finally:
        logs.chmod(mode_before)
    assert rc == 2 and err.count("\n") == 1 and f"{logs} is writable by other users" in err, err
    assert Admin(fresh_redis.client()).state(S) == "FAILED"  # still lost: nothing started
    assert warm_generations(GroupRepository(logs), S) == frozenset()  # nothing recorded
