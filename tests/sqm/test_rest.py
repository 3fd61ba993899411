"""The IBM MQ messaging REST API (docs/rest.md) of a real `sqm run` member, driven with curl and with urllib: each
status code and header IBM documents, selection, wait, priority, persistence, expiry, user properties, the
native client on the other side, and a kill -9 right after a 201."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest

from cfemu.admin import Admin
from cfemu.connection import connect
from sqm.core.connection import MAX_EXPIRY_MS
from sqm.service.client import Client
from tests.support.certs import issue, make_ca
from tests.support.service_proc import OP_TOKEN, TOKEN, TOKENS_ENV, ServerProc, start_server

QUEUES = (*(f"RQ{i}" for i in range(1, 21)), "RBQ")
POISON_Q, BACKOUT_Q, THRESHOLD = "RPQ", "RBQ", 2  # RPQ: backout threshold 2, backout queue RBQ
CSRF = {"ibm-mq-rest-csrf-token": "x"}
TEXT = {"Content-Type": "text/plain;charset=utf-8"}


@dataclass
class Member:
    server: ServerProc
    rest_port: int
    tmp: Path
    url: str

    def base(self, queue: str, qmgr: str | None = None, version: str = "v3") -> str:
        return (f"http://127.0.0.1:{self.rest_port}/ibmmq/rest/{version}/messaging/qmgr/"
                f"{qmgr or self.server.name}/queue/{queue}")


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> dict[str, Any]:
        err = self.json()["error"]
        assert isinstance(err, list) and len(err) == 1, err
        item = err[0]
        assert item["type"] == "rest" and item["msgId"].startswith("MQWB") and item["message"], item
        assert {"explanation", "action"} <= item.keys(), item
        return dict(item)


def basic(token: str = TOKEN, user: str = "app1") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()}


def http(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
         *, auth: bool = True, timeout: float = 30.0) -> Reply:
    """A request with urllib (a plain HTTP client)."""
    h = {**(basic() if auth else {}), **(headers or {})}
    req = urllib.request.Request(url, data=body, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def put(m: Member, queue: str, text: str, **headers: str) -> str:
    r = http("POST", m.base(queue) + "/message", text.encode(), {**CSRF, **TEXT, **headers})
    assert r.status == 201, (r.status, r.body)
    return r.headers["ibm-mq-md-messageid"]


def take(m: Member, queue: str, query: str = "") -> Reply:
    return http("DELETE", m.base(queue) + "/message" + query, headers=CSRF)


def curl(*args: str) -> tuple[int, dict[str, str], bytes]:
    """curl -i: (status, headers, body)."""
    out = subprocess.run(["curl", "-sS", "-i", "--max-time", "30", *args], capture_output=True, check=True,
                         timeout=60).stdout
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, body


def start_member(url: str, tmp: Path, name: str = "QM1", *args: str) -> Member:
    server = start_server(url, tmp, name, "--rest-port", "0", *args)
    info = json.loads((tmp / f"{name}.ready").read_text())
    return Member(server, int(info["rest_port"]), tmp, url)


@pytest.fixture(scope="module")
def member(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Member]:
    client = redis_server.client()
    client.flushall()
    client.close()
    r = connect(redis_server.url)
    Admin(r).ensure_structure("APP1", QUEUES)
    Admin(r).define_queue(POISON_Q, "APP1", backout_threshold=THRESHOLD, backout_queue=BACKOUT_Q)
    r.close()
    m = start_member(redis_server.url, tmp_path_factory.mktemp("rest"))
    try:
        yield m
    finally:
        m.server.stop()


# --- curl: what the README shows, and the documented status codes ------------------------------------------------
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_round_trip_and_refusals(member: Member) -> None:
    url = member.base("RQ1") + "/message"
    user = f"app:{TOKEN}"
    status, headers, _ = curl("-u", user, "-H", "ibm-mq-rest-csrf-token: x", "-H",
                              "Content-Type: text/plain;charset=utf-8", "-X", "POST", url, "-d", "hello")
    assert status == 201 and headers["ibm-mq-md-messageid"].startswith("ID:")
    assert len(headers["ibm-mq-md-messageid"]) == 3 + 48
    status, headers, body = curl("-u", user, "-H", "ibm-mq-rest-csrf-token: x", "-X", "DELETE", url)
    assert (status, body) == (200, b"hello")
    assert headers["content-type"].startswith("text/plain") and "utf-8" in headers["content-type"]
    assert headers["ibm-mq-md-persistence"] == "persistent" and headers["ibm-mq-md-expiry"] == "unlimited"
    status, _, body = curl("-u", user, "-H", "ibm-mq-rest-csrf-token: x", "-X", "DELETE", url)
    assert (status, body) == (204, b"")
    # a bearer token instead of basic auth
    status, _, _ = curl("-H", f"Authorization: Bearer {TOKEN}", "-H", "ibm-mq-rest-csrf-token: x", "-H",
                        "Content-Type: text/plain", "-X", "POST", url, "-d", "b")
    assert status == 201
    assert take(member, "RQ1").body == b"b"
    # 401: no credentials, with a challenge
    status, headers, body = curl("-H", "ibm-mq-rest-csrf-token: x", "-X", "DELETE", url)
    assert status == 401 and "Basic" in headers["www-authenticate"]
    assert json.loads(body)["error"][0]["msgId"] == "MQWB0104E"
    # 403: no CSRF header
    status, _, body = curl("-u", user, "-H", "Content-Type: text/plain", "-X", "POST", url, "-d", "x")
    assert status == 403 and json.loads(body)["error"][0]["msgId"] == "MQWB0100E"
    # 415: not a text body
    status, _, body = curl("-u", user, "-H", "ibm-mq-rest-csrf-token: x", "-H", "Content-Type: image/png", "-X",
                           "POST", url, "-d", "x")
    assert status == 415 and json.loads(body)["error"][0]["msgId"] == "MQWB0306E"
    # 404: another queue manager
    status, _, body = curl("-u", user, "-X", "GET", member.base("RQ1", qmgr="QMX") + "/message")
    err = json.loads(body)["error"][0]
    assert status == 404 and err["msgId"] == "MQWB0009E" and err["reasonCode"] == 2058
    assert err["completionCode"] == 2
    assert take(member, "RQ1").status == 204  # nothing was put by the refused requests


# --- urllib: every status and header ------------------------------------------------------------------------------
def test_put_get_headers_and_empty(member: Member) -> None:
    mid = put(member, "RQ2", "héllo wörld", **{"ibm-mq-md-correlationId": "order-17"})
    assert mid.startswith("ID:")
    r = take(member, "RQ2")
    assert r.status == 200 and r.body.decode("utf-8") == "héllo wörld"
    assert r.headers["ibm-mq-md-messageid"] == mid
    assert r.headers["ibm-mq-md-correlationid"] == "order-17"
    assert r.headers["ibm-mq-md-priority"] == "0"
    assert take(member, "RQ2").status == 204


def test_refusals(member: Member) -> None:
    url = member.base("RQ3") + "/message"
    r = http("POST", url, b"x", {**CSRF, **TEXT}, auth=False)
    assert r.status == 401 and "www-authenticate" in r.headers and r.error()["msgId"] == "MQWB0104E"
    r = http("POST", url, b"x", {**CSRF, **TEXT, **basic("not-a-token")}, auth=False)
    assert r.status == 401 and r.error()["reasonCode"] == 2035
    r = http("POST", url, b"x", TEXT)
    assert r.status == 403 and r.error()["msgId"] == "MQWB0100E"
    r = http("DELETE", url)
    assert r.status == 403, "DELETE changes state: it needs the CSRF header too"
    r = http("POST", url, b"x", {**CSRF, "Content-Type": "application/octet-stream"})
    assert r.status == 415
    r = http("POST", url, b"x", {**CSRF, "Content-Type": "text/plain;charset=iso-8859-1"})
    assert r.status == 415 and r.error()["msgId"] == "MQWB0305E"
    r = http("POST", member.base("RQ3", qmgr="NOPE") + "/message", b"x", {**CSRF, **TEXT})
    assert r.status == 404 and r.error()["msgId"] == "MQWB0009E"
    r = http("POST", member.base("NOSUCHQ") + "/message", b"x", {**CSRF, **TEXT})
    assert r.status == 404 and r.error()["reasonCode"] == 2085
    r = http("GET", f"http://127.0.0.1:{member.rest_port}/ibmmq/rest/v3/admin/qmgr")
    assert r.status == 404 and r.error()["msgId"] == "MQWB0006E"
    r = http("PUT", url, b"x", {**CSRF, **TEXT})
    assert r.status == 405 and "POST" in r.headers["allow"]
    r = http("DELETE", url, headers={**CSRF, "Accept": "application/json"})
    assert r.status == 406
    for header, value in (("ibm-mq-md-persistence", "sometimes"), ("ibm-mq-md-priority", "12"),
                          ("ibm-mq-md-expiry", "soon"), ("ibm-mq-md-correlationId", "ID:zz")):
        r = http("POST", url, b"x", {**CSRF, **TEXT, header: value})
        assert r.status == 400 and r.error()["msgId"] == "MQWB0302E", (header, r.body)
    r = http("DELETE", url + "?wait=forever", headers=CSRF)
    assert r.status == 400
    assert take(member, "RQ3").status == 204  # nothing was put by a refused request


def post_raw(m: Member, queue: str, headers: list[tuple[str, str]]) -> Reply:
    """A POST with http.client, its headers as given: repeated, differing in case only, each value's characters
    sent as the bytes of the same codes (latin-1: "\\xc2\\xb2" is the UTF-8 of ², "\\xff" a byte that is not UTF-8)."""
    c = HTTPConnection("127.0.0.1", m.rest_port, timeout=30)
    try:
        c.putrequest("POST", m.base(queue).split(str(m.rest_port), 1)[1] + "/message")
        for k, v in [*basic().items(), *CSRF.items(), *TEXT.items(), ("Content-Length", "1"), *headers]:
            c.putheader(k, v.encode("latin-1"))
        c.endheaders(b"x")
        r = c.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        c.close()


SUPERSCRIPT_TWO = "\xc2\xb2"  # ², a digit to str.isdigit, not to int()


def test_numbers_are_ascii_digits_within_bounds(member: Member) -> None:
    """A superscript digit, 5000 digits, an expiry past MQ's: a 400 naming the value, never a bare 500."""
    url = member.base("RQ20") + "/message"
    for query in ("?wait=%C2%B2", "?wait=" + "1" * 5000):
        r = http("DELETE", url + query, headers=CSRF)
        assert r.status == 400 and r.error()["msgId"] == "MQWB0118E", r.body
    for limit in ("%C2%B2", "1" * 5000):
        r = http("GET", member.base("RQ20") + "/messagelist?limit=" + limit)
        assert r.status == 400 and r.error()["msgId"] == "MQWB0118E", r.body
    for header, value in (("ibm-mq-md-priority", SUPERSCRIPT_TWO), ("ibm-mq-md-expiry", SUPERSCRIPT_TWO),
                          ("ibm-mq-md-expiry", str(MAX_EXPIRY_MS + 1)), ("ibm-mq-md-expiry", "9" * 5000)):
        r = post_raw(member, "RQ20", [(header, value)])
        assert r.status == 400 and r.error()["msgId"] == "MQWB0302E" and header in r.error()["message"], r.body
    put(member, "RQ20", "longest", **{"ibm-mq-md-expiry": str(MAX_EXPIRY_MS)})
    assert take(member, "RQ20").body == b"longest"
    assert take(member, "RQ20").status == 204  # nothing was put by a refused request


