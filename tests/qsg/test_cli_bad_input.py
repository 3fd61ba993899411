"""Bad input to a command line is one line naming the problem, exit status 2, and nothing durable changes: a file
the command would write (a metrics file, a report, a ready file, an ACL file) in no directory or in the place of a
directory, a directory setting that is a file or cannot be made, a malformed CF name, size or host name, a TLS
certificate that is not PEM. In process, through each console script's main(), as tests/qsg/test_conventions.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from backup import cli as backup_cli
from qsg import cli as cfemu_cli
from qsg.chaos import cli as chaos_cli
from restore import cli as restore_cli
from sqm import cli as sqm_cli
from sqm.service.client import Client
from sqm.service.protocol import QueueManagerUnavailableError

Main = Callable[..., int]
NO_CF = "redis://127.0.0.1:1"  # nothing listens there: a command that got as far as the CF would say so instead

# (main, argv, words of the message): {tmp} is the test's directory, holding "file", a regular file.
REFUSED: list[tuple[Main, list[str], str]] = [
    (backup_cli.main, ["run", "APP1", "--redis-url", NO_CF, "--metrics-file", "{tmp}/nodir/m.prom"],
     "cfbackup run: error: argument --metrics-file: must be a file in a directory that exists"),
    (restore_cli.main, ["run", "APP1", "--redis-url", NO_CF, "--metrics-file", "{tmp}"],
     "cfrestore run: error: argument --metrics-file: must be a file, not the directory"),
    (restore_cli.main, ["run", "APP1", "--redis-url", NO_CF, "--report", "{tmp}/file/r.json"],
     "cfrestore run: error: argument --report: must be a file in a directory that can be made, not '{tmp}/file/r.json' "
     "(its directory: '{tmp}/file' is not a directory)"),
    (restore_cli.main, ["plan", "APP1", "--redis-url", NO_CF, "--report", "{tmp}/file/new/r.json"],
     "(its directory: '{tmp}/file/new' cannot be made: '{tmp}/file' is not a directory)"),
    (cfemu_cli.main, ["migrate", "load", "{tmp}/unload", "--redis-url", NO_CF, "--report", "{tmp}/nodir/r.json"],
     "cfemu migrate load: error: argument --report: must be a file in a directory that exists"),
    (cfemu_cli.main, ["console", "--redis-url", NO_CF, "--ready-file", "{tmp}/nodir/ready.json"],
     "cfemu console: error: argument --ready-file: must be a file in a directory that exists"),
    (cfemu_cli.main, ["console", "--redis-url", NO_CF, "--allow-host", "console.example.com:8470"],
     "cfemu console: error: argument --allow-host: must be a DNS name"),
    (cfemu_cli.main, ["console", "--redis-url", NO_CF, "--allow-host", "http://console.example.com/"],
     "cfemu console: error: argument --allow-host: must be a DNS name"),
    (cfemu_cli.main, ["console", "--redis-url", NO_CF, "--cluster-dir", "{tmp}/c", "--tls-cert", "{tmp}/file",
                      "--tls-key", "{tmp}/file"], "not a PEM certificate and its private key"),
    (cfemu_cli.main, ["console", "--redis-url", NO_CF, "--cluster-dir", "{tmp}/c", "--tls-cert", "{tmp}/file",
                      "--tls-key", "{tmp}/nokey.pem"], "cfemu: error: --tls-key: no such file: {tmp}/nokey.pem"),
    (cfemu_cli.main, ["cf", "start", "--dir", "{tmp}/cf", "--tls-cert", "{tmp}/file", "--tls-key", "{tmp}/file"],
     "cfemu: error: --tls-cert {tmp}/file and --tls-key {tmp}/file: not a PEM certificate and its private key"),
    (cfemu_cli.main, ["cluster", "up", "--dir", "{tmp}/file"], "cfemu: error: --cluster-dir: '{tmp}/file' is not a "
                                                                "directory"),
    (cfemu_cli.main, ["cf", "start", "--dir", "{tmp}/file/cf"], "cfemu: error: --cf-dir: '{tmp}/file/cf' cannot be "
                                                                 "made: '{tmp}/file' is not a directory"),
    (sqm_cli.main, ["log", "print", "--all", "--log-root", "{tmp}/file"],
     "sqm: error: --log-root: '{tmp}/file' is not a directory"),
    (restore_cli.main, ["archive", "--archive-dir", "{tmp}/file"],
     "cfrestore archive: error: argument --archive-dir: '{tmp}/file' is not a directory"),
    (chaos_cli.main, ["run", "--dir", "{tmp}/file/chaos"], "argument --dir: '{tmp}/file/chaos' cannot be made"),
    (cfemu_cli.main, ["secrets", "init", "--dir", "{tmp}/file/secrets"], "cfemu: error: --dir: '{tmp}/file/secrets' "
                                                                          "cannot be made"),
    (cfemu_cli.main, ["secrets", "init", "--dir", "{tmp}/s", "--acl-file", "{tmp}/nodir/users.acl"],
     "cfemu: error: --acl-file: must be a file in a directory that exists"),
    (cfemu_cli.main, ["cluster", "up", "--dir", "{tmp}/c", "--spark", "1", "--spark-memory", "2x"],
     "cfemu cluster: error: argument --spark-memory: '2x' is not a size"),
    (cfemu_cli.main, ["cluster", "up", "--dir", "{tmp}/c", "--spark", "1", "--spark-memory", "100k"],
     "argument --spark-memory: '100k' is below the least a Spark worker can offer, 1 MiB"),
    (cfemu_cli.main, ["cluster", "up", "--dir", "{tmp}/c", "--structure", "APP 1"],
     "cfemu cluster: error: argument --structure: bad structure name 'APP 1'"),
    (cfemu_cli.main, ["cluster", "up", "--dir", "{tmp}/c", "--queue", "Q1/x"],
     "cfemu cluster: error: argument --queue: bad queue name 'Q1/x'"),
    (cfemu_cli.main, ["define", "queue", "Q 1", "--structure", "APP1", "--redis-url", NO_CF],
     "cfemu define queue: error: argument name: bad queue name 'Q 1'"),
    (cfemu_cli.main, ["put", "Q\n1", "x", "--redis-url", NO_CF], "cfemu put: error: argument queue: bad queue name"),
    (cfemu_cli.main, ["backup", "run", "APP*", "--redis-url", NO_CF],
     "cfemu backup run: error: argument structure: bad structure name 'APP*'"),
    (cfemu_cli.main, ["restore", "mark-failed", "A:B", "--redis-url", NO_CF],
     "cfemu restore mark-failed: error: argument structure: bad structure name 'A:B'"),
    (cfemu_cli.main, ["pstore", "mode", "APP 1", "HOT", "--redis-url", NO_CF],
     "cfemu pstore mode: error: argument structure: bad structure name 'APP 1'"),
    (cfemu_cli.main, ["migrate", "unload", "APP1", "--to", "{tmp}/file/unload", "--redis-url", NO_CF],
     "cfemu migrate unload: error: argument --to: '{tmp}/file/unload' cannot be made"),
    (sqm_cli.main, ["log", "print", "--member", "QM 1", "--log-root", "{tmp}"],
     "sqm log print: error: argument --member: bad member name 'QM 1'"),
    (sqm_cli.main, ["log", "lost", "../QM1", "--confirm", "../QM1", "--log-root", "{tmp}"],
     "sqm log lost: error: argument MEMBER: bad member name '../QM1'"),
    (sqm_cli.main, ["log", "prune", "--member", "QM.1", "--log-root", "{tmp}"],
     "sqm log prune: error: argument --member: bad member name 'QM.1'"),
    (cfemu_cli.main, ["backup", "run"], "cfemu backup run: error: the following arguments are required: structure "
                                        "(see 'cfemu backup run --help')"),
    (cfemu_cli.main, ["restore", "plan", "APP1", "--redis-url", "http://x"],
     "cfemu restore: error: the CF URL is not one a connection can be made with"),
]


@pytest.fixture
def nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No settings anywhere, and a working directory with no cluster or CF above it; tmp_path/file is a file."""
    for name in ("REDIS_URL", "CFEMU_LOG_ROOT", "CFEMU_BACKUP_DIR", "CFEMU_CLUSTER_DIR", "CFEMU_CF_DIR",
                 "CFEMU_LOG_ARCHIVE_DIR", "CFEMU_SECRETS_DIR", "SQM_TOKEN", "SQM_OPERATOR_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("not a directory, not PEM\n")
    return tmp_path


def _run(main: Main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's usage errors
        return int(e.code or 0)


@pytest.mark.parametrize(("main", "argv", "message"), REFUSED,
                         ids=lambda v: " ".join(v[:3]) if isinstance(v, list) else None)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(main: Main, argv: list[str], message: str, nowhere: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(p.relative_to(nowhere) for p in nowhere.rglob("*"))
    assert _run(main, [a.replace("{tmp}", str(nowhere)) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message.replace("{tmp}", str(nowhere)) in err, err
    assert sorted(p.relative_to(nowhere) for p in nowhere.rglob("*")) == before  # nothing made, nothing removed


def test_a_directory_setting_from_the_environment_is_checked_as_its_flag(nowhere: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CFEMU_BACKUP_DIR", str(nowhere / "file"))
    assert _run(backup_cli.main, ["list"]) == 2
    _, err = capsys.readouterr()
    assert err == f"cfbackup: error: $CFEMU_BACKUP_DIR: '{nowhere / 'file'}' is not a directory\n"


def test_the_spark_memory_is_handed_to_spark_in_whole_mib() -> None:
    args = cfemu_cli.build_parser().parse_args(["cluster", "up", "--spark-memory", "1.5GiB"])
    assert args.spark_memory == "1536m"
    assert cfemu_cli.build_parser().parse_args(["cluster", "up"]).spark_memory == "2048m"  # the default, 2g


def test_a_refusal_before_the_run_still_writes_the_metrics_file_as_failed(nowhere: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """node_exporter then shows the run failed, not the last good run's metrics as if nothing happened."""
    for main, argv, prefix in (
            (restore_cli.main, ["run", "APP1", "--redis-url", NO_CF, "--memory-limit", "5"], "cfrestore_"),
            (backup_cli.main, ["run", "APP1", "--redis-url", "http://x"], "cfbackup_")):
        metrics = nowhere / f"{prefix}run.prom"
        assert _run(main, [*argv, "--metrics-file", str(metrics)]) == 2
        _, err = capsys.readouterr()
        assert err.count("\n") == 1, err
        assert f'{prefix}last_run_success{{structure="APP1"}} 0.0' in metrics.read_text()


def test_secrets_init_keeps_an_acl_file_that_holds_another_acl(nowhere: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    acl = nowhere / "users.acl"
    acl.write_text("user default on nopass ~* +@all\n")
    assert _run(cfemu_cli.main, ["secrets", "init", "--dir", str(nowhere / "s"), "--acl-file", str(acl)]) == 2
    _, err = capsys.readouterr()
    assert err == (f"cfemu: error: --acl-file: {acl} exists and holds another ACL: pass --force to write over it, "
                   "or name a new file\n")
    assert acl.read_text() == "user default on nopass ~* +@all\n" and not (nowhere / "s").exists()

    # --force writes it; the same command again finds the same ACL there and is no refusal
    assert _run(cfemu_cli.main, ["secrets", "init", "--dir", str(nowhere / "s"), "--acl-file", str(acl),
                                 "--force", "--json"]) == 0
    written = acl.read_text()
    assert "user qsg-member on" in written
    assert _run(cfemu_cli.main, ["secrets", "init", "--dir", str(nowhere / "s"), "--acl-file", str(acl),
                                 "--json"]) == 0
    assert acl.read_text() == written
    capsys.readouterr()


def _sqm_run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`sqm run` as an operator runs it, a subprocess, with a token and no settings from anywhere else."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CFEMU_", "SQM_")) and k != "REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "sqm.cli", "run", "--log-root", str(tmp_path / "logs"), *argv],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**env, "SQM_TOKEN": "a-token-for-this-test"})


@pytest.mark.parametrize(("argv", "code", "words"), [
    (["--name", "QM1", "--redis-url", NO_CF, "--cf-wait", "0"], 1,
     "sqm: error: QM1: MQRC_CF_STRUC_FAILED (2373): the CF did not answer within 0s"),
    (["--name", "QM1", "--redis-url", NO_CF, "--tls-cert", "{tmp}/file", "--tls-key", "{tmp}/file"], 2,
     "sqm: error: TLS certificate {tmp}/file and key {tmp}/file: not a PEM certificate and its private key"),
    (["--name", "QM.1", "--redis-url", NO_CF], 2, "sqm run: error: argument --name: bad member name 'QM.1'"),
], ids=["cf-unreachable", "tls-not-pem", "bad-name"])
def test_sqm_run_that_cannot_start_says_why_in_one_line(tmp_path: Path, argv: list[str], code: int,
                                                        words: str) -> None:
    (tmp_path / "file").write_text("not PEM\n")
    done = _sqm_run(tmp_path, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(words.replace("{tmp}", str(tmp_path))), done.stderr
    assert not (tmp_path / "logs").exists()  # no member log, no group repository: nothing joined


@pytest.fixture
def nobody() -> Iterator[tuple[str, socket.socket]]:
    """An endpoint nothing answers on: a socket listening that never accepts nor replies (the kernel completes the
    connection, the handshake waits), and the address of a port nothing listens on (its socket closed)."""
    silent = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    refused = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    try:
        yield refused, silent
    finally:
        silent.close()


@pytest.mark.timed
def test_a_clients_first_connection_gives_up_within_its_first_connect_timeout(
        nobody: tuple[str, socket.socket]) -> None:
    refused, silent = nobody
    quiet = f"127.0.0.1:{silent.getsockname()[1]}"
    for endpoint in (refused, quiet):
        t0 = time.monotonic()
        with pytest.raises(QueueManagerUnavailableError, match=f"no queue manager answered: {endpoint}: "):
            Client([endpoint], token="a-token", first_connect_timeout=1.0)
        assert time.monotonic() - t0 < 2.0, endpoint  # not reconnect_timeout's 15 s, nor request_timeout's 30


@pytest.mark.timed
def test_a_command_given_a_server_that_is_not_there_fails_within_a_few_seconds(
        nobody: tuple[str, socket.socket], tmp_path: Path) -> None:
    refused, _ = nobody
    env = {**os.environ, "SQM_TOKEN": "a-token-for-this-test"}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "qsg.cli", "put", "Q1", "x", "--server", refused, "--redis-url",
                           NO_CF], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    took = time.monotonic() - t0
    assert done.returncode == 75 and done.stderr.count("\n") == 1, done.stderr  # 2059: retry later
    assert f"no queue manager answered: {refused}: " in done.stderr, done.stderr
    assert took < 10.0, took  # the interpreter's start and imports, then 3 s at most: not the client's 15 s of retries
