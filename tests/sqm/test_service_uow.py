"""Units of work as conversations over the network (docs/uow.md): `sqm run` processes, clients on real sockets, one
session per connection (logon), its UOWs backed out when the connection ends."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cfemu.errors import (
    BackedOutError,
    BadRequestError,
    EndOfUowError,
    NoMessageError,
    OutcomeUnknownError,
    TruncatedMessageError,
    UnknownUowError,
    UowLimitError,
    UowStatusError,
)
from sqm.service.client import Client
from sqm.service.protocol import NotAuthorizedError, NotLoggedOnError, SessionLostError, encode_frame
from tests.support.service_proc import (
    OP_TOKEN,
    TOKEN,
    Raw,
    ServerProc,
    fresh_group,
    logged_on,
    serving_pair,
    start_server,
)
from tests.support.waits import sigstop

SVC = "SVC"  # persistent status kept 2 lifetimes, so QUERY and LAST see finished UOWs


@pytest.fixture(scope="module")
def servers(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, ServerProc]]:
    """Two members of one group, a service defined on its structure."""
    fresh_group(redis_server).define_queue(SVC, "APP1", uow={"status_lifetime": 2})
    with serving_pair(redis_server.url, tmp_path_factory.mktemp("uowgroup")) as pair:
        yield pair


@contextlib.contextmanager
def stopped(srv: ServerProc, c: Client) -> Iterator[None]:
    """The server stopped (SIGSTOP) and the client's patience short: its request is lost in flight."""
    c.request_timeout = 1.0
    sigstop(srv.proc.pid)  # stopped: kill() returns before every thread is
    try:
        yield
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        c.request_timeout = 30.0


def eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_a_uow_is_received_whole_and_in_order_by_a_client_of_another_member(servers: Any) -> None:
    qm1, qm2 = servers
    with logged_on(qm1, "alice", "a-tok") as a, logged_on(qm2, "bob") as b:
        sent = [a.send(SVC, b"move %d" % i) for i in range(3)]
        assert [s["status"] for s in sent] == ["RECEIVED"] * 3 and len({s["uow"] for s in sent}) == 1
        assert [s["messages"] for s in sent] == [1, 2, 3] and a.held
        uow = sent[0]["uow"]
        assert a.syncpoint("COMMIT") == {"status": "ACCEPTED", "uow": uow} and not a.held
        got = [b.receive(SVC, option="SYNC") for _ in range(3)]
        assert [(g["body"], g["recv"], g["uow"], g["status"]) for g in got] == [
            (b"move 0", "RECV_FIRST", uow, "DELIVERED"), (b"move 1", "RECV_MIDDLE", uow, "DELIVERED"),
            (b"move 2", "RECV_LAST", uow, "DELIVERED")]
        with pytest.raises(EndOfUowError):
            b.receive(SVC)
        assert a.syncpoint("QUERY", uow)["status"] == "DELIVERED"
        assert b.syncpoint("COMMIT") == {"status": "PROCESSED", "uow": uow}
        q = a.syncpoint("QUERY", uow)
        assert (q["status"], q["sender"], q["receiver"], q["messages"]) == ("PROCESSED", "alice", "bob", 3)
        with pytest.raises(UowStatusError):  # the same exception class as in process: nothing is held
            b.syncpoint("COMMIT")
        with pytest.raises(NoMessageError):
            b.receive(SVC, option="SYNC", wait_ms=100)


def test_commit_both_over_the_network(servers: Any) -> None:
    qm1, qm2 = servers
    with logged_on(qm1, "white") as w, logged_on(qm2, "black") as bl:
        request = w.send(SVC, b"e2e4", commit=True)
        assert request["status"] == "ACCEPTED"
        got = bl.receive(SVC, option="SYNC")
        assert (got["body"], got["recv"]) == (b"e2e4", "RECV_ONLY")
        reply = bl.send(SVC, b"e7e5")
        assert bl.held
        both = bl.syncpoint("COMMIT", "BOTH")
        assert both == {"status": "ACCEPTED", "uow": reply["uow"],
                        "received": {"uow": request["uow"], "status": "PROCESSED"}}
        assert w.receive(SVC, option="SYNC")["body"] == b"e7e5"
        w.syncpoint("COMMIT")
        assert w.syncpoint("QUERY", request["uow"])["status"] == "PROCESSED"
        assert bl.syncpoint("QUERY", reply["uow"])["status"] == "PROCESSED"


