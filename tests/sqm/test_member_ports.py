"""A member's ports are had before it starts: one that cannot be had (taken by another process) stops `sqm run` as a
configuration error (exit 2, one line naming the option), before it joins the group or opens a log; and while a
member restarts, a connection to its port is refused (a client goes to another member) rather than held in a
backlog. A real `sqm run` against a real CF."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from tests.support.service_proc import TOKENS_ENV


@pytest.mark.parametrize("option", ["--port", "--metrics-port", "--rest-port"])
def test_a_port_that_cannot_be_had_stops_the_member_before_it_joins(redis_url: str, tmp_path: Path,
                                                                      option: str) -> None:
    """It joined the group, wrote its log and its repository entry, then failed to listen with exit 1: a member
    that never served was left listed in the group and in the log root."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        ports = {"--port": "0", "--metrics-port": "0", "--rest-port": "0", option: str(port)}
        done = subprocess.run([sys.executable, "-m", "sqm.cli", "run", "--name", "QM9", "--redis-url", redis_url,
                               "--log-root", str(tmp_path / "logs"), *[x for kv in ports.items() for x in kv]],
                              env={**os.environ, **TOKENS_ENV}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port} ({option}): Address already in use" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert "QM9" not in Admin(connect(redis_url)).members()
    assert not (tmp_path / "logs" / "QM9").exists()


def test_a_connection_to_a_member_still_starting_is_refused(redis_url: str, tmp_path: Path) -> None:
    """Its port is bound but not listening until it serves: a client's connect fails at once (and it tries another
    member), where a listening socket not yet accepting would have held it for the whole restart. The member is
    held in its start by a CF that does not answer yet (it waits for the CF)."""
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]
    silent = socket.create_server(("127.0.0.1", 0))  # a "CF" that accepts and never answers
    try:
        cf_port = silent.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "sqm.cli", "run", "--name", "QM8", "--redis-url",
                                 f"redis://127.0.0.1:{cf_port}/0", "--log-root", str(tmp_path / "logs"), "--port",
                                 str(port), "--metrics-port", "0", "--cf-wait", "30"],
                                env={**os.environ, **TOKENS_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 30
            while True:  # once it has bound its port, binding the same port fails
                try:
                    with socket.socket() as probe:
                        probe.bind(("127.0.0.1", port))
                except OSError:
                    break
                assert proc.poll() is None and time.monotonic() < deadline, "the member never bound its port"
                time.sleep(0.05)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
        finally:
            proc.kill()
            proc.wait()
    finally:
        silent.close()
