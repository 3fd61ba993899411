"""A HOT start (`cfemu pstore start --mode HOT`) over a member log with a corrupt record is refused in one line that
names the log and where, exit status 2, the structure left as it was: as `cfrestore run` refuses it (invariant 6).
Before, the command died with a traceback. Real redis-server lost with FLUSHALL, a real member, its log, a real
backup."""

from __future__ import annotations

from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.embedded import EmbeddedRedis
from qsg.pstore_cli import main as pstore
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"


def test_a_hot_start_over_a_corrupt_log_is_refused_in_one_line(fresh_redis: EmbeddedRedis, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(fresh_redis.url)
    qm = start_qm(fresh_redis.url, logs, "QM1", background=False)
    c = qm.connect()
    for i in range(20):
        c.put("Q1", b"p%d" % i)
        c.commit()
    run_backup(client, S, backups, log_root=logs)
    qm.stop()
    segment = sorted((logs / "QM1").glob("seg-*.log"))[-1]
    raw = bytearray(segment.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a record the restore replays (after the backup's replay start)
    segment.write_bytes(bytes(raw))
    lose_cf(fresh_redis.client())
    before = sorted(p.name for p in (backups / S).iterdir())

    rc = pstore(["start", S, "--mode", "HOT", "--redis-url", fresh_redis.url, "--log-root", str(logs),
                 "--backup-dir", str(backups)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("cfemu pstore: error: corrupt record log ") and segment.name in err
    assert Admin(fresh_redis.client()).state(S) == "FAILED"  # nothing started
    assert sorted(p.name for p in (backups / S).iterdir()) == before  # no restore point, no report