def test_query_and_last_after_reconnecting_with_the_same_user_and_token(servers: Any) -> None:
    qm1, qm2 = servers
    with logged_on(qm1, "carol", "c-tok") as c:
        committed = c.send(SVC, b"kept", commit=True)["uow"]
        pending = c.send(SVC, b"not committed")["uow"]
    # The connection ended: its session with it, the UOW it was sending backed out.
    with logged_on(qm2, "carol", "c-tok") as again:
        assert eventually(lambda: again.syncpoint("LAST")["status"] == "BACKEDOUT")  # once the server saw it go
        assert again.syncpoint("LAST")["uow"] == pending
        assert again.syncpoint("QUERY", committed)["status"] == "ACCEPTED"
        again.syncpoint("CANCEL", committed)  # the sender withdraws it: the next test finds the service empty
        assert again.syncpoint("QUERY", committed)["status"] == "CANCELLED"
    with logged_on(qm2, "carol", "another token") as other, pytest.raises(UnknownUowError):
        other.syncpoint("LAST")  # LAST is by user id and token


def test_a_second_logon_ends_the_first_session(servers: Any) -> None:
    qm1, _ = servers
    with logged_on(qm1, "mike", "m-tok") as c:
        uow = c.send(SVC, b"abandoned")["uow"]
        c.logon("nina")  # the same connection, a new session: mike's sending UOW is backed out first
        assert not c.held and c.user == "nina"
        assert c.syncpoint("QUERY", uow)["status"] == "BACKEDOUT"
        with pytest.raises(UowStatusError):
            c.syncpoint("COMMIT")


def test_a_client_that_leaves_mid_receive_gives_the_uow_back_with_its_delivery_counted(servers: Any) -> None:
    qm1, qm2 = servers
    with logged_on(qm1, "dave") as d:
        uow = d.send(SVC, b"one")["uow"]
        d.send(SVC, b"two", commit=True)
        quitter = logged_on(qm2, "erin")
        first = quitter.receive(SVC, option="SYNC")
        assert (first["uow"], first["recv"], first["deliveries"]) == (uow, "RECV_FIRST", 0)
        assert d.syncpoint("QUERY", uow)["status"] == "DELIVERED"
        quitter.close()  # gone mid-UOW, one message of two received
        assert eventually(lambda: d.syncpoint("QUERY", uow)["status"] == "ACCEPTED")
        assert d.syncpoint("QUERY", uow)["deliveries"] == 1
    with logged_on(qm1, "frank") as f:
        got = [f.receive(SVC, option="SYNC") for _ in range(2)]
        assert [(g["body"], g["recv"], g["deliveries"]) for g in got] == [
            (b"one", "RECV_FIRST", 1), (b"two", "RECV_LAST", 1)]
        assert f.syncpoint("COMMIT")["status"] == "PROCESSED"


def test_a_waiting_receive_ends_with_its_connection_and_takes_nothing(servers: Any) -> None:
    qm1, qm2 = servers
    r = Raw(qm2.port)
    assert r.login()["ok"]
    assert r.request("logon", {"user": "gone"})["ok"]
    r.send_bytes(encode_frame({"id": 1, "op": "receive", "args": {"service": SVC, "option": "SYNC",
                                                                  "wait_ms": 20_000}}))
    time.sleep(0.5)
    r.close()  # leaves mid-wait
    time.sleep(0.3)
    with logged_on(qm1, "grace") as g:
        uow = g.send(SVC, b"for a present receiver", commit=True)["uow"]
        time.sleep(1.0)  # a wait still running would have taken it by now
        q = g.syncpoint("QUERY", uow)
        assert (q["status"], q["deliveries"]) == ("ACCEPTED", 0), q
        got = g.receive(SVC, option="SYNC", wait_ms=1000)
        assert (got["uow"], got["deliveries"]) == (uow, 0)
        g.syncpoint("COMMIT")


def test_requests_before_logon_are_refused_and_change_nothing(servers: Any) -> None:
    qm1, _ = servers
    with Client(qm1.endpoint, token=TOKEN) as c:
        with pytest.raises(NotLoggedOnError, match="logon"):
            c.send(SVC, b"x", commit=True)
        with pytest.raises(NotLoggedOnError):
            c.receive(SVC)
        with pytest.raises(NotLoggedOnError):
            c.syncpoint("LAST")
        for user in ("", "u" * 33, "tab\there"):
            with pytest.raises(BadRequestError, match="user"):
                c.logon(user)
        with pytest.raises(BadRequestError, match="token"):
            c.logon("henry", "t" * 33)
        with pytest.raises(NotLoggedOnError):  # a refused logon makes no session
            c.syncpoint("LAST")
        c.logon("henry")
        with pytest.raises(BadRequestError, match="option"):
            c.syncpoint("FINISH")
        with pytest.raises(BadRequestError, match="wait_ms"):
            c.receive(SVC, wait_ms=10**9)
    with logged_on(qm1, "henry") as h, pytest.raises(UnknownUowError):
        h.syncpoint("LAST")


