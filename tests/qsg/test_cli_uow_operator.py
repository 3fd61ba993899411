"""`cfemu uow set-uow-status`: the operator's ETBCMD SET-UOW-STATUS (docs/uow.md), through a real `sqm run` on a real
CF: the transitions the state table allows, the refused ones (one line each, nothing changed), the line in the
member's log, and the changes surviving the member's SIGKILL and the CF's loss (restored from a backup taken before
them, and the member's log)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from backup.run import run_backup
from cfemu.embedded import EmbeddedRedis
from restore.run import run_restore
from sqm.service.client import Client
from sqm.service.protocol import NotAuthorizedError
from tests.qsg.test_cli import ok, run
from tests.support.service_proc import start_server

S, SVC = "APP1", "SVC"


def fails(*args: str) -> str:
    r = run("cfemu", *args)
    assert r.returncode != 0 and r.stderr.count("\n") == 1, (r.returncode, r.stdout, r.stderr)
    return r.stderr


@pytest.mark.slow
def test_the_operator_sets_a_uows_status_as_the_table_allows_and_it_survives_a_restart(tmp_path: Path) -> None:
    cf = EmbeddedRedis(data_dir=tmp_path / "cf").start()
    logs = tmp_path / "logs"
    where = ["--redis-url", cf.url, "--log-root", str(logs)]
    env = {"SQM_OPERATOR_TOKEN": "op-tok"}
    srv = start_server(cf.url, tmp_path, "QM1", "--token", "tok", env=env)
    try:
        ok("cfemu", "define", "structure", S, *where)
        ok("cfemu", "define", "queue", "BQ", "--structure", S, *where)
        ok("cfemu", "define", "queue", SVC, "--structure", S, "--uow", "--status-lifetime", "2",
           "--postpone-attempts", "1", "--postpone-delay", "3600", "--backout-queue", "BQ", *where)
        run_backup(cf.client(), S, tmp_path / "backups", log_root=logs)  # before every change below
        operator = ["--server", srv.endpoint, "--token", "op-tok"]
        with Client(srv.endpoint, token="tok") as a, Client(srv.endpoint, token="tok") as b:
            a.logon("alice", "a-tok")
            b.logon("bob", "b-tok")
            postponed = a.send(SVC, b"postponed", commit=True)["uow"]
            delivered = a.send(SVC, b"delivered", commit=True)["uow"]
            accepted = a.send(SVC, b"accepted", commit=True)["uow"]
            assert b.receive(SVC, option="SYNC")["uow"] == postponed
            assert b.syncpoint("CANCEL")["status"] == "POSTPONED"  # for an hour of up-time
            assert b.receive(SVC, option="SYNC")["uow"] == delivered  # held by bob
            received = a.send(SVC, b"received")["uow"]  # alice's open UOW

            # Allowed: POSTPONED -> ACCEPTED, ACCEPTED -> CANCELLED (its message to the backout queue)
            d = json.loads(ok("cfemu", "uow", "set-uow-status", postponed, "ACCEPTED", "--json", *operator))
            assert (d["was"], d["status"], d["uow"]) == ("POSTPONED", "ACCEPTED", postponed)
            line = ok("cfemu", "uow", "set-uow-status", accepted, "CANCELLED", *operator)
            assert f"unit of work {accepted}: ACCEPTED -> CANCELLED" in line and "moved to BQ" in line
            bq = json.loads(ok("cfemu", "browse", "BQ", "--json", *operator))["messages"]
            assert [m["body"] for m in bq] == ["accepted"]

            # Refused, one line each, nothing changed
            for uow, status, why in [
                    (postponed, "ACCEPTED", "operator SET-UOW-STATUS ACCEPTED is not allowed in status ACCEPTED "
                                            "(only in POSTPONED)"),
                    (delivered, "CANCELLED", "is not allowed in status DELIVERED (only in ACCEPTED, POSTPONED)"),
                    (received, "ACCEPTED", "is not allowed in status RECEIVED (only in POSTPONED)"),
                    (accepted, "ACCEPTED", "is not allowed in status CANCELLED"),
                    ("00" * 16, "CANCELLED", "is not known")]:
                assert why in fails("uow", "set-uow-status", uow, status, *operator), (uow, status)
            assert "invalid choice: 'PROCESSED'" in fails("uow", "set-uow-status", delivered, "PROCESSED", *operator)
            with pytest.raises(NotAuthorizedError):  # an application may not
                a.set_uow_status(postponed, "CANCELLED")
            assert [a.syncpoint("QUERY", u)["status"] for u in (postponed, accepted, delivered, received)] == [
                "ACCEPTED", "CANCELLED", "DELIVERED", "RECEIVED"]
        assert "SET-UOW-STATUS by the operator on connection" in srv.log_text()
        assert f"unit of work {postponed} of service {SVC} from POSTPONED to ACCEPTED" in srv.log_text()

        # The member killed, the CF lost: restored from the backup (taken before the changes) and the log
        srv.stop(signal.SIGKILL)
        cf.kill()
        cf.start()
        run_restore(cf.client(), S, backup_root=tmp_path / "backups", log_root=logs)
        srv = start_server(cf.url, tmp_path, "QM1", "--token", "tok", env=env)
        with Client(srv.endpoint, token="tok") as c:
            c.logon("carol", "c-tok")
            assert c.syncpoint("QUERY", accepted)["status"] == "CANCELLED"  # a persistent status: kept
            got = c.receive(SVC, option="SYNC", wait_ms=10_000)  # ACCEPTED: receivable, before its hour is over
            assert got["uow"] in (postponed, delivered)
            seen = {got["uow"]}
            c.syncpoint("COMMIT")
            seen.add(c.receive(SVC, option="SYNC", wait_ms=10_000)["uow"])
            c.syncpoint("COMMIT")
            assert seen == {postponed, delivered}  # bob's, ACCEPTED again when his session ended
    finally:
        srv.stop()
        cf.stop()
