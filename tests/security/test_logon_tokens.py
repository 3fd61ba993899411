"""One user cannot read or act as another: a second application with the same application token (the service
authenticates applications, not users) reads no other user's logon token, status or unit of work, and touches no
other user's unit of work, status or subscription (docs/security.md, "Logon tokens and other users' work").

Two `sqm run` members of one group on the session's redis-server. The victim (alice) logs on with a token; the
attacker is another client of the same application token that first looks for her token wherever a client can see
one (a browse of every companion queue of the service and of the topic), then logs on as her with every token it
found and a guess, and as itself, and tries each operation. The owner with her token, and an operator, still can.
"""

from __future__ import annotations

import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cfemu.errors import (
    BadRequestError,
    MQError,
    NoMessageError,
    UnknownObjectError,
    UnknownUowError,
    UowStatusError,
)
from qsg.chaos.faults.clients import tokens_in_clear
from sqm.core import logon_token
from sqm.service.client import Client
from sqm.service.protocol import NotAuthorizedError
from tests.support.service_proc import (
    OP_TOKEN,
    TOKEN,
    ServerProc,
    fresh_group,
    logged_on,
    serving_pair,
)

SVC, TOPIC = "SVC", "NEWS"
COMPANIONS = (f"{SVC}.UOWDATA", f"{SVC}.UOWCTL", f"{TOPIC}.PUB", f"{TOPIC}.SUB")


@pytest.fixture(scope="module")
def servers(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, ServerProc]]:
    admin = fresh_group(redis_server)
    admin.define_queue(SVC, "APP1", uow={"status_lifetime": 2})
    admin.define_queue(TOPIC, "APP1", topic={})
    with serving_pair(redis_server.url, tmp_path_factory.mktemp("tokens")) as pair:
        yield pair


def user_token() -> str:
    return f"tk-{secrets.token_hex(10)}"  # unique: found nowhere unless this test's user put it there


def operator(srv: ServerProc) -> Client:
    return Client(srv.endpoint, token=OP_TOKEN, role="operator")


def stolen_tokens(srv: ServerProc) -> list[str]:
    """Every logon token an application finds by browsing the companion queues."""
    found: list[str] = []
    with Client(srv.endpoint, token=TOKEN) as spy:
        for queue in COMPANIONS:
            try:
                messages = spy.browse(queue, 1000)
            except NotAuthorizedError:
                continue
            found += tokens_in_clear(messages)
    return found


def attackers(srv: ServerProc, user: str) -> Iterator[Client]:
    """Clients of the same application token logged on as ``user`` with every token found or guessed, and as
    another user of their own."""
    for token in dict.fromkeys([*stolen_tokens(srv), "guess", ""]):
        c = Client(srv.endpoint, token=TOKEN)
        try:
            c.logon(user, token)
        except BadRequestError:  # not a token a logon takes (a stored form is longer than any)
            c.close()
            continue
        yield c
    yield logged_on(srv, f"mallory-{secrets.token_hex(3)}", user_token())


def sent_uow(srv: ServerProc, user: str, token: str, body: bytes = b"her order") -> str:
    with logged_on(srv, user, token) as c:
        return str(c.send(SVC, body, commit=True)["uow"])


def processed_uow(srv: ServerProc, user: str, token: str) -> str:
    """A UOW of ``user`` received and committed by a service: PROCESSED, its status kept."""
    uow = sent_uow(srv, user, token)
    with logged_on(srv, "server", "server-token") as s:
        while True:
            got = s.receive(SVC, option="SYNC", wait_ms=5000)
            s.syncpoint("COMMIT")
            if got["uow"] == uow:
                return uow


def cf_values(redis_server: Any) -> bytes:
    """Every key and value of the CF, as one byte string."""
    r = redis_server.client()
    out = bytearray()
    try:
        for key in r.scan_iter(count=1000):
            kind = r.type(key)
            out += key
            if kind == b"string":
                out += r.get(key) or b""
            elif kind == b"hash":
                for k, v in r.hgetall(key).items():
                    out += k + v
            elif kind == b"list":
                out += b"".join(r.lrange(key, 0, -1))
            elif kind == b"set":
                out += b"".join(r.smembers(key))
            elif kind == b"zset":
                out += b"".join(r.zrange(key, 0, -1))
            elif kind == b"stream":
                out += repr(r.xrange(key)).encode()
    finally:
        r.close()
    return bytes(out)


def files_under(*roots: Path) -> Iterator[tuple[Path, bytes]]:
    for root in roots:
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            if path.is_file() and path.name != logon_token.KEY_FILE:
                yield path, path.read_bytes()