def test_user_property_headers_given_once_with_a_name_in_utf8(member: Member) -> None:
    """Two ibm-mq-usr-x headers, x and X, an empty name, a byte that is not UTF-8: a 400 MQWB0302E naming the
    header, nothing put (no last one winning silently, no two properties of one case-insensitive header)."""
    for headers, named in (([("ibm-mq-usr-x", "one"), ("ibm-mq-usr-x", "two")], "ibm-mq-usr-x"),
                           ([("ibm-mq-usr-x", "one"), ("ibm-mq-usr-X", "two")], "ibm-mq-usr-X"),
                           ([("ibm-mq-usr-", "v")], "ibm-mq-usr-'"),
                           ([("ibm-mq-usr-bad", "caf\xe9")], "ibm-mq-usr-bad")):
        r = post_raw(member, "RQ20", headers)
        assert r.status == 400 and r.error()["msgId"] == "MQWB0302E", (headers, r.body)
        assert named in r.error()["message"], r.error()["message"]
        assert "surrogates" not in r.body.decode()
    r = post_raw(member, "RQ20", [("ibm-mq-usr-x", "caf\xc3\xa9")])  # café in UTF-8
    assert r.status == 201
    assert http("GET", member.base("RQ20") + "/messagelist").json()["messages"][0]["userProperties"] == {"x": "café"}
    assert take(member, "RQ20").status == 200 and take(member, "RQ20").status == 204


