"""The REST door in the chaos suite: the checker's at-most-once rule for REST gets on crafted histories (a message may
go missing only where a REST get's outcome is unknown, one message per such get, and is never received twice), and
the REST runner's record of each HTTP exchange, against a small HTTP server on loopback that answers as told."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qsg.chaos.bodies import make_body, parse_body
from qsg.chaos.history import History, load_history, pair_ops
from qsg.chaos.put_spec import PutSpec
from qsg.chaos.rest_actions import EMPTY, Rest, RestRunner, RestSession
from tests.qsg.chaos.test_checker import Hist, only

REST = {"via": "rest"}


def rest_put(h: Hist, msg: str, *, queue: str = "Q1", outcome: str = "ok", status: int = 201) -> None:
    h.op("c1-rest", "put", outcome, {"status": status, "qmgr": "QM1"}, **REST, msg=msg, queue=queue, priority=0,
         persistent=True, syncpoint=False, expiry_ms=0)


def rest_get(h: Hist, msg: str | None, *, queue: str = "Q1", outcome: str = "ok") -> None:
    """A REST get: ok with the message received (200), or unknown with none (the exchange broke)."""
    result = {"msg": msg, "crc_ok": True, "queue": queue, "priority": 0, "persistent": True, "status": 200} \
        if msg is not None else {"reason": "ConnectionResetError"}
    h.op("c2-rest", "get", outcome, result, **REST, queue=queue, syncpoint=False, wait_ms=0)


def test_a_rest_acknowledged_put_missing_without_an_unknown_rest_get_is_lost() -> None:
    h = Hist()
    rest_put(h, "m1")
    rest_put(h, "m2")
    h.drain("m2")
    only(h.findings(), "lost")


def test_a_message_received_by_rest_and_by_the_native_client_is_duplicated() -> None:
    h = Hist()
    rest_put(h, "m1")
    rest_get(h, "m1")
    h.get("c", "c.1", "m1")
    h.commit("c", "c.1")
    only(h.findings(), "duplicated")
    h = Hist()  # twice by REST
    h.put_committed("p", "m1")
    rest_get(h, "m1")
    rest_get(h, "m1")
    only(h.findings(), "duplicated")


def test_a_message_missing_after_an_unknown_rest_get_is_allowed_and_counted() -> None:
    h = Hist()
    rest_put(h, "m1")
    h.put_committed("p", "m2")
    rest_get(h, None, outcome="unknown")  # took m1 or m2, and the reply never came
    h.drain("m2")
    result_counts = check_counts(h)
    assert all(v == 0 for v in h.findings().values()), h.findings()
    assert result_counts["missing after an unknown REST get (allowed: at-most-once)"] == 1


def test_each_unknown_rest_get_accounts_for_one_missing_message_at_most() -> None:
    h = Hist()
    rest_put(h, "m1")
    h.put_committed("p", "m2")
    rest_get(h, None, outcome="unknown")
    only(h.findings(), "lost")  # two missing, one get: one of them is lost
    h.put_committed("p", "m3")
    rest_get(h, None, outcome="unknown")
    only(h.findings(), "lost")  # three missing, two gets: one of them is lost
    rest_get(h, None, outcome="unknown")
    assert all(v == 0 for v in h.findings().values()), h.findings()  # three gets: each accounts for one


def test_a_committed_unit_of_work_whose_message_an_unknown_rest_get_took_is_whole() -> None:
    """Seen in chaos runs (seed 15, peer-clock-skew): UOW c0.492 put three messages on Q3 and committed (ok); a REST
    get on the victim member took two of them, the second just before the member died after forcing that get's
    COMMIT (failpoint after-log-force), and its peer's recovery completed the get; the REST exchange broke
    (unknown). The message was consumed for nobody, as the at-most-once rule allows: the lost rule excused it, but
    the atomicity rule counted it as a put that did not take effect and reported the unit of work half done."""
    h = Hist()
    h.put("c0", "c0.492", "m1", queue="Q3")
    h.put("c0", "c0.492", "m2", queue="Q3")
    h.put("c0", "c0.492", "m3", queue="Q3")
    h.put_committed("p", "n1")
    h.get("c0", "c0.492", "n1")
    h.commit("c0", "c0.492")
    rest_get(h, "m2", queue="Q3")
    rest_get(h, None, outcome="unknown", queue="Q3")  # took m3: the member died after forcing the get's commit
    h.drain("m1", "Q3")
    result_counts = check_counts(h)
    assert all(v == 0 for v in h.findings().values()), h.findings()
    assert result_counts["missing after an unknown REST get (allowed: at-most-once)"] == 1
    # One message per unknown get: a second message of the unit of work missing is a half-done unit of work.
    h = Hist()
    h.put("c0", "c0.1", "m1", queue="Q3")
    h.put("c0", "c0.1", "m2", queue="Q3")
    h.put("c0", "c0.1", "m3", queue="Q3")
    h.commit("c0", "c0.1")
    rest_get(h, None, outcome="unknown", queue="Q3")
    h.drain("m1", "Q3")
    findings = h.findings()
    assert findings["atomicity"] == 1 and findings["lost"] == 1, findings
    # Nor does a get on another queue account for one.
    h = Hist()
    h.put("c0", "c0.1", "m1", queue="Q3")
    h.put("c0", "c0.1", "m2", queue="Q3")
    h.commit("c0", "c0.1")
    rest_get(h, None, outcome="unknown", queue="Q1")
    h.drain("m1", "Q3")
    findings = h.findings()
    assert findings["atomicity"] == 1 and findings["lost"] == 1, findings


def test_an_unknown_unit_of_work_whose_message_an_unknown_rest_get_may_have_taken_is_not_half_done() -> None:
    """The same for a unit of work whose commit's outcome is unknown: its one delivered message says it committed,
    the other one an unknown REST get may have taken."""
    h = Hist()
    h.put("c0", "c0.1", "m1", queue="Q3")
    h.put("c0", "c0.1", "m2", queue="Q3")
    h.commit("c0", "c0.1", outcome="unknown")
    rest_get(h, None, outcome="unknown", queue="Q3")
    h.drain("m1", "Q3")
    assert all(v == 0 for v in h.findings().values()), h.findings()


def test_an_unknown_rest_get_excuses_no_message_of_another_queue_nor_one_put_long_after_it() -> None:
    h = Hist()
    rest_get(h, None, outcome="unknown", queue="Q2")
    rest_put(h, "m1")
    only(h.findings(), "lost")  # another queue
    h = Hist()
    rest_get(h, None, outcome="unknown")
    h.t += 30.0  # the get's server side was over long before the message was put
    rest_put(h, "m1")
    only(h.findings(), "lost")


def test_a_pending_rest_get_delivers_and_a_failed_one_excuses_nothing() -> None:
    h = Hist()
    h.put_committed("p", "m1")
    rest_get(h, "m1", outcome="unknown")  # 200 with ibm-mq-outcome: pending: delivered, perhaps again later
    h.drain("m1")
    assert all(v == 0 for v in h.findings().values()), h.findings()
    h = Hist()
    h.put_committed("p", "m1")
    h.op("c2-rest", "get", "fail", {"status": 503, "reason": "MQWB0303E 2373"}, **REST, queue="Q1",
         syncpoint=False, wait_ms=0)  # refused: the door backed its get out
    only(h.findings(), "lost")


def test_a_rest_get_after_backouts_comes_after_them_though_the_door_tells_no_backout_count() -> None:
    """Seen in a chaos run (seed 2, short kinds): a REST get that waited (asked before a native get took the message,
    answered after that get's backout gave it back), and one that took a message backed out twice, sorted before the
    deliveries they followed (the REST delivery has no backout count, and was asked first): the aborted native get
    looked like the one that took the message, an atomicity finding of a UOW that was backed out."""
    h = Hist()
    h.put_committed("p", "m1", "m2")
    h.n += 1  # the REST get is asked first and waits (its invocation now, its answer after the backout)
    rest_id, asked = h.n, h.t + 0.005
    h.events.append({"type": "invoke", "id": rest_id, "t": asked, "client": "c2-rest", "op": "get", **REST,
                     "queue": "Q1", "syncpoint": False, "wait_ms": 300})
    h.get("c", "c.1", "m1")
    h.put("c", "c.1", "m2x")
    h.backout("c", "c.1")
    h.t += 0.01
    h.events.append({"type": "ok", "id": rest_id, "t": round(h.t, 4), "msg": "m1", "crc_ok": True, "queue": "Q1",
                     "priority": 0, "persistent": True, "status": 200})
    for n, uow in enumerate(("c.2", "c.3")):  # m2 backed out twice, then taken by REST
        h.get("c", uow, "m2", backout_count=n)
        h.put("c", uow, f"m2x{n}")
        h.backout("c", uow)
    rest_get(h, "m2")
    assert all(v == 0 for v in h.findings().values()), h.findings()


def test_a_rest_get_answered_after_its_member_was_held_up_came_before_the_get_that_consumed_the_message() -> None:
    """Seen in a chaos run (seed 2, disk-full and sqm-pause): a DELETE on a member that was paused as it took the
    message; its peer fenced it and backed its get out, a native get took the message (backout count 1) and committed;
    the member, resumed, committed the get, was fenced, and answered 200 with ``ibm-mq-outcome: unknown``. The REST
    take came first: it is not a second consumer, and the native unit of work is whole."""
    h = Hist()
    h.put_committed("p", "m1")
    h.n += 1
    rest_id, asked = h.n, h.t + 0.005
    h.events.append({"type": "invoke", "id": rest_id, "t": asked, "client": "c4-rest", "op": "get", **REST,
                     "queue": "Q1", "syncpoint": False, "wait_ms": 0})
    h.t += 3.0  # the member is paused; its peer recovers it
    h.put("c", "c.1", "m2")
    h.get("c", "c.1", "m1", backout_count=1)
    h.commit("c", "c.1")
    h.t += 0.1
    h.events.append({"type": "unknown", "id": rest_id, "t": round(h.t, 4), "reason": "ibm-mq-outcome: unknown",
                     "msg": "m1", "crc_ok": True, "queue": "Q1", "priority": 0, "persistent": True, "status": 200})
    h.drain("m2")
    assert all(v == 0 for v in h.findings().values()), h.findings()
    # The same REST answer for a get asked after the native get had consumed the message: delivered twice.
    h = Hist()
    h.put_committed("p", "m1")
    h.get("c", "c.1", "m1")
    h.commit("c", "c.1")
    rest_get(h, "m1", outcome="unknown")
    assert h.findings()["duplicated"] == 1, h.findings()


def check_counts(h: Hist) -> dict[str, int]:
    from qsg.chaos.checker import check

    return check(h.events).counts


# --- the runner's record of each exchange, against an HTTP server that answers as told ------------------------------
class Door(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next of ``script``: a status (with headers and body) or "reset" (the connection
    closed with no reply)."""

    script: list[Any] = []
    received: list[tuple[str, str, dict[str, str], bytes]] = []

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.received.append((self.command, self.path, dict(self.headers), body))
        what = self.script.pop(0)
        if what == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            self.close_connection = True
            return
        status, headers, data = what
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def door() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Door)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    Door.script, Door.received = [], []
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def ibm_error(status: int, reason: int) -> tuple[int, dict[str, str], bytes]:
    body = {"error": [{"msgId": "MQWB0303E", "reasonCode": reason, "completionCode": 2, "message": "x"}]}
    return status, {"Content-Type": "application/json"}, json.dumps(body).encode()


