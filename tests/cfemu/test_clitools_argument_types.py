"""The argument types every command line shares (cfemu.clitools): a number with fractions in a range, a file the
command reads and a file it writes later. A bad value raises argparse.ArgumentTypeError, which the parser says in
one line."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from cfemu.clitools import (
    CLIError,
    cf_name,
    check_directory,
    directory,
    input_file,
    number,
    output_file,
    seconds,
)


@pytest.mark.parametrize(("text", "said"), [
    ("0", "must be a number > 0 and <= 4095, not 0"),
    ("-0.5", "must be a number > 0 and <= 4095, not -0.5"),
    ("4095.5", "must be a number > 0 and <= 4095, not 4095.5"),
    ("nan", "must be a number > 0 and <= 4095, not nan"),
    ("inf", "must be a number > 0 and <= 4095, not inf"),
    ("64MiB", "must be a number > 0 and <= 4095, not '64MiB'"),
])
def test_a_number_out_of_its_range_or_malformed_is_refused(text: str, said: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{said}$"):
        number(0, 4095, above=True)(text)


def test_a_number_in_its_range_is_taken_with_its_fraction() -> None:
    assert number(0, 4095, above=True)("0.004") == 0.004
    assert number(0, 4095, above=True)("4095") == 4095.0
    assert number(-1)("-1") == -1.0
    with pytest.raises(argparse.ArgumentTypeError, match="^must be a number, not -inf$"):
        number()("-inf")  # open at both ends, still never infinite
    assert seconds()("0") == 0.0  # seconds: a number from 0 unless told otherwise
    with pytest.raises(argparse.ArgumentTypeError, match="must be a number >= 0, not -1"):
        seconds()("-1")


def test_an_output_file_must_be_a_file_in_a_directory_that_exists(tmp_path: Path) -> None:
    assert output_file(str(tmp_path / "ready.json")) == tmp_path / "ready.json"
    (tmp_path / "old").write_text("x")
    assert output_file(str(tmp_path / "old")) == tmp_path / "old"  # written over later: taken
    with pytest.raises(argparse.ArgumentTypeError, match="must be a file in a directory that exists, not .*nowhere"):
        output_file(str(tmp_path / "nowhere" / "ready.json"))
    with pytest.raises(argparse.ArgumentTypeError, match="must be a file, not the directory"):
        output_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="must be a file, not ''"):
        output_file("")
    assert not any(p.name != "old" for p in tmp_path.iterdir())  # nothing created


def test_an_input_file_must_be_a_file_that_exists_and_may_be_read(tmp_path: Path) -> None:
    cert = tmp_path / "server.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    assert input_file(str(cert)) == str(cert)
    with pytest.raises(argparse.ArgumentTypeError, match="^must be a file that exists, not .*missing.pem'$"):
        input_file(str(tmp_path / "missing.pem"))
    with pytest.raises(argparse.ArgumentTypeError, match="^must be a file that exists, not "):
        input_file(str(tmp_path))  # a directory
    cert.chmod(0)
    if not os.access(cert, os.R_OK):  # root reads whatever the mode says
        with pytest.raises(argparse.ArgumentTypeError, match="^must be a file this user may read, not "):
            input_file(str(cert))


def test_an_output_file_must_be_one_this_user_may_write(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "old").write_text("x")
    (locked / "old").chmod(0o400)
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes whatever the mode says
            pytest.skip("this user may write anywhere")
        with pytest.raises(argparse.ArgumentTypeError, match="^must be a file in a directory this user may write"):
            output_file(str(locked / "new"))
        with pytest.raises(argparse.ArgumentTypeError, match="^must be a file this user may write"):
            output_file(str(locked / "old"))
    finally:
        locked.chmod(0o700)


def test_a_directory_must_be_one_or_one_that_can_be_made(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert check_directory(tmp_path, "--log-root") == tmp_path
    assert check_directory(tmp_path / "new" / "deeper", "--log-root") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # checked, not made
    with pytest.raises(CLIError, match=r"^--log-root: '.*/file' is not a directory$"):
        check_directory(tmp_path / "file", "--log-root")
    with pytest.raises(CLIError, match=r"^--log-root: '.*/file/logs' cannot be made: '.*/file' is not a directory$"):
        check_directory(tmp_path / "file" / "logs", "--log-root")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'.*/file' is not a directory$"):
        directory("--dir")(str(tmp_path / "file"))


@pytest.mark.parametrize(("kind", "text"), [("structure", "APP 1"), ("queue", "Q1\n"), ("queue", ""),
                                            ("structure", "S" * 49), ("member", "QM.1"), ("member", "Q" * 33)])
def test_a_bad_cf_name_is_refused(kind: str, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"^bad {kind} name "):
        cf_name(kind)(text)


def test_a_good_cf_name_is_taken() -> None:
    assert cf_name("structure")("APP1") == "APP1"
    assert cf_name("queue")("ORDERS.IN-2") == "ORDERS.IN-2"
    assert cf_name("member")("QM_1") == "QM_1"
    assert cf_name("structure", empty=True)("") == ""  # "none", where an option allows it
