"""`cfemu topic|sub|publish` (docs/pubsub.md): defining and listing topics, subscriptions and a publication through
a real `sqm run`'s service, every command with --json and with tables, one-line errors; `cfemu` subprocesses, a real
CF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.pubsub import pubsub as ps
from sqm.service.client import Client
from tests.qsg.test_cli import ok, run
from tests.support.group import start_qm
from tests.support.service_proc import TOKEN, start_server


def fails(*args: str) -> str:
    r = run("cfemu", *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, (r.returncode, r.stdout, r.stderr)
    return r.stderr


@pytest.mark.slow
def test_topics_subscriptions_and_a_publication(redis_url: str, tmp_path: Path) -> None:
    where = ["--redis-url", redis_url, "--log-root", str(tmp_path / "logs")]
    ok("cfemu", "define", "structure", "APP1", *where)
    assert "lifetime_s" in fails("topic", "define", "NEWS", "--structure", "APP1", "--lifetime", "0", *where)
    assert "--structure" in fails("topic", "define", "NEWS", *where)
    assert Admin(connect(redis_url)).queues() == []  # a refused define defines nothing
    d = json.loads(ok("cfemu", "topic", "define", "NEWS", "--structure", "APP1", "--lifetime", "600",
                      "--subscription-expiration", "3600", "--json", *where))
    assert d["persistent"] and d["durable"] and d["lifetime_s"] == 600
    assert d["companions"] == ["NEWS.PUB", "NEWS.SUB"]
    assert "topic CHAT defined" in ok("cfemu", "topic", "define", "CHAT", "--structure", "APP1", "--no-durable",
                                      "--no-persistent", *where)
    srv = start_server(redis_url, tmp_path, "QM1", "--token", TOKEN, env={"SQM_OPERATOR_TOKEN": "op-tok"})
    try:
        server = ["--server", srv.endpoint, "--token", "op-tok"]
        assert "--server" in fails("sub", "add", "NEWS", "alice", *where)
        assert "does not allow durable" in fails("sub", "add", "CHAT", "bob", "--durable", *server)
        s = json.loads(ok("cfemu", "sub", "add", "NEWS", "alice", "--json", *server))
        assert s["name"] == "alice" and s["durable"]
        assert "bob subscribed to NEWS (durable" in ok("cfemu", "sub", "add", "NEWS", "bob", *server)
        p = json.loads(ok("cfemu", "publish", "NEWS", "one", "two", "--json", *server))
        assert p["messages"] == 2 and p["committed"]
        with Client(srv.endpoint, token=TOKEN) as c:
            got = c.receive_pub("NEWS", "alice")
            assert got["messages"] == [b"one", b"two"] and got["pub"] == p["pub"]
            c.pub_commit()
        listed = json.loads(ok("cfemu", "sub", "list", "NEWS", "--json", *server))["subscriptions"]
        assert {x["name"]: x["received"] for x in listed} == {"alice": 1, "bob": 0}
        assert "alice" in ok("cfemu", "sub", "list", "NEWS", *server)
        topics = {t["topic"]: t for t in json.loads(ok("cfemu", "topic", "list", "--json", *where))["topics"]}
        assert topics["NEWS"]["subscriptions"] == 2 and topics["NEWS"]["publication_messages"] == 2
        assert topics["CHAT"]["durable"] is False
        assert "NEWS" in ok("cfemu", "topic", "list", *where)
        assert "unsubscribed" in ok("cfemu", "sub", "remove", "NEWS", "bob", *server)
        assert "no subscription bob" in fails("sub", "remove", "NEWS", "bob", *server)
        assert "not a topic" in fails("publish", "NEWS.PUB", "x", *server)
        with Client(srv.endpoint, token=TOKEN) as carol:  # a logged-on owner's, whose token the operator lacks
            carol.logon("carol", "her-secret")
            carol.subscribe("NEWS", "inbox")
        [row] = [x for x in json.loads(ok("cfemu", "sub", "list", "NEWS", "--json", *server))["subscriptions"]
                 if x["user"] == "carol"]
        assert "give it to 'sub remove TOPIC' without NAME" in fails("sub", "remove", "NEWS", "inbox", "--id",
                                                                     row["id"], *server)
        assert "inbox unsubscribed" in ok("cfemu", "sub", "remove", "NEWS", "--id", row["id"], *server)
        assert "carol" not in ok("cfemu", "sub", "list", "NEWS", *server)
    finally:
        assert srv.stop() == 0, srv.log_text()


def test_topic_list_counts_a_backlog_without_reading_it(redis_url: str, tmp_path: Path) -> None:
    """`cfemu topic list` is what an operator watches when a slow subscriber's backlog grows: it counts the
    publication messages from the CF's lists, never their data, and counts every one however many there are."""
    where = ["--redis-url", redis_url, "--log-root", str(tmp_path / "logs")]
    admin = Admin(connect(redis_url))
    admin.ensure_structure("APP1")
    admin.define_queue("BIG", "APP1", topic={})
    qm = start_qm(redis_url, tmp_path / "logs", "QM1", background=False)
    try:
        ps.subscribe(qm, "BIG", "slow")  # never receives: the backlog stays
        for _ in range(3):
            ps.publish(qm, "BIG", [b"x" * (4 * 2**20 - 1024)])
    finally:
        qm.stop()
    before = int(connect(redis_url).info("stats")["total_net_output_bytes"])
    topics = {t["topic"]: t for t in json.loads(ok("cfemu", "topic", "list", "--json", *where))["topics"]}
    sent = int(connect(redis_url).info("stats")["total_net_output_bytes"]) - before
    assert topics["BIG"]["publication_messages"] == 3 and topics["BIG"]["subscriptions"] == 1
    assert sent < 2**20, f"topic list made the CF send {sent} bytes for a backlog of 12 MiB"
