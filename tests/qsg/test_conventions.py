"""What every command line shares (cfemu.clitools): one-line errors with exit status 2 and the traceback only with
--verbose, and --json on every verb. In process, through each console script's main()."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from backup import cli as backup_cli
from qsg import cli as cfemu_cli
from qsg.chaos import cli as chaos_cli
from restore import cli as restore_cli
from sqm import cli as sqm_cli

ROOT = Path(__file__).resolve().parents[2]

Main = Callable[[list[str] | None], int]

# (prog, main, argv that fails for a reason the operator can act on, words of the message)
ERRORS: list[tuple[str, Main, list[str], str]] = [
    ("cfemu", cfemu_cli.main, ["status", "--redis-url", "http://x"], "unsupported URL scheme"),
    ("cfemu", cfemu_cli.main, ["status"], "no CF found: pass --redis-url"),
    ("sqm", sqm_cli.main, ["log", "print", "--all", "--log-root", "{tmp}/nowhere"], "does not exist"),
    ("sqm", sqm_cli.main, ["run", "--name", "QM1", "--no-auth", "--host", "192.0.2.1"], "--no-auth is refused"),
    ("sqm", sqm_cli.main, ["run", "--name", "QM1"], "no CF found: pass --redis-url"),
    ("cfbackup", backup_cli.main, ["show", "NOPE", "--backup-dir", "{tmp}"], "is not a backup id"),
    ("cfbackup", backup_cli.main, ["run", "APP1"], "no CF found: pass --redis-url"),
    ("cfrestore", restore_cli.main, ["run", "APP1", "--redis-url", "http://x"], "unsupported URL scheme"),
    ("cfrestore", restore_cli.main, ["plan", "APP1"], "no CF found: pass --redis-url"),
    # a URL no connection can be made with, refused before a server or a loop starts (each poll had failed)
    ("cfemu", cfemu_cli.main, ["console", "--redis-url", "redis://[::1"], "Invalid IPv6 URL"),
    ("cfemu", cfemu_cli.main, ["exporter", "--redis-url", "redis://127.0.0.1:99999"], "Port out of range"),
    ("cfbackup", backup_cli.main, ["schedule", "--interval", "60", "--redis-url", "redis://127.0.0.1:-1"],
     "Port could not be cast"),
    ("cfbackup", backup_cli.main, ["run", "APP1", "--redis-url", "redis+cluster://127.0.0.1:1/?node=h:x"],
     "bad address in the cluster URL"),
    ("cfemu chaos", chaos_cli.main, ["check", "/dev/null"], "not a chaos history"),
]


@pytest.fixture
def nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No settings anywhere: no environment, and a working directory with no cluster or CF above it."""
    for name in ("REDIS_URL", "CFEMU_LOG_ROOT", "CFEMU_BACKUP_DIR", "CFEMU_CLUSTER_DIR", "CFEMU_CF_DIR", "SQM_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("prog, main, argv, message", ERRORS, ids=lambda v: v if isinstance(v, str) else None)
def test_an_error_is_one_line_and_exit_2(prog: str, main: Main, argv: list[str], message: str, nowhere: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("{tmp}", str(nowhere)) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"{prog}: error: ") and message in err, err

    assert main([*argv, "--verbose"]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("Traceback") and err.splitlines()[-1].startswith(f"{prog}: error: "), err


def leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                 ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every verb's own parser (the leaves of the subcommand tree), with the words that reach it."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from leaf_parsers(sub, (*path, name))


@pytest.mark.parametrize("prog, parser", [
    ("cfemu", cfemu_cli.build_parser()), ("sqm", sqm_cli.build_parser()), ("cfbackup", backup_cli.build_parser()),
    ("cfrestore", restore_cli.build_parser()), ("cfemu chaos", chaos_cli.build_parser())], ids=lambda v: v
    if isinstance(v, str) else None)
def test_every_verb_has_json(prog: str, parser: argparse.ArgumentParser) -> None:
    verbs = list(leaf_parsers(parser))
    assert verbs
    for path, leaf in verbs:
        options = {o for a in leaf._actions for o in a.option_strings}
        delegated = any(a.dest == "rest" for a in leaf._actions)  # cfemu backup/restore/demo/chaos: their own CLI
        assert delegated or "--json" in options, f"{prog} {' '.join(path)} has no --json"


def test_a_daemon_with_json_logs_json_lines(redis_url: str, tmp_path: Path) -> None:
    """`sqm run --json` (and `cfbackup schedule --json`, through the same clitools.configure_logging): every log
    line is one JSON object."""
    import json

    from cfemu.admin import Admin
    from cfemu.connection import connect
    from tests.support.service_proc import start_server

    Admin(connect(redis_url)).define_structure("APP1")
    srv = start_server(redis_url, tmp_path, "QM1", "--json")
    assert srv.stop() == 0
    lines = [json.loads(line) for line in srv.log_text().splitlines()]
    assert lines and all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    assert any("QM1" in x["message"] for x in lines)


@pytest.mark.parametrize("argv", [
    ["define", "structure", "APP9", "--max-entries", "99999999999999999999"],
    ["alter", "structure", "APP9", "--max-bytes", "9007199254740992"],
    ["define", "queue", "Q9", "--structure", "APP9", "--backout-threshold", "99999999999999999999"],
], ids=["define-max-entries", "alter-max-bytes", "define-backout-threshold"])
def test_a_definitions_number_beyond_what_the_cf_holds_is_one_line(argv: list[str], nowhere: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything is read or written (a 20-digit capacity of a structure the CF had lost was written
    to the group repository and stopped every member's start)."""
    with pytest.raises(SystemExit) as e:
        cfemu_cli.main(argv)
    assert e.value.code == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "must be a whole number from 0 to 9007199254740991" in err, err


@pytest.mark.parametrize(("main", "argv", "words"), [
    (restore_cli.main, ["run", "APP1", "--engine", "bogus"], "cfrestore run: error: argument --engine: invalid choice"),
    (restore_cli.main, ["audit"], "cfrestore audit: error: the following arguments are required"),
    (sqm_cli.main, ["log", "print"], "sqm log print: error: one of the arguments --member --all is required"),
    (chaos_cli.main, ["run", "--bogus"], "error: unrecognized arguments: --bogus"),
    (backup_cli.main, ["run"], "cfbackup run: error: the following arguments are required"),
    (cfemu_cli.main, ["console", "--server", "host:"], "cfemu console: error: argument --server: bad endpoint"),
    (cfemu_cli.main, ["conn", "--server", "127.0.0.1:abc"], "cfemu conn: error: argument --server: bad endpoint"),
    (cfemu_cli.main, ["put", "Q1", "x", "--server", ":1"], "cfemu put: error: argument --server: bad endpoint"),
    (chaos_cli.main, ["soak", "--seeds", "0"], "argument --seeds: must be a whole number from 1"),
    (chaos_cli.main, ["run", "--duration", "nan"], "argument --duration: must be a number > 0"),
    (chaos_cli.main, ["run", "--clients", "99999999999999999999"], "argument --clients: must be a whole number"),
], ids=["cfrestore-engine", "cfrestore-audit", "sqm-log-print", "chaos-run", "cfbackup-run", "console-server",
        "conn-server", "put-server", "chaos-seeds", "chaos-duration", "chaos-clients"])
def test_every_commands_usage_error_is_one_line(main: Main, argv: list[str], words: str, nowhere: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's own usage errors print the usage block then the error; every command's parser says it in one
    line with the --help to read (cfemu.clitools.Parser), as cfemu's and cfbackup's did."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and words in err and "--help')" in err, err


def test_a_reader_that_goes_away_ends_the_command_without_an_error(tmp_path: Path) -> None:
    """`... --json | head`: the pipe's reader leaves; the command stops quietly with the status a shell gives a
    process SIGPIPE ended (141), not "error: [Errno 32] Broken pipe"."""
    script = ("import argparse, sys\n"
              "from cfemu.clitools import run_command\n"
              "def lines(args, out):\n"
              "    for i in range(200000):\n"
              "        print(f'line {i} ' + 'x' * 60)\n"
              "    return 0\n"
              "sys.exit(run_command('sqm', argparse.Namespace(), lines))\n")
    done = subprocess.run(f"{sys.executable} -c \"$SCRIPT\" | head -n 1; exit ${{PIPESTATUS[0]}}", shell=True,
                          executable="/bin/bash", capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "SCRIPT": script})
    assert done.stdout == "line 0 " + "x" * 60 + "\n"
    assert done.stderr == "" and done.returncode == 141, (done.returncode, done.stderr)


def test_a_stopped_cluster_is_named_as_down(nowhere: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Beside a cluster that is down, a command that needs its CF says the cluster is down and how to start it (it
    said "no CF found ... start one"), and `cluster restart` of a member refuses before starting one that could
    only fail to join (it printed the member's whole log as one 4 KB line)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cluster = nowhere / "var" / "cluster"
    cluster.mkdir(parents=True)
    (cluster / "cluster.json").write_text(json.dumps({"cf": {"pid": dead.pid, "port": 1},
                                                      "managers": [{"name": "QM1", "pid": dead.pid}]}))
    assert cfemu_cli.main(["status"]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and f"the cluster in {cluster} is down (its CF does not run)" in err, err
    assert "cfemu cluster up --dir" in err
    assert cfemu_cli.main(["cluster", "restart", "QM1"]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "cfemu cluster restart QM1: the cluster in" in err and "is down" in err, err


def test_with_json_an_error_is_a_json_document_on_stdout_too(nowhere: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A script reading --json output got nothing on stdout when the command failed; now the one line on stderr,
    and {"error", "exit"} on stdout. A command that printed a partial answer adds no second document."""
    assert cfemu_cli.main(["status", "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": err.removeprefix("cfemu: error: ").rstrip("\n"), "exit": 2}
    assert err.startswith("cfemu: error: no CF found") and err.count("\n") == 1


def test_secrets_init_never_writes_its_acl_file_over_what_is_not_a_regular_file(
        nowhere: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The ACL file is written in its path's place: given a device (run as root, /dev/null was replaced by a
    regular file), a pipe, a directory or a link, it is refused in one line, and no secrets directory is made."""
    fifo, link = nowhere / "fifo", nowhere / "link"
    os.mkfifo(fifo)
    (nowhere / "target").write_text("kept")
    link.symlink_to(nowhere / "target")
    for acl, words in ((fifo, "is not a regular file"), (nowhere, "is not a regular file"),
                       (link, "is not a regular file"),
                       (nowhere / "missing" / "acl", "must be a file in a directory that exists")):
        assert cfemu_cli.main(["secrets", "init", "--dir", str(nowhere / "secrets"), "--acl-file", str(acl)]) == 2
        _, err = capsys.readouterr()
        assert err.count("\n") == 1 and words in err, err
        assert not (nowhere / "secrets").exists()
    assert fifo.is_fifo() and link.is_symlink() and (nowhere / "target").read_text() == "kept"
    assert cfemu_cli.main(["secrets", "init", "--dir", str(nowhere / "secrets"), "--acl-owner", "0"]) == 2
    assert "needs --acl-file" in capsys.readouterr().err
    assert cfemu_cli.main(["secrets", "init", "--dir", str(nowhere / "secrets"), "--acl-file",
                           str(nowhere / "users.acl")]) == 0
    assert (nowhere / "users.acl").is_file()
