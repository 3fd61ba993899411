"""A real `sqm run` process whose log reaches its file size limit (EFBIG, as ENOSPC) while 8 clients put
persistent messages outside syncpoint. A group commit's write that fails part way leaves some COMMITs whole on disk
and tells all their puts 2102 "persistent work is refused"; killed and restarted with room, the member redoes the
whole COMMITs: messages reported refused are delivered (a phantom, docs/chaos.md: "its put was backed out or
failed"). The outcome of a commit whose force failed is unknown, not refused."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from cfemu.errors import LogFailedError, OutcomeUnknownError
from sqm.service.client import Client
from tests.sqm.test_log_failure import start_member
from tests.support.group import define_group
from tests.support.service_proc import TOKEN

SIZE = 30_000


def queue_ids(port: int) -> set[int]:
    with Client(("127.0.0.1", port), token=TOKEN, reconnect_timeout=1.0) as c:
        return {int(m.body[:6]) for m in c.browse("Q1", limit=10_000)}


@pytest.mark.slow
def test_a_put_refused_because_the_log_failed_is_never_delivered(redis_url: str, tmp_path: Path) -> None:
    logs, ready = tmp_path / "logs", tmp_path / "QM2.ready"
    define_group(redis_url, queues=("Q1",))
    proc = start_member(redis_url, logs, ready, limited=True)  # files up to 256 KiB
    refused: list[int] = []
    try:
        port = json.loads(ready.read_text())["port"]

        def putter(t: int) -> None:
            with Client(("127.0.0.1", port), token=TOKEN, reconnect_timeout=1.0) as c:
                for i in range(1000):
                    n = t * 1000 + i
                    try:
                        c.put("Q1", b"%06d" % n + b"x" * SIZE, syncpoint=False)
                    except LogFailedError:
                        refused.append(n)
                        return
                    except OutcomeUnknownError:  # its COMMIT may be on disk: not refused; the next put is
                        continue
        threads = [threading.Thread(target=putter, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert refused
        assert not set(refused) & queue_ids(port)
        proc.kill()  # the operator stops it, frees the disk and starts it again
        proc.wait(30)
        time.sleep(1.5)  # its lease lapses
        proc = start_member(redis_url, logs, ready, limited=False)
        delivered = set(refused) & queue_ids(json.loads(ready.read_text())["port"])
        assert not delivered, f"puts told 2102 'persistent work is refused', delivered after the restart: " \
                              f"{sorted(delivered)} of {sorted(refused)}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
