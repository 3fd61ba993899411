"""Every number, duration, size, port, count and file `sqm` takes is checked as its command line is parsed: a value
out of range (negative, zero where it means nothing, NaN, infinity, absurdly large) or malformed is one line on
stderr naming the option and the value, exit status 2, and nothing is opened or written: no log directory, no
ready file, and a prune with a bad --below leaves the log's files as they were."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sqm import cli as sqm_cli
from sqm.core.scans import MAX_SCAN_SLOTS
from sqm.request_slots import MAX_SLOTS
from sqm.service.config import MAX_REST_WORKERS
from sqm.service.protocol import MAX_FRAME, MIN_FRAME
from tests.support.group import define_group, start_qm

SQM = str(Path(sys.executable).parent / "sqm")  # the console script as installed (qsg.member.main)
HUGE = "1" + "0" * 30
# The ranges docs/runbook.md gives ("The ranges of sqm's numbers"), beside those the modules name.
YEAR_S, YEAR_MS = 366 * 86400, 366 * 86400 * 1000
MAX_SEGMENT, MAX_LRSN = 2**32 - 1, 2**64 - 1


def wholes(low: int, high: int) -> list[str]:
    """The bad values of a whole number from low to high: just outside either end, a negative one, absurdly large,
    NaN, infinity, a fraction, a word."""
    below = [str(low - 1)] + (["-1"] if low > 0 else [])
    return [*below, str(high + 1), HUGE, "nan", "inf", "1.5", "ten"]


def durations(*, zero_means_nothing: bool) -> list[str]:
    """The bad values of a number of seconds (at most a year): negative, zero where it means nothing, more than a
    year, absurdly large, NaN, infinities, a unit the option does not take."""
    return ["-1", *(["0"] if zero_means_nothing else []), str(YEAR_S + 1), "1e300", "nan", "inf",
            "-inf", "5s"]


PORT = wholes(0, 65535)
CONNECTIONS = wholes(1, 2**20)
RUN = ["run", "--name", "QM1"]

# (the words before the option, the option, its bad values)
OPTIONS: list[tuple[list[str], str, list[str]]] = [
    (RUN, "--port", PORT),
    (RUN, "--metrics-port", PORT),
    (RUN, "--rest-port", PORT),
    (RUN, "--log-ring", wholes(3, 100_000)),
    (RUN, "--log-segment-mb", ["0", "-1", str(4096), HUGE, "nan", "inf", "64MiB"]),
    (RUN, "--checkpoint-interval", durations(zero_means_nothing=False)),
    (RUN, "--cpl-entries", wholes(0, 1000)),
    (RUN, "--auth-timeout", durations(zero_means_nothing=True)),
    (RUN, "--idle-timeout", durations(zero_means_nothing=False)),
    (RUN, "--max-connections", CONNECTIONS),
    (RUN, "--max-connections-per-peer", CONNECTIONS),
    (RUN, "--max-unauthenticated", CONNECTIONS),
    (RUN, "--max-request-bytes-per-member", wholes(MIN_FRAME, 2**40)),
    (RUN, "--request-budget-wait", durations(zero_means_nothing=False)),
    (RUN, "--rest-max-body", wholes(1, 100 * 2**20)),
    (RUN, "--rest-workers", wholes(1, MAX_REST_WORKERS)),
    (RUN, "--http-head-timeout", durations(zero_means_nothing=True)),
    (RUN, "--rest-keepalive-timeout", durations(zero_means_nothing=True)),
    (RUN, "--rest-max-connections", CONNECTIONS),
    (RUN, "--rest-max-connections-per-peer", CONNECTIONS),
    (RUN, "--metrics-max-connections", CONNECTIONS),
    (RUN, "--metrics-max-connections-per-peer", CONNECTIONS),
    (RUN, "--metrics-cache", durations(zero_means_nothing=False)),
    (RUN, "--lease-ms", wholes(500, YEAR_MS)),
    (RUN, "--cf-connections", wholes(4, 10_000)),
    (RUN, "--request-slots", wholes(1, MAX_SLOTS)),
    (RUN, "--scan-slots", wholes(1, MAX_SCAN_SLOTS)),
    (RUN, "--slot-lease-ms", wholes(1, YEAR_MS)),
    (RUN, "--logload", wholes(1, 16_000_000)),
    (RUN, "--max-frame", wholes(MIN_FRAME, MAX_FRAME)),
    (RUN, "--shutdown-grace", durations(zero_means_nothing=False)),
    (RUN, "--cf-wait", durations(zero_means_nothing=False)),
    (RUN, "--clock-skew-ms", [str(-YEAR_MS - 1), str(YEAR_MS + 1), HUGE, "-" + HUGE, "nan", "1.5"]),
    (RUN, "--max-umsgs", ["0", "-1", "1000000000", HUGE, "nan", "inf", "1.5"]),
    (RUN, "--ready-file", ["{tmp}/no-such-directory/QM1.ready", "{tmp}"]),
    (RUN, "--tls-cert", ["{tmp}/no-such-file.pem", "{tmp}"]),
    (RUN, "--tls-key", ["{tmp}/no-such-file.key", "{tmp}"]),
    (RUN, "--tls-ca", ["{tmp}/no-such-ca.pem", "{tmp}"]),
    ([*RUN, "--pstore-report", "YES"], "--pstore-report-file", ["{tmp}/no-such-directory/report", "{tmp}"]),
    (["log", "print", "--all"], "--from-lrsn", wholes(0, MAX_LRSN)),
    (["log", "print", "--all"], "--to-lrsn", wholes(0, MAX_LRSN)),
    (["log", "prune", "--all"], "--below", wholes(1, MAX_SEGMENT)),
]

CASES = [(words, option, value) for words, option, values in OPTIONS for value in values]


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory, and no settings in the environment: nothing `sqm` writes can hide anywhere."""
    for name in [n for n in os.environ if n.startswith(("CFEMU_", "SQM_")) or n == "REDIS_URL"]:
        monkeypatch.delenv(name)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def given(option: str, value: str) -> list[str]:
    """The option and its value as words of a command line: ``--opt=-inf`` for a value that would read as an option
    (argparse takes '-1' after an option for its value, not '-inf')."""
    looks_like_an_option = value.startswith("-") and not value[1:].isdigit()
    return [f"{option}={value}"] if looks_like_an_option else [option, value]


