"""A backup that yields to the group's work (backup.pacing): it pauses between batches, for the share
its setting gives, only while the CF serves others; on an idle CF it never pauses. Real redis-server for the
command counts and the backups; a clock of the test's own for the arithmetic."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from backup.cli import build_parser
from backup.files import read_backup
from backup.pacing import IDLE_BATCH_FACTOR, Pacer, probe_commands
from backup.run import run_backup
from cfemu import bulk, settings
from cfemu.clitools import settings as resolve_args
from cfemu.embedded import EmbeddedRedis
from sqm.core.manager import QueueManager
from tests.support.group import define_group, start_qm
from tests.support.waits import wait_until


class Clock:
    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def _pacer(counts: list[int], share: float, clock: Clock) -> Pacer:
    it = iter(counts)
    return Pacer(lambda: next(it), share, probe_every_s=0.05, clock=clock, sleep=clock.sleep)


def test_no_pause_while_only_the_backup_works() -> None:
    """The command count grows by the backup's own reads and probes only: no pause, whatever the share."""
    clock = Clock()
    own = bulk.READ_COMMANDS
    counts = [1000 + k * (own * 1 + 1) for k in range(100)]  # one read and one probe between probes
    p = _pacer(counts, 0.1, clock)
    for _ in range(50):
        p.before_read()
        clock.t += 0.06  # a batch: longer than the probe interval, so each read is preceded by a probe
    assert clock.slept == [] and not p.loaded
    assert p.stats.probes == 50 and p.stats.loaded_probes == 0


def test_one_stray_command_in_a_short_first_interval_is_not_taken_for_the_groups_work() -> None:
    """The first verdict comes after the first batch, a few milliseconds: one command not the backup's own (a
    member's heartbeat) had read as 500 commands a second of others' work, and an idle CF's backup paused (seen
    once in tests/backup's real-CF test while the machine was loaded)."""
    clock = Clock()
    own = bulk.READ_COMMANDS
    p = _pacer([1000, 1000 + 1 + own + 1, 1000 + 2 * (1 + own) + 1], 0.1, clock)
    p.before_read()  # the baseline; then the first read
    clock.t += 0.002
    p.before_read()  # one command more than this interval's own
    assert not p.loaded and clock.slept == []


def test_pauses_for_the_share_while_others_work() -> None:
    """Others' commands above the idle rate: after each batch a pause of (1 - share) / share of the batch's time
    (capped), so the backup works `share` of the time."""
    clock = Clock()
    counts = [1000 + k * 10_000 for k in range(100)]  # far above IDLE_OPS_PER_S whatever the interval
    p = _pacer(counts, 0.2, clock)
    p.before_read()  # the first probe: a baseline, no verdict yet
    assert clock.slept == []
    for _ in range(5):
        clock.t += 0.06
        p.before_read()
    assert p.loaded
    assert clock.slept == pytest.approx([0.06 * 4] * 5)
    clock.t += 5.0  # a batch that took very long: the pause is capped
    p.before_read()
    assert clock.slept[-1] == p.max_pause_s


def test_the_time_paused_is_the_time_away_not_the_time_asked_for() -> None:
    """A loaded machine wakes a sleeper late: the stats (the manifest's paused_s) count the time the backup was
    away, and the late wake-up is not taken for work the next pause must make up for."""
    clock = Clock()

    def late_sleep(s: float) -> None:
        clock.sleep(s)
        clock.t += 0.05  # woken 50 ms late

    it = iter([1000 + k * 10_000 for k in range(100)])
    p = Pacer(lambda: next(it), 0.5, probe_every_s=0.05, clock=clock, sleep=late_sleep)
    p.before_read()
    for _ in range(3):
        clock.t += 0.1
        p.before_read()
    assert clock.slept == pytest.approx([0.1] * 3)  # each pause as long as the batch before it, no more
    assert p.stats.pause_s == pytest.approx(3 * 0.15)


