"""`cfemu` and units of work sent to services (docs/uow.md): defining a service, a UOW's status through a member's
service (query, last, set-status, delete) and the UOW column of browse; `cfemu` subprocesses, a real `sqm run`, a
real CF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cfemu.admin import Admin, AdminError
from cfemu.connection import connect
from sqm.service.client import Client
from tests.qsg.test_cli import ok, run
from tests.support.service_proc import start_server


@pytest.fixture
def where(redis_url: str, tmp_path: Path) -> list[str]:
    return ["--redis-url", redis_url, "--log-root", str(tmp_path / "logs")]


def fails(*args: str) -> str:
    """A one-line error on stderr, exit status 2."""
    r = run("cfemu", *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, (r.returncode, r.stdout, r.stderr)
    return r.stderr


@pytest.mark.slow
def test_define_a_service(where: list[str], redis_url: str) -> None:
    ok("cfemu", "define", "structure", "APP1", *where)
    assert "need --uow" in fails("define", "queue", "SVC", "--structure", "APP1", "--max-uows", "5", *where)
    assert "--max-messages: must be a whole number >= 1, not 0" in fails("define", "queue", "SVC", "--structure",
                                                                          "APP1", "--uow", "--max-messages", "0", *where)
    admin = Admin(connect(redis_url))
    assert admin.queues() == []  # a refused define defines nothing
    d = json.loads(ok("cfemu", "define", "queue", "SVC", "--structure", "APP1", "--uow", "--max-messages", "4",
                      "--no-uow-store", "--status-lifetime", "2", "--uow-lifetime", "600", "--postpone-attempts", "3",
                      "--postpone-delay", "5", "--max-uows", "9", "--json", *where))
    assert d["uow"] == {"store": False, "max_uows": 9, "max_messages": 4, "lifetime_s": 600, "status_lifetime": 2,
                        "postpone_attempts": 3, "postpone_delay_s": 5, "conv_nonact_s": 300}
    assert admin.queue_def("SVC").uow == d["uow"]
    assert {q.name for q in admin.queues()} == {"SVC", "SVC.UOWDATA", "SVC.UOWCTL"}
    table = ok("cfemu", "define", "queue", "SVC2", "--structure", "APP1", "--uow", *where)
    assert "service SVC2 defined" in table and "uow.max_messages" in table and "16" in table
    assert "uow.max_uows" not in table  # not given: the group's (cfemu define uow-defaults; docs/uow.md)
    plain = json.loads(ok("cfemu", "define", "queue", "Q1", "--structure", "APP1", "--json", *where))
    assert plain["uow"] == {}
    with pytest.raises(AdminError):
        admin.queue_def("Q1.UOWDATA")


@pytest.mark.slow
def test_uow_status_verbs_and_the_browse_column(where: list[str], redis_url: str, tmp_path: Path) -> None:
    ok("cfemu", "define", "structure", "APP1", *where)
    ok("cfemu", "define", "queue", "SVC", "--structure", "APP1", "--uow", "--status-lifetime", "2", *where)
    srv = start_server(redis_url, tmp_path, "QM1", "--token", "tok", env={"SQM_OPERATOR_TOKEN": "op-tok"})
    try:
        server = ["--server", srv.endpoint, "--token", "op-tok"]
        with Client(srv.endpoint, token="tok") as a:
            a.logon("alice", "a-tok")
            sent = a.send("SVC", b"first")
            uow, conversation = sent["uow"], sent["conversation"]
            a.send("SVC", b"second", commit=True)
            a.send("SVC", b"outside any UOW", option="MSG")

        # browse: the UOW of each message of SVC.UOWDATA and its position, each control entry's status
        data = json.loads(ok("cfemu", "browse", "SVC.UOWDATA", "--json", *server))["messages"]
        assert [(m["body"], m["uow"], m["uow_position"]) for m in data] == [("first", uow, 1), ("second", uow, 2)]
        ctl = json.loads(ok("cfemu", "browse", "SVC.UOWCTL", "--json", *where))["messages"]  # in process too
        assert sorted((m["uow"], m["uow_status"]) for m in ctl) == sorted(
            [(uow, "ACCEPTED"), (uow, "LAST"), (conversation, "CONVERSATION")])  # and the conversation's record
        plain = json.loads(ok("cfemu", "browse", "SVC", "--json", *server))["messages"]
        assert [(m["body"], m["uow"], m["uow_status"]) for m in plain] == [("outside any UOW", "", "")]
        table = ok("cfemu", "browse", "SVC.UOWDATA", *server)
        assert "UOW" in table and f"{uow[:16]} #2" in table
        assert f"{uow[:16]} ACCEPTED" in ok("cfemu", "browse", "SVC.UOWCTL", *server)

        q = json.loads(ok("cfemu", "uow", "query", uow, "--json", *server))
        assert (q["uow"], q["status"], q["sender"], q["messages"], q["qmgr"]) == (uow, "ACCEPTED", "alice", 2, "QM1")
        assert "ACCEPTED" in ok("cfemu", "uow", "query", uow, *server)
        last = json.loads(ok("cfemu", "uow", "last", "--user", "alice", "--user-token", "a-tok", "--json", *server))
        assert (last["uow"], last["status"]) == (uow, "ACCEPTED")
        assert "MQRC_UNKNOWN_OBJECT_NAME" in fails("uow", "last", "--user", "alice", *server)  # another token

        set_it = ["uow", "set-status", uow, "--user", "alice", "--user-token", "a-tok"]
        assert json.loads(ok("cfemu", *set_it, "waiting for bob", "--json", *server))["user_status"] == (
            "waiting for bob")
        assert "64 bytes" in fails(*set_it, "x" * 65, *server)
        assert "neither sent nor received" in fails("uow", "set-status", uow, "other", "--user", "mallory", *server)
        assert json.loads(ok("cfemu", "uow", "query", uow, "--json", *server))["user_status"] == "waiting for bob"

        delete = ["uow", "delete", uow, "--user", "alice", "--user-token", "a-tok"]
        assert "DELETE is not allowed in status ACCEPTED" in fails(*delete, *server)
        with Client(srv.endpoint, token="tok") as b:
            b.logon("bob")
            assert [b.receive("SVC", option="SYNC")["recv"] for _ in range(2)] == ["RECV_FIRST", "RECV_LAST"]
            b.syncpoint("COMMIT")
        assert json.loads(ok("cfemu", "uow", "query", uow, "--json", *server))["status"] == "PROCESSED"
        assert json.loads(ok("cfemu", *delete, "--json", *server))["deleted"] is True
        assert "is not known" in fails("uow", "query", uow, *server)

        assert "--server" in fails("uow", "query", uow)
        assert "user" in fails("uow", "last", "--user", "u" * 33, *server)
    finally:
        assert srv.stop() == 0, srv.log_text()