# --- not readable -----------------------------------------------------------------------------------------------
def test_no_companion_queue_can_be_browsed_by_an_application(servers: Any) -> None:
    """Her token, her status and her messages were one browse away: every companion queue of a service and of a
    topic is refused to an application, whoever it logs on as; an operator browses them."""
    qm1, qm2 = servers
    token = user_token()
    uow = sent_uow(qm1, "alice", token, b"alice's secret order")
    with logged_on(qm1, "alice", token) as a:
        a.subscribe(TOPIC, "alice-news")
    for srv in (qm1, qm2):
        for c in (Client(srv.endpoint, token=TOKEN), logged_on(srv, "mallory", user_token())):
            with c:
                for queue in COMPANIONS:
                    with pytest.raises(NotAuthorizedError, match="holds the state of"):
                        c.browse(queue)
    assert stolen_tokens(qm1) == stolen_tokens(qm2) == []
    with operator(qm2) as op:
        assert bytes.fromhex(uow) in {m.correlid for m in op.browse(f"{SVC}.UOWDATA", 1000)}
        assert any(m.msgid == bytes.fromhex(uow) for m in op.browse(f"{SVC}.UOWCTL", 1000))
        assert op.browse(f"{TOPIC}.SUB", 1000)


def test_her_token_is_nowhere_in_the_cf(servers: Any, redis_server: Any) -> None:
    """The CF (every key and value, as a holder of a CF password sees them) holds neither her token nor the group's
    logon key: her control entry, her LAST pointer, a receiver's token and her subscription hold its keyed hash."""
    qm1, qm2 = servers
    token, server_token = user_token(), user_token()
    uow = sent_uow(qm1, "alice", token)
    with logged_on(qm2, "receiver", server_token) as s:  # a receiver's token is kept on her control too
        while s.receive(SVC, option="SYNC", wait_ms=5000)["uow"] != uow:
            s.syncpoint("COMMIT")
        s.syncpoint("SETUSTATUS", uow, user_status=b"being worked on")
        with logged_on(qm1, "alice", token) as a:
            a.subscribe(TOPIC, "alice-news")
            assert a.syncpoint("LAST")["uow"] == uow
            blob = cf_values(redis_server)
        s.syncpoint("BACKOUT")
    assert uow.encode() in blob  # the scan does see her entries
    assert token.encode() not in blob and server_token.encode() not in blob
    key = logon_token.group_key(qm1.log_root)
    assert key not in blob and key.hex().encode() not in blob


def test_her_token_is_not_in_any_log_record_nor_the_members_output(servers: Any) -> None:
    """Her control entries and her subscription are logged (persistent): the members' log records, the group
    repository and the members' own output hold no token."""
    qm1, qm2 = servers
    token = user_token()
    uow = processed_uow(qm1, "alice", token)
    with logged_on(qm2, "alice", token) as a:
        a.subscribe(TOPIC, "alice-log")
        assert a.syncpoint("QUERY", uow)["status"] == "PROCESSED"
    seen = list(files_under(qm1.log_root, qm1.stderr, qm2.stderr))
    assert any(bytes.fromhex(uow) in data or uow.encode() in data for _, data in seen)  # her UOW's records are
    assert [str(p) for p, data in seen if token.encode() in data] == []


def test_her_messages_are_not_readable(servers: Any) -> None:
    """Her UOW's messages are on the service's data queue and her publications on the topic's: no application
    browses or gets them there (a service's receiver gets them by receiving, as a service does)."""
    qm1, _ = servers
    token = user_token()
    body = f"alice's body {secrets.token_hex(6)}".encode()
    sent_uow(qm1, "alice", token, body)
    with logged_on(qm1, "alice", token) as a:
        a.publish(TOPIC, body, commit=True)
    for c in attackers(qm1, "alice"):
        with c:
            for queue in COMPANIONS:
                with pytest.raises(NotAuthorizedError):
                    c.browse(queue, 1000)
                with pytest.raises(NotAuthorizedError):
                    c.get(queue, syncpoint=False)


def test_her_status_is_not_readable(servers: Any) -> None:
    """SYNCPOINT LAST finds her last UOW by her user id and token: no other token finds it, and her control entry
    cannot be browsed."""
    qm1, qm2 = servers
    token = user_token()
    uow = sent_uow(qm1, "alice-st", token)
    for c in attackers(qm2, "alice-st"):
        with c:
            with pytest.raises(UnknownUowError):
                c.syncpoint("LAST")
            with pytest.raises(NotAuthorizedError):
                c.browse(f"{SVC}.UOWCTL", 1000)
    with logged_on(qm2, "alice-st", token) as a:
        assert a.syncpoint("LAST")["uow"] == uow