def test_an_oversized_user_status_is_refused_and_changes_nothing(servers: Any) -> None:
    qm1, _ = servers
    with logged_on(qm1, "ivan", "i-tok") as c:
        with pytest.raises(BadRequestError, match="64 bytes"):
            c.send(SVC, b"x", user_status=b"s" * 65)
        assert not c.held
        with pytest.raises(UnknownUowError):
            c.syncpoint("LAST")  # no UOW was made
        uow = c.send(SVC, b"x", user_status=b"first")["uow"]
        assert c.syncpoint("SETUSTATUS", uow, user_status=b"s" * 64)["user_status"] == "s" * 64
        with pytest.raises(BadRequestError, match="64 bytes"):
            c.syncpoint("SETUSTATUS", uow, user_status=b"s" * 65)
        q = c.syncpoint("QUERY", uow)
        assert (q["user_status"], q["status"], q["messages"]) == ("s" * 64, "RECEIVED", 1)
        assert c.syncpoint("BACKOUT")["status"] == "BACKEDOUT"


def test_define_a_service_through_the_service_and_its_limits(servers: Any) -> None:
    qm1, _ = servers
    with Client(qm1.endpoint, token=OP_TOKEN, role="operator") as op:
        with pytest.raises(BadRequestError, match="max_messages"):
            op.define_queue("SVC2", "APP1", uow={"max_messages": 0})
        with pytest.raises(BadRequestError, match="unknown UOW attribute"):
            op.define_queue("SVC2", "APP1", uow={"colour": 1})
        d = op.define_queue("SVC2", "APP1", uow={"max_messages": 2, "store": False})
        assert d["uow"]["max_messages"] == 2 and d["uow"]["store"] is False
    with logged_on(qm1, "judy") as c:
        first = c.send("SVC2", b"1")
        assert first["persistent"] is False  # the service's STORE
        c.send("SVC2", b"2")
        with pytest.raises(UowLimitError):
            c.send("SVC2", b"3")
        c.syncpoint("BACKOUT")


def test_a_commit_whose_connection_is_lost_has_an_unknown_outcome_then_last_tells(servers: Any) -> None:
    _, qm2 = servers
    c = logged_on(qm2, "kate", "k-tok", reconnect_timeout=20.0)
    uow = c.send(SVC, b"mid-commit")["uow"]
    with stopped(qm2, c):  # the commit is sent; its reply does not come in time
        with pytest.raises(OutcomeUnknownError, match="QUERY or LAST"):
            c.syncpoint("COMMIT")
    assert c.user is None  # the session ended with the connection
    with pytest.raises(NotLoggedOnError):
        c.syncpoint("LAST")
    c.logon("kate", "k-tok")
    # The server ran the commit it had read before the connection went: LAST tells the outcome.
    assert eventually(lambda: c.syncpoint("LAST")["status"] != "RECEIVED")  # once it saw the connection go
    last = c.syncpoint("LAST")
    assert last["uow"] == uow and last["status"] in ("ACCEPTED", "BACKEDOUT")
    if last["status"] == "ACCEPTED":
        c.syncpoint("CANCEL", uow)
    c.close()


def test_a_lost_connection_ends_the_session_and_backs_out_what_it_held(servers: Any) -> None:
    _, qm2 = servers
    c = logged_on(qm2, "leo", "l-tok")
    uow = c.send(SVC, b"held")["uow"]
    with stopped(qm2, c), pytest.raises(BackedOutError, match="log on again"):
        c.send(SVC, b"more")
    c.logon("leo", "l-tok")
    assert eventually(lambda: c.syncpoint("QUERY", uow)["status"] == "BACKEDOUT")
    with stopped(qm2, c), pytest.raises(SessionLostError):  # nothing held: only the session is gone
        c.syncpoint("QUERY", uow)
    c.close()


