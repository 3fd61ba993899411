"""cfbackup's numeric options are finite and in range, or refused in one line, exit 2, before anything runs: NaN
made the scheduler spin (Event.wait(nan) returns at once), inf overflowed the platform's time_t, and a negative or
NaN --wait was taken silently."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import redis

from backup.cli import build_parser, main
from backup.run import run_backup
from backup.schedule import run_backup_scheduler
from cfemu.settings import resolve

REFUSED = [
    (["schedule", "--interval", "nan"], "--interval"),
    (["schedule", "--interval", "inf"], "--interval"),
    (["schedule", "--interval", "0"], "--interval"),
    (["schedule", "--interval", "-5"], "--interval"),
    (["schedule", "--interval", "1e12"], "--interval"),
    (["schedule", "--interval", "1", "--keep", "-1"], "--keep"),
    (["schedule", "--interval", "1", "--metrics-port", "70000"], "--metrics-port"),
    (["run", "APP1", "--wait", "-1"], "--wait"),
    (["run", "APP1", "--wait", "nan"], "--wait"),
    (["run", "APP1", "--wait", "inf"], "--wait"),
    (["run", "APP1", "--lease", "nan"], "--lease"),
    (["run", "APP1", "--lease", "0"], "--lease"),
    (["run", "APP1", "--batch", "0"], "--batch"),
    (["run", "APP1", "--exclint", "-1"], "--exclint"),
    (["prune", "APP1", "--keep", "0"], "--keep"),
    (["prune", "APP1", "--keep", "nan"], "--keep"),
]


@pytest.mark.parametrize(("argv", "option"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_number_out_of_range_is_one_line_and_exit_2(argv: list[str], option: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main([*argv, "--redis-url", "redis://127.0.0.1:1"])
    except SystemExit as e:  # argparse's usage error
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cfbackup") and option in err, err


def test_numbers_in_range_are_taken() -> None:
    args = build_parser().parse_args(["schedule", "--interval", "0.5", "--keep", "0", "--metrics-port", "0"])
    assert (args.interval, args.keep, args.metrics_port) == (0.5, 0, 0)
    args = build_parser().parse_args(["run", "APP1", "--wait", "0", "--lease", "2.5"])
    assert (args.wait, args.lease) == (0.0, 2.5)


@pytest.mark.parametrize("interval", [math.nan, math.inf, 0.0, -1.0])
def test_the_scheduler_refuses_an_interval_it_cannot_wait(interval: float, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interval"):
        run_backup_scheduler(interval, resolve(log_root=tmp_path, backup_dir=tmp_path), stop=threading.Event())


@pytest.mark.parametrize("wait", [math.nan, math.inf, -1.0])
def test_a_backup_refuses_a_wait_it_cannot_keep(wait: float, redis_url: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="wait"):
        run_backup(redis.Redis.from_url(redis_url), "APP1", tmp_path, wait_s=wait)
