"""Log management (seed 002's active and inactive log, linear and circular logging, the operator's view;
docs/log-management.md), against a real redis-server and real log files: linear logging archives what no recovery
needs and every reader still reads it; a member killed by a real SIGKILL after many checkpoints restarts reading one
checkpoint interval and the logs alone restore its structure from n intervals; a circular log that cannot free a
segment refuses work and loses nothing; ``sqm log status|archive|prune``."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import redis

from cfemu.errors import ResourceProblemError
from restore.run import LOGS, run_restore
from sqm.cli import main as sqm_main
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager
from sqm.core.relog import newest_pass
from sqm.log import LogReader, find_log_dirs
from sqm.log.format import archived_segments, list_segments, read_manifest
from sqm.logprint import read_records
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

S = "APP1"
ROOT = Path(__file__).resolve().parents[2]


def drain(conn: Connection) -> list[tuple[bytes, int]]:
    """What the clients see on Q1: each message with its backout count, in browse order."""
    return [(m.body, m.backout_count) for m in conn.browse("Q1", limit=10_000)]


def checkpoints_in(paths: list[Path], member: str) -> int:
    from sqm.log.format import SegmentScan
    n = 0
    for p in paths:
        segno = int(p.name[4:12])
        n += sum(1 for _, r in SegmentScan(p, segno, member, is_last=True) if r["k"] == "CHECKPOINT")
    return n


def churn(qm: QueueManager, c: Connection, checkpoints: int) -> None:
    """Log load: six 200-byte messages put and got, each in a unit of work of its own, then a checkpoint, this many
    times."""
    for k in range(checkpoints):
        for j in range(6):
            c.put("Q1", f"churn-{k}-{j}".encode() + b"." * 200, priority=9)
            c.commit()
            c.get("Q1")
            c.commit()
        qm.checkpoint("logload")


def test_linear_logging_archives_what_no_recovery_needs_and_readers_still_read_it(redis_url: str,
                                                                                  tmp_path: Path) -> None:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=2, segment_bytes=4096)
    c = qm.connect()
    for i in range(8):
        c.put("Q1", f"stay-{i}".encode() + b"." * 100)
    c.commit()
    first_put = min(r["l"] for _, r in LogReader(qm.log_dir).records() if r["k"] == "PUT")
    churn(qm, c, 12)
    ret = qm.retention
    assert ret is not None and not ret.unknown
    manifest = read_manifest(qm.log_dir)
    archived = archived_segments(manifest)
    active = list_segments(qm.log_dir)
    assert archived and active[0][0] == archived[-1].segment + 1  # a prefix went to the archive
    assert all(a.max_lrsn is not None and a.max_lrsn < ret.lrsn for a in archived)  # none of it needed
    assert stat.S_IMODE(qm.archive_dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(a.path.stat().st_mode) == 0o600 for a in archived)
    assert not any((qm.log_dir / a.path.name).exists() for a in archived)  # removed from the active log
    # Bounded: the active log holds the window (n = 2 intervals) and the segments around it, not the 12 intervals.
    assert checkpoints_in([p for _, p in active], "QM1") <= 4
    # Every reader reads the archived segments where they are: the reader, the printer.
    recs = [r for _, r in LogReader(qm.log_dir).records()]
    assert min(r["l"] for r in recs if r["k"] == "PUT") == first_put
    assert any(r["k"] == "PUT" and r["l"] == first_put for r in read_records(logs, "QM1", None, None))
    assert any(r["l"] == first_put for r in read_records(logs, None, None, None))
    truth = [(b, n) for b, n in drain(c)]
    qm.stop(checkpoint=False)
    client = redis.Redis.from_url(redis_url)
    lose_cf(client)
    result = run_restore(client, S, backup_root=backups, log_root=logs)
    assert result.base_kind == LOGS
    assert all(a.max_lrsn < result.replay_from for a in archived)  # the restore needed nothing archived
    qm = start_qm(redis_url, logs, "QM1", background=False)
    assert drain(qm.connect()) == truth
    qm.stop()


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from sqm.core.manager import QueueManager, QueueManagerConfig
    url, logs, intervals = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    qm = QueueManager(QueueManagerConfig(name="QM1", log_root=logs, redis_url=url, background=False,
                                         cpl_entries=3, segment_bytes=8192, logload=10**9))
    qm.start()
    c = qm.connect()
    for i in range(20):
        c.put("Q1", b"long-lived-%d" % i + b"." * 150)
    c.commit()
    for k in range(intervals):
        for j in range(12):
            c.put("Q1", b"churn-%d-%d" % (k, j) + b"." * 300, priority=9)
            c.commit()
            c.get("Q1")
            c.commit()
        qm.checkpoint("logload")
    for j in range(5):  # after the last checkpoint: committed work, and a UOW in flight
        c.put("Q1", b"late-%d" % j)
        c.commit()
    c.put("Q1", b"in-flight")
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_a_member_killed_after_many_checkpoints_restarts_reading_one_interval(redis_url: str,
                                                                             tmp_path: Path) -> None:
    """Hours of activity, compressed: 30 checkpoint intervals with messages that stay the whole time. Killed by a
    real SIGKILL, the member restarts reading only the log from its last checkpoint (one interval); its active log
    holds about n = 3 intervals (the rest archived), and the structure restored from the logs alone reads no
    archived segment and equals what the clients see."""
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    define_group(redis_url, queues=("Q1",))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, redis_url, str(logs), "30"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "ready", child.stderr.read() if child.stderr else line
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -9
    reader = LogReader(logs / "QM1")
    last_pos, last_lrsn = reader.checkpoints()[-1]
    archived = archived_segments(read_manifest(logs / "QM1"))
    assert archived, "nothing was archived"
    total = sum(s.records for s in reader.segments())

    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=3, segment_bytes=8192)
    rep = qm.last_restart
    assert rep.checkpoint_lrsn == last_lrsn
    assert min(rep.segments_read) == last_pos.segment  # from the checkpoint on: nothing before it
    assert rep.records_read <= 20 and rep.records_read < total / 50  # the 5 late puts, the in-flight one (+ ENDs)
    assert rep.in_flight == 1
    assert any(m.startswith("CSQR003I") and f"LRSN {last_lrsn}" in m for m in rep.messages)
    assert any(m.startswith("CSQR006I") for m in rep.messages)
    active = list_segments(logs / "QM1")
    assert checkpoints_in([p for _, p in active], "QM1") <= 3 + 3  # n intervals and the segments at the edges
    c = qm.connect()
    truth = drain(c)
    assert sum(1 for b, _ in truth if b.startswith(b"long-lived")) == 20
    qm.stop()
    client = redis.Redis.from_url(redis_url)
    lose_cf(client)
    result = run_restore(client, S, backup_root=backups, log_root=logs)
    assert result.base_kind == LOGS
    assert all(a.max_lrsn is not None and a.max_lrsn < result.replay_from
               for a in archived_segments(read_manifest(logs / "QM1")))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    assert drain(qm.connect()) == truth
    qm.stop()


def test_a_full_circular_log_refuses_persistent_work_and_loses_nothing(redis_url: str, tmp_path: Path) -> None:
    """A ring of 4 segments; an in-doubt unit of work holds the oldest record recovery needs. Persistent puts and
    gets fill the ring; the member checkpoints and relogs, cannot free the segment, and refuses new persistent work
    naming the unit of work; nothing was overwritten (every committed message was delivered, the in-doubt PUT is
    still in the log). Once the coordinator resolves the UOW, the ring frees and work goes on."""
    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=1, segment_bytes=4096,
                  log_mode="circular", log_ring=4)
    held = qm.connect()
    held.put("Q1", b"in-doubt")
    uow_id = held.prepare("xid-1")
    in_doubt_put = next(r["l"] for _, r in LogReader(qm.log_dir).records() if r["k"] == "PUT")
    c = qm.connect()
    done = 0
    with pytest.raises(ResourceProblemError) as refused:
        for i in range(500):
            c.put("Q1", b"m-%d" % i + b"." * 200, syncpoint=False)
            assert c.get("Q1", syncpoint=False).body == b"m-%d" % i + b"." * 200
            done += 1
    assert "circular log is full" in str(refused.value) and uow_id in str(refused.value)
    assert 10 < done < 500
    assert len(list_segments(qm.log_dir)) <= 4
    assert any(r["l"] == in_doubt_put for _, r in LogReader(qm.log_dir).records())
    assert qm.counters.get("log_full_refusals", 0) >= 1 and not qm.log_failed
    with pytest.raises(ResourceProblemError):  # refused again, the member still up
        c.put("Q1", b"refused", syncpoint=False)
    assert [m.body for m in c.browse("Q1", limit=10_000)] == []  # nothing refused got in, nothing else was lost
    qm.stop(checkpoint=False)  # killed with its ring full: the restart finds room without overwriting
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=1, segment_bytes=4096,
                  log_mode="circular", log_ring=4)
    assert [u.id for u in qm.indoubt()] == [uow_id]
    assert any(r["l"] == in_doubt_put for _, r in LogReader(qm.log_dir).records())
    c = qm.connect()
    qm.resolve(uow_id, True)
    c.put("Q1", b"after", syncpoint=False)  # the ring frees at the next checkpoints
    assert [m.body for m in c.browse("Q1", limit=10_000)] == [b"in-doubt", b"after"]
    qm.stop()
    qm = start_qm(redis_url, logs, "QM1", background=False, log_mode="circular", log_ring=4, segment_bytes=4096)
    assert [m.body for m in qm.connect().browse("Q1", limit=10_000)] == [b"in-doubt", b"after"]
    qm.stop()


def test_a_reader_follows_a_segment_archived_while_it_reads(tmp_path: Path) -> None:
    """A running member archives while restore or the printer reads its log: a segment listed as active when the
    reader began and archived before it got there is read from the archive."""
    from sqm.log import RecordLog

    d = tmp_path / "QM1"
    with RecordLog(d, "QM1", segment_bytes=1024) as rlog:
        for i in range(60):
            rlog.append({"k": "END", "l": 1000 + i, "u": f"u{i}", "pad": "." * 100})
        rlog.force()
        assert len(rlog.segments()) > 4
        it = LogReader(d).records()
        first = [next(it)]
        moved = rlog.archive(4, tmp_path / "archive")
        assert [m.segment for m in moved] == [1, 2, 3]
        rest = list(it)
    assert [r["l"] for _, r in first + rest] == list(range(1000, 1060))


def test_a_damaged_segment_is_named_when_archiving_finds_it_not_its_temporary_copy(tmp_path: Path) -> None:
    """Archiving reads back its copy of each segment: a damaged frame found there is the segment's own (the copy
    holds the same bytes), so the error names the segment in the active log, the copy is removed, and the segment
    stays where it was (invariant 6, docs/invariants.md)."""
    from sqm.log import RecordLog
    from sqm.log.format import FRAME_HEADER_BYTES, LogCorruptError

    d = tmp_path / "QM1"
    with RecordLog(d, "QM1", segment_bytes=1024) as rlog:
        for i in range(60):
            rlog.append({"k": "END", "l": 1000 + i, "u": f"u{i}", "pad": "." * 100})
        rlog.force()
        damaged = rlog.segments()[1]
        assert damaged.first is not None
        raw = bytearray(damaged.path.read_bytes())
        raw[damaged.first.offset + FRAME_HEADER_BYTES + 5] ^= 0xFF  # one bit flipped in its first record's body
        damaged.path.write_bytes(bytes(raw))
        with pytest.raises(LogCorruptError) as e:
            rlog.archive(4, tmp_path / "archive")
    assert e.value.path == str(damaged.path) and e.value.offset == damaged.first.offset
    assert str(damaged.path) in str(e.value) and ".tmp" not in str(e.value) and "CRC mismatch" in str(e.value)
    assert damaged.path.exists()
    assert not list((tmp_path / "archive").glob("*.tmp"))


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = sqm_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_log_status_archive_and_prune(redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """status shows each segment's LRSN range, state and why it is kept; archive and prune act on a stopped
    member's log only, prune refuses a needed segment and names what needs it."""
    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))

    def churn(qm: Any, intervals: int, after: int = 0) -> None:
        c = qm.connect()
        for k in range(intervals + 1):
            for _ in range(5 if k < intervals else after):
                c.put("Q1", b"x" * 300, syncpoint=False)
                c.get("Q1", syncpoint=False)
            if k < intervals:
                qm.checkpoint("logload")

    # QM1 archives at each checkpoint what is inactive then, and stops (killed: no checkpoint) after more work;
    # QM2's checkpoints then move the structure's relog window on, past QM1's older segments: inactive, not yet
    # archived (QM1 is not running to do it).
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=1, segment_bytes=4096)
    churn(qm, 6, after=12)
    common = ("--log-root", str(logs), "--redis-url", redis_url)
    rc, out, err = run_cli(capsys, "log", "archive", "--member", "QM1", *common)
    assert rc == 2 and "running member" in err  # the running member's log: it archives by itself
    qm.stop(checkpoint=False)
    qm2 = start_qm(redis_url, logs, "QM2", background=False, cpl_entries=1, segment_bytes=4096)
    churn(qm2, 3, after=12)
    qm2.stop(checkpoint=False)
    rc, out, _ = run_cli(capsys, "log", "status", "--all", "--json", *common)
    assert rc == 0
    doc = json.loads(out)
    rows = [r for r in doc["segments"] if r["member"] == "QM1"]
    states = [r["state"] for r in rows]
    assert states == sorted(states, key=["archived", "inactive", "active"].index)  # a prefix is not needed
    assert {"archived", "inactive", "active"} <= set(states)
    assert all(r["kept_for"] == [] for r in rows if r["state"] == "inactive")
    last = rows[-1]
    assert last["state"] == "active" and last["kept_for"] == ["the segment being written"]
    kept = [r for r in rows if r["state"] == "active" and r is not last]
    assert kept and all(any("restart and peer recovery: checkpoint" in w for w in r["kept_for"]) for r in kept)
    assert any("CF recovery of APP1: the relog window" in w for r in doc["segments"] for w in r["kept_for"])
    assert {m["member"] for m in doc["members"]} == {"QM1", "QM2"}
    rc, out, _ = run_cli(capsys, "log", "status", "--member", "QM1", *common)
    assert rc == 0 and "kept for" in out and "inactive" in out and "QM2" not in out
    # archive: the inactive segments of the stopped member go to the archive (then status shows them archived)
    rc, out, _ = run_cli(capsys, "log", "archive", "--member", "QM1", "--json", *common)
    assert rc == 0
    moved = [r["segment"] for r in json.loads(out)["archived"]]
    assert moved == [r["segment"] for r in rows if r["state"] == "inactive"]
    rc, out, _ = run_cli(capsys, "log", "status", "--member", "QM1", "--json", *common)
    rows = json.loads(out)["segments"]
    assert [r["state"] for r in rows if r["segment"] in moved] == ["archived"] * len(moved)
    # prune: refuses a needed segment, names what needs it; removes what nothing needs.
    first_needed = next(r["segment"] for r in rows if r["state"] == "active")
    rc, _, err = run_cli(capsys, "log", "prune", "--member", "QM1", "--below", str(first_needed + 1), *common)
    assert rc == 2 and f"segment {first_needed} is still needed, by" in err and "nothing removed" in err
    before = [r["segment"] for r in rows]
    rc, out, _ = run_cli(capsys, "log", "prune", "--member", "QM1", "--json", *common)
    assert rc == 0
    pruned = [r["segment"] for r in json.loads(out)["pruned"]]
    assert pruned == [s for s in before if s < first_needed]
    assert [s.segment for s in LogReader(logs / "QM1").segments()] == [s for s in before if s >= first_needed]
    qm = start_qm(redis_url, logs, "QM1", background=False)  # restart after the prune
    c = qm.connect()
    c.put("Q1", b"kept")
    c.commit()
    truth = drain(c)
    qm.stop(checkpoint=False)
    client = redis.Redis.from_url(redis_url)
    lose_cf(client)  # and restore after it, from the logs alone
    assert run_restore(client, S, backup_root=tmp_path / "backups", log_root=logs).base_kind == LOGS
    qm = start_qm(redis_url, logs, "QM1", background=False)
    assert drain(qm.connect()) == truth == [(b"kept", 0)]
    qm.stop()


