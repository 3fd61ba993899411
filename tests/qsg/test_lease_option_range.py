"""A member's lease (--lease-ms) has one range wherever it is given: `sqm run`, `cfemu cluster up` (which passes it
to each member's `sqm run`) and a cfemu command's in-process member. `cluster up` took any value above 500, and a
lease `sqm run` refuses then failed every member at its start, after the group's CF and directories were made."""

from __future__ import annotations

import pytest

from cfemu.clitools import MAX_MS, MIN_LEASE_MS
from qsg.cli import build_parser
from sqm.cli import build_parser as sqm_parser

COMMANDS = {
    "sqm run": lambda lease: sqm_parser().parse_args(["run", "--name", "QM1", "--lease-ms", lease]),
    "cfemu cluster up": lambda lease: build_parser().parse_args(["cluster", "up", "--lease-ms", lease]),
    "cfemu put": lambda lease: build_parser().parse_args(["put", "Q1", "x", "--lease-ms", lease]),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("lease", [str(MIN_LEASE_MS - 1), str(MAX_MS + 1), "1" + "0" * 30, "nan", "5s"])
def test_a_lease_out_of_range_is_refused_in_one_line(command: str, lease: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        COMMANDS[command](lease)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--lease-ms" in err and lease in err and "\n" not in err, err


@pytest.mark.parametrize("command", COMMANDS)
def test_the_range_s_ends_are_taken(command: str) -> None:
    assert {COMMANDS[command](str(v)).lease_ms for v in (MIN_LEASE_MS, MAX_MS)} == {MIN_LEASE_MS, MAX_MS}
