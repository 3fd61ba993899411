"""A member renews its lease from its join on, through restart recovery and its checkpoint (docs/invariants.md).

A member killed with SIGKILL while it held 50,000 messages on its queues and a unit of work in flight is restarted
once its peer has recovered it, on a machine kept busy by CPU burners, with a 1.5 s lease and a peer running. Its restart (reading the log,
backing out the unit of work, the start checkpoint with its relog pass of every live message) takes longer than
the lease; a member that renewed only once restart had finished was fenced by the peer right after it served.
It must stay up, unfenced, for seconds after it serves. Real `sqm run` processes, real signals."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.connection import connect
from sqm.service.client import Client
from tests.support.group import define_group
from tests.support.service_proc import TOKEN, ServerProc, start_server

MESSAGES = 50_000
LEASE = ("--lease-ms", "1500")


@contextmanager
def busy_machine(burners: int = 2) -> Iterator[None]:
    """CPU-burning processes for the duration, one a core of the machine the test ran on (2)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def fill(srv: ServerProc, n: int, clients: int = 2, per_uow: int = 500) -> None:
    """n persistent messages on Q1 through the member, in units of work of per_uow, from several clients."""
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            # A commit of per_uow messages may wait its turn for a long time on a loaded machine: not a lost link
            with Client(srv.endpoint, token=TOKEN, request_timeout=180.0) as c:
                for i in range(k, n, clients):
                    c.put("Q1", b"%07d" % i + b"." * 200)
                    if (i // clients + 1) % per_uow == 0:
                        c.commit()
                c.commit()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.e2e
@pytest.mark.slow
def test_a_slow_restart_on_a_busy_machine_keeps_its_lease(redis_url: str, tmp_path: Path) -> None:
    define_group(redis_url)
    admin = Admin(connect(redis_url))
    member = start_server(redis_url, tmp_path, "QM1", *LEASE)
    peer = start_server(redis_url, tmp_path, "QM2", *LEASE)
    try:
        t0 = time.monotonic()
        fill(member, MESSAGES)
        fill_s = time.monotonic() - t0
        assert CF(connect(redis_url)).structure("APP1").depths()["Q1"]["CP"] == MESSAGES
        inflight = Client(member.endpoint, token=TOKEN)  # a unit of work in flight at the kill: restart backs it out
        for i in range(2_000):
            inflight.put("Q2", b"in flight %d" % i)
        member.proc.send_signal(signal.SIGKILL)
        member.proc.wait()
        inflight.close()
        deadline = time.monotonic() + 120
        while "QM1" in admin.members():  # the peer recovers the dead incarnation (its in-flight work backed out)
            assert time.monotonic() < deadline, "the peer never recovered QM1"
            time.sleep(0.1)
        with busy_machine():
            t0 = time.monotonic()
            member = start_server(redis_url, tmp_path, "QM1", *LEASE, timeout=120)
            serving_s = time.monotonic() - t0
            epoch = admin.epoch("QM1")
            time.sleep(5.0)  # a lease lapsed during restart is recovered by the peer within a second or two
            alive = member.proc.poll() is None
            text = member.log_text()
        restarted = re.findall(r"QM1 restarted in ([0-9.]+)s", text)
        print(f"\nfill {MESSAGES} in {fill_s:.1f} s; restart {restarted[-1] if restarted else '?'} s, serving after "
              f"{serving_s:.1f} s on a busy machine")
        assert alive and admin.epoch("QM1") == epoch, f"QM1 was fenced after its restart:\n{text[-3000:]}"
        assert "fenced" not in text[text.rfind("restart: current status rebuild"):]
        with Client(member.endpoint, token=TOKEN) as c:  # it serves: the in-flight work was backed out
            assert c.get("Q1", syncpoint=False).body.startswith(b"0")
        assert CF(connect(redis_url)).structure("APP1").depths()["Q2"]["CP"] == 0
    finally:
        for srv in (member, peer):
            if srv.proc.poll() is None:
                srv.proc.kill()
                srv.proc.wait()