def test_group_name_is_a_qmgr_too(member: Member) -> None:
    group = Admin(connect(member.url)).group_name()
    r = http("POST", member.base("RQ4", qmgr=group) + "/message", b"g", {**CSRF, **TEXT})
    assert r.status == 201
    assert http("DELETE", member.base("RQ4", qmgr=group) + "/message", headers=CSRF).body == b"g"


def test_browse_leaves_the_message(member: Member) -> None:
    first = put(member, "RQ5", "one", **{"ibm-mq-md-correlationId": "c1"})
    second = put(member, "RQ5", "two")
    r = http("GET", member.base("RQ5") + "/message")  # no CSRF header needed to browse
    assert r.status == 200 and r.body == b"one" and r.headers["ibm-mq-md-messageid"] == first
    r = http("GET", member.base("RQ5") + f"/message?messageId={second}")
    assert r.status == 200 and r.body == b"two"
    r = http("GET", member.base("RQ5") + "/message?correlationId=c1")
    assert r.body == b"one"
    r = http("GET", member.base("RQ5") + "/messagelist")
    assert r.status == 200 and r.headers["content-type"].startswith("application/json")
    listed = r.json()["messages"]
    assert [x["messageId"] for x in listed] == [first, second]
    assert listed[0]["correlationId"] == "c1" and listed[0]["persistence"] == "persistent"
    assert listed[0]["putDateTime"].endswith("Z")
    assert take(member, "RQ5").body == b"one" and take(member, "RQ5").body == b"two"
    assert http("GET", member.base("RQ5") + "/message").status == 204
    assert http("GET", member.base("RQ5") + "/messagelist").json() == {"messages": []}


