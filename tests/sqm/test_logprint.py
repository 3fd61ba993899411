"""sqm log print: one member's log or the merged log, filters, JSON and table output, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sqm.cli import main
from sqm.log import LogReader
from tests.support.group import define_group, start_qm
from tests.support.harness import lose_cf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> dict[str, object]:
    """Two members' logs: QM1 puts on Q1 and Q2, QM2 gets the Q1 message (after one backed-out get)."""
    url = redis_server.url
    client = redis_server.client()
    lose_cf(client)
    define_group(url, queues=("Q1", "Q2"))
    root = tmp_path_factory.mktemp("logprint") / "logs"
    qm1 = start_qm(url, root, "QM1", background=False)
    qm2 = start_qm(url, root, "QM2", background=False)
    a, b = qm1.connect(), qm2.connect()
    m1 = a.put("Q1", b"one")
    a.put("Q2", b"two")
    put_uow = a.uow.id if a.uow else ""
    a.commit()
    b.get("Q1")
    b.backout()
    b.get("Q1")
    get_uow = b.uow.id if b.uow else ""
    b.commit()
    qm1.stop()
    qm2.stop()
    lose_cf(client)
    return {"root": root, "msgid": m1.msgid.hex(), "entry": m1.entry_id, "put_uow": put_uow, "get_uow": get_uow}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["log", "print", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


def test_merged_log_of_all_members_in_lrsn_order(history: dict[str, object],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--all", "--log-root", str(history["root"]), "--json")
    assert rc == 0
    lines = json_lines(out)
    root = Path(str(history["root"]))
    assert len(lines) == sum(1 for m in ("QM1", "QM2") for _ in LogReader(root / m).records())
    assert {x["member"] for x in lines} == {"QM1", "QM2"}
    lrsns = [x["lrsn"] for x in lines]
    assert lrsns == sorted(lrsns)
    put = next(x for x in lines if x["kind"] == "PUT")
    assert put["record"]["d"] == b"one".hex()
    assert put["description"].startswith("put ")


def test_one_member_and_kind_filter(history: dict[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--member", "QM2", "--log-root", str(history["root"]), "--json",
                     "--kind", "commit,backout", "--kind", "GET")
    assert rc == 0
    lines = json_lines(out)
    assert {x["member"] for x in lines} == {"QM2"}
    assert [x["kind"] for x in lines] == ["GET", "BACKOUT", "GET", "COMMIT"]


def test_message_filter_follows_the_message_across_members(history: dict[str, object],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    for ident in (str(history["msgid"]), str(history["entry"])):
        rc, out, _ = run(capsys, "--all", "--log-root", str(history["root"]), "--json", "--message", ident)
        assert rc == 0
        lines = json_lines(out)
        assert [(x["member"], x["kind"]) for x in lines] == [
            ("QM1", "PUT"), ("QM1", "COMMIT"), ("QM1", "END"),
            ("QM2", "GET"), ("QM2", "BACKOUT"), ("QM2", "END"),
            ("QM2", "GET"), ("QM2", "COMMIT"), ("QM2", "END")]


def test_queue_uow_and_lrsn_filters(history: dict[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    root = str(history["root"])
    _, out, _ = run(capsys, "--all", "--log-root", root, "--json", "--queue", "Q2")
    # ... and its copies: each member's shutdown relogs every message (seed 000, relogging at termination)
    assert [x["kind"] for x in json_lines(out)] == ["PUT", "COMMIT", "END", "RELOG", "RELOG"]

    _, out, _ = run(capsys, "--all", "--log-root", root, "--json", "--uow", str(history["get_uow"]))
    lines = json_lines(out)
    assert [x["kind"] for x in lines] == ["GET", "COMMIT", "END"]
    assert {x["uow"] for x in lines} == {history["get_uow"]}

    _, out, _ = run(capsys, "--all", "--log-root", root, "--json")
    everything = json_lines(out)
    lo, hi = everything[2]["lrsn"], everything[-3]["lrsn"]
    _, out, _ = run(capsys, "--all", "--log-root", root, "--json", "--from-lrsn", str(lo), "--to-lrsn", str(hi))
    assert json_lines(out) == everything[2:-2]


@pytest.mark.parametrize("argv, message", [
    (["--member", "QM9"], "no log for member QM9 under {root} (members: QM1, QM2)"),
    (["--all", "--kind", "PUT,FROB"], "unknown record kind FROB"),
    (["--all", "--from-lrsn", "5", "--to-lrsn", "4"], "--from-lrsn 5 is above --to-lrsn 4"),
])
def test_bad_input_is_one_line(history: dict[str, object], capsys: pytest.CaptureFixture[str],
                               argv: list[str], message: str) -> None:
    root = str(history["root"])
    rc, out, err = run(capsys, *argv, "--log-root", root)
    assert rc == 2 and out == ""
    assert err.startswith("sqm: error: " + message.format(root=root))
    assert err.count("\n") == 1


def test_missing_log_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "--all", "--log-root", str(tmp_path / "nowhere"))
    assert rc == 2 and "does not exist" in err and err.count("\n") == 1


def test_corrupt_log_names_file_and_offset(history: dict[str, object], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    src = Path(str(history["root"])) / "QM1"
    dst = tmp_path / "logs" / "QM1"
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "writer.lock":
            (dst / f.name).write_bytes(f.read_bytes())
    pos, _ = list(LogReader(dst).records())[1]
    seg = dst / f"seg-{pos.segment:08d}.log"
    data = bytearray(seg.read_bytes())
    data[pos.offset + 12] ^= 0xFF
    seg.write_bytes(bytes(data))
    rc, _, err = run(capsys, "--member", "QM1", "--log-root", str(tmp_path / "logs"))
    assert rc == 2
    assert err.startswith(f"sqm: error: corrupt record log {seg} at byte offset {pos.offset}: CRC mismatch")
    assert err.count("\n") == 1
    rc, _, err = run(capsys, "--member", "QM1", "--log-root", str(tmp_path / "logs"), "--verbose")
    assert rc == 2 and "Traceback" in err


def test_table_output_from_the_command_line(history: dict[str, object]) -> None:
    env = {**os.environ, "CFEMU_LOG_ROOT": str(history["root"])}
    proc = subprocess.run([sys.executable, "-m", "sqm.cli", "log", "print", "--all", "--kind", "COMMIT"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # The title names the log root and wraps at the table's width: over several lines where the temporary path is
    # long (a pytest-xdist worker's has one directory more).
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["LRSN"])
    title = " ".join(line.strip() for line in lines[:header])
    assert title.startswith("merged log of all members under") and title.endswith(": 2 records"), title
    assert lines[header].split() == ["LRSN", "member", "kind", "UOW", "description"]
    body = lines[header + 1:]
    assert len(body) == 2 and all(" COMMIT " in line and "commit uow" in line for line in body)
    assert any(str(history["put_uow"]) in line for line in body)