# --- not touchable: one test per operation --------------------------------------------------------------------
def test_no_one_else_cancels_her_uow(servers: Any) -> None:
    qm1, qm2 = servers
    token = user_token()
    uow = sent_uow(qm1, "alice-c", token)
    for c in attackers(qm2, "alice-c"):
        with c:
            with pytest.raises(UowStatusError, match="only its sender may CANCEL"):
                c.syncpoint("CANCEL", uow)
    with logged_on(qm1, "alice-c", token) as a:
        assert a.syncpoint("QUERY", uow)["status"] == "ACCEPTED"
        assert a.syncpoint("CANCEL", uow)["status"] == "CANCELLED"  # she still can


def test_no_one_else_backs_out_or_commits_her_open_uow(servers: Any) -> None:
    """A UOW being sent is held by its sender's session: no other session backs it out or commits it by its id."""
    qm1, qm2 = servers
    token = user_token()
    with logged_on(qm1, "alice-b", token) as a:
        uow = a.send(SVC, b"part 1")["uow"]
        for c in attackers(qm2, "alice-b"):
            with c:
                for option in ("BACKOUT", "COMMIT", "EOC"):
                    with pytest.raises(UowStatusError, match="not held by this session"):
                        c.syncpoint(option, uow)
        assert a.syncpoint("QUERY", uow)["status"] == "RECEIVED"
        assert a.syncpoint("BACKOUT")["status"] == "BACKEDOUT"  # she still can


def test_no_one_else_deletes_her_status(servers: Any) -> None:
    qm1, qm2 = servers
    token = user_token()
    uow = processed_uow(qm1, "alice-d", token)
    for c in attackers(qm2, "alice-d"):
        with c:
            with pytest.raises(UowStatusError, match="only its sender may DELETE"):
                c.syncpoint("DELETE", uow)
    with logged_on(qm1, "alice-d", token) as a:
        assert a.syncpoint("QUERY", uow)["status"] == "PROCESSED"
        assert a.syncpoint("DELETE", uow)["deleted"] is True  # she still can
        with pytest.raises(UnknownUowError):
            a.syncpoint("QUERY", uow)


def test_no_one_else_sets_her_user_status(servers: Any) -> None:
    qm1, qm2 = servers
    token = user_token()
    uow = sent_uow(qm1, "alice-u", token)
    for c in attackers(qm2, "alice-u"):
        with c:
            with pytest.raises(UowStatusError, match="neither sent nor received"):
                c.syncpoint("SETUSTATUS", uow, user_status=b"forged")
    with logged_on(qm1, "alice-u", token) as a:
        assert a.syncpoint("QUERY", uow)["user_status"] == ""
        assert a.syncpoint("SETUSTATUS", uow, user_status=b"hers")["user_status"] == "hers"  # she still can


def test_no_one_else_receives_or_commits_her_publication(servers: Any) -> None:
    qm1, qm2 = servers
    token = user_token()
    with logged_on(qm1, "alice-p", token) as a:
        a.subscribe(TOPIC, "mine")
    with logged_on(qm2, "publisher", user_token()) as p:
        pub = p.publish(TOPIC, b"for alice", commit=True)["pub"]
    for c in attackers(qm2, "alice-p"):
        with c:
            with pytest.raises(UnknownObjectError, match="no subscription"):
                c.receive_pub(TOPIC, "mine")
            c.pub_commit()  # commits nothing of hers
    with logged_on(qm1, "alice-p", token) as a:  # she still receives it, once
        assert a.receive_pub(TOPIC, "mine", wait_ms=5000)["pub"] == pub
        a.pub_commit()
        with pytest.raises(NoMessageError):
            a.receive_pub(TOPIC, "mine")


def test_no_one_else_removes_her_durable_subscription(servers: Any) -> None:
    qm1, qm2 = servers
    token = user_token()
    with logged_on(qm1, "alice-r", token) as a:
        a.subscribe(TOPIC, "keep", durable=True)
    for c in attackers(qm2, "alice-r"):
        with c:
            with pytest.raises(UnknownObjectError, match="no subscription"):
                c.unsubscribe(TOPIC, "keep")
    with logged_on(qm1, "alice-r", token) as a:
        assert [s["name"] for s in a.subscriptions(TOPIC)] == ["keep"]
        assert a.unsubscribe(TOPIC, "keep")["name"] == "keep"  # she still can
        assert a.subscriptions(TOPIC) == []


