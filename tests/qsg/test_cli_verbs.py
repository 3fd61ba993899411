"""`cfemu`'s verbs have one registry (qsg.cli.VERBS) that the parser and the dispatch both read: every verb that
runs is listed by `cfemu --help` with its one line, the module's usage names it, and every verb, its own or
delegated to another command line, takes --json."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qsg import cli
from qsg.cli import VERBS, Command, Delegate
from tests.qsg.test_conventions import leaf_parsers

ROOT = Path(__file__).resolve().parents[2]


def listed_verbs(help_text: str) -> dict[str, str]:
    """The verbs `cfemu --help` lists under its positional arguments, each with its help line(s)."""
    verbs: dict[str, str] = {}
    section = help_text.split("positional arguments:", 1)[1].split("\n\n", 1)[0]
    last = None
    for line in section.splitlines()[2:]:  # after the VERB line
        m = re.match(r"^    (\S+)\s*(.*)$", line)
        if m:
            last = m.group(1)
            verbs[last] = m.group(2)
        elif last is not None:
            verbs[last] = (verbs[last] + " " + line.strip()).strip()
    return verbs


def test_cfemu_help_lists_every_verb_with_its_help() -> None:
    """The console script as installed (pyproject's [project.scripts]), in a subprocess."""
    entry = Path(sys.executable).with_name("cfemu")
    r = subprocess.run([str(entry), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    listed = listed_verbs(r.stdout)
    assert list(listed) == list(VERBS)
    for name, text in listed.items():
        assert text == " ".join(VERBS[name].help.split()), name


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_listed_verb_runs(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The dispatch runs every verb the help lists: its own --help (cfemu's parser, or the delegate's)."""
    with pytest.raises(SystemExit) as done:
        cli.main([verb, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and verb in out.split("\n\n", 1)[0], out
    if verb in ("backup", "restore"):  # the same command line as cfbackup / cfrestore, named as it was run
        assert out.startswith(f"usage: cfemu {verb} ")


def test_an_unknown_verb_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["nope"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and all(f"'{name}'" in err for name in VERBS)


def test_the_module_usage_names_every_verb() -> None:
    usage = (cli.__doc__ or "").split("\n\n")[1]
    for name in VERBS:
        assert re.search(rf"(cfemu |\| |, ){name}\b", usage), f"qsg/cli.py's usage does not name {name}"


def test_every_target_loads() -> None:
    for name, verb in VERBS.items():
        if isinstance(verb, Command):
            assert callable(cli.load(verb.run)), name
            assert verb.arguments is None or callable(cli.load(verb.arguments)), name
            assert set(verb.parents) <= {"common", "where", "server"}, name
        else:
            assert callable(cli.load(verb.main)), name


@pytest.mark.parametrize("verb", [n for n, v in VERBS.items() if isinstance(v, Delegate)])
def test_every_delegated_verb_has_json(verb: str) -> None:
    """Each delegate's own parser (its module's build_parser) promises --json on every verb, as cfemu's own verbs
    do (tests/qsg/test_conventions.py)."""
    delegate = VERBS[verb]
    assert isinstance(delegate, Delegate)
    module = delegate.main.partition(":")[0]
    parser = cli.load(f"{module}:build_parser")()
    leaves = [(path, leaf) for path, leaf in leaf_parsers(parser) if path[:len(delegate.argv_prefix)]
              == delegate.argv_prefix]
    assert leaves
    for path, leaf in leaves:
        options = {o for a in leaf._actions for o in a.option_strings}
        assert "--json" in options, f"cfemu {verb} {' '.join(path)} has no --json"


def test_no_verb_module_imports_the_dispatcher() -> None:
    """qsg.cli imports the verb modules (through VERBS); they share qsg.cli_common, never qsg.cli itself."""
    for path in [*sorted((ROOT / "qsg").glob("*_cli.py")), ROOT / "qsg" / "cli_common.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "qsg.cli" and not (node.module == "qsg" and any(
                    a.name == "cli" for a in node.names)), f"{path.name} imports qsg.cli"
            elif isinstance(node, ast.Import):
                assert all(a.name != "qsg.cli" for a in node.names), f"{path.name} imports qsg.cli"
