"""No needed segment is ever pruned (docs/log-management.md, "Active and inactive log"): a property test over random
histories (hypothesis, bounded examples) against a real redis-server and real log files. A history mixes puts of
messages that stay and of messages consumed at once, gets backed out, checkpoints (each relogs; linear logging
archives what is inactive), backups, in-doubt units of work (resolved later), member kills (no checkpoint) and clean
stops, and CF losses. At every stop the logs are pruned of everything sqm.core.retention says no recovery needs
(sqm.logadmin.prune_log, what ``sqm log prune`` runs); then the restart, and after a CF loss the restore, must give
back the reference state: each message with its backout count, in get order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backup.run import run_backup
from cfemu.admin import Admin
from cfemu.connection import connect
from restore.run import run_restore
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager
from sqm.log import LogReader, find_log_dirs
from sqm.logadmin import prune_log
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"
OPS = st.lists(st.sampled_from(["stay", "churn", "churn", "backout", "checkpoint", "checkpoint", "backup",
                                "indoubt", "resolve", "kill", "stop", "lose-cf"]), min_size=6, max_size=18)


class History:
    """One member, one queue; the reference state is the list of (body, backout count) in get order."""

    def __init__(self, url: str, root: Path) -> None:
        self.url, self.logs, self.backups = url, root / "logs", root / "backups"
        self.client = define_group(url, queues=("Q1",))
        self.qm: QueueManager = self.start()
        self.conn: Connection = self.qm.connect()
        self.ref: list[tuple[bytes, int]] = []
        self.n = 0
        self.indoubt: tuple[str, bytes] | None = None
        self.pruned = 0

    def start(self) -> QueueManager:
        return start_qm(self.url, self.logs, "QM1", background=False, cpl_entries=2, segment_bytes=2048)

    def seen(self) -> list[tuple[bytes, int]]:
        return [(m.body, m.backout_count) for m in self.conn.browse("Q1", limit=10_000)]

    def op(self, what: str) -> None:
        c = self.conn
        self.n += 1
        if what == "stay":
            body = b"stay-%d" % self.n + b"." * 120
            c.put("Q1", body)
            c.commit()
            self.ref.append((body, 0))
        elif what == "churn":
            for _ in range(4):
                c.put("Q1", b"churn" + b"." * 200, priority=9)
                c.commit()
                c.get("Q1")
                c.commit()
        elif what == "backout" and self.ref:
            c.get("Q1")
            c.backout()
            body, n = self.ref[0]
            self.ref[0] = (body, n + 1)
        elif what == "checkpoint":
            self.qm.checkpoint("logload")
        elif what == "backup":
            run_backup(self.client, S, self.backups, log_root=self.logs)
        elif what == "indoubt" and self.indoubt is None:
            other = self.qm.connect()
            body = b"indoubt-%d" % self.n
            other.put("Q1", body)
            self.indoubt = (other.prepare(f"xid-{self.n}"), body)
        elif what == "resolve" and self.indoubt is not None:
            uow, body = self.indoubt
            self.qm.resolve(uow, True)
            self.ref.append((body, 0))
            self.indoubt = None
        elif what in ("kill", "stop", "lose-cf"):
            self.restart(checkpoint=what == "stop", lose=what == "lose-cf")
        assert self.seen() == self.ref, what

    def restart(self, *, checkpoint: bool, lose: bool = False) -> None:
        self.qm.stop(checkpoint=checkpoint)
        admin = Admin(connect(self.url))
        for d in find_log_dirs(self.logs):
            self.pruned += len(prune_log(d, admin, self.logs))
        if lose:
            lose_cf(self.client)
            run_restore(redis.Redis.from_url(self.url), S, backup_root=self.backups, log_root=self.logs)
        self.qm = self.start()
        self.conn = self.qm.connect()
        if self.indoubt is not None:
            uow, _ = self.indoubt
            assert [u.id for u in self.qm.indoubt()] == [uow]


# The property and the check of its histories after it share PRUNED: one worker runs both, in file order.
ONE_WORKER = pytest.mark.xdist_group("log-pruning-property")
# Histories in the default suite; the deep twin below runs DEEP_EXAMPLES more.
EXAMPLES, DEEP_EXAMPLES = 6, 15


def prune_restart_and_restore(redis_url: str, tmp_path_factory: Any, ops: list[str]) -> int:
    """One history; the segments it pruned."""
    root = tmp_path_factory.mktemp("history")
    lose_cf(redis.Redis.from_url(redis_url))  # each example starts from an empty CF
    h = History(redis_url, root)
    try:
        for what in [*ops, "lose-cf"]:
            h.op(what)
        if h.indoubt is not None:
            h.op("resolve")
        h.op("kill")
        assert h.seen() == h.ref
    finally:
        h.qm.stop(checkpoint=False)
    assert sum(s.records for s in LogReader(h.logs / "QM1").segments()) > 0
    print(f"history {ops}: {h.pruned} segments pruned")
    return h.pruned


@pytest.mark.slow
@ONE_WORKER
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(ops=OPS)
def test_after_any_prune_restart_and_restore_give_the_reference_state(redis_url: str, tmp_path_factory: Any,
                                                                     ops: list[str]) -> None:
    PRUNED.append(prune_restart_and_restore(redis_url, tmp_path_factory, ops))


PRUNED: list[int] = []


@pytest.mark.slow  # in the tier of the property it checks, and after it
@ONE_WORKER
def test_the_histories_pruned_segments() -> None:
    """Runs after the property (file order): some of its histories must really have pruned segments, or the
    property proved nothing about pruning."""
    assert len(PRUNED) == EXAMPLES and sum(1 for n in PRUNED if n) >= PRUNING_HISTORIES, PRUNED


PRUNING_HISTORIES = 3  # of the default suite's EXAMPLES (about half of what they give: all 6 prune)


@pytest.mark.deep
def test_after_any_prune_of_more_histories_restart_and_restore_give_the_reference_state(
        redis_url: str, tmp_path_factory: Any) -> None:
    pruned: list[int] = []

    @settings(max_examples=DEEP_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(ops=OPS)
    def history(ops: list[str]) -> None:
        pruned.append(prune_restart_and_restore(redis_url, tmp_path_factory, ops))

    history()
    assert len(pruned) == DEEP_EXAMPLES and sum(1 for n in pruned if n) >= 5, pruned
