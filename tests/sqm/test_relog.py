"""Selective relogging with a Checkpoint Positioning List (seed 000; docs/log-management.md), against a
real redis-server and real log files: which messages a checkpoint relogs and when, the CPL it carries, and the
seed's rules (a pass killed midway, a delete logged before the relog in one UOW, relogging at termination), each
checked by restoring the structure from the logs alone and comparing with what the clients know.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import redis

from cfemu import keys
from restore.run import LOGS, newest_pass, run_restore
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager
from sqm.log import LogReader, find_log_dirs
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "logs", tmp_path / "backups"


def relogs(log_dir: Path) -> list[dict[str, Any]]:
    return [r for _, r in LogReader(log_dir).records() if r["k"] == "RELOG"]


def checkpoints(log_dir: Path) -> list[dict[str, Any]]:
    return [r for _, r in LogReader(log_dir).records() if r["k"] == "CHECKPOINT"]


def stored_cpl(client: redis.Redis) -> Any:
    raw = client.hget(keys.meta(S), "relog_cpl")
    return json.loads(raw) if raw else None


def available(conn: Connection, queue: str = "Q1") -> list[tuple[bytes, int]]:
    return sorted((m.body, m.backout_count) for m in conn.browse(queue, limit=10_000))


def restore_from_logs(url: str, logs: Path, backups: Path) -> Any:
    client = redis.Redis.from_url(url)
    lose_cf(client)
    result = run_restore(client, S, backup_root=backups, log_root=logs)
    assert result.base_kind == LOGS, result.start
    return result


def test_a_checkpoint_relogs_only_messages_older_than_the_oldest_cpl_pair(redis_url: str,
                                                                          dirs: tuple[Path, Path]) -> None:
    """Seed 000, Figures 1-4 with n = 3: a message that stays is relogged at the (n+1)-th checkpoint after its put,
    and again n checkpoints later; messages that come and go are never relogged; each checkpoint record carries the
    CPL aged by one pair and the window, which is the oldest pair's end."""
    logs, _ = dirs
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=3)
    c = qm.connect()
    for i in range(5):
        c.put("Q1", f"stay-{i}".encode())
    c.commit()
    per_checkpoint = []
    for k in range(7):
        for j in range(4):  # churn: put and consumed within the interval
            c.put("Q1", f"churn-{k}-{j}".encode(), priority=9)
            c.commit()
            assert c.get("Q1").body == f"churn-{k}-{j}".encode()
            c.commit()
        before = len(relogs(qm.log_dir))
        qm.checkpoint("logload")
        per_checkpoint.append(len(relogs(qm.log_dir)) - before)
    assert per_checkpoint == [0, 0, 0, 5, 0, 0, 5]
    assert {r["e"]["id"] for r in relogs(qm.log_dir)} == {m.entry_id for m in c.browse("Q1", limit=100)}
    ckpts = [r for r in checkpoints(qm.log_dir) if r["why"] == "logload"]
    for prev, cur in zip(ckpts, ckpts[1:], strict=False):
        p, q = prev["rl"][S], cur["rl"][S]
        assert q["cpl"][:-1] == p["cpl"][1:] and q["cpl"][-1] == [q["b"], cur["l"]]  # aged by one pair
        assert q["w"] == p["cpl"][0][1]  # the window: the oldest pair's end before aging
    assert stored_cpl(qm.redis)["p"] == ckpts[-1]["rl"][S]["cpl"]
    qm.stop(checkpoint=False)


