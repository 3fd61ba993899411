"""Input bounds (docs/security.md): names with a trailing newline are refused, ids, property names, float
properties and expiry values are bounded, no error message carries a password, and a corrupt log at `sqm run` start
gives a one-line error, not a traceback. Each probed through the public API or the command line, as a client or an operator would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import BadRequestError
from tests.support.group import define_group, start_qm


def test_a_name_with_a_trailing_newline_is_refused(redis_url: str) -> None:
    admin = Admin(connect(redis_url))
    for bad in ("APP1\n", "Q1\n"):
        with pytest.raises(ValueError, match="bad structure name"):
            admin.define_structure(bad)
    define_group(redis_url)
    with pytest.raises(ValueError, match="bad queue name"):
        admin.define_queue("Q9\n", "APP1")


@pytest.mark.parametrize("what", ["msgid", "correlid", "property name", "property count", "expiry", "big int",
                                  "NaN float", "infinite float"])
def test_unbounded_message_fields_are_refused_and_nothing_is_put(redis_url: str, tmp_path: Path,
                                                                 what: str) -> None:
    define_group(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    try:
        conn = qm.connect()
        kw: dict[str, object] = {
            "msgid": {"msgid": b"m" * 2**20}, "correlid": {"correlid": b"c" * 25},
            "property name": {"properties": {"n" * 2**20: 1}},
            "property count": {"properties": {f"p{i}": i for i in range(20_000)}},
            "expiry": {"expiry_ms": 2**63}, "big int": {"properties": {"n": 2**70}},
            # a float property must be finite: a NaN broke the REST API's message list (not JSON) for every message
            "NaN float": {"properties": {"f": float("nan")}}, "infinite float": {"properties": {"f": -float("inf")}},
        }[what]
        with pytest.raises(BadRequestError):
            conn.put("Q1", b"x", syncpoint=False, **kw)  # type: ignore[arg-type]
        assert conn.browse("Q1") == []
        with pytest.raises(BadRequestError):
            conn.get("Q1", msgid=b"m" * 2**20)
    finally:
        qm.stop()


def test_sqm_run_on_a_corrupt_log_says_so_in_one_line(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url)
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    c = qm.connect()
    for i in range(5):
        c.put("Q1", b"x%d" % i)
    c.commit()
    qm.stop()
    seg = next((tmp_path / "logs" / "QM1").glob("seg-*"))
    data = bytearray(seg.read_bytes())
    data[80] ^= 0xFF  # a flipped byte in the middle of the segment: corruption, not a torn tail
    seg.write_bytes(bytes(data))
    out = subprocess.run([sys.executable, "-m", "sqm.cli", "run", "--name", "QM1", "--redis-url", redis_url,
                          "--log-root", str(tmp_path / "logs"), "--port", "0"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "SQM_TOKEN": "a-token-for-this-test"})
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert "Traceback" not in out.stderr, out.stderr
    assert any("seg-" in line for line in lines), out.stderr
    assert redis_url.split("@")[0].split(":")[-1] not in out.stderr, "the CF password leaked into an error"
