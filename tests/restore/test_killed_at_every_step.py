"""A restore killed (SIGKILL) at any step after its claim, then run again, gives the structure a clean run gives.

test_crash.py kills the restore between two batches of its load (the one failpoint in it); here a real cfrestore
process is killed right before or after each of its other steps: the claim, restore's decisions logged, the wipe,
the UOW records and tombstones, the verify pass, the restore point, the switch to ACTIVE. The process that runs
cfrestore replaces the step's function with one that SIGKILLs the process there (the same disk and CF a kill -9
leaves)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import redis

from backup.run import run_backup
from cfemu import keys
from cfemu.admin import Admin
from restore.run import RESTORE_MEMBER, run_restore
from sqm.core import records
from sqm.log import LogReader
from tests.restore.test_restore import VOLATILE, S, snapshot
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

# cfrestore run, with `where` ("module:attribute[.attribute]:before|after") made to SIGKILL the process.
KILLING = """
import importlib, os, signal, sys
module, path, when = sys.argv[1].split(":")
owner = importlib.import_module(module)
*parents, name = path.split(".")
for p in parents:
    owner = getattr(owner, p)
real = getattr(owner, name)
def killing(*args, **kwargs):
    if when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    out = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
    return out
setattr(owner, name, killing)
from restore.cli import main
sys.argv = ["cfrestore", *sys.argv[2:]]
sys.exit(main())
"""

STEPS = [
    "cfemu.bulk:claim:after",
    "restore.run:_log_decisions:after",
    "restore.run:remove_unfinished_points:after",
    "cfemu.bulk:reset:after",
    "cfemu.bulk:Loader.finish:after",
    "cfemu.bulk:verify_counts:after",
    "backup.points:RestorePointWriter.finish:after",
    "cfemu.bulk:activate:after",
    "restore.run:rebuild_catalog:after",
]


def structure(client: redis.Redis) -> dict[str, object]:
    """snapshot() less what differs between two restores of the same history: the header's generation and clock,
    and the generation a carried UOW's record names (the restore's own)."""
    out = snapshot(client, volatile=VOLATILE)
    kind, uows = out.get(keys.uows(S), ("hash", {}))
    out[keys.uows(S)] = (kind, {u: {k: v for k, v in msgpack.unpackb(rec).items() if k != "g"}
                                for u, rec in uows.items()})
    return out


def cfrestore(url: str, logs: Path, backups: Path, *args: str, killed_at: str | None = None
              ) -> subprocess.CompletedProcess[str]:
    run = ["run", S, "--redis-url", url, "--backup-dir", str(backups), "--log-root", str(logs), *args]
    cmd = [sys.executable, "-c", KILLING, killed_at, *run] if killed_at else [sys.executable, "-m", "restore.cli", *run]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ))


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS)
def test_a_restore_killed_at_a_step_and_run_again_gives_the_clean_result(redis_url: str, tmp_path: Path,
                                                                        step: str) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client: redis.Redis = define_group(redis_url)
    qm1, qm2 = (start_qm(redis_url, logs, name, background=False) for name in ("QM1", "QM2"))
    a, b = qm1.connect(), qm2.connect()
    for i in range(30):
        a.put("Q1" if i % 2 else "Q2", b"m" + str(i).encode(), priority=i % 10)
    a.commit()
    backup_id = run_backup(client, S, backups, log_root=logs)["id"]
    for _ in range(5):
        b.get("Q1")
    b.commit()
    in_doubt = qm1.connect()
    in_doubt.put("Q2", b"in doubt")
    in_doubt.get("Q1")
    in_doubt.prepare("xid-1")
    in_commit = qm1.connect()  # its COMMIT on disk, not applied when the CF is lost
    in_commit.put("Q2", b"in commit")
    in_commit.get("Q2")
    assert in_commit.uow is not None
    qm1.append(records.commit(in_commit.uow.id, qm1.clock.now(), in_commit.uow.structures))
    qm1.log.force()
    inflight = qm2.connect()
    inflight.get("Q2")  # in flight at the loss: restore backs it out
    b.put("Q1", b"forces QM2's log")
    b.commit()
    lose_cf(client)

    killed = cfrestore(redis_url, logs, backups, killed_at=step)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    again = cfrestore(redis_url, logs, backups)
    if step.startswith(("cfemu.bulk:activate", "restore.run:rebuild_catalog")):
        assert again.returncode == 2 and "is ACTIVE" in again.stderr, again.stderr  # it was done
    else:
        assert again.returncode == 0, again.stderr
    assert Admin(client).state(S) == "ACTIVE"
    resumed = structure(client)
    assert client.hlen(keys.entries(S)) == 30 - 5 + 1 + 1  # the in-doubt put, the in-commit put, less its get
    assert any(k.endswith(":tomb") for k in resumed) and any(k.endswith(":uows") for k in resumed)
    decided = [r for _, r in LogReader(logs / RESTORE_MEMBER).records()]
    assert [(r["k"], r["o"]) for r in decided] == [("RECOVERY", "B")]

    Admin(client).set_state(S, "FAILED")
    run_restore(client, S, backup_root=backups, log_root=logs, backup_id=backup_id)
    assert structure(client) == resumed
    for qm in (qm1, qm2):
        qm.stop()
