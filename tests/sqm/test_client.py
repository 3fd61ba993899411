"""The client library end to end: several clients on several `sqm run` servers of one cluster, kill -9 of a
server with failover and peer recovery, and a commit whose outcome the client cannot know."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfemu.errors import BackedOutError, InDoubtError, NoMessageError, OutcomeUnknownError
from cfemu.procs import free_port
from qsg.local_group import LocalGroup
from sqm.service.client import Client, parse_endpoint
from sqm.service.protocol import QueueManagerUnavailableError
from tests.support.group import define_group
from tests.support.messages import drained
from tests.support.service_proc import TOKEN, start_server

LEASE_MS = 1000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGroup]:
    c = LocalGroup.up(tmp_path_factory.mktemp("cluster"), managers=3, backup_interval=None, lease_ms=LEASE_MS,
                      queues=("Q1", "Q2", "Q3"))
    yield c
    c.down()
    assert c.running_processes() == {}


def endpoints(cluster: LocalGroup, *names: str) -> list[str]:
    by_name = {n: f"{h}:{p}" for n, h, p in cluster.endpoints}
    return [by_name[n] for n in names]


def test_parse_endpoint() -> None:
    assert parse_endpoint("127.0.0.1:7001") == ("127.0.0.1", 7001)
    assert parse_endpoint(("h", 1)) == ("h", 1)
    for bad in ("nohost", "h:port", ":1", "h:70000"):
        with pytest.raises(ValueError, match="bad endpoint"):
            parse_endpoint(bad)


def test_several_clients_on_several_servers(cluster: LocalGroup) -> None:
    names = cluster.names
    producers = [Client(endpoints(cluster, names[i % 3]), token=cluster.token) for i in range(6)]
    errors: list[BaseException] = []

    def produce(i: int, c: Client) -> None:
        try:
            for j in range(0, 30, 3):
                with c.unit_of_work():
                    for k in range(3):
                        c.put("Q1", f"p{i}-{j + k}".encode())
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(i, c)) for i, c in enumerate(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert {p.qmgr for p in producers} == set(names)
    got: list[bytes] = []
    for name in names:  # consumers on every server: each message exactly once
        with Client(endpoints(cluster, name), token=cluster.token) as consumer:
            for _ in range(20):
                got.append(consumer.get("Q1").body)
            consumer.commit()
    with Client(endpoints(cluster, names[0]), token=cluster.token) as c:
        got += drained(c, "Q1")
    assert sorted(got) == sorted(f"p{i}-{j}".encode() for i in range(6) for j in range(30))
    for p in producers:
        p.close()


def test_unit_of_work_backs_out_on_an_exception(cluster: LocalGroup) -> None:
    with Client(endpoints(cluster, "QM1"), token=cluster.token) as a, Client(endpoints(cluster, "QM2"), token=cluster.token) as b:
        with pytest.raises(RuntimeError), a.unit_of_work():
            a.put("Q2", b"never")
            raise RuntimeError("application failure")
        assert not a.uow_open
        with pytest.raises(NoMessageError):
            b.get("Q2")
        b.commit()


def test_kill_9_of_a_server_fails_clients_over_and_peer_recovery_releases_its_messages(cluster: LocalGroup) -> None:
    with Client(endpoints(cluster, "QM1"), token=cluster.token) as setup:
        setup.put("Q3", b"held by the victim", syncpoint=False)
    victim = Client(endpoints(cluster, "QM2", "QM3"), token=cluster.token)
    bystander = Client(endpoints(cluster, "QM2", "QM3"), token=cluster.token)
    assert victim.qmgr == bystander.qmgr == "QM2"
    held = victim.get("Q3")  # in an open UOW on QM2
    assert held.body == b"held by the victim" and victim.uow_open
    killed_at = time.monotonic()
    cluster.kill_manager("QM2", signal.SIGKILL)

    # The client with the open UOW is told it was backed out, then carries on on QM3.
    with pytest.raises(BackedOutError):
        victim.commit()
    assert victim.ping()["qmgr"] == "QM3"
    # A client with no UOW at stake fails over without noticing.
    bystander.put("Q3", b"after failover", syncpoint=False)
    assert bystander.qmgr == "QM3"

    # Peer recovery (QM1 or QM3) backs out the dead member's UOW once its lease lapses: the message is back.
    with Client(endpoints(cluster, "QM1"), token=cluster.token) as c:
        m = c.get("Q3", msgid=held.msgid, wait_ms=20_000)
        released_after = time.monotonic() - killed_at
        assert (m.body, m.backout_count) == (b"held by the victim", 1)
        assert released_after < 20
        c.commit()
        assert drained(c, "Q3") == [b"after failover"]
    victim.close()
    bystander.close()

    cluster.restart_manager("QM2")
    with Client(endpoints(cluster, "QM2"), token=cluster.token) as again:
        assert again.qmgr == "QM2"
        again.put("Q3", b"QM2 is back", syncpoint=False)
        assert again.get("Q3", syncpoint=False).body == b"QM2 is back"


def test_connection_lost_during_commit_is_outcome_unknown(redis_url: str, tmp_path: Path) -> None:
    """The server dies after logging the commit and before telling the client: the client must not guess.
    Restart recovery then completes the in-commit UOW, so here the truth was 'committed'."""
    define_group(redis_url)
    srv = start_server(redis_url, tmp_path, "QM5", env={"SQM_FAILPOINTS": "after-log-force"})
    c = Client(srv.endpoint, token=TOKEN, reconnect_timeout=2)
    c.put("Q1", b"committed or not?")
    with pytest.raises(OutcomeUnknownError) as e:
        c.commit()
    assert e.value.reason == 2009
    assert srv.proc.wait(timeout=10) == -signal.SIGKILL
    c.close()
    again = start_server(redis_url, tmp_path, "QM5")
    try:
        with Client(again.endpoint, token=TOKEN) as c2:
            assert c2.get("Q1").body == b"committed or not?"
            c2.commit()
    finally:
        assert again.stop() == 0


def test_no_server_answers(tmp_path: Path) -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(QueueManagerUnavailableError, match=f"127.0.0.1:{port}"):
        Client(f"127.0.0.1:{port}", reconnect_timeout=0.5)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("asked", ["commit", "backout"])
def test_a_client_that_commits_or_backs_out_after_its_prepare_hears_the_unit_of_work_is_in_doubt(
        redis_url: str, tmp_path: Path, asked: str) -> None:
    """Through a real server (its batched syncpoint calls): the application's commit or backout after its prepare
    is refused, MQRC_UOW_IN_DOUBT, not answered as done; the coordinator's resolve then commits the work."""
    define_group(redis_url)
    srv = start_server(redis_url, tmp_path, "QM6")
    try:
        with Client(srv.endpoint, token=TOKEN) as c:
            c.put("Q1", b"prepared")
            uow = c.prepare("xid-client")
            with pytest.raises(InDoubtError, match=f"{uow} is prepared"):
                getattr(c, asked)()
            c.resolve(uow, True, xid="xid-client")
            c.commit()  # resolved: nothing in doubt, nothing open
            assert c.get("Q1", syncpoint=False).body == b"prepared"
    finally:
        assert srv.stop() == 0
