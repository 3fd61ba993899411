"""Publish and subscribe through failures, on real processes: two `sqm run` members, clients on real sockets, a
member killed with SIGKILL, the CF (a redis-server) killed and the structure restored from a fuzzy backup and the
members' logs. Every durable subscriber receives every publication committed after it subscribed exactly once, in
commit order, whole (on either member, online or back after a while offline); a non-durable subscription does not
survive its member's restart nor the CF's loss; publications leave the CF once every subscriber has committed them."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from cfemu.errors import BackedOutError, MQError, NoMessageError, UnknownObjectError
from sqm.service.client import Client
from tests.support.service_proc import TOKEN, ServerProc, start_server

S, T, EPHEMERAL = "APP1", "NEWS", "CHAT"
LEASE = "1000"


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    last: MQError | None = None
    while True:
        try:
            value = check()
        except MQError as e:
            value, last = None, e
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last: {last or value!r})")
        time.sleep(0.1)


class Group:
    def __init__(self, url: str, root: Path) -> None:
        self.url, self.root = url, root
        self.members: dict[str, ServerProc] = {}

    def start(self, name: str) -> ServerProc:
        self.members[name] = start_server(self.url, self.root, name, "--token", TOKEN, "--lease-ms", LEASE)
        return self.members[name]

    def client(self, name: str) -> Client:
        return Client(self.members[name].endpoint, token=TOKEN)

    def stop_all(self) -> None:
        for m in self.members.values():
            m.stop(signal.SIGKILL if m.proc.poll() is None else signal.SIGTERM)


@pytest.fixture
def group(fresh_redis: Any, tmp_path: Path) -> Iterator[Group]:
    admin = Admin(connect(fresh_redis.url))
    admin.define_structure(S, recauto=False)  # the test restores it itself, at a known moment
    admin.define_queue(T, S, topic={})
    admin.define_queue(EPHEMERAL, S, topic={"durable": False, "persistent": False})
    g = Group(fresh_redis.url, tmp_path)
    g.start("QM1")
    g.start("QM2")
    yield g
    g.stop_all()


def publish(c: Client, topic: str, label: str, parts: int = 2) -> list[bytes]:
    bodies = [f"{label}/{i}".encode() for i in range(parts)]
    for body in bodies:
        c.publish(topic, body)
    c.pub_commit()
    return bodies


def receive_all(c: Client, topic: str, name: str) -> list[list[bytes]]:
    got = []
    while True:
        try:
            got.append(c.receive_pub(topic, name, wait_ms=300)["messages"])
        except NoMessageError:
            return got
        c.pub_commit()


def pub_entries(url: str) -> int:
    return len(connect(url).keys(f"{{{S}}}:ix:{T}.PUB:c:*"))  # one index set per publication on the CF


def test_every_durable_subscriber_once_across_a_member_kill_with_one_offline(group: Group, fresh_redis: Any) -> None:
    c1, c2 = group.client("QM1"), group.client("QM2")
    c1.subscribe(T, "s1")
    c2.subscribe(T, "s2")
    c2.subscribe(T, "offline")  # receives nothing until the end
    c1.subscribe(EPHEMERAL, "temp")
    published = [publish(c1 if i % 2 else c2, T, f"p{i}") for i in range(6)]
    publish(c1, EPHEMERAL, "e0")
    s1: list[list[bytes]] = []
    for _ in range(3):
        s1.append(c1.receive_pub(T, "s1")["messages"])
        c1.pub_commit()
    assert c1.receive_pub(T, "s1")["messages"] == published[3]  # received, not committed: the member dies
    assert not c2.publish(T, b"never")["committed"]  # open on QM2 while QM1 dies: never seen, then dropped
    group.members["QM1"].proc.send_signal(signal.SIGKILL)
    group.members["QM1"].proc.wait()
    with pytest.raises(BackedOutError):
        c1.pub_commit()
    wait_for("QM2 recovered QM1", lambda: "QM1" not in Admin(connect(fresh_redis.url)).members())
    c2.pub_backout()  # the open publication is dropped, whole
    published += [publish(c2, T, f"p{i}") for i in range(6, 9)]
    group.start("QM1")
    c1 = group.client("QM1")
    s1 += receive_all(c1, T, "s1")  # p3 again (it was never committed), then the rest
    s2 = receive_all(c2, T, "s2")
    assert s1 == published and s2 == published
    wait_for("temp dropped", lambda: not c2.subscriptions(EPHEMERAL))  # it ended with its member's incarnation
    with pytest.raises(UnknownObjectError):
        c1.receive_pub(EPHEMERAL, "temp")
    assert pub_entries(fresh_redis.url) == len(published)  # kept for the one still offline
    offline = group.client("QM1")
    assert receive_all(offline, T, "offline") == published  # back after a while, on the other member
    wait_for("every publication removed once all committed", lambda: pub_entries(fresh_redis.url) == 0)


def test_every_durable_subscriber_once_across_a_cf_loss_with_restore(group: Group, fresh_redis: Any,
                                                                     tmp_path: Path) -> None:
    from backup.run import run_backup
    from restore.run import run_restore

    c1, c2 = group.client("QM1"), group.client("QM2")
    for c, name in ((c1, "s1"), (c2, "s2")):
        c.subscribe(T, name)
    c2.subscribe(EPHEMERAL, "temp")
    published = [publish(c1, T, f"p{i}") for i in range(3)]
    s1 = [c1.receive_pub(T, "s1")["messages"]]
    c1.pub_commit()
    run_backup(connect(fresh_redis.url), S, tmp_path / "backups", log_root=tmp_path / "logs")  # fuzzy: work goes on
    published += [publish(c2, T, f"p{i}") for i in range(3, 6)]
    s1.append(c1.receive_pub(T, "s1")["messages"])
    c1.pub_commit()  # after the backup: in the logs only
    s2 = [c2.receive_pub(T, "s2")["messages"]]
    c2.pub_commit()
    assert c2.receive_pub(T, "s2")["messages"] == published[1]  # in flight when the CF goes
    fresh_redis.kill()
    fresh_redis.start()
    run_restore(connect(fresh_redis.url), S, backup_root=tmp_path / "backups", log_root=tmp_path / "logs")
    wait_for("members back on the restored CF",
             lambda: {"QM1", "QM2"} <= set(Admin(connect(fresh_redis.url)).members()))
    with pytest.raises(MQError):
        c2.pub_commit()  # its position's change was lost with the CF: received again
    c1, c2 = group.client("QM1"), group.client("QM2")
    wait_for("QM1 serves the restored structure", lambda: c1.subscriptions(T))
    published += [publish(c1, T, f"p{i}") for i in range(6, 8)]
    s1 += receive_all(c1, T, "s1")
    s2 += receive_all(c2, T, "s2")
    assert s1 == published and s2 == published
    assert c2.subscriptions(EPHEMERAL) == []  # non-persistent: gone with the CF
    wait_for("every publication removed once all committed", lambda: pub_entries(fresh_redis.url) == 0)