def test_a_message_the_connection_cannot_carry_is_refused_and_not_taken(servers: Any, redis_server: Any) -> None:
    """A member whose replies are limited to 64 KiB (--max-frame): a message longer than that is not taken for a
    client that cannot carry it (MQRC_TRUNCATED_MSG_FAILED): a UOW's is ACCEPTED again at once, a message outside a
    UOW stays on the service queue (a receive outside syncpoint once consumed it and lost it)."""
    qm1, _ = servers
    narrow = start_server(redis_server.url, qm1.log_root.parent, "QM3", "--token", TOKEN, "--max-frame",
                          str(64 * 1024))
    try:
        with logged_on(qm1, "olga") as s, logged_on(narrow, "pete") as r:
            uow = s.send(SVC, b"x" * 100_000, commit=True)["uow"]
            with pytest.raises(TruncatedMessageError):
                r.receive(SVC, option="SYNC")
            assert not r.held
            assert r.syncpoint("QUERY", uow)["status"] == "ACCEPTED"
            got = s.receive(SVC, option="SYNC")
            assert (got["uow"], len(got["body"]), got["deliveries"]) == (uow, 100_000, 1)
            s.syncpoint("COMMIT")
            s.send(SVC, b"y" * 100_000, option="MSG")
            with pytest.raises(TruncatedMessageError):
                r.receive(SVC, option="MSG")
            plain = s.receive(SVC, option="MSG")
            assert (plain["recv"], len(plain["body"])) == ("RECV_NONE", 100_000)
    finally:
        assert narrow.stop() == 0, narrow.log_text()


def test_an_application_cannot_put_to_get_from_or_browse_a_service_s_companion_queues(servers: Any) -> None:
    """A message put on <SVC>.UOWCTL by hand blocked the service's receives; a get by the UOW id took its status
    away; a browse showed every user's statuses, owners and messages: over the service, the companion queues are
    the product's own. An operator browses them."""
    qm1, _ = servers
    with logged_on(qm1, "rita") as c:
        uow = c.send(SVC, b"x", commit=True)["uow"]
        for queue in (SVC + ".UOWCTL", SVC + ".UOWDATA"):
            with pytest.raises(NotAuthorizedError, match="holds the state of"):
                c.put(queue, b"forged", correlid=b"A", syncpoint=False)
            with pytest.raises(NotAuthorizedError, match="holds the state of"):
                c.get(queue, syncpoint=False)
            with pytest.raises(NotAuthorizedError, match="holds the state of"):
                c.browse(queue)
        with Client(qm1.endpoint, token=OP_TOKEN, role="operator") as op:
            assert [m.correlid for m in op.browse(SVC + ".UOWDATA")] == [bytes.fromhex(uow)]
        assert c.syncpoint("QUERY", uow)["status"] == "ACCEPTED"
        got = c.receive(SVC, option="SYNC")
        assert got["uow"] == uow
        c.syncpoint("COMMIT")


def test_a_conversation_is_bound_to_the_instance_that_received_it_over_the_network(servers: Any) -> None:
    """RECEIVE's CONVID over the service (docs/uow.md, "Conversations"): the bound instance's by OLD, never another
    instance's; EOC ends it for the sender; a malformed CONVID is refused before anything runs."""
    qm1, qm2 = servers
    with logged_on(qm1, "alice", "a-tok") as a, logged_on(qm1, "server", "i1") as x, \
            logged_on(qm2, "server", "i2") as y:
        first = a.send(SVC, b"first", commit=True)
        conv = first["conversation"]
        assert x.receive(SVC, option="SYNC", convid="NEW")["uow"] == first["uow"]
        x.syncpoint("COMMIT")
        last = a.send(SVC, b"last", conversation=conv, eoc="EOC")
        with pytest.raises(UowStatusError, match=f"conversation {conv} of service {SVC} was ended by EOC"):
            a.send(SVC, b"after", conversation=conv)
        with pytest.raises(NoMessageError):
            y.receive(SVC, option="SYNC", convid="ANY", wait_ms=200)
        got = x.receive(SVC, option="SYNC", convid="OLD")
        assert (got["uow"], got["eoc"], got["conversation"]) == (last["uow"], "EOC", conv)
        x.syncpoint("COMMIT")
        with pytest.raises(BadRequestError, match="'convid' must be at most 64 characters"):
            y.receive(SVC, option="SYNC", convid="c" * 65)
        with pytest.raises(BadRequestError, match="CONVID must be NEW, OLD, ANY or a conversation id"):
            y.receive(SVC, option="SYNC", convid="")