def test_a_working_group_gets_one_read_in_flight_an_idle_cf_all_of_them() -> None:
    """The pauses share the backup's working time: two reads in flight held the CF twice as much per second
    worked, and the group's paced drop rose from 5.6% to 13-16%. So while the group works, one read at a time."""
    clock = Clock()
    idle = _pacer([1000 + k * (bulk.READ_COMMANDS + 1) for k in range(10)], 0.1, clock)
    idle.before_read()
    clock.t += 0.06
    idle.before_read()
    assert not idle.loaded and idle.reads_in_flight() == bulk.FETCH_DEPTH > 1
    busy = _pacer([1000 + k * 10_000 for k in range(10)], 0.1, clock)
    assert busy.reads_in_flight() == bulk.FETCH_DEPTH  # no verdict yet
    busy.before_read()
    clock.t += 0.06
    busy.before_read()
    assert busy.loaded and busy.reads_in_flight() == 1


def test_a_working_group_gets_reads_of_the_backups_batch_an_idle_cf_larger_ones() -> None:
    """While the group works each read asks for the backup's batch (the CF held as briefly as the share was
    measured with); on an idle CF, and before the first verdict, IDLE_BATCH_FACTOR times as many."""
    clock = Clock()
    busy = _pacer([1000 + k * 10_000 for k in range(10)], 0.1, clock)
    assert busy.batch_size(500) == 500 * IDLE_BATCH_FACTOR == 1000  # no verdict yet
    busy.before_read()
    clock.t += 0.06
    busy.before_read()
    assert busy.loaded and busy.batch_size(500) == 500
    idle = _pacer([1000 + k * (bulk.READ_COMMANDS + 1) for k in range(10)], 0.1, clock)
    idle.before_read()
    clock.t += 0.06
    idle.before_read()
    assert not idle.loaded and idle.batch_size(500) == 1000


def test_share_one_never_pauses_nor_probes() -> None:
    clock = Clock()
    p = Pacer(lambda: pytest.fail("no probe with share 1"), 1.0, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type, return-value]
    for _ in range(10):
        p.before_read()
        clock.t += 0.1
    assert clock.slept == []


def test_a_new_step_counts_afresh() -> None:
    """The snapshot between steps is the backup's own work (a script and its calls): not taken for load."""
    clock = Clock()
    counts = [1000, 1000 + bulk.READ_COMMANDS + 1, 1000 + 50_000, 1000 + 50_000 + bulk.READ_COMMANDS + 1]
    p = _pacer(counts, 0.1, clock)
    p.before_read()
    clock.t += 0.06
    p.before_read()
    p.new_step()  # 50,000 commands of snapshot come next
    clock.t += 0.01
    p.before_read()
    clock.t += 0.06
    p.before_read()
    assert not p.loaded and clock.slept == []


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="share must be above 0 and at most 1"):
        Pacer(lambda: 0, share)


def test_the_setting_resolves_flag_then_environment_then_default() -> None:
    assert settings.resolve(env={}).backup_share() == settings.DEFAULT_BACKUP_SHARE
    assert settings.resolve(env={settings.ENV_BACKUP_SHARE: "0.25"}).backup_share() == 0.25
    assert settings.resolve(backup_share="0.5", env={settings.ENV_BACKUP_SHARE: "0.25"}).backup_share() == 0.5
    found = settings.resolve(env={settings.ENV_BACKUP_SHARE: "0.25"})
    assert found.env()[settings.ENV_BACKUP_SHARE] == "0.25"  # handed on to the scheduler's backups
    assert settings.ENV_BACKUP_SHARE not in settings.resolve(env={}).env()
    with pytest.raises(ValueError, match=r"\$CFEMU_BACKUP_SHARE: 'lots' is not a number"):
        settings.resolve(env={settings.ENV_BACKUP_SHARE: "lots"}).backup_share()
    with pytest.raises(ValueError, match="--backup-share: '2' is not a share"):
        settings.resolve(backup_share="2", env={}).backup_share()
    args = build_parser().parse_args(["run", "APP1", "--backup-share", "0.3"])
    assert isinstance(args, argparse.Namespace) and resolve_args(args).backup_share() == 0.3


@pytest.fixture
def group(fresh_redis: EmbeddedRedis, tmp_path: Path) -> Iterator[tuple[redis.Redis, list[QueueManager]]]:
    client = define_group(fresh_redis.url)
    qms = [start_qm(fresh_redis.url, tmp_path / "logs", f"QM{i}", background=False) for i in (1, 2)]
    conn = qms[0].connect()
    for _ in range(3000):
        conn.put("Q2", os.urandom(100))
    conn.commit()
    yield client, qms
    for qm in qms:
        qm.stop()