def newest_window(logs: Path) -> Any:
    found = newest_pass(find_log_dirs(logs), S)
    return found[1]["w"] if found else None


def test_a_structure_whose_last_backup_is_older_than_the_retained_logs_restores_from_the_logs_alone(
        redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A backup, then many checkpoint intervals with messages that stay; the logs pruned to what recovery needs no
    longer reach back to the backup's replay start. The CF lost, restore starts from the relog window (the logs
    alone) and rebuilds what the clients see."""
    from backup.run import run_backup

    logs, backups = tmp_path / "logs", tmp_path / "backups"
    client = define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=2, segment_bytes=4096)
    c = qm.connect()
    for i in range(6):
        c.put("Q1", f"stay-{i}".encode() + b"." * 100, priority=i % 3)
    c.commit()
    c.get("Q1")
    c.backout()
    backup = run_backup(client, S, backups, log_root=logs)
    churn(qm, c, 10)
    truth = drain(c)
    qm.stop(checkpoint=False)
    rc, out, _ = run_cli(capsys, "log", "prune", "--all", "--json", "--log-root", str(logs), "--redis-url", redis_url)
    assert rc == 0 and json.loads(out)["pruned"]
    first = LogReader(logs / "QM1").segments()[0]
    assert first.min_lrsn is not None and first.min_lrsn > int(backup["replay_from"])  # the backup's range is gone
    lose_cf(client)
    result = run_restore(client, S, backup_root=backups, log_root=logs)
    assert result.base_kind == LOGS and "logs alone" in result.start
    qm = start_qm(redis_url, logs, "QM1", background=False)
    assert drain(qm.connect()) == truth
    qm.stop()


@pytest.mark.slow
def test_checkpoints_by_time_and_when_log_space_runs_low(redis_url: str, tmp_path: Path) -> None:
    """Besides LOGLOAD: the housekeeping thread checkpoints every checkpoint_interval_s, and when the log's file
    system has less free space than log_low_space_bytes (here: more than any disk has, so always low)."""
    import time

    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))

    def whys(qm: Any) -> list[str]:
        return [r["why"] for _, r in LogReader(qm.log_dir).records() if r["k"] == "CHECKPOINT"]

    qm = start_qm(redis_url, logs, "QM1", checkpoint_interval_s=0.5, log_low_space_bytes=0)
    time.sleep(1.6)
    assert whys(qm).count("time") >= 2
    qm.stop()
    qm = start_qm(redis_url, logs, "QM2", checkpoint_interval_s=0, log_low_space_bytes=2**62)
    deadline = time.monotonic() + 15
    while "log space" not in whys(qm) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "log space" in whys(qm) and "time" not in whys(qm)
    qm.stop()


@pytest.mark.parametrize(("args", "message"), [
    (["--log-ring", "2"], "argument --log-ring: must be a whole number from 3 to"),
    (["--checkpoint-interval", "-1"], "argument --checkpoint-interval: must be a number from 0 to"),
    (["--cpl-entries", "-1"], "argument --cpl-entries: must be a whole number from 0 to"),
    (["--log-mode", "spiral"], "invalid choice"),
])
def test_sqm_run_refuses_bad_log_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                          message: str) -> None:
    try:
        rc = sqm_main(["run", "--name", "QM1", "--no-auth", "--log-root", str(tmp_path / "logs"), *args])
    except SystemExit as e:  # argparse's own refusal
        rc = int(e.code or 0)
    _, err = capsys.readouterr()
    assert rc == 2 and message in err
    assert not (tmp_path / "logs").exists()  # nothing durable changed


def test_a_circular_roll_interrupted_while_reusing_a_segment_leaves_a_readable_log(tmp_path: Path) -> None:
    """A crash between emptying the released segment and renaming it: the next open removes the emptied file (below
    the manifest's pruned mark) and every record recovery was told to keep is read back."""
    from unittest import mock

    from sqm.log import RecordLog

    d = tmp_path / "QM1"
    real_replace = os.replace

    def crash_on_segment(src: Any, dst: Any) -> None:
        if str(src).endswith(".log"):
            raise OSError("killed here")
        real_replace(src, dst)

    rlog = RecordLog(d, "QM1", segment_bytes=512, ring=3)
    lrsn = 1000
    while len(rlog.segments()) < 3:
        lrsn += 1
        rlog.append({"k": "END", "l": lrsn, "u": "u", "pad": "." * 60})
    rlog.force()
    rlog.release_below(2)
    kept = [r["l"] for _, r in LogReader(d).records() if r["l"] > max(s.max_lrsn or 0 for s in rlog.segments()[:1])]
    with mock.patch("sqm.log.writer.os.replace", crash_on_segment), pytest.raises(OSError, match="killed here"):
        while True:
            lrsn += 1
            rlog.append({"k": "END", "l": lrsn, "u": "u", "pad": "." * 60})
    rlog._release_lock()  # the process is gone: the kernel drops its lock (what it buffered is lost with it)
    with RecordLog(d, "QM1", segment_bytes=512, ring=3) as again:
        assert [s.segment for s in again.segments()][0] == 2
        got = [r["l"] for _, r in again.records()]
        assert got[:len(kept)] == kept
        again.append({"k": "END", "l": lrsn + 1, "u": "u"})
    assert len(list_segments(d)) <= 3


def test_restart_reports_progress_on_a_long_range(redis_url: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """CSQR031I every PROGRESS_EVERY records read (50,000; 5 here), as MQ reports a long log range."""
    import sqm.core.recovery

    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False)
    c = qm.connect()
    for i in range(12):
        c.put("Q1", b"m-%d" % i)
        c.commit()
    qm.stop(checkpoint=False)
    monkeypatch.setattr(sqm.core.recovery, "PROGRESS_EVERY", 5)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    progress = [m for m in qm.last_restart.messages if m.startswith("CSQR031I")]
    assert len(progress) == qm.last_restart.records_read // 5 >= 4
    assert all("reading the log forward" in m for m in progress)
    qm.stop()