def test_the_window_holds_every_live_message_so_the_logs_alone_restore_it(redis_url: str,
                                                                          dirs: tuple[Path, Path]) -> None:
    """After many intervals, the newest complete pass's window starts after every original put of the messages that
    stayed; restoring from the logs alone, from that window, gives back exactly what the clients see (order and
    backout counts included)."""
    logs, backups = dirs
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=2)
    c = qm.connect()
    for i in range(6):
        c.put("Q1", f"stay-{i}".encode(), priority=i % 3)
    c.commit()
    c.get("Q1")
    c.backout()  # a backout count to keep
    first_puts = max(r["l"] for _, r in LogReader(qm.log_dir).records() if r["k"] == "PUT")
    for k in range(6):
        c.put("Q1", f"late-{k}".encode())
        c.commit()
        qm.checkpoint("logload")
    truth = [(m.body, m.backout_count) for m in drain_order(c)]
    qm.stop(checkpoint=False)
    found = newest_pass(find_log_dirs(logs), S)
    assert found is not None and found[1]["w"] > first_puts
    result = restore_from_logs(redis_url, logs, backups)
    assert result.replay_from == found[1]["w"] and "logs alone" in result.start
    qm = start_qm(redis_url, logs, "QM1", background=False)
    assert [(m.body, m.backout_count) for m in drain_order(qm.connect())] == truth
    qm.stop()


def drain_order(conn: Connection) -> list[Any]:
    """Every available message on Q1 in get order (browse order is get order)."""
    return list(conn.browse("Q1", limit=10_000))


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "backout"])
def test_a_get_before_the_relog_in_one_uow_discards_the_relog(redis_url: str, dirs: tuple[Path, Path],
                                                              commit: bool) -> None:
    """Seed 000's starred rule: a deletion logged before the relog of the same message in one UOW, the UOW's commit
    after it. The pass copies the message as the get holds it (UG, with the UOW): restored from the logs alone it is
    consumed when the UOW commits (the relog is discarded) and available again, its backout count raised, when the
    UOW backs out."""
    logs, backups = dirs
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=1)
    c = qm.connect()
    c.put("Q1", b"old")
    c.put("Q1", b"other")
    c.commit()
    for _ in range(2):
        qm.checkpoint("logload")  # both relogged once: their PUT records fall out of the window
    getter = qm.connect()
    assert getter.get("Q1").body == b"old"  # logged, not forced, not committed
    qm.checkpoint("logload")  # relogs both again: "old" as the get holds it
    copy = [r["e"] for r in relogs(qm.log_dir) if r["e"]["id"] and r["e"].get("st") == "UG"]
    assert len(copy) == 1 and copy[0]["u"]
    if commit:
        getter.commit()
    else:
        getter.backout()
    c.put("Q1", b"forces the log")
    c.commit()
    truth = available(c)
    qm.stop(checkpoint=False)
    result = restore_from_logs(redis_url, logs, backups)
    puts = [r for _, r in LogReader(logs / "QM1").records() if r["k"] == "PUT" and r["d"] == b"old"]
    assert puts[0]["l"] < result.replay_from  # the original put is outside the window: only the copies tell
    qm = start_qm(redis_url, logs, "QM1", background=False)
    assert available(qm.connect()) == truth
    assert ((b"old", 1) in truth) == (not commit)
    qm.stop()


def test_shutdown_relogs_everything_and_the_window_starts_there(redis_url: str, dirs: tuple[Path, Path]) -> None:
    """Seed 000: relogging at termination. A clean stop relogs every message, whatever its age, and its window
    starts at the pass's begin, so a restore from the logs alone reads nothing before the shutdown."""
    logs, backups = dirs
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=5)
    c = qm.connect()
    for i in range(4):
        c.put("Q1", f"m{i}".encode())
    c.commit()
    truth = available(c)
    qm.stop()
    last = checkpoints(logs / "QM1")[-1]
    assert last["why"] == "shutdown" and last["rl"][S]["w"] == last["rl"][S]["b"]
    assert len([r for r in relogs(logs / "QM1") if r["l"] > last["rl"][S]["b"]]) == 4
    assert last["rl"][S]["cpl"] == [[last["rl"][S]["b"], last["l"]]] * 5
    result = restore_from_logs(redis_url, logs, backups)
    assert result.replay_from == last["rl"][S]["b"]
    qm = start_qm(redis_url, logs, "QM1", background=False)
    assert available(qm.connect()) == truth
    qm.stop()


CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from sqm.core.manager import QueueManager, QueueManagerConfig
    url, logs = sys.argv[1], Path(sys.argv[2])
    qm = QueueManager(QueueManagerConfig(name="QM1", log_root=logs, redis_url=url, background=False,
                                         cpl_entries=2))
    qm.start()
    c = qm.connect()
    for i in range(4):
        c.put("Q1", f"stay-{i}".encode())
    c.commit()
    print("put", flush=True)
    for k in range(4):
        qm.checkpoint("logload")
        print("checkpoint", k, flush=True)
    qm.stop()
""")


@pytest.mark.parametrize("point", ["relog-before-force", "relog-after-force", "relog-before-checkpoint"])
def test_a_pass_killed_midway_moves_no_window(redis_url: str, dirs: tuple[Path, Path], point: str) -> None:
    """Seed 000: relog records of an incomplete checkpoint. A member killed (SIGKILL) in the middle of the pass
    that relogs its messages leaves the stored CPL and the logs' last complete pass as they were; the pass's copies,
    whatever reached the disk, are never relied on: the restart's pass copies again whatever was not marked (a mark
    only ever follows the force), and the structure restored from the logs alone, then or after the restart, holds
    every message."""
    logs, backups = dirs
    client = define_group(redis_url, queues=("Q1",))
    env = {**os.environ, "SQM_FAILPOINTS": point, "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", CHILD, redis_url, str(logs)], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == -9, child.stderr[-2000:]
    # The first pass to relog anything is the third checkpoint after the puts (n = 2): the failpoint's first hit
    # with copies. relog-before-checkpoint fires at every checkpoint: it killed the start checkpoint's.
    assert child.stdout.count("checkpoint") == (0 if point == "relog-before-checkpoint" else 2), child.stdout
    cpl_before = stored_cpl(client)
    found = newest_pass(find_log_dirs(logs), S)
    if point == "relog-before-checkpoint":
        assert found is None and cpl_before is None  # the start checkpoint's pass never completed
        return
    assert found is not None
    assert cpl_before["p"] == found[1]["cpl"]  # the incomplete pass stored nothing
    assert client.hget(keys.meta(S), "relog_owner") == b"QM1"  # its lock: the dead member's, until its lease ends

    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=2)  # the restart's pass takes over
    truth = available(qm.connect())
    assert [b for b, _ in truth] == [f"stay-{i}".encode() for i in range(4)]
    qm.stop(checkpoint=False)
    start = newest_pass(find_log_dirs(logs), S)
    assert start is not None and start[1]["e"] > found[1]["e"]
    restore_from_logs(redis_url, logs, backups)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    assert available(qm.connect()) == truth
    qm.stop()


def test_one_member_relogs_a_structure_at_a_time(redis_url: str, dirs: tuple[Path, Path]) -> None:
    """The relog lock: while one member's pass holds it, another member's checkpoint leaves the structure to it;
    once released, either may relog it, continuing the same CPL (read from the structure's header)."""
    logs, _ = dirs
    define_group(redis_url, queues=("Q1",))
    a: QueueManager = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=2)
    b: QueueManager = start_qm(redis_url, logs, "QM2", background=False, cpl_entries=2)
    a.redis.hset(keys.meta(S), mapping={"relog_owner": "QM1", "relog_until": 2**50})
    before, prev = stored_cpl(b.redis), dict(b.relog_passes[S])  # B relogged it at its start
    b.checkpoint("logload")
    assert stored_cpl(b.redis) == before and checkpoints(b.log_dir)[-1]["rl"][S] == prev  # left to QM1
    a.redis.hdel(keys.meta(S), "relog_owner", "relog_until")
    b.checkpoint("logload")
    after = stored_cpl(b.redis)
    assert after["p"][:-1] == before["p"][1:]  # B continued the CPL A's passes left
    for qm in (a, b):
        qm.stop(checkpoint=False)