def test_the_runner_records_what_each_exchange_said(door: int, tmp_path: Path) -> None:
    h = History(tmp_path / "h.jsonl")
    # QM9's port refuses connections: nothing sent, the next member (QM1) answers.
    s = RestSession(h, [("QM9", "127.0.0.1", closed_port()), ("QM1", "127.0.0.1", door)], "c1-rest", token="tok")
    r = RestRunner(h, s, "c1.1")
    msg_body = make_body("7-1-1", 100)
    Door.script = [(201, {"ibm-mq-md-messageId": "ID:00"}, b""), ibm_error(503, 2373), ibm_error(500, 2124), "reset",
                   (200, {"ibm-mq-md-priority": "5", "ibm-mq-md-persistence": "persistent"}, msg_body),
                   (200, {"ibm-mq-outcome": "pending"}, msg_body), (204, {}, b""), "reset", ibm_error(503, 2161)]
    puts = [PutSpec(f"7-1-{n}", "Q1", 5, n % 2 == 0, 0, 100) for n in range(1, 5)]
    assert [r.put(p) for p in puts] == ["ok", "fail", "unknown", "unknown"]
    assert [r.get("Q2", 100) for _ in range(5)] == ["ok", "unknown", EMPTY, "unknown", "fail"]
    s.endpoints = [("QM9", "127.0.0.1", closed_port())]
    assert r.put(PutSpec("7-1-9", "Q1", 0, True, 0, 10)) == "fail"  # no member took the connection: not sent
    assert r.get("Q1", 0) == "fail"
    h.close()
    ops, _ = pair_ops(load_history(tmp_path / "h.jsonl"))
    assert all(o.args["via"] == "rest" and "uow" not in o.args and o.args["syncpoint"] is False for o in ops)
    assert [(o.op, o.outcome) for o in ops] == [
        ("put", "ok"), ("put", "fail"), ("put", "unknown"), ("put", "unknown"), ("get", "ok"), ("get", "unknown"),
        ("get", "fail"), ("get", "unknown"), ("get", "fail"), ("put", "fail"), ("get", "fail")]
    assert ops[0].result["qmgr"] == "QM1" and ops[1].result["reason"] == "MQWB0303E 2373"
    assert ops[4].result | {} == {"msg": "7-1-1", "crc_ok": True, "queue": "Q2", "priority": 5, "persistent": True,
                                  "qmgr": "QM1", "status": 200}
    assert ops[5].result["msg"] == "7-1-1" and "msg" not in ops[7].result and ops[6].result["status"] == 204
    # What went over the wire: the workload's body, as text, with the persistence and priority headers, the token,
    # the CSRF header; gets are DELETEs with their wait.
    method, path, headers, body = Door.received[0]
    assert method == "POST" and path == "/ibmmq/rest/v3/messaging/qmgr/QM1/queue/Q1/message"
    assert parse_body(body) == ("7-1-1", True) and body.decode("ascii")
    assert headers["ibm-mq-md-persistence"] == "nonPersistent" and headers["ibm-mq-md-priority"] == "5"
    assert headers["Authorization"] == "Bearer tok" and "ibm-mq-rest-csrf-token" in headers
    assert Door.received[1][2]["ibm-mq-md-persistence"] == "persistent"
    assert Door.received[4][:2] == ("DELETE", "/ibmmq/rest/v3/messaging/qmgr/QM1/queue/Q2/message?wait=100")


