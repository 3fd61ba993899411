"""DISPLAY CONN says what the member verified of a connection and what is only the client's word: the application
name a client gives at hello (and the user id of its logon) is a claim any connection can make, the one still in
its handshake included, so `cfemu conn` and `--json` mark them claimed, say how the role was proven (or that it was
not: NO (handshake)), and show the subject of a client certificate the member checked (mutual TLS). A hostile name
(the table's markup, a terminal escape, a line break) is shown escaped and cut: it cannot pass for another row or
break the command. Before, an impostor that only said hello showed as "payroll" beside the real payroll, and a name
with rich markup could make `cfemu conn` fail. Real `sqm run` members, raw connections, `cfemu conn` subprocesses."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sqm.service.client import Client, client_tls_context
from tests.qsg.test_cli import ok, run
from tests.support.certs import issue, make_ca
from tests.support.service_proc import OP_TOKEN, TOKEN, Raw, fresh_group, start_server

HOSTILE = "[/bold]\x1b[2J\nQM1  99  payroll"


def conn_json(*args: str) -> list[dict[str, Any]]:
    return list(json.loads(ok("cfemu", "conn", "--json", *args, "--token", OP_TOKEN))["connections"])


def test_an_unauthenticated_claim_of_a_name_is_told_from_the_authenticated_one(redis_server: Any,
                                                                                 tmp_path: Path) -> None:
    fresh_group(redis_server)
    # The impostor stays in its handshake while the test looks: the member closes it after --auth-timeout (5 s by
    # default), which two `cfemu conn` runs on a loaded machine can outlast.
    srv = start_server(redis_server.url, tmp_path, "QM1", "--auth-timeout", "120")
    impostor = Raw(srv.port)
    hostile = Raw(srv.port)
    try:
        with Client(srv.endpoint, token=TOKEN, client_name="payroll") as real:
            real.logon("alice", "secret")
            hello = impostor.request("hello", {"client": "payroll", "nonce": b"n" * 32})  # and no auth
            assert hello["ok"], hello
            assert hostile.login(client=HOSTILE)["ok"]  # authenticated, with a hostile name
            rows = conn_json("--server", srv.endpoint)
            payrolls = [r for r in rows if r["application"] == "payroll"]
            assert len(payrolls) == 2
            proven, claimed_only = sorted(payrolls, key=lambda r: r["role"] is None)
            assert (proven["role"], proven["auth"], proven["user"]) == ("application", "challenge", "alice")
            assert (claimed_only["role"], claimed_only["auth"], claimed_only["user"]) == (None, None, None)
            assert all(r["claimed"] == ["application", "user"] for r in rows)
            assert {r["auth"] for r in rows if r["application"] == "cfemu"} == {"challenge"}
            assert all(r["certificate"] is None for r in rows)

            shown = run("cfemu", "conn", "--server", srv.endpoint, "--token", OP_TOKEN,
                        env={**os.environ, "COLUMNS": "400"})  # wide enough that no cell is folded
            assert shown.returncode == 0, shown.stderr
            table = shown.stdout
            assert "payroll (claimed)" in table and "alice (claimed)" in table
            assert "NO (handshake)" in table and "application (token proven)" in table
            assert "not checked" in table  # the note under the table says what is claimed
            # The hostile name: escaped and cut, on its own row; its "row" is not one of the table's.
            assert "\x1b" not in table and "[/bold]" in table
            assert not any(line.lstrip().startswith("QM1  99") for line in table.splitlines())
    finally:
        impostor.close()
        hostile.close()
        assert srv.stop() == 0, srv.log_text()
    assert "\x1b" not in srv.log_text()


def test_a_client_certificate_verified_by_mutual_tls_is_shown(redis_server: Any, tmp_path: Path) -> None:
    fresh_group(redis_server)
    ca = make_ca(tmp_path, "ca")
    cert, key = issue(ca, tmp_path, "member")
    app_cert, app_key = issue(ca, tmp_path, "payroll-prod")
    srv = start_server(redis_server.url, tmp_path, "QM1", "--tls-cert", str(cert), "--tls-key", str(key),
                       "--tls-ca", str(ca.cert))
    operator_cert, operator_key = issue(ca, tmp_path, "operator")
    try:
        tls = client_tls_context(str(ca.cert), str(app_cert), str(app_key))
        with Client(srv.endpoint, token=TOKEN, tls=tls, client_name="payroll") as c:
            c.ping()
            with Client(srv.endpoint, token=OP_TOKEN, role="operator", client_name="ops",
                        tls=client_tls_context(str(ca.cert), str(operator_cert), str(operator_key))) as op:
                rows = {r["application"]: r for r in op.connections()["connections"]}
        assert rows["payroll"]["certificate"] == "CN=payroll-prod" and rows["payroll"]["tls"] is True
        assert rows["ops"]["certificate"] == "CN=operator"
    finally:
        assert srv.stop() == 0, srv.log_text()
