"""The kombu transport (qsg.kombu_transport) against a real local group: kombu's own integration mixins, from the
sdist of the installed kombu downloaded at test time (tests/support/kombu_sdist.py), as kombu runs them against
its own transports (t/integration/test_redis.py, test_pgmq.py), then what the mixins do not check: a consumer
that dies unacknowledged (its message comes back), a member killed under a consumer, the envelope round trip.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

kombu = pytest.importorskip("kombu")

from kombu.exceptions import ChannelError  # noqa: E402

import qsg.kombu_transport as kt  # noqa: E402
from cfemu.errors import BackedOutError, NoMessageError, UnknownObjectError  # noqa: E402
from cfemu.procs import free_port  # noqa: E402
from qsg.local_group import LocalGroup  # noqa: E402
from sqm.service.client import Client  # noqa: E402
from tests.support import kombu_sdist  # noqa: E402

pytestmark = pytest.mark.slow

try:
    common: Any = kombu_sdist.integration_common()
    MIXIN_QUEUES = kombu_sdist.queue_names(common)
    DOWNLOAD_PROBLEM = ""
except Exception as e:  # one failing test says why, rather than a collection error that stops the whole run
    common = kombu_sdist.missing_mixins()
    MIXIN_QUEUES, DOWNLOAD_PROBLEM = [], str(e)


def test_kombu_integration_mixins_were_downloaded() -> None:
    assert not DOWNLOAD_PROBLEM, DOWNLOAD_PROBLEM
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGroup]:
    g = LocalGroup.up(tmp_path_factory.mktemp("kombu") / "g", managers=2, backup_interval=None, lease_ms=2000)
    try:
        yield g
    finally:
        g.down()


def members(g: LocalGroup) -> list[tuple[str, int]]:
    return [(h, p) for _, h, p in g.endpoints]


def options(g: LocalGroup, **extra: Any) -> dict[str, Any]:
    return {"operator_token": g.operator_token, "polling_interval": 0.05, **extra}


def _purge(g: LocalGroup, queues: list[str]) -> None:
    with Client(members(g), token=g.token, client_name="purge") as c:
        for q in queues:
            try:
                while c.get_batch(q, 1000, commit=True):
                    pass
            except UnknownObjectError:
                pass


@pytest.fixture
def connection(group: LocalGroup) -> Iterator[Any]:
    _purge(group, MIXIN_QUEUES)
    conn = kombu.Connection(kt.members_url(members(group), group.token or ""), transport_options=options(group))
    try:
        yield conn
    finally:
        conn.release()


@pytest.fixture
def invalid_connection(group: LocalGroup) -> Any:
    return kombu.Connection(f"cfemu://:{group.token}@127.0.0.1:{free_port('127.0.0.1')}/APP1",
                            transport_options={"reconnect_timeout": 0, "connect_timeout": 1})


@pytest.fixture
def failover_connection(group: LocalGroup) -> Iterator[Any]:
    """A dead member first, then a live one (kombu's failover list)."""
    _purge(group, MIXIN_QUEUES)
    _, host, port = group.endpoints[1]
    dead = f"cfemu://:{group.token}@127.0.0.1:{free_port('127.0.0.1')}/APP1"
    conn = kombu.Connection(f"{dead};cfemu://:{group.token}@{host}:{port}/APP1",
                            transport_options=options(group, reconnect_timeout=0), connect_timeout=1)
    try:
        yield conn
    finally:
        conn.release()


# --- kombu's integration mixins -----------------------------------------------------------------------------------
@pytest.mark.e2e
class TestCfemuBasicFunctionality(common.BasicFunctionality):
    pass


@pytest.mark.e2e
class TestCfemuBaseMessage(common.BaseMessage):
    pass


@pytest.mark.e2e
class TestCfemuBasePriority(common.BasePriority):
    PRIORITY_ORDER = "asc"  # MQ's: 9 is got first


@pytest.mark.e2e
class TestCfemuBaseExchangeTypes(common.BaseExchangeTypes):
    @pytest.mark.xfail(strict=True, raises=TimeoutError,
                       reason="no fanout: a fanout exchange needs a binding table shared by every process, which the "
                              "transport does not keep (docs/kombu.md); a fanout publish reaches no queue")
    def test_fanout(self, connection: Any) -> None:
        super().test_fanout(connection)


@pytest.mark.e2e
class TestCfemuBaseTimeToLive(common.BaseTimeToLive):
    pass


@pytest.mark.e2e
class TestCfemuBaseFailover(common.BaseFailover):
    pass


# --- what the mixins do not check ---------------------------------------------------------------------------------
CONSUMER = textwrap.dedent("""
    import os, sys, kombu
    import qsg.kombu_transport
    with kombu.Connection(sys.argv[1], transport_options={"polling_interval": 0.05}) as conn:
        with conn.SimpleQueue(sys.argv[2]) as q:
            m = q.get(timeout=10)
            print(m.payload["n"], flush=True)
            os.kill(os.getpid(), 9)   # dies holding the delivery, unacknowledged
""")


def test_a_consumer_that_dies_unacknowledged_leaves_its_message_to_the_next(group: LocalGroup) -> None:
    url = kt.members_url(members(group), group.token or "")
    with kombu.Connection(url, transport_options=options(group)) as conn, closing(conn.SimpleQueue("kdie")) as q:
        q.put({"n": 7})
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        r = subprocess.run([sys.executable, "-c", CONSUMER, url, "kdie"], capture_output=True, text=True,
                           timeout=60, env=env)
        assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
        assert r.stdout.strip() == "7"
        m = q.get(timeout=10)  # the member backed the dead consumer's unit of work out
        assert m.payload == {"n": 7}
        assert m.delivery_info["redelivered"] is True
        m.ack()
        with pytest.raises(q.Empty):
            q.get(timeout=0.3)


def test_ack_is_a_commit_and_an_unacknowledged_delivery_is_invisible_to_others(group: LocalGroup) -> None:
    url = kt.members_url(members(group), group.token or "")
    with kombu.Connection(url, transport_options=options(group)) as conn, closing(conn.SimpleQueue("kack")) as q:
        q.put(b"one", serializer=None, content_type="application/data", content_encoding="binary")
        m = q.get(timeout=5)
        assert m.body == b"one"
        with Client(members(group), token=group.token) as c:
            assert list(c.browse("kack")) == []  # held in the delivery's unit of work
            m.ack()
            with pytest.raises(NoMessageError):
                c.get("kack", syncpoint=False)
        q.put({"n": 2})
        q.get(timeout=5)  # never acknowledged: closing the channel backs it out
    with Client(members(group), token=group.token) as c:
        assert [x.priority for x in c.browse("kack")] == [0]


def test_the_envelope_and_the_mq_message(group: LocalGroup) -> None:
    """The body is the MQ message's body; priority and expiry are MQ's; kombu's envelope rides in a property."""
    url = kt.members_url(members(group), group.token or "")
    with kombu.Connection(url, transport_options=options(group)) as conn, closing(conn.SimpleQueue("kenv")) as q:
        q.put("héllo", serializer=None, content_type="text/plain", content_encoding="utf-8",
              headers={"h": [1, "x", {"y": None}]}, priority=12, expiration=60)
        with Client(members(group), token=group.token) as c:
            (mq,) = c.browse("kenv")
        assert mq.body == "héllo".encode() and mq.priority == 9 and mq.expiry > 0 and mq.persistent
        m = q.get(timeout=5)
        assert (m.payload, m.content_type, m.headers) == ("héllo", "text/plain", {"h": [1, "x", {"y": None}]})
        m.ack()


def test_a_member_killed_under_a_consumer_loses_nothing(tmp_path: Path) -> None:
    g = LocalGroup.up(tmp_path / "g", managers=2, backup_interval=None, lease_ms=2000)
    try:
        url = kt.members_url(members(g), g.token or "")
        with kombu.Connection(url, transport_options=options(g)) as conn, closing(conn.SimpleQueue("kfail")) as q:
            for n in range(10):
                q.put({"n": n})
            held = q.get(timeout=5)  # a unit of work open on QM1 (the first member named), with the prefetched
            g.kill_manager("QM1")
            got: list[int] = []
            backed_out = 0
            deadline = time.monotonic() + 60
            while len(got) < 10 and time.monotonic() < deadline:
                try:
                    m = q.get(timeout=1)
                except q.Empty:
                    continue
                try:
                    m.ack()
                except BackedOutError:  # prefetched from QM1 before it died: recovered, it comes back
                    backed_out += 1
                    continue
                got.append(m.payload["n"])
            with pytest.raises(BackedOutError):  # its unit of work was backed out by QM1's recovery
                held.ack()
        assert sorted(got) == list(range(10)), (got, backed_out)  # each acknowledged once, none lost
        assert backed_out >= 1
    finally:
        g.down()


def test_the_readme_kombu_example_runs_as_written(tmp_path: Path) -> None:
    """README's kombu section, run from the directory of a group started as ``cfemu cluster up`` starts one."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## kombu and Celery"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]
    g = LocalGroup.up(tmp_path / "var" / "cluster", managers=2, backup_interval=None)
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip() == "{'order': 1}"
    finally:
        g.down()


def test_a_bad_url_is_refused_naming_it_without_its_token() -> None:
    """A failover URL without a port is refused, the URL in the message with its token hidden: an application
    logs the exception it gets, and the service token must not land in its log."""
    url = "cfemu://:S3CRET-SERVICE-TOKEN@127.0.0.1:1;cfemu://:S3CRET-SERVICE-TOKEN@otherhost/APP1"
    with pytest.raises(ValueError, match=r"bad cfemu URL 'cfemu://:\*\*\*@otherhost/APP1'") as raised:
        kombu.Connection(url).connect()
    assert "S3CRET" not in str(raised.value)


@pytest.mark.parametrize("raw, body", [
    ("notjson", b"from an MQ app"),  # an MQ application's (a REST POST's header ibm-mq-usr-kombu: notjson)
    ("[1]", b"x"),
    ('{"properties": "x"}', b"x"),
    ('{"headers": [1], "text": false}', b"x"),
    ('{"properties": {"body_encoding": "base64"}}', b"not base64 at all!"),
    ('{"text": true}', b"\xff\xfe not UTF-8"),
], ids=["not-json", "a-list", "properties-text", "headers-list", "body-encoding", "text-not-utf8"])
def test_a_bad_envelope_is_delivered_without_it_and_said(group: LocalGroup, caplog: pytest.LogCaptureFixture,
                                                         raw: str, body: bytes) -> None:
    """Any application may put any user property: a ``kombu`` property that is not the envelope _put writes is
    delivered as a message without an envelope (a warning names the queue and the message), and the consumer
    goes on to the next message; it never raises out of a poll (a Celery worker died of it, at every restart)."""
    _purge(group, ["kbad"])
    url = kt.members_url(members(group), group.token or "")
    with kombu.Connection(url, transport_options=options(group)) as conn, closing(conn.SimpleQueue("kbad")) as q:
        with Client(members(group), token=group.token) as c:
            bad = c.put("kbad", body, syncpoint=False, properties={"kombu": raw})
        q.put({"n": 1})
        with caplog.at_level("WARNING", logger="qsg.kombu_transport"):
            m = q.get(timeout=5)
        assert (m.body, m.content_type, m.headers) == (body, None, {})
        assert m.payload == (body if body.startswith(b"\xff") else body.decode())  # bytes when not UTF-8
        assert f"message {bad.msgid.hex()} on kbad has a bad 'kombu' property" in caplog.text
        m.ack()
        assert q.get(timeout=5).payload == {"n": 1}


def test_a_poison_message_alone_on_its_queue_reaches_its_backout_queue(group: LocalGroup) -> None:
    """Requeued up to the queue's backout threshold, the message is moved to its backout queue by the next poll,
    and stays moved: the poll that moved it and then found nothing commits the move (backed out with its
    connection, the message went back to its queue at every poll, its backout count climbing for ever)."""
    with Client(members(group), token=group.operator_token, role="operator") as admin:
        for name, threshold, boq in (("kpoisbo", 0, ""), ("kpois", 3, "kpoisbo")):
            admin.define_queue(name, "APP1", backout_threshold=threshold, backout_queue=boq, replace=True)
    _purge(group, ["kpois", "kpoisbo"])
    url = kt.members_url(members(group), group.token or "")
    with kombu.Connection(url, transport_options=options(group)) as conn, closing(conn.SimpleQueue("kpois")) as q:
        q.put({"poison": 1})
        for _ in range(3):
            q.get(timeout=5).requeue()
        with pytest.raises(q.Empty):
            q.get(timeout=1)
        with Client(members(group), token=group.token) as c:
            assert list(c.browse("kpois")) == []
            (moved,) = c.browse("kpoisbo")
            assert (moved.body, moved.backout_count) == (b'{"poison": 1}', 3)


def test_a_prefetch_count_above_max_unacked_holds_max_unacked(group: LocalGroup) -> None:
    """Each unacknowledged delivery holds a connection to a member: a consumer's prefetch count never takes more
    than ``max_unacked`` of them (a prefetch of 200 held 127 connections, and the member's connection limit per
    address then refused every other application of the host)."""
    _purge(group, ["kpref"])
    url = kt.members_url(members(group), group.token or "")
    got: list[Any] = []
    with kombu.Connection(url, transport_options=options(group, max_unacked=3)) as conn:
        queue = kombu.Queue("kpref", routing_key="kpref")
        with conn.Producer() as producer:
            for n in range(8):
                producer.publish({"n": n}, routing_key="kpref", declare=[queue])
        with conn.Consumer(queue, callbacks=[lambda body, message: got.append(message)], prefetch_count=200):
            for _ in range(10):
                try:
                    conn.drain_events(timeout=0.3)
                except TimeoutError:
                    pass
            assert len(got) == 3 and len(conn.transport._held) == 3
            for m in got:
                m.ack()
            conn.drain_events(timeout=5)
            assert len(got) > 3


def test_gets_without_acks_stop_at_max_unacked_and_take_nothing_more(group: LocalGroup) -> None:
    """basic_get did not look at max_unacked: 127 gets without an ack held 127 connections, and the member's limit
    per address then refused every other application of the host. Past max_unacked a get is a ChannelError, before
    anything is taken; an ack makes room again."""
    _purge(group, ["kgets"])
    url = kt.members_url(members(group), group.token or "")
    with kombu.Connection(url, transport_options=options(group, max_unacked=3)) as conn:
        q = conn.SimpleQueue("kgets")
        for n in range(6):
            q.put({"n": n})
        held = [q.get_nowait() for _ in range(3)]
        with pytest.raises(ChannelError, match="3 deliveries not yet acknowledged.*max_unacked 3") as refused:
            q.get_nowait()
        assert "\n" not in str(refused.value)
        assert len(conn.transport._held) == 3 and q.qsize() == 3  # nothing more taken
        held[0].ack()
        assert q.get_nowait().payload == {"n": 3}
        q.close()


def test_a_publish_with_a_negative_expiration_is_refused_and_an_infinite_priority_is_the_highest(
        group: LocalGroup) -> None:
    """expiration=-5 returned as if published, and the message was gone before any get (RabbitMQ refuses it);
    priority=inf raised a bare OverflowError, not one of the transport's errors."""
    _purge(group, ["kexp"])
    url = kt.members_url(members(group), group.token or "")
    with kombu.Connection(url, transport_options=options(group)) as conn:
        q = conn.SimpleQueue("kexp")
        for bad in (-5, -0.5):  # seconds: kombu sends them as milliseconds
            with pytest.raises(ChannelError, match="is not a number of milliseconds of 0 or more"):
                q.put({"n": 0}, expiration=bad)
        assert q.qsize() == 0
        q.put({"n": 1}, priority=float("inf"))
        q.put({"n": 2}, priority=float("-inf"))
        with Client(members(group), token=group.token, client_name="check") as c:
            assert [m.priority for m in c.browse("kexp", 10)] == [9, 0]
        q.close()


def test_a_delivery_held_past_the_idle_timeout_stays_with_its_consumer(tmp_path: Path) -> None:
    """A consumer that works on a message longer than the member's idle timeout (a long Celery task, an ETA task)
    keeps it: the transport pings the held connection, which the member would close as idle, backing the delivery
    out to the next consumer while the first still works on it. And a held connection the ping finds lost (its
    member killed) makes the delivery's ack raise BackedOutError: the message is delivered again, never reported
    acknowledged by a commit on the connection the ping reconnected."""
    g = LocalGroup.up(tmp_path / "g", managers=2, backup_interval=None, lease_ms=2000,
                      manager_args=("--idle-timeout", "2"))
    try:
        url = kt.members_url(members(g), g.token or "")
        opts = options(g, keepalive_interval=0.5)
        with kombu.Connection(url, transport_options=opts) as a, kombu.Connection(url, transport_options=opts) as b, \
                closing(a.SimpleQueue("klong")) as qa, closing(b.SimpleQueue("klong")) as qb:
            qa.put({"task": "long"})
            m = qa.get(timeout=5)
            deadline = time.monotonic() + 5  # 2.5 idle timeouts
            while time.monotonic() < deadline:
                with pytest.raises(qb.Empty):
                    qb.get(timeout=0.5)
            m.ack()
            with pytest.raises(qb.Empty):
                qb.get(timeout=0.5)

            qa.put({"task": "lost"})
            m = qa.get(timeout=5)  # held on QM1, the first member named
            g.kill_manager("QM1")
            time.sleep(2)  # a ping or more: it reconnects to QM2, the unit of work gone with QM1 (recovered)
            with pytest.raises(BackedOutError):
                m.ack()
            again = qb.get(timeout=30)
            assert again.payload == {"task": "lost"} and again.delivery_info["redelivered"]
            again.ack()
    finally:
        g.down()


def test_an_ack_after_the_connection_closed_raises_a_connection_error(group: LocalGroup) -> None:
    """Closing a connection backs its deliveries out; an ack or a reject of one afterwards (Celery's consumer
    restarting while a late-acknowledged task still runs) raises one of the transport's connection errors, which
    Celery reports ("Couldn't ack"), and the message is delivered again."""
    _purge(group, ["kclosed"])
    url = kt.members_url(members(group), group.token or "")
    with kombu.Connection(url, transport_options=options(group)) as conn, closing(conn.SimpleQueue("kclosed")) as q:
        q.put({"n": 1})
        q.put({"n": 2})
    conn = kombu.Connection(url, transport_options=options(group))
    q = conn.SimpleQueue("kclosed")
    first, second = q.get(timeout=5), q.get(timeout=5)
    errors = conn.connection_errors
    conn.close()
    with pytest.raises(errors, match="channel was closed"):
        first.ack()
    with pytest.raises(errors, match="channel was closed"):
        second.reject()
    with kombu.Connection(url, transport_options=options(group)) as conn, closing(conn.SimpleQueue("kclosed")) as q:
        again = [q.get(timeout=5), q.get(timeout=5)]
        assert sorted(m.payload["n"] for m in again) == [1, 2]
        assert all(m.delivery_info["redelivered"] for m in again)
        for m in again:
            m.ack()


@pytest.mark.parametrize("option, value, said", [
    ("max_unacked", 0, "max_unacked=0: not a whole number of at least 1"),
    ("max_unacked", -1, "max_unacked=-1: not a whole number of at least 1"),
    ("max_unacked", "abc", "max_unacked='abc': not a whole number of at least 1"),
    ("max_unacked", 2.5, "max_unacked=2.5: not a whole number of at least 1"),
    ("size_limit", None, "size_limit=None: not a whole number of at least 1"),
    ("keepalive_interval", -1, "keepalive_interval=-1: not a number of seconds 0 or more"),
    ("polling_interval", "soon", "polling_interval='soon': not a number of seconds 0 or more"),
    ("request_timeout", 0, "request_timeout=0: not a number of seconds above 0"),
    ("connect_timeout", "x", "connect_timeout='x': not a number of seconds above 0"),
    ("reconnect_timeout", float("nan"), "reconnect_timeout=nan: not a number of seconds 0 or more"),
    ("keepalive_interval", 1e300, "keepalive_interval=1e+300: not a number of seconds 0 or more, at most 86400"),
    ("endpoints", 7, "endpoints=7: not a list of 'HOST:PORT'"),
    ("endpoints", ["nohost"], "endpoints: "),
    ("operator_token", 123, "operator_token: not text but int"),
    ("client_name", ["k"], "client_name: not text but list"),
])
def test_a_bad_transport_option_is_refused_naming_it(group: LocalGroup, option: str, value: Any, said: str) -> None:
    """Each transport option is checked when the connection is made: a bad one is one line naming the option and
    its value (max_unacked=0 received nothing, silently; max_unacked='abc' said only "invalid literal for int()")."""
    url = kt.members_url(members(group), group.token or "")
    conn = kombu.Connection(url, transport_options=options(group, **{option: value}))
    with pytest.raises(ValueError) as raised:
        conn.connect()
    assert f"cfemu: transport option {said}" in str(raised.value) and "\n" not in str(raised.value)
    conn.release()


def test_good_transport_options_given_as_text_are_taken(group: LocalGroup) -> None:
    url = kt.members_url(members(group), group.token or "")
    opts = options(group, max_unacked="2", size_limit="10", keepalive_interval="0", request_timeout="5",
                   endpoints=f"127.0.0.1:{members(group)[1][1]}")
    with kombu.Connection(url, transport_options=opts) as conn:
        t = conn.transport
        conn.connect()
        assert (t.max_unacked, t.size_limit, t.keepalive_interval) == (2, 10, 0.0)
        assert t._client_args["request_timeout"] == 5.0 and len(t._client_args["endpoints"]) == 2