def test_no_one_else_lists_her_subscriptions(servers: Any) -> None:
    qm1, qm2 = servers
    token = user_token()
    with logged_on(qm1, "alice-l", token) as a:
        a.subscribe(TOPIC, "listed")
    for c in attackers(qm2, "alice-l"):
        with c:
            assert c.subscriptions(TOPIC) == []
            assert c.subscriptions(TOPIC, user="alice-l", token=token) == []  # an application names no owner
    with logged_on(qm1, "alice-l", token) as a:
        assert [(s["name"], s["user"], s["token"]) for s in a.subscriptions(TOPIC)] == [("listed", "alice-l", True)]


# --- the owner and the operator still can -------------------------------------------------------------------------
def test_the_owner_with_her_token_on_any_member_still_does_everything(servers: Any) -> None:
    qm1, qm2 = servers
    token = user_token()
    with logged_on(qm1, "alice-o", token) as a:
        a.subscribe(TOPIC, "own")
        first = a.send(SVC, b"one", commit=True)["uow"]
        second = a.send(SVC, b"two", commit=True)["uow"]
    with logged_on(qm2, "publisher", user_token()) as p:
        pub = p.publish(TOPIC, b"news", commit=True)["pub"]
    with logged_on(qm2, "alice-o", token) as a:
        assert a.syncpoint("LAST")["uow"] == second
        assert a.syncpoint("SETUSTATUS", first, user_status=b"x")["user_status"] == "x"
        assert a.syncpoint("CANCEL", first)["status"] == "CANCELLED"
        assert a.syncpoint("DELETE", first)["deleted"] is True
        assert [s["name"] for s in a.subscriptions(TOPIC)] == ["own"]
        assert a.receive_pub(TOPIC, "own", wait_ms=5000)["pub"] == pub
        a.pub_commit()
        assert a.unsubscribe(TOPIC, "own")["name"] == "own"


def test_an_operator_still_sees_and_settles_every_owner_s(servers: Any) -> None:
    """An operator browses the companion queues (every entry's owner token in its stored form only), lists every
    owner's subscriptions and removes one naming its owner's user id and token."""
    qm1, qm2 = servers
    token = user_token()
    uow = sent_uow(qm1, "alice-op", token)
    with logged_on(qm1, "alice-op", token) as a:
        a.subscribe(TOPIC, "ops")
    with operator(qm2) as op:
        controls = [msgpack.unpackb(m.body, raw=False) for m in op.browse(f"{SVC}.UOWCTL", 1000)
                    if m.msgid == bytes.fromhex(uow)]
        assert [c["sender"] for c in controls] == ["alice-op"]
        assert logon_token.is_sealed(controls[0]["token"]) and token not in controls[0]["token"]
        assert ("ops", "alice-op", True) in {(s["name"], s["user"], s["token"]) for s in op.subscriptions(TOPIC)}
        assert op.unsubscribe(TOPIC, "ops", user="alice-op", token=token)["name"] == "ops"
    with logged_on(qm1, "alice-op", token) as a:
        assert a.subscriptions(TOPIC) == []


def test_the_http_endpoints_show_no_token_nor_message(servers: Any) -> None:
    qm1, _ = servers
    token = user_token()
    body = f"body-{secrets.token_hex(6)}".encode()
    sent_uow(qm1, "alice-h", token, body)
    time.sleep(0.1)
    for path in ("/metrics", "/healthz", "/readyz"):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{qm1.metrics_port}{path}", timeout=10) as r:
                text = r.read()
        except urllib.error.HTTPError as e:  # /readyz may be 503: its body is checked all the same
            text = e.read()
        assert token.encode() not in text and body not in text


def test_a_refusal_echoes_no_one_s_token(servers: Any) -> None:
    """The refusals an attacker gets name the unit of work, never the sender's token (nor its stored form)."""
    qm1, qm2 = servers
    token = user_token()
    uow = sent_uow(qm1, "alice-e", token)
    stored = logon_token.seal_with(logon_token.group_key(qm1.log_root), "alice-e", token)
    with logged_on(qm2, "alice-e", "guess") as c:
        for option in ("CANCEL", "DELETE", "SETUSTATUS", "BACKOUT"):
            with pytest.raises(MQError) as e:
                c.syncpoint(option, uow, **({"user_status": b"x"} if option == "SETUSTATUS" else {}))
            assert token not in str(e.value) and stored not in str(e.value)
        with pytest.raises(MQError) as e:
            c.browse(f"{SVC}.UOWCTL")
        assert token not in str(e.value)