def test_probe_reads_the_cfs_command_count(group: tuple[redis.Redis, list[QueueManager]]) -> None:
    client, _ = group
    commands = probe_commands(client, "APP1")
    a = commands()
    client.ping()
    assert commands() == a + 2  # the ping and the first probe


def _busy(client: redis.Redis, qms: list[QueueManager], stop: threading.Event,
          done: list[int]) -> list[threading.Thread]:
    def loop(qm: QueueManager) -> None:
        conn = qm.connect()
        while not stop.is_set():
            conn.put("Q1", b"w" * 100)
            conn.commit()
            conn.get("Q1")
            conn.commit()
            done[0] += 1

    def other_clients() -> None:
        # Many commands a round trip: the CF stays busy by the pacer's measure (commands a second) even when this
        # process's threads get little of a loaded machine and the members' loops slow to a crawl
        while not stop.is_set():
            pipe = client.pipeline(transaction=False)
            for _ in range(100):
                pipe.ping()
            pipe.execute()

    threads = [threading.Thread(target=loop, args=(qm,)) for qm in qms] + [threading.Thread(target=other_clients)]
    for t in threads:
        t.start()
    return threads


def test_an_idle_cf_gets_an_unpaced_backup_a_busy_one_a_paced_one(
        group: tuple[redis.Redis, list[QueueManager]], tmp_path: Path) -> None:
    """Real CF, real group: alone, the backup never pauses; beside two members' put/get loops and other clients'
    commands it pauses (its manifest says how long), and still copies every resident message, restorable as ever."""
    client, qms = group
    idle = run_backup(client, "APP1", tmp_path / "bk", batch=100, share=0.1)
    assert idle["pacing"] == {"share": 0.1, "pauses": 0, "paused_s": 0.0}
    assert idle["entries"] == 3000

    stop = threading.Event()
    done = [0]
    threads = _busy(client, qms, stop, done)
    try:
        wait_until(lambda: done[0] >= 10, 60, "the group at work")  # its threads may start late on a busy machine
        t0 = time.monotonic()
        # small batches: the backup lasts several probe intervals even if the first verdict missed the group
        # (the members are threads of this process: they may not run in the first batch's few milliseconds)
        busy = run_backup(client, "APP1", tmp_path / "bk", batch=20, share=0.1)
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert done[0] > 0
    pacing = busy["pacing"]
    assert pacing["pauses"] >= 10, pacing
    # It pauses nine times what it measured itself working between two reads (share 0.1): nine tenths of its
    # copy steps' time. The pacer paces the copy, not the backup's set-up and its files' closing (their fsyncs
    # took seconds under the suite's disk load in CI), so the steps' time is the measure; an unpaced backup
    # pauses not at all.
    copying = sum(step["seconds"] for step in busy["steps"])
    assert pacing["paused_s"] > 0.5 * copying, (pacing, copying, elapsed, busy["steps"])
    frames = list(read_backup(tmp_path / "bk" / "APP1" / busy["id"]).frames())
    assert sum(1 for _, w, _ in frames if w["q"] == "Q2") == 3000


def test_share_one_runs_unpaced_beside_the_group(
        group: tuple[redis.Redis, list[QueueManager]], tmp_path: Path) -> None:
    client, qms = group
    stop = threading.Event()
    done = [0]
    threads = _busy(client, qms, stop, done)
    try:
        wait_until(lambda: done[0] >= 10, 60, "the group at work")  # its threads may start late on a busy machine
        m = run_backup(client, "APP1", tmp_path / "bk", batch=100, share=1.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert m["pacing"]["pauses"] == 0 and m["entries"] >= 3000


def test_cfbackup_run_takes_the_share_from_the_environment(
        fresh_redis: EmbeddedRedis, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from backup.cli import main

    define_group(fresh_redis.url)
    monkeypatch.setenv(settings.ENV_BACKUP_SHARE, "0.4")
    assert main(["run", "APP1", "--json", "--redis-url", fresh_redis.url, "--backup-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["pacing"]["share"] == 0.4
    assert main(["run", "APP1", "--json", "--redis-url", fresh_redis.url, "--backup-dir", str(tmp_path),
                 "--backup-share", "0"]) == 2
    assert "--backup-share: '0' is not a share" in capsys.readouterr().err