def test_an_action_runs_all_its_puts_or_gets(door: int, tmp_path: Path) -> None:
    h = History(tmp_path / "h.jsonl")
    r = RestRunner(h, RestSession(h, [("QM1", "127.0.0.1", door)], "c1-rest", token=None), "c1.1")
    Door.script = [(201, {}, b""), (201, {}, b""), (204, {}, b""), ibm_error(503, 2373)]
    assert r.run(Rest(puts=(PutSpec("a", "Q1", 0, True, 0, 10), PutSpec("b", "Q3", 0, False, 4000, 10))))
    assert not r.run(Rest(gets=("Q1", "Q2")))  # the second was refused
    assert "Authorization" not in Door.received[0][2] and Door.received[1][2]["ibm-mq-md-expiry"] == "4000"


def test_a_member_whose_clients_are_cut_off_is_skipped_as_one_that_refuses(door: int, tmp_path: Path) -> None:
    """A fault that cuts a member's clients off (its client proxy) cuts the REST clients off it too: nothing is sent
    to it, the next member is tried, and with none left the call failed (it sent nothing)."""
    h = History(tmp_path / "h.jsonl")
    cut = {"QM1"}
    s = RestSession(h, [("QM1", "127.0.0.1", door), ("QM2", "127.0.0.1", door)], "c1-rest", token=None,
                    reachable=lambda name: name not in cut)
    r = RestRunner(h, s, "c1.1")
    Door.script = [(201, {}, b"")]
    assert r.put(PutSpec("a", "Q1", 0, True, 0, 10)) == "ok"
    assert Door.received[0][1].startswith("/ibmmq/rest/v3/messaging/qmgr/QM2/")
    cut.add("QM2")
    assert r.get("Q1", 0) == "fail" and len(Door.received) == 1
