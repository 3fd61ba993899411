"""cfrestore: the verbs, their output, and one-line errors (exit 2)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from cfemu.admin import Admin
from cfemu.clitools import PhaseBars
from cfemu.errors import StructureFailedError
from restore import engine as engine_module
from restore.cli import main
from restore.engine import (
    LOAD,
    READ_BACKUP,
    READ_LOGS,
    SETTLE,
    LocalEngine,
    UnknownEngineError,
    engine_names,
    get_engine,
)
from restore.run import RESTORE_MEMBER, run_restore
from sqm.core.manager import QueueManager
from tests.restore.test_restore import S, all_keys, small_workload
from tests.support.harness import lose_cf


@pytest.fixture
def group(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[QueueManager]]:
    logs, backups = tmp_path / "logs", tmp_path / "backups"
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("CFEMU_BACKUP_DIR", str(backups))
    monkeypatch.setenv("CFEMU_LOG_ROOT", str(logs))
    qms, _ = small_workload(redis_url, logs, backups)
    yield qms
    for qm in qms:
        qm.stop()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # a usage error, refused as the command line is parsed
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_prints_the_plan_and_changes_nothing(group: list[QueueManager], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    client = group[0].redis
    lose_cf(client)
    rc, out, err = run(capsys, "plan", S)
    assert rc == 0, err
    assert "APP1 plan (dry run: nothing changed)" in out
    for member in ("QM1", "QM2", "QM3"):
        assert member in out
    assert "restored" in out and "17" in out and "uows in flight backed out" in out
    assert all_keys(client) == {} and not (tmp_path / "logs" / RESTORE_MEMBER).exists()
    rc, out, _ = run(capsys, "run", S, "--dry-run", "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["dry_run"] and plan["counts"]["restored"] == 17 and all_keys(client) == {}


def test_run_restores_and_writes_the_report(group: list[QueueManager], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    lose_cf(group[0].redis)
    report = tmp_path / "report.json"
    rc, out, err = run(capsys, "run", S, "--report", str(report), "--json")
    assert rc == 0, err
    result: dict[str, Any] = json.loads(out)
    assert result["loaded_entries"] == 17 and result["report_path"] == str(report)
    assert json.loads(report.read_text()) == result
    assert Admin(group[0].redis).state(S) == "ACTIVE"
    rc, out, _ = run(capsys, "run", S, "--mark-failed")  # the table form, and the default report location
    assert rc == 0 and "loaded" in out and "17 messages" in out
    assert len(list((tmp_path / "backups" / S).glob("restore-*.json"))) == 1


def test_errors_are_one_line_with_exit_2(group: list[QueueManager], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "run", S)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("cfrestore: error: structure APP1 is ACTIVE")
    rc, _, err = run(capsys, "run", S, "--mark-failed", "--backup", "APP1-20000101T000000Z-abcdef")
    assert rc == 2 and "no backup APP1-20000101T000000Z-abcdef" in err and err.count("\n") == 1
    rc, _, err = run(capsys, "run", S, "--verbose")
    assert rc == 2 and "Traceback" in err and "RestoreError" in err
    rc, _, err = run(capsys, "run", "bad/name", "--mark-failed")
    assert rc == 2 and "bad structure name" in err
    lose_cf(group[0].redis)
    rc, _, err = run(capsys, "run", S, "--log-root", str(tmp_path / "nowhere"))
    assert rc == 2 and "no log for members QM1, QM2, QM3 under" in err


def test_a_malformed_backup_name_and_a_backup_dir_others_can_write_are_one_line_errors(
        group: list[QueueManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lose_cf(group[0].redis)
    for bad, problem in (("APP1-20241399T999999Z-abcdef", "20241399T999999Z is not a date and time"),
                         ("APP1-20240230T000000Z-abcdef", "20240230T000000Z is not a date and time"),
                         ("garbage", "'garbage' is not a backup id")):
        rc, _, err = run(capsys, "run", S, "--backup", bad)
        assert rc == 2 and err.count("\n") == 1 and err.startswith("cfrestore: error: "), err
        assert problem in err, err
    (tmp_path / "backups").chmod(0o777)
    rc, _, err = run(capsys, "run", S)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{tmp_path / 'backups'} is writable by other users (mode 777)" in err
    assert all_keys(group[0].redis) == {}, "refused before anything was written"


def test_mark_failed_then_purge(group: list[QueueManager], capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "purge", S)
    assert rc == 2 and "is ACTIVE" in err
    rc, out, _ = run(capsys, "mark-failed", S)
    assert rc == 0 and "ACTIVE -> FAILED" in out
    with pytest.raises(StructureFailedError):
        group[0].connect().put("Q1", b"refused")
    rc, out, _ = run(capsys, "purge", S, "--json")
    assert rc == 0 and json.loads(out)["discarded"] == 19
    assert Admin(group[0].redis).state(S) == "ACTIVE"
    conn = group[0].connect()
    conn.put("Q1", b"works again")
    conn.commit()


def test_progress_bars_show_every_phase(group: list[QueueManager], tmp_path: Path) -> None:
    lose_cf(group[0].redis)
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    with PhaseBars(console) as bars:
        run_restore(group[0].redis, S, backup_root=tmp_path / "backups", log_root=tmp_path / "logs",
                    progress=bars)
    shown = screen.getvalue()
    for phase in (READ_BACKUP, READ_LOGS, SETTLE, LOAD):
        assert phase in shown
    assert "17/17" in shown  # the load bar, complete


class _NamedEngine(LocalEngine):
    def __init__(self, label: str) -> None:
        self.name = label


def make_engine(**options: Any) -> _NamedEngine:
    """This module stands in for a lazily imported engine module (like restore.engine_spark)."""
    return _NamedEngine(options.get("label", "lazy"))


def test_engines_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_engine().name == "columnar" and "spark" in engine_names()  # the default (restore.engine.default_engine)
    with pytest.raises(UnknownEngineError, match="unknown restore engine 'nope': choose one of columnar, local, spark"):
        get_engine("nope")
    monkeypatch.setitem(engine_module._LAZY, "lazy", __name__)
    monkeypatch.delitem(engine_module._ENGINES, "lazy", raising=False)
    assert get_engine("lazy", label="made lazily").name == "made lazily"


def test_plan_says_nothing_to_replay_when_no_record_follows_the_backup(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A backup taken once the group stopped, then the CF lost: no record lies above the backup's replay start, and
    the plan says so (never a range whose end is below its start)."""
    from backup.run import run_backup
    from tests.support.group import define_group, start_qm

    logs, backups = tmp_path / "logs", tmp_path / "backups"
    for name, value in (("REDIS_URL", redis_url), ("CFEMU_BACKUP_DIR", str(backups)), ("CFEMU_LOG_ROOT", str(logs))):
        monkeypatch.setenv(name, value)
    client = define_group(redis_url)
    qm = start_qm(redis_url, logs, "QM1", background=False)
    try:
        conn = qm.connect()
        conn.put("Q1", b"kept")
        conn.commit()
    finally:
        qm.stop()
    run_backup(client, S, backups, log_root=logs)
    lose_cf(client)
    rc, out, err = run(capsys, "plan", S)
    assert rc == 0, err
    assert "nothing to replay" in out and ".." not in out.split("replay", 1)[1].splitlines()[0], out
    rc, out, _ = run(capsys, "plan", S, "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["replay_range"] == {"empty": True, "from": None, "to": None}, plan
    assert plan["counts"]["restored"] == 1