def said_once(err: str, option: str, value: str) -> None:
    """One line that names the option and the bad value, and no traceback."""
    assert err.count("\n") == 1 and err.startswith("sqm") and "Traceback" not in err, err
    assert f"{option}: " in err and value in err, err


@pytest.mark.parametrize(("words", "option", "value"), CASES, ids=[f"{o}={v}" for _, o, v in CASES])
def test_a_bad_value_of_any_option_is_refused_in_one_line(words: list[str], option: str, value: str,
                                                          empty_cwd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    value = value.replace("{tmp}", str(empty_cwd))
    argv = [*words, "--log-root", str(empty_cwd / "logs"), *given(option, value)]
    try:
        code = sqm_cli.main(argv)
    except SystemExit as e:  # the parser's refusal
        code = e.code
    assert code == 2
    said_once(capsys.readouterr().err, option, value)
    assert not any(empty_cwd.iterdir())  # no log root, no report, no ready file


@pytest.mark.slow
@pytest.mark.parametrize(("words", "option", "values"), OPTIONS, ids=[o for _, o, _ in OPTIONS])
def test_the_sqm_command_refuses_a_bad_value_of_each_option_in_one_line(words: list[str], option: str,
                                                                        values: list[str], empty_cwd: Path) -> None:
    """The command as installed, a real process: one of the option's bad values (the one of its position in the
    list, so that every kind of bad value is run by some option; the test above runs them all in-process)."""
    value = values[OPTIONS.index((words, option, values)) % len(values)].replace("{tmp}", str(empty_cwd))
    done = subprocess.run([SQM, *words, "--log-root", str(empty_cwd / "logs"), *given(option, value)], cwd=empty_cwd,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    said_once(done.stderr, option, value)
    assert not any(empty_cwd.iterdir())


def fingerprint(root: Path) -> dict[str, str]:
    """Every file under root: its path and a digest of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_prune_with_a_bad_below_leaves_the_log_as_it_was(redis_url: str, tmp_path: Path) -> None:
    """A stopped member's log of several segments; `sqm log prune --below` with each kind of bad value (a real
    process) is refused in one line, and every file of the log is still there with the same bytes."""
    logs = tmp_path / "logs"
    define_group(redis_url, queues=("Q1",))
    qm = start_qm(redis_url, logs, "QM1", background=False, cpl_entries=1, segment_bytes=4096)
    conn = qm.connect()
    for _interval in range(4):
        for _message in range(5):
            conn.put("Q1", b"x" * 300, syncpoint=False)
            conn.get("Q1", syncpoint=False)
        qm.checkpoint("logload")
    qm.stop(checkpoint=False)
    before = fingerprint(logs)
    assert sum(name.endswith(".log") for name in before) > 2  # segments a prune could remove
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CFEMU_", "SQM_"))}
    for i, value in enumerate(("-3", "0", "nan", "1.5", HUGE, str(MAX_SEGMENT + 1))):
        which = ("--member", "QM1") if i % 2 else ("--all",)
        done = subprocess.run([SQM, "log", "prune", *which, "--below", value, "--log-root", str(logs),
                               "--redis-url", redis_url, "--json"], capture_output=True, text=True, timeout=120,
                              env=env, cwd=tmp_path)
        assert done.returncode == 2 and done.stdout == "", done
        said_once(done.stderr, "--below", value)
    assert fingerprint(logs) == before


SETTINGS = [
    ({"SQM_MAX_UMSGS": "0"}, "$SQM_MAX_UMSGS: '0' is not between 1 and 999999999"),
    ({"SQM_MAX_UMSGS": "nan"}, "$SQM_MAX_UMSGS: 'nan' is not a number of messages"),
    ({"CFEMU_RESTORE_WORKERS": "-1"}, "$CFEMU_RESTORE_WORKERS: '-1' is not between 1 and"),
    ({"CFEMU_RESTORE_MEMORY": "lots"}, "$CFEMU_RESTORE_MEMORY: 'lots' is not a size"),
    ({"CFEMU_RESTORE_MEMORY": "1e400GiB"}, "$CFEMU_RESTORE_MEMORY: '1e400GiB' is not a size"),
    ({"CFEMU_PSTORE_REPORT": "{tmp}/no-such-directory/report"}, "$CFEMU_PSTORE_REPORT: must be a file in a directory "
                                                                "that exists"),
]


@pytest.mark.parametrize(("setting", "words"), SETTINGS, ids=[next(iter(s)) + "=" + next(iter(s.values()))
                                                              for s, _ in SETTINGS])
def test_a_bad_setting_in_the_environment_stops_sqm_run_at_start_in_one_line(setting: dict[str, str], words: str,
                                                                             empty_cwd: Path) -> None:
    """The numbers `sqm run` reads from its environment (MAXUMSGS; RECAUTO's restore memory and workers, which it
    would read only when a structure fails; the store report's file) are checked as it starts: one line naming the
    variable, exit status 2, before it reaches the CF or writes anything."""
    env = {**os.environ, **{k: v.replace("{tmp}", str(empty_cwd)) for k, v in setting.items()}}
    done = subprocess.run([SQM, "run", "--name", "QM1", "--no-auth", "--redis-url", "redis://127.0.0.1:1",
                           "--log-root", str(empty_cwd / "logs"), "--pstore-report", "YES"], cwd=empty_cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("sqm: error: ") and words in done.stderr, done
    assert not any(empty_cwd.iterdir())
