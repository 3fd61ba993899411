"""A `sqm run` member killed (SIGKILL) by one of its failpoints (sqm.core.failpoints) in the middle of its work, and a
peer that recovers that work: the harness of the tests that hold what the clients were told against what the peer
leaves on the queue. The victim is QM1, the peer QM2, real processes on the test's CF, each with a lease of 1 s so
that the peer recovers the victim soon after its death; both are stopped at the end (the victim if it is alive)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqm.log import LogReader
from sqm.service.client import Client
from tests.support.group import define_group
from tests.support.service_proc import OP_TOKEN, ServerProc, start_server


@dataclass
class KilledMember:
    victim: ServerProc  # QM1, whose failpoint kills it
    peer: ServerProc  # QM2

    def run_clients(self, client: Callable[[ServerProc, int], None], count: int, *, join_timeout: float,
                    what: str) -> None:
        """``count`` threads each run ``client(victim, k)`` until the failpoint kills the victim under them; then
        the peer has recovered its work (``what`` is the failure's message if the victim was not killed)."""
        threads = [threading.Thread(target=client, args=(self.victim, k)) for k in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=join_timeout)
        self.recovered(timeout=30, what=what)

    def recovered(self, timeout: float = 10.0, what: str = "the member was not killed by its failpoint") -> None:
        """The victim died of SIGKILL (within ``timeout`` seconds), and the peer has recovered its work."""
        assert self.victim.proc.wait(timeout=timeout) == -signal.SIGKILL, what
        peer_recovered(self.peer)


def peer_recovered(srv: ServerProc, timeout: float = 30) -> None:
    """Wait until the member has recovered a peer (its operator status counts one peer recovery)."""
    deadline = time.monotonic() + timeout
    with Client(srv.endpoint, token=OP_TOKEN, role="operator") as op:
        while op.status()["peer_recoveries"] < 1:
            assert time.monotonic() < deadline, "no peer recovery"
            time.sleep(0.1)


@contextmanager
def killed_by_failpoint(redis_url: str, tmp_path: Path, queue: str, failpoint: str,
                        *victim_args: str) -> Iterator[KilledMember]:
    """A group with ``queue`` on its structure APP1, QM1 started with SQM_FAILPOINTS=``failpoint`` (and
    ``victim_args``) and its peer QM2."""
    define_group(redis_url, queues=(queue,))
    servers = [start_server(redis_url, tmp_path, "QM1", "--lease-ms", "1000", *victim_args,
                            env={"SQM_FAILPOINTS": failpoint})]
    try:
        servers.append(start_server(redis_url, tmp_path, "QM2", "--lease-ms", "1000"))
        yield KilledMember(*servers)
    finally:
        for srv in servers:
            if srv.proc.poll() is None:
                srv.stop()


@dataclass
class OnDisk:
    """A member's log as its disk holds it: the units of work of each message's put and get, those committed."""

    put_uow: dict[bytes, str]
    get_uow: dict[bytes, str]
    committed: set[str]

    @property
    def got(self) -> set[bytes]:
        """The messages a committed get took."""
        return {b for b, u in self.get_uow.items() if u in self.committed}

    def put_committed(self, body: bytes) -> bool:
        return self.put_uow.get(body, "") in self.committed

    def get_committed(self, body: bytes) -> bool:
        return self.get_uow.get(body, "") in self.committed


def log_on_disk(directory: Path) -> OnDisk:
    """The log of a member (its directory) as its disk holds it, read after the member died."""
    put_uow: dict[bytes, str] = {}
    entry_body: dict[str, bytes] = {}
    get_uow: dict[bytes, str] = {}
    committed: set[str] = set()
    for _, rec in LogReader(directory).records():
        if rec["k"] == "PUT":
            put_uow[bytes(rec["d"])] = rec["u"]
            entry_body[rec["e"]["id"]] = bytes(rec["d"])
        elif rec["k"] == "GET":
            get_uow[entry_body[rec["i"]]] = rec["u"]
        elif rec["k"] == "COMMIT":
            committed.add(rec["u"])
    return OnDisk(put_uow, get_uow, committed)