def test_selection_by_correlation_and_message_id(member: Member) -> None:
    put(member, "RQ6", "a", **{"ibm-mq-md-correlationId": "alpha"})
    mid_b = put(member, "RQ6", "b", **{"ibm-mq-md-correlationId": "ID:" + b"beta".hex()})
    put(member, "RQ6", "c")
    r = take(member, "RQ6", f"?messageId={mid_b}")
    assert r.body == b"b" and r.headers["ibm-mq-md-correlationid"] == "beta"
    assert take(member, "RQ6", "?correlationId=alpha").body == b"a"
    assert take(member, "RQ6", "?correlationId=alpha").status == 204
    assert take(member, "RQ6").body == b"c"


def test_wait_for_a_message(member: Member) -> None:
    t0 = time.monotonic()
    assert take(member, "RQ7", "?wait=300").status == 204
    assert time.monotonic() - t0 >= 0.25
    later = threading.Timer(0.5, lambda: put(member, "RQ7", "late"))
    later.start()
    try:
        t0 = time.monotonic()
        r = take(member, "RQ7", "?wait=10000")
        assert r.status == 200 and r.body == b"late" and time.monotonic() - t0 < 9
    finally:
        later.join()


def test_a_waiting_get_whose_caller_left_takes_nothing(member: Member) -> None:
    """The caller hangs up while its DELETE waits; the message that comes next is backed out, not lost."""
    gone = subprocess.run(["curl", "-sS", "--max-time", "0.5", "-u", f"app:{TOKEN}", "-H",
                           "ibm-mq-rest-csrf-token: x", "-X", "DELETE", member.base("RQ14") + "/message?wait=3000"],
                          capture_output=True, timeout=30)
    assert gone.returncode != 0  # curl gave up (timed out)
    put(member, "RQ14", "for someone else")
    time.sleep(0.5)  # the abandoned get takes it, sees its caller gone, backs it out
    r = take(member, "RQ14", "?wait=5000")
    assert r.status == 200 and r.body == b"for someone else"


