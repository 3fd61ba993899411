"""cfbackup as a user runs it: a real process against a real redis-server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backup.files import MANIFEST_NAME
from cfemu.admin import Admin
from cfemu.connection import connect
from tests.support.cfbackup import cfbackup, group_to_back_up


@pytest.fixture
def env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    return group_to_back_up(redis_url, tmp_path, 20)


@pytest.mark.slow
def test_run_list_show_verify_prune(env: dict[str, str], redis_url: str, tmp_path: Path) -> None:
    first = cfbackup("run", "APP1", "--json", env=env)
    assert first.returncode == 0, first.stderr
    manifest = json.loads(first.stdout)
    assert manifest["entries"] == 20 and manifest["exception_records"] == 0
    assert manifest["members"] == []  # QM1 left the group cleanly
    bid = manifest["id"]

    table = cfbackup("run", "APP1", "--batch", "3", env=env)
    assert table.returncode == 0, table.stderr
    assert "committed puts" in table.stdout and "entries copied" in table.stdout

    listed = cfbackup("list", "APP1", "--json", env=env)
    rows = json.loads(listed.stdout)
    assert [r["state"] for r in rows] == ["ok", "ok"] and rows[1]["id"] == bid
    assert bid in cfbackup("list", env=env).stdout

    shown = cfbackup("show", bid, env=env)
    assert shown.returncode == 0 and "LRSN start / end" in shown.stdout and "uncommitted gets" in shown.stdout
    assert json.loads(cfbackup("show", bid, "--json", env=env).stdout)["manifest"]["signature"] == \
        manifest["signature"]

    ok = cfbackup("verify", bid, "--json", env=env)
    assert ok.returncode == 0 and json.loads(ok.stdout)["frames"] == 20
    assert json.loads(ok.stdout)["signed"] is True and json.loads(ok.stdout)["key"] == manifest["signature"]["key"]

    pruned = cfbackup("prune", "APP1", "--keep", "1", "--json", env=env)
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["removed"] == [bid]
    assert not (tmp_path / "bk" / "APP1" / bid).exists()
    assert [b["id"] for b in Admin(connect(redis_url)).backups("APP1")] == \
        [rows[0]["id"]]


@pytest.mark.slow
def test_corrupt_backup_and_bad_input_are_one_line_errors(env: dict[str, str], tmp_path: Path) -> None:
    run = cfbackup("run", "APP1", "--json", env=env)
    bid = json.loads(run.stdout)["id"]
    path = tmp_path / "bk" / "APP1" / bid
    f = path / "entries-0001.bin"
    raw = bytearray(f.read_bytes())
    raw[40] ^= 0xFF
    f.write_bytes(bytes(raw))

    bad = cfbackup("verify", bid, env=env)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "bad CRC in the frame at byte 9" in bad.stderr
    verbose = cfbackup("verify", bid, "--verbose", env=env)
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr

    (path / MANIFEST_NAME).unlink()
    listed = json.loads(cfbackup("list", "APP1", "--json", env=env).stdout)
    assert [r["state"] for r in listed] == ["incomplete"]
    shown = cfbackup("show", bid, env=env)
    assert shown.returncode == 2 and "is incomplete" in shown.stderr

    for args, message in [
        (("run", "NOPE"), "structure NOPE is not defined"),
        (("show", "garbage"), "'garbage' is not a backup id"),
        (("verify", "APP1-20200101T000000Z-abcdef"), "no backup APP1-20200101T000000Z-abcdef"),
        (("prune", "APP1", "--older-than", "soon"), "bad age 'soon'"),
        (("run", "APP1", "--exclint", "-5"), "argument --exclint: must be a whole number >= 0, not -5"),
        (("run", "APP1", "--batch", "0"), "argument --batch: must be a whole number >= 1, not 0"),
        (("list", "APP1", "--backup-dir", str(tmp_path / "nowhere")), f"the backup directory {tmp_path / 'nowhere'} "
                                                                      "does not exist"),
    ]:
        out = cfbackup(*args, env=env)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        # a usage error names the verb too (cfemu.clitools.Parser): "cfbackup run: error: argument ..."
        assert out.stderr.startswith("cfbackup") and ": error: " in out.stderr and out.stderr.count("\n") == 1, \
            out.stderr
        assert message in out.stderr, out.stderr
    assert sorted(p.name for p in (tmp_path / "bk" / "APP1").iterdir()) == [bid], "bad input changed nothing"
    assert not (tmp_path / "bk" / "NOPE").exists()

    no_cf = cfbackup("run", "APP1", env={**env, "REDIS_URL": "redis://127.0.0.1:1/0"})
    assert no_cf.returncode == 2 and no_cf.stderr.count("\n") == 1
    assert no_cf.stderr.startswith("cfbackup: error: cannot reach the CF: ") and "Connection refused" in no_cf.stderr


def test_a_malformed_backup_name_is_one_clear_line(env: dict[str, str]) -> None:
    """Digits where the id's date and time go that are no date (month 13, 30 February): one line naming the id
    and what is wrong with it, not the parser's own message."""
    for verb in ("show", "verify", "sign"):
        for bad, ts in (("APP1-20241399T999999Z-abcdef", "20241399T999999Z"),
                        ("APP1-20240230T000000Z-abcdef", "20240230T000000Z")):
            out = cfbackup(verb, bad, env=env)
            assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
            assert out.stderr.startswith(f"cfbackup: error: '{bad}' is not a backup id: {ts} is not a date and time "
                                         "(YYYYmmddTHHMMSSZ, UTC)"), out.stderr


def test_a_backup_dir_others_can_write_is_refused_before_the_cf_is_touched(
        env: dict[str, str], redis_url: str, tmp_path: Path) -> None:
    """The backup root and the structure's directory are both checked, before the CF marks the backup and raises
    its floor: whoever can write the root can replace the structure's directory."""
    from cfemu.cf import CF

    before = CF(connect(redis_url)).structure("APP1").info()
    for where in (tmp_path / "bk", tmp_path / "bk" / "APP1"):
        where.mkdir(exist_ok=True)
        where.chmod(0o777)
        out = cfbackup("run", "APP1", env=env)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert f"{where} is writable by other users (mode 777)" in out.stderr, out.stderr
        assert CF(connect(redis_url)).structure("APP1").info() == before, "the CF was not touched"
        assert not any((tmp_path / "bk").rglob("APP1-*")), "nothing was written"
        where.chmod(0o700)
    assert cfbackup("run", "APP1", env=env).returncode == 0
