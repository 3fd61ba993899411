"""DISPLAY CONN and DISPLAY QSTATUS as an operator runs them: `cfemu conn` and `cfemu status QUEUE` subprocesses
against real `sqm run` members on a real CF, with real clients connected to them."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sqm.service.client import Client
from sqm.service.protocol import NotAuthorizedError
from tests.qsg.test_cli import ok, run
from tests.support.service_proc import OP_TOKEN, TOKEN, ServerProc, start_server


@contextlib.contextmanager
def two_members_serving_q1(redis_url: str, tmp_path: Path) -> Iterator[tuple[list[str], ServerProc, ServerProc]]:
    """APP1 and Q1 defined with `cfemu define`, QM1 and QM2 serving them: (the settings arguments that name the
    group, QM1, QM2); each member must stop cleanly at the end."""
    where = ["--redis-url", redis_url, "--log-root", str(tmp_path / "logs")]
    ok("cfemu", "define", "structure", "APP1", *where)
    ok("cfemu", "define", "queue", "Q1", "--structure", "APP1", *where)
    qm1 = start_server(redis_url, tmp_path, "QM1")
    qm2 = start_server(redis_url, tmp_path, "QM2")
    try:
        yield where, qm1, qm2
    finally:
        assert qm1.stop() == 0
        assert qm2.stop() == 0


def _conn(*args: str) -> dict[str, Any]:
    return dict(json.loads(ok("cfemu", "conn", "--json", *args)))


@pytest.mark.slow
def test_conn_shows_each_connection_with_its_application_peer_and_open_uow(redis_url: str, tmp_path: Path) -> None:
    with two_members_serving_q1(redis_url, tmp_path) as (where, qm1, qm2):
        operator = ["--server", qm1.endpoint, "--server", qm2.endpoint, "--token", OP_TOKEN]
        with Client(qm1.endpoint, token=TOKEN, client_name="payroll") as app, \
                Client(qm2.endpoint, token=TOKEN, client_name="billing") as idle:
            app.put("Q1", b"in flight")  # under syncpoint: the connection's UOW stays open
            idle.ping()
            local = app._wire.sock.getsockname() if app._wire is not None else None
            assert local is not None
            doc = _conn(*operator)
            assert doc["unreachable"] == []
            rows = {r["application"]: r for r in doc["connections"]}
            payroll, billing = rows["payroll"], rows["billing"]
            assert (payroll["qmgr"], payroll["role"], payroll["tls"]) == ("QM1", "application", False)
            assert payroll["peer"] == f"{local[0]}:{local[1]}"
            assert payroll["requests"] >= 1 and payroll["queues"] == ["Q1"]
            assert payroll["last_request"] >= payroll["connected"] > time.time() - 600
            assert payroll["uow"]["state"] == "INFLIGHT" and payroll["uow"]["id"].startswith("QM1.")
            assert payroll["uow"]["messages"] == 1 and payroll["uow"]["age_s"] >= 0
            assert (billing["qmgr"], billing["uow"]) == ("QM2", None)
            # cfemu's own operator connections are listed too, named as cfemu names itself
            assert {r["role"] for r in doc["connections"] if r["application"] == "cfemu"} == {"operator"}
            # nothing secret: no token in any form
            text = json.dumps(doc)
            assert TOKEN not in text and OP_TOKEN not in text
            # the --member filter, and the table
            only = _conn(*operator, "--member", "QM2")
            assert {r["qmgr"] for r in only["connections"]} == {"QM2"}
            r = run("cfemu", "conn", *operator, "--member", "QM9")
            assert r.returncode == 2 and "no member QM9" in r.stderr and "QM1, QM2" in r.stderr, r.stderr
            table = ok("cfemu", "conn", *operator)
            assert "payroll" in table and "INFLIGHT" in table and f"{local[0]}:{local[1]}" in table

            app.commit()  # the UOW ends: no open UOW any more
            after = {r["application"]: r for r in _conn(*operator)["connections"]}
            assert after["payroll"]["uow"] is None and after["payroll"]["requests"] > payroll["requests"]
        gone = {r["application"] for r in _conn(*operator)["connections"]}
        assert "payroll" not in gone and "billing" not in gone  # closed connections leave the list


@pytest.mark.slow
def test_an_application_token_is_refused_the_connections(redis_url: str, tmp_path: Path) -> None:
    srv = start_server(redis_url, tmp_path, "QM1")
    try:
        with Client(srv.endpoint, token=TOKEN) as app, pytest.raises(NotAuthorizedError):
            app.connections()
        with Client(srv.endpoint, token=OP_TOKEN, role="operator") as op:
            assert op.connections()["qmgr"] == "QM1"
        # cfemu with only the application's token: refused in one line, naming the operator token
        app_env = {k: v for k, v in os.environ.items() if k not in ("SQM_OPERATOR_TOKEN", "CFEMU_SECRETS_DIR")}
        r = run("cfemu", "conn", "--server", srv.endpoint, env={**app_env, "SQM_TOKEN": TOKEN}, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "operator token" in r.stderr, r.stderr
        # a member that does not answer: its own line, and retry later
        r = run("cfemu", "conn", "--server", srv.endpoint, "--server", "127.0.0.1:1", "--token", OP_TOKEN)
        assert r.returncode == 75 and "127.0.0.1:1" in r.stdout + r.stderr and "QM1" in r.stdout, r
    finally:
        assert srv.stop() == 0


def _qstatus(*args: str) -> dict[str, Any]:
    return dict(json.loads(ok("cfemu", "status", "Q1", "--json", *args)))


@pytest.mark.slow
def test_queue_status_fields_follow_puts_and_gets(redis_url: str, tmp_path: Path) -> None:
    """DISPLAY QSTATUS: uncommitted puts and gets, depth, oldest message age, handles and the last put and get
    (merged over the members) change as messages are put and got through two members."""
    with two_members_serving_q1(redis_url, tmp_path) as (where, qm1, qm2):
        members = [*where, "--server", qm1.endpoint, "--server", qm2.endpoint, "--token", OP_TOKEN]
        empty = _qstatus(*members)
        assert (empty["depth"], empty["uncommitted"], empty["oldest_message_age_s"]) == (
            0, {"puts": 0, "gets": 0}, None)
        assert (empty["handles"], empty["last_put"], empty["last_get"]) == (0, None, None)
        # Without members to ask, the CF's fields are there and the members' say they were not asked.
        cf_only = _qstatus(*where)
        assert cf_only["handles"] is None and cf_only["members_asked"] == [] and cf_only["depth"] == 0

        with Client(qm1.endpoint, token=TOKEN, client_name="putter") as putter, \
                Client(qm2.endpoint, token=TOKEN, client_name="getter") as getter:
            before_put = time.time()
            putter.put("Q1", b"one")
            putter.put("Q1", b"two")
            s = _qstatus(*members)
            assert (s["depth"], s["uncommitted"]) == (0, {"puts": 2, "gets": 0})
            assert s["handles"] == 1 and s["handles_by_member"] == {"QM1": 1, "QM2": 0}
            assert s["last_put"] >= before_put and s["last_get"] is None
            putter.commit()
            time.sleep(0.2)  # the oldest message's age must grow past it (put times are in ms)
            s = _qstatus(*members)
            assert (s["depth"], s["uncommitted"]) == (2, {"puts": 0, "gets": 0})
            assert s["oldest_message_age_s"] >= 0.2

            before_get = time.time()
            assert getter.get("Q1") is not None  # under syncpoint: held by an uncommitted get
            s = _qstatus(*members)
            assert (s["depth"], s["uncommitted"]) == (1, {"puts": 0, "gets": 1})
            assert s["handles"] == 2 and s["handles_by_member"] == {"QM1": 1, "QM2": 1}
            assert s["last_get"] >= before_get and s["last_put"] < before_get
            getter.commit()
            assert getter.get("Q1") is not None
            getter.commit()
            s = _qstatus(*members)
            assert (s["depth"], s["uncommitted"], s["oldest_message_age_s"]) == (0, {"puts": 0, "gets": 0}, None)
            table = ok("cfemu", "status", "Q1", *members)
            assert "DISPLAY QSTATUS" in table and "uncommitted gets" in table and "QM1 1, QM2 1" in table
        s = _qstatus(*members)  # the connections closed: no handles; the last put and get stay
        assert s["handles"] == 0 and s["last_put"] and s["last_get"]
        r = run("cfemu", "status", "NOPE", *where)
        assert r.returncode == 2 and "no queue 'NOPE'" in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.slow
def test_conn_through_tls_shows_the_connections_tls(redis_url: str, tmp_path: Path) -> None:
    """A member serving TLS: cfemu conn reaches it with --server-ca, and its TLS connections say so."""
    from sqm.service.client import client_tls_context
    from tests.support.certs import issue, make_ca

    ca = make_ca(tmp_path, "ca")
    cert, key = issue(ca, tmp_path, "member")
    srv = start_server(redis_url, tmp_path, "QM1", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        with Client(srv.endpoint, token=TOKEN, tls=client_tls_context(str(ca.cert)), client_name="secure-app") as c:
            c.ping()
            doc = _conn("--server", srv.endpoint, "--server-ca", str(ca.cert), "--token", OP_TOKEN)
        rows = {r["application"]: r for r in doc["connections"]}
        assert rows["secure-app"]["tls"] is True and rows["cfemu"]["tls"] is True
        r = run("cfemu", "conn", "--server", srv.endpoint, "--token", OP_TOKEN)  # without the CA: no answer
        assert r.returncode == 75 and "QM1" not in r.stdout, r
    finally:
        assert srv.stop() == 0