def send_waiting_get(m: Member, queue: str, wait_ms: int) -> socket.socket:
    """A DELETE ?wait=wait_ms sent on a connection of its own, its reply not read yet."""
    s = socket.create_connection(("127.0.0.1", m.rest_port), timeout=60)
    s.sendall((f"DELETE {m.base(queue).split(str(m.rest_port), 1)[1]}/message?wait={wait_ms} HTTP/1.1\r\n"
               f"Host: x\r\nAuthorization: {basic()['Authorization']}\r\nibm-mq-rest-csrf-token: x\r\n"
               "Content-Length: 0\r\nConnection: close\r\n\r\n").encode())
    return s


def reply_of(s: socket.socket) -> tuple[int, bytes]:
    """(status, body) of the one reply on a connection that closes after it."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_abandoned_waiting_gets_free_their_threads_and_take_nothing(member: Member) -> None:
    """40 waiting DELETEs whose callers hung up: another client's POST is not held up (it waited for a thread a
    whole wait long), and a message that arrives is not taken and backed out by a get nobody waits for (it came
    back to the next consumer as a redelivery, its backout count raised)."""
    waiters = [send_waiting_get(member, "RQ15", 20000) for _ in range(40)]
    time.sleep(0.3)
    for s in waiters:
        s.close()
    time.sleep(0.5)  # the member sees them gone at its next poll of the CF
    t0 = time.monotonic()
    put(member, "RQ16", "not held up")
    assert time.monotonic() - t0 < 3
    put(member, "RQ15", "for someone who is there")
    time.sleep(0.5)
    with Client(member.server.endpoint, token=TOKEN) as c:
        m = c.get("RQ15", wait_ms=2000)
        c.commit()
    assert m.body == b"for someone who is there" and m.backout_count == 0
    assert take(member, "RQ16").body == b"not held up"


def test_waiting_gets_do_not_hold_up_puts(member: Member) -> None:
    """40 DELETEs waiting, their callers there: a put (another client's) runs at once, and every waiting get,
    in a thread or in line, gets one of the messages put next."""
    waiters = [send_waiting_get(member, "RQ17", 20000) for _ in range(40)]
    time.sleep(0.5)
    t0 = time.monotonic()
    put(member, "RQ18", "not held up")
    assert time.monotonic() - t0 < 3
    for i in range(40):
        put(member, "RQ17", f"m{i}")
    replies = [reply_of(s) for s in waiters]
    assert sorted(body for _, body in replies) == sorted(f"m{i}".encode() for i in range(40))
    assert {status for status, _ in replies} == {200}
    assert take(member, "RQ18").body == b"not held up"


def test_rest_workers_bound_the_waiting_gets(fresh_redis: Any, tmp_path: Path) -> None:
    """--rest-workers 1: one get waits in a thread, the others wait in line, each no longer than its wait."""
    r = connect(fresh_redis.url)
    Admin(r).ensure_structure("APP1", ("WQ", "PQ"))
    r.close()
    m = start_member(fresh_redis.url, tmp_path, "QMR", "--rest-workers", "1")
    try:
        t0 = time.monotonic()
        waiters = [send_waiting_get(m, "WQ", 1500) for _ in range(3)]
        put(m, "PQ", "p")
        assert time.monotonic() - t0 < 1.2, "a put waits for no waiting get"
        assert [reply_of(s)[0] for s in waiters] == [204, 204, 204]
        assert time.monotonic() - t0 < 4, "each waited its 1.5 s, not one after the other"
    finally:
        m.server.stop()


def test_sqm_run_refuses_bad_rest_options_before_it_starts(fresh_redis: Any, tmp_path: Path) -> None:
    """One line and exit status 2, before the member starts (not a traceback once it has started)."""
    for options, said in ((("--rest-port", "-1"), "--rest-port: must be a whole number from 0 to 65535"),
                          (("--rest-port", "70000"), "--rest-port: must be a whole number from 0 to 65535"),
                          (("--rest-port", "0", "--rest-workers", "0"), "--rest-workers: must be a whole number from "
                                                                        "1 to 1024")):
        bad = subprocess.run([sys.executable, "-m", "sqm.cli", "run", "--name", "QMB", "--redis-url", fresh_redis.url,
                              "--log-root", str(tmp_path / "logs"), "--port", "0", *options],
                             capture_output=True, text=True, timeout=60, env={**os.environ, **TOKENS_ENV})
        assert bad.returncode == 2 and said in bad.stderr, (options, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr, bad.stderr


def test_a_poison_message_alone_on_its_queue_reaches_its_backout_queue(member: Member) -> None:
    """The DELETE's get moves the poison message to the backout queue, then finds nothing: the move is committed
    with the 204, not backed out with the request (the message went back to its queue at every DELETE, its
    backout count climbing)."""
    with Client(member.server.endpoint, token=TOKEN) as c:
        c.put(POISON_Q, b"poison")
        c.commit()
        for _ in range(THRESHOLD):
            c.get(POISON_Q)
            c.backout()
    assert take(member, POISON_Q).status == 204
    assert take(member, POISON_Q).status == 204
    with Client(member.server.endpoint, token=TOKEN) as c:
        assert list(c.browse(POISON_Q)) == []
        m = c.get(BACKOUT_Q)
        c.commit()
    assert m.body == b"poison" and m.backout_count == THRESHOLD


def test_a_waiting_get_whose_caller_left_keeps_its_poison_moves(member: Member) -> None:
    """The waiting DELETE moves the poison message, waits, sees its caller gone: the move is committed (backed
    out, the message went back to its queue, its backout count one higher, for the next get to move again)."""
    with Client(member.server.endpoint, token=TOKEN) as c:
        c.put(POISON_Q, b"poison 2")
        c.commit()
        for _ in range(THRESHOLD):
            c.get(POISON_Q)
            c.backout()
    s = send_waiting_get(member, POISON_Q, 5000)
    time.sleep(0.3)
    s.close()
    time.sleep(0.7)
    with Client(member.server.endpoint, token=TOKEN) as c:
        assert list(c.browse(POISON_Q)) == []
        m = c.get(BACKOUT_Q)
        c.commit()
    assert m.body == b"poison 2" and m.backout_count == THRESHOLD


def test_priority_order(member: Member) -> None:
    for text, prio in (("low", "1"), ("high", "9"), ("mid", "5"), ("default", None)):
        put(member, "RQ8", text, **({"ibm-mq-md-priority": prio} if prio else {}))
    got = [take(member, "RQ8") for _ in range(4)]
    assert [g.body for g in got] == [b"high", b"mid", b"low", b"default"]
    assert [g.headers["ibm-mq-md-priority"] for g in got] == ["9", "5", "1", "0"]


def test_persistence_and_expiry(member: Member) -> None:
    put(member, "RQ9", "np", **{"ibm-mq-md-persistence": "nonPersistent", "ibm-mq-md-expiry": "60000"})
    r = take(member, "RQ9")
    assert r.headers["ibm-mq-md-persistence"] == "nonPersistent"
    assert 0 < int(r.headers["ibm-mq-md-expiry"]) <= 60000
    put(member, "RQ9", "short", **{"ibm-mq-md-expiry": "200"})
    time.sleep(0.5)
    assert take(member, "RQ9").status == 204, "an expired message is not delivered"
    with Client(member.server.endpoint, token=TOKEN) as c:
        c.put("RQ9", b"native", persistent=False)
        c.commit()
    assert take(member, "RQ9").headers["ibm-mq-md-persistence"] == "nonPersistent"


def test_user_properties_round_trip(member: Member) -> None:
    put(member, "RQ10", "p", **{"ibm-mq-usr-colour": "blue", "ibm-mq-usr-Size": "XL"})
    r = http("GET", member.base("RQ10") + "/message")
    assert r.headers["ibm-mq-usr-colour"] == "blue" and r.headers["ibm-mq-usr-size"] == "XL"
    with Client(member.server.endpoint, token=TOKEN) as c:
        m = c.get("RQ10")
        c.commit()
    # header names are case-insensitive in HTTP (a client may change their case): compare names so
    assert {k.lower(): v for k, v in m.properties.items()} == {"colour": "blue", "size": "XL"}
    with Client(member.server.endpoint, token=TOKEN) as c:
        c.put("RQ10", b"n", properties={"n": 3, "s": "t"})
        c.commit()
    r = take(member, "RQ10")
    assert r.headers["ibm-mq-usr-n"] == "3" and r.headers["ibm-mq-usr-s"] == "t"


def test_more_user_properties_than_http_carries_are_left_on_the_queue(member: Member) -> None:
    """120 small properties (a reply of more than 100 headers: Python's http.client refuses it), or 10 KiB of
    them: the DELETE is a 400 and the message stays for a native client, never committed for a caller who cannot
    read the reply. A POST cannot set so many."""
    many = {f"p{i}": "v" for i in range(120)}
    big = {f"b{i}": "x" * 1000 for i in range(10)}
    with Client(member.server.endpoint, token=TOKEN) as c:
        for props in (many, big):
            c.put("RQ19", b"props", properties=props)
            c.commit()
            for r in (take(member, "RQ19"), http("GET", member.base("RQ19") + "/message")):
                assert r.status == 400 and r.error()["reasonCode"] == 2110, r.body
                assert "user properties" in r.error()["message"]
            m = c.get("RQ19")
            c.commit()
            assert m.properties == props
    r = http("POST", member.base("RQ19") + "/message", b"x",
             {**CSRF, **TEXT, **{f"ibm-mq-usr-p{i}": "v" for i in range(65)}})
    assert r.status == 400 and r.error()["msgId"] == "MQWB0302E", r.body
    r = http("POST", member.base("RQ19") + "/message", b"x",
             {**CSRF, **TEXT, **{f"ibm-mq-usr-b{i}": "x" * 1000 for i in range(9)}})
    assert r.status == 400 and r.error()["msgId"] == "MQWB0302E", r.body
    put(member, "RQ19", "64 are carried", **{f"ibm-mq-usr-p{i}": "v" for i in range(64)})
    r = take(member, "RQ19")
    assert r.status == 200 and sum(k.startswith("ibm-mq-usr-") for k in r.headers) == 64
    assert take(member, "RQ19").status == 204


def test_native_client_on_the_other_side(member: Member) -> None:
    mid = put(member, "RQ11", "from rest", **{"ibm-mq-md-correlationId": "xyz"})
    with Client(member.server.endpoint, token=TOKEN) as c:
        m = c.get("RQ11", wait_ms=2000)
        c.commit()
        assert m.body == b"from rest" and "ID:" + m.msgid.hex() == mid and m.correlid.rstrip(b"\0") == b"xyz"
        sent = c.put("RQ11", "from native ✓".encode(), priority=4, correlid=b"k1")
        c.commit()
    r = take(member, "RQ11")
    assert r.body.decode() == "from native ✓" and r.headers["ibm-mq-md-messageid"] == "ID:" + sent.msgid.hex()
    assert r.headers["ibm-mq-md-priority"] == "4" and r.headers["ibm-mq-md-correlationid"] == "k1"
    with Client(member.server.endpoint, token=TOKEN) as c:  # not text: refused, and left on the queue
        c.put("RQ11", b"\xff\xfe binary")
        c.commit()
    assert take(member, "RQ11").status == 400
    with Client(member.server.endpoint, token=TOKEN) as c:
        assert c.get("RQ11").body == b"\xff\xfe binary"
        c.commit()


def test_operator_token_and_v2_alias(member: Member) -> None:
    r = http("POST", member.base("RQ12", version="v2") + "/message", b"v2", {**CSRF, **TEXT, **basic(OP_TOKEN)},
             auth=False)
    assert r.status == 201
    r = http("POST", member.base("RQ12", version="v2") + "/message", b"x",
             {**CSRF, **TEXT, "ibm-mq-md-priority": "3"})
    assert r.status == 400, "priority is a v3 header"
    assert take(member, "RQ12").body == b"v2"


def test_metrics_count_rest_requests(member: Member) -> None:
    put(member, "RQ13", "m")
    take(member, "RQ13")
    info = json.loads((member.tmp / "QM1.ready").read_text())
    with urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'sqm_requests_total{op="put",qmgr="QM1",result="ok"}' in text
    assert 'sqm_requests_total{op="get",qmgr="QM1",result="ok"}' in text


# --- TLS: the service's certificate serves the REST port too -------------------------------------------------------
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_rest_over_the_services_tls(fresh_redis: Any, tmp_path: Path) -> None:
    r = connect(fresh_redis.url)
    Admin(r).ensure_structure("APP1", ("TQ",))
    r.close()
    ca = make_ca(tmp_path, "rest-ca")
    cert, key = issue(ca, tmp_path, "server")
    m = start_member(fresh_redis.url, tmp_path, "QMT", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        url = f"https://127.0.0.1:{m.rest_port}/ibmmq/rest/v3/messaging/qmgr/QMT/queue/TQ/message"
        status, headers, _ = curl("--cacert", str(ca.cert), "-u", f"app:{TOKEN}", "-H", "ibm-mq-rest-csrf-token: x",
                                  "-H", "Content-Type: text/plain", "-X", "POST", url, "-d", "secret")
        assert status == 201 and headers["ibm-mq-md-messageid"].startswith("ID:")
        status, _, body = curl("--cacert", str(ca.cert), "-u", f"app:{TOKEN}", "-H", "ibm-mq-rest-csrf-token: x",
                               "-X", "DELETE", url)
        assert (status, body) == (200, b"secret")
        plain = subprocess.run(["curl", "-sS", "--max-time", "10", "-u", f"app:{TOKEN}", url.replace("https", "http")],
                               capture_output=True, timeout=30)
        assert b"secret" not in plain.stdout  # plain HTTP on the TLS port gets nothing
    finally:
        m.server.stop()


def test_shutdown_ends_a_waiting_get(fresh_redis: Any, tmp_path: Path) -> None:
    r = connect(fresh_redis.url)
    Admin(r).ensure_structure("APP1", ("WQ",))
    r.close()
    m = start_member(fresh_redis.url, tmp_path, "QMW")
    replies: list[Reply] = []
    waiter = threading.Thread(target=lambda: replies.append(take(m, "WQ", "?wait=30000")))
    waiter.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert m.server.stop() == 0, m.server.log_text()
    waiter.join(timeout=30)
    assert time.monotonic() - t0 < 15 and replies and replies[0].status == 503, replies
    # said as the member stopping, not as the caller having left (it had not)
    message = replies[0].error()["message"]
    assert "the member QMW is stopping: the wait ended with nothing taken" in message, message
    assert "client left" not in message


# --- durability: a 201 is a committed message ---------------------------------------------------------------------
def test_kill_minus_9_right_after_201_keeps_the_message(fresh_redis: Any, tmp_path: Path) -> None:
    redis_url = fresh_redis.url  # a CF of its own: the module's member keeps the shared one
    r = connect(redis_url)
    Admin(r).ensure_structure("APP1", ("DQ",))
    r.close()
    m = start_member(redis_url, tmp_path, "QMD")
    ids = []
    try:
        for i in range(5):
            ids.append(put(m, "DQ", f"durable {i}"))
        os.kill(m.server.proc.pid, signal.SIGKILL)
        m.server.proc.wait(timeout=10)
    finally:
        if m.server.proc.poll() is None:
            m.server.proc.kill()
    again = start_member(redis_url, tmp_path, "QMD")  # restart: its log and the CF hold what was committed
    try:
        got = [take(again, "DQ") for _ in range(5)]
        assert [g.body for g in got] == [f"durable {i}".encode() for i in range(5)]
        assert [g.headers["ibm-mq-md-messageid"] for g in got] == ids
        assert take(again, "DQ").status == 204
    finally:
        again.server.stop()


# --- the README's lines, as written, against `cfemu cluster up --rest` ---------------------------------------------
def readme_rest_lines() -> str:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("### The IBM MQ REST messaging API", 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_round_trip_through_cluster_up(tmp_path: Path) -> None:
    lines = readme_rest_lines()
    assert "curl -s" in lines and "-X DELETE" in lines
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CFEMU_", "SQM_", "REDIS_URL"))}  # what the cluster's directory gives, nothing else
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    try:
        done = subprocess.run(["bash", "-e", "-c", lines], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=240)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith("hello"), (done.stdout, done.stderr)
    finally:
        subprocess.run([str(bin_dir / "cfemu"), "cluster", "down", "--dir", str(tmp_path / "var" / "cluster")],
                       cwd=tmp_path, env=env, capture_output=True, timeout=120)


def test_only_a_member_that_serves_rest_loads_aiohttp(member: Member) -> None:
    """aiohttp is imported when --rest-port is given, not by every member (it had cost each member's start, and
    each test that starts one, a tenth of a second)."""
    def loaded(server: ServerProc) -> bool:
        return "/aiohttp/" in Path(f"/proc/{server.proc.pid}/maps").read_text()

    assert loaded(member.server)
    plain = start_server(member.url, member.tmp, "QM2")  # the group's log root
    try:
        assert not loaded(plain)
    finally:
        plain.stop()
