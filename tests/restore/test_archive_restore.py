"""A real restore on the Spark engine with --archive-dir: it reads the group's own archive in place of the closed
segments, and refuses a forged one before it changes anything (docs/security.md, "The log archive").

The forgery is the review's: someone who can write the archive rewrote a member's archived segment as a valid
Parquet file, with a body of their own in a put made after the backup and without the unit of work that consumed
a message after it. Before archives were sealed, the restore loaded the forged body and brought the consumed
message back. One Spark restore of each kind, on the suite's shared session."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from backup.run import run_backup
from cfemu import keys
from restore.archive import archive_logs
from restore.run import run_restore
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.xdist_group("spark")]

S = "APP1"
KEPT = {b"msg-1", b"msg-2", b"msg-3", b"late"}


def decoded(path: Path) -> list[dict[str, Any]]:
    return [msgpack.unpackb(b, raw=False) for b in pq.read_table(path).column("record").to_pylist()]


def holding(archive: Path, body: bytes) -> Path:
    """The archived segment file that holds the put of `body`."""
    return next(f for f in sorted(archive.glob("QM1/seg-*.parquet"))
                if any(r["k"] == "PUT" and r.get("d") == body for r in decoded(f)))


def forge(archive: Path) -> Path:
    """The put of "late" given another body, the unit of work that got msg-0 removed; the file rewritten."""
    path = holding(archive, b"late")
    recs = decoded(path)
    msg0 = next(r["e"]["id"] for r in recs if r["k"] == "PUT" and r.get("d") == b"msg-0")
    got_it = next(r["u"] for r in recs if r["k"] == "GET" and r["i"] == msg0)
    for r in recs:
        if r["k"] == "PUT" and r.get("d") == b"late":
            r["d"] = b"FORGED"
    keep = [i for i, r in enumerate(recs) if r.get("u") != got_it]
    t = pq.read_table(path).take(pa.array(keep))
    packed = pa.array([msgpack.packb(recs[i], use_bin_type=True) for i in keep], pa.binary())
    pq.write_table(t.set_column(t.schema.get_field_index("record"), "record", packed), path)
    return path


def restore(client: redis.Redis, root: Path, backup_id: str, spark: Any) -> Any:
    lose_cf(client)
    return run_restore(client, S, backup_root=root / "backups", log_root=root / "logs", backup_id=backup_id,
                       engine="spark", engine_options={"spark": spark, "archive_dir": root / "archive"})


def test_a_spark_restore_reads_the_sealed_archive_and_refuses_a_forged_one(spark: Any, redis_url: str,
                                                                          tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    client = define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False, segment_bytes=4096, cpl_entries=0)
    try:
        conn = qm.connect()
        for i in range(4):
            conn.put("Q1", f"msg-{i}".encode())
        conn.commit()
        backup_id = str(run_backup(client, S, tmp_path / "backups", log_root=logs)["id"])
        conn.put("Q1", b"late")
        conn.commit()
        assert conn.get("Q1").body == b"msg-0"
        conn.commit()
        for _ in range(12):  # consumed traffic on Q2: the records above end up in closed (archived) segments
            conn.put("Q2", os.urandom(1024))
            conn.commit()
            conn.get("Q2")
            conn.commit()
    finally:
        qm.stop()
    assert archive_logs(logs, tmp_path / "archive").archived
    holding(tmp_path / "archive", b"late")  # the records the forgery changes are read from the archive

    result = restore(client, tmp_path, backup_id, spark)
    assert set(client.hvals(keys.data(S))) == KEPT and result.loaded_entries == len(KEPT)

    forged = forge(tmp_path / "archive")
    with pytest.raises(ValueError, match=f"{forged}: not the file that was archived") as refused:
        restore(client, tmp_path, backup_id, spark)
    assert type(refused.value).__name__ == "ArchiveError"  # restore.archive's, a ValueError: one line in the CLI
    assert client.hlen(keys.entries(S)) == 0 and not client.exists(keys.meta(S)), "nothing written into the CF"
