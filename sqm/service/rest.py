"""The IBM MQ messaging REST API on a member (docs/rest.md): put, destructive get and browse of text messages
over HTTP, at the URLs, headers, status codes and error bodies IBM's mqweb server uses.

Served by aiohttp on the member's own event loop (``sqm run --rest-port``), with the service's TLS settings. Each
request runs on an MQ connection handle of its own, made and closed in a worker thread, through the queue
operations' handlers (sqm.service.queue_ops) under a request slot, as the service's requests run:

- POST puts under syncpoint and commits; the 201 is sent only after the commit returned (the log forced);
- DELETE gets under syncpoint, then commits only if the caller is still connected, and replies after the commit;
  otherwise it backs out and the message stays on its queue. A DELETE that waits runs in a thread of the waiting
  gets' own (sqm.service.rest_waits): waits never hold the threads puts and browses run in, and a waiting get whose
  caller hung up stops waiting and takes nothing;
- GET browses: nothing is taken.

Authentication: HTTP basic (the password is a role's token; the user name is neither checked nor stored) or a bearer
token; a role's token is accepted in clear only from a loopback peer or over TLS, as the service's bearer token.
Every request other than GET (and HEAD, OPTIONS) must carry ``ibm-mq-rest-csrf-token``, with any value.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any, Protocol

from aiohttp import web

from cfemu.errors import ClientGoneError, MQError, NoMessageError, OutcomePendingError, OutcomeUnknownError
from cfemu.keys import check_name
from cfemu.limits import MAX_ID_LENGTH
from sqm.core.client_watch import ClientWatch
from sqm.core.connection import MAX_EXPIRY_MS, Connection, Message
from sqm.core.manager import CF_DOWN
from sqm.http_guard import GuardedSite, HttpLimits, peer_has_finished, read_body, runner_kwargs
from sqm.operations import APPLICATION, OPERATOR, one_line, short
from sqm.request_slots import RequestSlots
from sqm.service import queue_ops
from sqm.service.auth import Failures
from sqm.service.config import ServerConfig, is_loopback_ip
from sqm.service.protocol import MAX_FRAME, message_from_wire
from sqm.service.rest_waits import RestWatch, WaitSlots
from sqm.service.session import Stats

log = logging.getLogger("sqm.service.rest")

PREFIX = "/ibmmq/rest/{version}/messaging/qmgr/{qmgr}/queue/{queue}"
CSRF_HEADER = "ibm-mq-rest-csrf-token"
MD = "ibm-mq-md-"
USR = "ibm-mq-usr-"
OUTCOME_HEADER = "ibm-mq-outcome"  # a DELETE's get delivered with its commit "pending" or "unknown" (docs/rest.md)
# The bodies IBM's POST takes: text of these media types, in UTF-8 (a missing charset is UTF-8).
TEXT_TYPES = frozenset({"text/plain", "text/html", "text/xml", "application/json", "application/xml"})
TEXT_PLAIN = "text/plain; charset=utf-8"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MAX_LIST = 1000  # messages a messagelist browses at most (its ``limit``)
ID_PREFIX = "ID:"
# What an error body repeats of a string the client chose (a queue name, a header, a path): a name of this many
# characters, an MQ error of this many (they name the queue, the property...), control characters escaped. Enough to
# recognise it, one line always, never the client's kilobytes back in the reply or the member's log.
ECHO_CHARS = 64
ERROR_CHARS = 400


class RestServer(queue_ops.Service, Protocol):
    """What the REST endpoint uses of the server: the queue operations' service, its request slots and counts."""

    @property
    def name(self) -> str: ...

    @property
    def slots(self) -> RequestSlots: ...

    @property
    def stats(self) -> Stats: ...


@dataclass(eq=False)
class RestSession:
    """One REST request's session for the queue operations' handlers (queue_ops.Session): its own connection
    handle, made by the first operation and closed (its unit of work backed out if still open) at the end."""

    number: int
    role: str
    peer: str
    reply_limit: int = MAX_FRAME
    conn: Connection | None = None
    gone: ClientWatch = field(default_factory=ClientWatch)  # RestWatch: set when its caller has gone
    queues: set[str] = field(default_factory=set)  # the queues it used (its puts and gets count in QueueActivity)

    def reply_room(self, messages: int = 1) -> int:
        return self.reply_limit


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite given as a string ("NaN", "Infinity", "-Infinity"), in lists
    and maps too: JSON has no such numbers, and a reply holding one (``NaN`` bare, as Python writes it) is one that
    JavaScript's JSON.parse and strict parsers refuse whole. The puts refuse such a property (cfemu.entry.
    check_properties), but a message stored before that rule, or put by another path, may still hold one."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def to_json(value: Any) -> str:
    """``value`` as strict JSON (finite: never NaN or Infinity)."""
    return json.dumps(finite(value), allow_nan=False)


def json_reply(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON reply, strict JSON always (to_json)."""
    return web.json_response(body, status=status, headers=headers, content_type="application/json", dumps=to_json)


class RestError(Exception):
    """An error reply: HTTP status and one element of IBM's error array."""

    def __init__(self, status: int, msg_id: str, message: str, explanation: str, action: str, *,
                 reason: int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.msg_id, self.message = status, msg_id, message
        self.explanation, self.action, self.reason, self.headers = explanation, action, reason, headers or {}

    def response(self) -> web.Response:
        item: dict[str, Any] = {"msgId": self.msg_id, "type": "rest", "message": f"{self.msg_id}: {self.message}",
                                "explanation": self.explanation, "action": self.action}
        if self.reason is not None:
            item.update(completionCode=2, reasonCode=self.reason)
        return json_reply({"error": [item]}, status=self.status, headers=self.headers)


# The HTTP status of an MQ reason code the queue manager gave (the rest are 500).
STATUS_OF_REASON = {
    2085: 404,  # MQRC_UNKNOWN_OBJECT_NAME: no such queue
    2035: 403,  # MQRC_NOT_AUTHORIZED: a companion queue, an operator's queue
    2046: 400, 2030: 400, 2080: 400,  # a bad value; a message too big for the queue; too long to carry
    2161: 503, 2009: 503, 2373: 503, 2102: 503, 2192: 503, 2024: 503,  # stopping, CF or log trouble, full: retry
}


def utf8(text: str) -> bool:
    """Whether ``text`` is text in UTF-8: no lone surrogates (what aiohttp makes of bytes that are not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def echo(text: str) -> str:
    """A string the client chose, as an error repeats it: quoted, escaped, at most ECHO_CHARS of it."""
    return short(text, ECHO_CHARS)


def queue_of(request: web.Request) -> str:
    """The queue the URL names; a name no queue can have (cfemu.keys: 1-48 characters of A-Z a-z 0-9 _ . -) is the
    404 of an unknown queue, before anything runs."""
    name = request.match_info["queue"]
    try:
        return check_name("queue", name)
    except ValueError:
        raise RestError(404, "MQWB0303E", f"No queue can be named {echo(name)}: a queue name is 1-48 characters of "
                        "A-Z a-z 0-9 _ . -", "The queue does not exist on this queue manager.",
                        "Resubmit the request with the name of a defined queue.", reason=2085) from None


def mq_failure(e: MQError, what: str) -> RestError:
    # A commit whose outcome is not known (its log force failed, peer recovery fenced the member as it committed, the
    # CF's reply to it was lost; OutcomeUnknownError, MQRC_CONNECTION_BROKEN as any broken connection) is not a
    # refusal: its work may be done, so it is never the 503 "try again" that the door answers after a backout.
    status = 500 if isinstance(e, OutcomeUnknownError) else STATUS_OF_REASON.get(e.reason, 500)
    said = one_line(str(e), ERROR_CHARS)  # it may repeat what the client sent (a property's name, say)
    if status == 404:
        return RestError(404, "MQWB0303E", f"{what}: {said}", "The queue does not exist on this queue manager.",
                         "Resubmit the request with the name of a defined queue.", reason=e.reason)
    if status == 403:
        return RestError(403, "MQWB0103E", f"Not authorized: {what}: {said}",
                         "The authenticated principal is not authorized to perform the requested operation.",
                         "Use the queue through the operations meant for it.", reason=e.reason)
    return RestError(status, "MQWB0303E", f"{what}: {said}",
                     "An error occurred while sending, receiving or browsing the message.",
                     "Resubmit the request later" if status == 503 else "Resubmit the request, correcting any issues.",
                     reason=e.reason)


def bad_header(name: str, value: str, why: str) -> RestError:
    return RestError(400, "MQWB0302E", f"The {name} request header cannot be set as {echo(value)} is not a valid "
                     "request header value.", why, "Resubmit the request using a valid header value.", reason=2046)


def bad_query(name: str, value: str, why: str) -> RestError:
    return RestError(400, "MQWB0118E", f"The {name} query parameter value {echo(value)} is not valid.", why,
                     "Resubmit the request with a valid query parameter value.", reason=2046)


MAX_DIGITS = 18  # the longest number a header or query value may be written with (MQ's longest expiry has 12)


def ascii_number(text: str) -> int | None:
    """The value of ``text`` when it is 1 to MAX_DIGITS ASCII digits, else None. str.isdigit alone also takes
    other scripts' digits and superscripts (``²``, which int() refuses), and int() of thousands of digits is slow
    work on the event loop."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= MAX_DIGITS else None


def encode_id(raw: bytes, *, text_ok: bool) -> str:
    """An id as v3 shows it: ``ID:`` and the hex of its bytes; a correlation id given as text (printable ASCII,
    not starting with ``ID:``) comes back as that text."""
    if text_ok and raw and all(0x20 <= b < 0x7F for b in raw) and not raw.startswith(ID_PREFIX.encode()):
        return raw.decode("ascii")
    return ID_PREFIX + raw.hex()


def decode_id(value: str, *, text_ok: bool, what: str, bad: Callable[[str, str, str], RestError]) -> bytes:
    """``ID:`` + hex (v3), a bare hex string (v1/v2 and v3 query parameters), or with ``text_ok`` an
    application-specific text id (v3's correlation id); at most MAX_ID_LENGTH bytes."""
    value = value.strip()
    try:
        if value.startswith(ID_PREFIX):
            raw = bytes.fromhex(value[len(ID_PREFIX):])
        elif text_ok:
            raw = value.encode("utf-8")
        else:
            raw = bytes.fromhex(value)
    except ValueError:
        raise bad(what, value, "An id is ID: followed by hexadecimal digits, two per byte.") from None
    if len(raw) > MAX_ID_LENGTH:
        raise bad(what, value, f"An id is at most {MAX_ID_LENGTH} bytes.")
    return raw


def correlid_forms(correlid: bytes) -> list[bytes]:
    """The stored correlation ids a browse by ``correlid`` matches: as given, and as MQ's 24-byte field holds a
    shorter one (padded with NULs), either way round: a native client may have put it padded, a REST one not."""
    bare = correlid.rstrip(b"\0")
    return list(dict.fromkeys((correlid, bare, bare.ljust(MAX_ID_LENGTH, b"\0"))))


def md_headers(m: Message, now_ms: int) -> dict[str, str]:
    """The ``ibm-mq-md-*`` and ``ibm-mq-usr-*`` headers of a message got or browsed."""
    h = {MD + "messageId": encode_id(m.msgid, text_ok=False),
         MD + "persistence": "persistent" if m.persistent else "nonPersistent",
         MD + "priority": str(m.priority),
         MD + "expiry": "unlimited" if not m.expiry else str(max(0, m.expiry - now_ms))}
    if m.correlid.strip(b"\0"):
        h[MD + "correlationId"] = encode_id(m.correlid, text_ok=True)
    for name, value in (m.properties or {}).items():
        shown = finite(value)  # a number that is not finite as its name, as a string property would show
        h[USR + str(name)] = shown if isinstance(shown, str) else to_json(shown)
    return h


# What HTTP carries in a header (RFC 9110): a name of token characters, a value without control characters other
# than tab. aiohttp refuses to send anything else, after the handler returned: a get committed by then is lost.
TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
FORBIDDEN_IN_VALUE = frozenset(chr(c) for c in (*range(0x09), *range(0x0A, 0x20), 0x7F))
# How many user properties HTTP carries as headers, and how many bytes of them: clients refuse a reply past their own
# bounds (Python's http.client more than 100 headers, many servers and proxies a head over 8 KiB), after the get
# was committed: the message lost for its caller. Past these the message is one the API cannot return (a 400, the get
# backed out), and a POST cannot set more.
MAX_USR_HEADERS = 64
MAX_USR_BYTES = 8 * 2**10  # each ``name: value`` line with its CRLF, names with their ibm-mq-usr- prefix


def usr_header_bytes(headers: dict[str, str]) -> int:
    """The bytes the ``ibm-mq-usr-*`` headers among ``headers`` take in an HTTP head (UTF-8)."""
    return sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items() if k.lower().startswith(USR))


def usr_bounds_problem(count: int, size: int) -> str:
    """Why ``count`` user properties of ``size`` header bytes are more than HTTP carries, or ""."""
    if count > MAX_USR_HEADERS:
        return f"{count} user properties are more than the {MAX_USR_HEADERS} the API carries as headers"
    if size > MAX_USR_BYTES:
        return f"its user properties take {size} bytes of headers, more than the {MAX_USR_BYTES} the API carries"
    return ""


def carried_headers(m: Message, now_ms: int, problem: str, verb: str) -> dict[str, str]:
    """md_headers, each of which HTTP can carry; a user property it cannot (a name that is not a token, a value
    with a control character such as CR or LF) is a 400 naming it and the ``problem`` (the message is left for a
    native client: IBM's API leaves a message it cannot return on its queue), telling how to ``verb`` it instead."""
    headers = md_headers(m, now_ms)
    usr = {k: v for k, v in headers.items() if k.startswith(USR)}
    if too_many := usr_bounds_problem(len(usr), usr_header_bytes(usr)):
        raise RestError(400, "MQWB0303E", f"The message cannot be returned: {too_many}."
                        f"{' ' + problem if problem else ''}",
                        "The messaging REST API returns a message's user properties as HTTP headers.",
                        f"{verb} it with the native client.", reason=2110)
    for name, value in headers.items():
        prop = name[len(USR):] if name.startswith(USR) else name
        why = ("its name is not an HTTP token" if not set(name) <= TOKEN_CHARS else
               "its value holds a control character" if not FORBIDDEN_IN_VALUE.isdisjoint(value) else "")
        if why:
            raise RestError(400, "MQWB0303E", f"The message's property {echo(prop)} cannot be returned as an "
                            f"{USR}* header: {why}.{' ' + problem if problem else ''}",
                            "The messaging REST API returns a message's user properties as HTTP headers.",
                            f"{verb} it with the native client.", reason=2110)
    return headers


def user_properties(request: web.Request) -> dict[str, str]:
    """The user properties a POST sets: one per ``ibm-mq-usr-NAME`` header. A header with no NAME, a NAME given
    twice (HTTP header names are case-insensitive: ``x`` and ``X`` are one header to a proxy, which may merge or
    drop either), or bytes that are not UTF-8, is a 400 naming it: none is dropped or chosen silently."""
    props: dict[str, str] = {}
    seen: dict[str, str] = {}  # a property's name in lower case -> its header as sent
    for header, value in request.headers.items():  # every header, repeated ones too
        if not header.lower().startswith(USR):
            continue
        name = header[len(USR):]
        if not name:
            raise bad_header(echo(header), value, "A user property's header is ibm-mq-usr-NAME, with a NAME.")
        if name.lower() in seen:
            raise bad_header(echo(header), value, f"The user property {echo(name)} is given twice (as "
                             f"{echo(seen[name.lower()])} and {echo(header)}): header names are case-insensitive, "
                             "a property's header is given once.")
        try:
            header.encode("utf-8")
            value.encode("utf-8")
        except UnicodeEncodeError:  # aiohttp hands bytes that are not UTF-8 on as lone surrogates
            raise bad_header(echo(header), value, "A user property's header is text in UTF-8.") from None
        seen[name.lower()] = header
        props[name] = value
    return props


def message_text(m: Message, problem: str, verb: str) -> str:
    """The message's body as text; one that is not UTF-8 is a 400 naming the ``problem`` (the messaging REST API
    returns text messages only) and telling how to ``verb`` it instead."""
    try:
        return m.body.decode("utf-8")
    except UnicodeDecodeError:
        raise RestError(400, "MQWB0303E", problem, "The messaging REST API returns text messages only.",
                        f"{verb} it with the native client.", reason=2110) from None


def text_reply(text: str, headers: dict[str, str]) -> web.Response:
    """200 with the message as text/plain, its descriptor in the headers (carried_headers)."""
    return web.Response(status=200, text=text, content_type="text/plain", charset="utf-8", headers=headers)


def summary(m: Message, now_ms: int) -> dict[str, Any]:
    """One message of a messagelist: its descriptor, not its body."""
    out: dict[str, Any] = {
        "messageId": encode_id(m.msgid, text_ok=False), "format": "MQSTR",
        "persistence": "persistent" if m.persistent else "nonPersistent", "priority": m.priority,
        "putDateTime": datetime.fromtimestamp(m.put_time / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
        "expiry": "unlimited" if not m.expiry else max(0, m.expiry - now_ms)}
    if m.correlid.strip(b"\0"):
        out["correlationId"] = encode_id(m.correlid, text_ok=True)
    if m.properties:
        out["userProperties"] = dict(m.properties)
    return out


class RestEndpoint:
    """The messaging REST API of one member: ``app`` is the aiohttp application, ``start``/``stop`` its site."""

    def __init__(self, server: RestServer, config: ServerConfig, tokens: dict[str, str]) -> None:
        self.server = server
        self.config = config
        self.tokens = tokens  # role -> token; empty when authentication is off (every request an operator)
        self.group = ""  # the queue-sharing group's name, read at start: a qmgr in the URL may name it too
        self.failures = Failures()
        # Requests that do not wait (puts, browses, gets without wait, commits, backouts) run in ``executor``;
        # waiting gets in ``wait_executor``, as many as ``waits`` lets wait at once (sqm.service.rest_waits).
        self.executor = ThreadPoolExecutor(max_workers=config.rest_workers, thread_name_prefix="rest")
        self.wait_executor = ThreadPoolExecutor(max_workers=config.rest_workers, thread_name_prefix="rest-wait")
        self.waits = WaitSlots(config.rest_workers, max(1, config.rest_workers // 2))
        self._numbers = iter(range(1, 2**62))
        self._active: weakref.WeakSet[RestSession] = weakref.WeakSet()  # the requests under way (stop wakes them)
        self._runner: web.AppRunner | None = None
        self.site: GuardedSite | None = None  # the listening site once started (its connection cap)
        self.port: int | None = None
        self.app = web.Application(middlewares=[self._errors], client_max_size=config.rest_max_body)
        r = self.app.router
        for version in ("v1", "v2", "v3"):
            base = PREFIX.replace("{version}", version)
            r.add_route("POST", base + "/message", self.post)
            r.add_route("DELETE", base + "/message", self.delete)
            r.add_route("GET", base + "/message", self.browse_one)
            r.add_route("GET", base + "/messagelist", self.message_list)

    # --- life cycle ----------------------------------------------------------------------------------------------
    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.group = await loop.run_in_executor(self.executor, self.server.qm.admin.group_name)
        c = self.config
        limits = HttpLimits(head_timeout_s=c.http_head_timeout_s, keepalive_timeout_s=c.rest_keepalive_timeout_s,
                            max_connections=c.rest_max_connections,
                            max_connections_per_peer=c.rest_max_connections_per_peer,
                            cap_options="--rest-max-connections and --rest-max-connections-per-peer")
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     shutdown_timeout=c.shutdown_grace_s, **runner_kwargs(limits, log))
        await self._runner.setup()
        site = GuardedSite(self._runner, host, port, limits, f"{self.server.name} REST", log,
                           ssl_context=c.ssl_context(), backlog=128)
        await site.start()
        self.site = site
        self.port = site.port
        return self.port

    async def stop(self) -> None:
        """Stop serving: a get still waiting ends (not taken, 503), requests under way get the shutdown grace."""
        for session in list(self._active):
            session.gone.set()
        if self._runner is not None:
            await self._runner.cleanup()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.wait_executor.shutdown(wait=False, cancel_futures=True)

    # --- what every request goes through -------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Every refusal as IBM's error body: this endpoint's own, and aiohttp's 404 and 405."""
        try:
            return await handler(request)
        except RestError as e:
            return e.response()
        except web.HTTPMethodNotAllowed as e:
            return RestError(405, "MQWB0007E", f"The {request.method} HTTP method is not allowed for this resource.",
                             "A recognized resource was requested with a method it does not support.",
                             f"Use one of: {', '.join(sorted(e.allowed_methods))}.",
                             headers={"Allow": ", ".join(sorted(e.allowed_methods))}).response()
        except web.HTTPNotFound:
            return RestError(404, "MQWB0006E", f"The resource {echo(request.path)} was not found.",
                             "The URL names no resource of the messaging REST API.",
                             "Use /ibmmq/rest/v3/messaging/qmgr/{qmgr}/queue/{queue}/message or .../messagelist."
                             ).response()
        except web.HTTPRequestEntityTooLarge:
            return RestError(400, "MQWB0303E", f"The request body exceeds {self.config.rest_max_body} bytes.",
                             "The body is longer than this member accepts over REST (sqm run --rest-max-body).",
                             "Send a shorter message.", reason=2030).response()

    def _authenticate(self, request: web.Request) -> str:
        """The role of the request, or RestError 401."""
        if not self.config.auth:
            return OPERATOR
        challenge = {"WWW-Authenticate": f'Basic realm="{self.server.name}", Bearer realm="{self.server.name}"'}
        header = request.headers.get("Authorization", "")
        scheme, _, cred = header.partition(" ")
        token = None
        if scheme.lower() == "basic":
            try:
                _, _, token = base64.b64decode(cred.strip(), validate=True).decode("utf-8").partition(":")
            except ValueError:  # not base64 (binascii.Error), not ASCII, a password not UTF-8 (UnicodeDecodeError)
                token = None
        elif scheme.lower() == "bearer":
            token = cred.strip()
        # aiohttp hands a header's bytes that are not UTF-8 on as lone surrogates, which no token holds and which
        # cannot be compared as bytes: refused here as credentials this member does not accept, never a 500.
        if token is not None and not utf8(token):
            token = None
        if token is None:
            self.server.stats.auth_failures["not_authenticated"] += 1
            raise RestError(401, "MQWB0104E", "The REST API request is not authenticated.",
                            "The request carried no credentials this member accepts (a token is text in UTF-8).",
                            "Send HTTP basic authentication whose password is the group's application token "
                            "(service.token), or Authorization: Bearer with that token.", reason=2035,
                            headers=challenge)
        peer = request.remote or "?"
        if request.transport is not None and request.transport.get_extra_info("sslcontext") is None \
                and not is_loopback_ip(peer):
            self.server.stats.auth_failures["bearer_in_clear"] += 1
            # Compared in constant time, as a valid one is below: the operator needs to know whether to rotate it.
            valid = any(known is not None and hmac.compare_digest(known.encode(), token.encode())
                        for known in self.tokens.values())
            log.warning("%s: REST request from %s sent a token in clear off loopback; refused%s",
                        self.server.name, peer, ": IT WAS VALID, treat it as exposed and rotate it (docs/security.md)"
                        if valid else " (it was not a token of this group)")
            raise RestError(401, "MQWB0104E", "Credentials sent in clear are refused on a non-loopback connection.",
                            "A token must not cross the network unencrypted.",
                            "Use HTTPS (sqm run --tls-cert/--tls-key).", reason=2035, headers=challenge)
        for role in (APPLICATION, OPERATOR):
            known = self.tokens.get(role)
            if known is not None and hmac.compare_digest(known.encode(), token.encode()):
                self.server.stats.authenticated[(role, "bearer")] += 1
                return role
        self.server.stats.auth_failures["bad_proof"] += 1
        raise RestError(401, "MQWB0104E", "The REST API request is not authenticated.",
                        "The credentials given are not a token of this group.",
                        "Resubmit the request with the group's application token.", reason=2035, headers=challenge)

    async def _admit(self, request: web.Request) -> RestSession:
        """Authentication (401), the CSRF header (403), the queue manager of the URL (404), the server's state
        (503): a session for the request that passed them."""
        try:
            role = self._authenticate(request)
        except RestError:
            _, delay = self.failures.record(request.remote or "?", time.monotonic())
            await asyncio.sleep(delay)  # the service's delay per address after a failed authentication
            raise
        if request.method not in SAFE_METHODS and CSRF_HEADER not in request.headers:
            raise RestError(403, "MQWB0100E", f"The CSRF header {CSRF_HEADER} was omitted from the request.",
                            "A request that changes state must carry the CSRF header.",
                            f"Resubmit the request with the {CSRF_HEADER} header (any value).", reason=2035)
        qmgr = request.match_info["qmgr"]
        if qmgr not in (self.server.name, self.group):
            raise RestError(404, "MQWB0009E", f"Could not find the queue manager {echo(qmgr)}.",
                            "The MQ REST API was invoked specifying a queue manager name which cannot be located.",
                            f"Resubmit the request with this member's name ({self.server.name}) or the group's "
                            f"({self.group}).", reason=2058)
        if self.server.stopping:
            raise mq_failure(self.server.quiescing(request.method), "the request was not carried out")
        session = RestSession(number=next(self._numbers), role=role, peer=request.remote or "?",
                              gone=RestWatch(request))
        self._active.add(session)
        return session

    async def _run(self, session: RestSession, op: str, work: Callable[[], Any], *,
                   executor: ThreadPoolExecutor | None = None) -> Any:
        """Run ``work`` in a worker thread (of ``executor``, by default the one for requests that do not wait)
        under a request slot, counted as the service counts ``op``; an MQ refusal becomes its RestError."""
        def call() -> Any:
            with self.server.slots.running():
                return work()
        try:
            result = await asyncio.get_running_loop().run_in_executor(executor or self.executor, call)
        except NoMessageError:
            self.server.stats.count((op, NoMessageError.reason_name))
            raise
        except ClientGoneError as e:
            self.server.stats.count((op, e.reason_name))
            if self.server.stopping:  # the server's stop ended it: the caller hears 503, try again elsewhere
                stopped = type(e)(f"the member {self.server.name} is stopping: the wait ended with nothing taken; "
                                  "try again (another member, or this one once it is back)")
                raise mq_failure(stopped, f"{op} on {session.number}") from None
            raise
        except MQError as e:
            self.server.stats.count((op, e.reason_name))
            raise mq_failure(e, f"{op} on {session.number}") from None
        except CF_DOWN as e:
            self.server.stats.count((op, "MQRC_CF_STRUC_FAILED"))
            raise RestError(503, "MQWB0303E", f"the CF is unavailable: {one_line(str(e), ERROR_CHARS)}", "The coupling facility did not answer.",
                            "Resubmit the request later.", reason=2373) from None
        self.server.stats.count((op, "ok"))
        return result

    def _close(self, session: RestSession) -> None:
        """The end of a request's connection handle: an open unit of work is backed out."""
        if session.conn is not None:
            try:
                session.conn.close()
            except MQError as e:
                log.warning("%s: backing out REST request %d: %s", self.server.name, session.number, one_line(str(e), ERROR_CHARS))

    @asynccontextmanager
    async def _handle(self, session: RestSession) -> AsyncIterator[None]:
        """A request's connection handle: whatever its unit of work still holds is backed out before the reply, so
        that a message a refused get took is back on its queue when the caller hears of it."""
        try:
            yield
        finally:
            self._active.discard(session)
            if session.conn is not None and session.conn.uow is not None:
                await asyncio.shield(asyncio.get_running_loop().run_in_executor(self.executor, self._close, session))

    # --- the endpoints -------------------------------------------------------------------------------------------
    async def post(self, request: web.Request) -> web.Response:
        """Put the body as a text message; 201 with its message id, after the commit returned."""
        session = await self._admit(request)
        v3 = "/v3/" in request.path
        args = self._put_args(request, v3=v3)
        raw = await read_body(request, self.config.http_head_timeout_s)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RestError(400, "MQWB0305E", "The request body is not valid UTF-8.",
                            "The messaging REST API puts text messages in UTF-8.",
                            "Send the body in UTF-8.", reason=2046) from None
        args.update(queue=queue_of(request), body=raw, syncpoint=True)

        def put() -> dict[str, Any]:
            done = queue_ops.put(self.server, session, args)
            queue_ops.commit(self.server, session, {})  # the unit of work forced to the log before the reply
            return done

        async with self._handle(session):
            done = await self._run(session, "put", put)
        msgid = encode_id(done["msgid"], text_ok=False)
        return web.Response(status=201, headers={MD + "messageId": msgid})

    def _put_args(self, request: web.Request, *, v3: bool) -> dict[str, Any]:
        ctype = request.headers.get("Content-Type")
        if ctype is None:
            raise RestError(415, "MQWB0306E", "The media type is unsupported for this type of request.",
                            "A put needs a Content-Type header: text/plain;charset=utf-8 or another text type.",
                            "Resubmit the request with Content-Type: text/plain;charset=utf-8.", reason=2046)
        if request.content_type not in TEXT_TYPES:
            raise RestError(415, "MQWB0306E", "The media type is unsupported for this type of request.",
                            f"The media type {echo(request.content_type)} is not one of "
                            f"{', '.join(sorted(TEXT_TYPES))}.",
                            "Resubmit the request with Content-Type: text/plain;charset=utf-8.", reason=2046)
        charset = (request.charset or "utf-8").lower()
        if charset not in ("utf-8", "utf8"):
            raise RestError(415, "MQWB0305E", f"The character set {echo(charset)} is not acceptable for the request.",
                            "The messaging REST API accepts UTF-8 bodies only.",
                            "Resubmit the request with charset=utf-8.", reason=2046)
        h = request.headers
        args: dict[str, Any] = {}
        if (p := h.get(MD + "persistence")) is not None:
            if p not in ("persistent", "nonPersistent"):
                raise bad_header(MD + "persistence", p, "Persistence is persistent or nonPersistent.")
            args["persistent"] = p == "persistent"
        if (e := h.get(MD + "expiry")) is not None and e != "unlimited":
            ms = ascii_number(e)
            if ms is None or not 0 < ms <= MAX_EXPIRY_MS:
                raise bad_header(MD + "expiry", e, f"Expiry is unlimited or a number of milliseconds, 1-{MAX_EXPIRY_MS} "
                                 "(MQ's longest expiry).")
            args["expiry_ms"] = ms
        if (c := h.get(MD + "correlationId")) is not None:
            args["correlid"] = decode_id(c, text_ok=v3, what=MD + "correlationId", bad=bad_header)
        if (pr := h.get(MD + "priority")) is not None:
            if not v3:
                raise bad_header(MD + "priority", pr, "ibm-mq-md-priority is a REST API v3 header.")
            priority = ascii_number(pr)
            if priority is None or not 0 <= priority <= 9:
                raise bad_header(MD + "priority", pr, "Priority is 0-9.")
            args["priority"] = priority
        if (rt := h.get(MD + "replyTo")) is not None:
            raise bad_header(MD + "replyTo", rt, "Reply-to queues are not built on this queue manager.")
        props = user_properties(request)
        if props:
            if not v3:
                raise bad_header(USR + "*", next(iter(props)), "User properties are a REST API v3 feature.")
            if too_many := usr_bounds_problem(len(props), usr_header_bytes({USR + k: v for k, v in props.items()})):
                raise bad_header(USR + "*", f"{len(props)} headers", f"A message has at most {MAX_USR_HEADERS} user "
                                 f"properties and {MAX_USR_BYTES} bytes of them ({too_many}).")
            args["properties"] = props
        return args

    def _selection(self, request: web.Request, v3: bool) -> dict[str, Any]:
        q = request.query
        sel: dict[str, Any] = {}
        if (c := q.get("correlationId")) is not None:
            sel["correlid"] = decode_id(c, text_ok=v3, what="correlationId", bad=bad_query)
        if (mid := q.get("messageId")) is not None:
            sel["msgid"] = decode_id(mid, text_ok=False, what="messageId", bad=bad_query)
        if "correlid" in sel and "msgid" in sel:
            raise bad_query("messageId", q["messageId"], "Select by messageId or by correlationId, not both.")
        return sel

    def _accepts_text(self, request: web.Request) -> None:
        accept = request.headers.get("Accept")
        if accept is None:
            return
        kinds = {part.split(";")[0].strip().lower() for part in accept.split(",")}
        if not kinds & {"*/*", "text/*", "text/plain"}:
            raise RestError(406, "MQWB0307E", "The requested media type is not acceptable.",
                            "A message comes back as text/plain;charset=utf-8.",
                            "Resubmit the request with Accept: text/plain (or none).")

    async def delete(self, request: web.Request) -> web.Response:
        """Take the next message (by correlationId or messageId, waiting up to ``wait`` ms) under syncpoint; commit
        while the caller is still there, then reply 200 with it; 204 when there is none."""
        session = await self._admit(request)
        self._accepts_text(request)
        v3 = "/v3/" in request.path
        args = self._selection(request, v3)
        wait = request.query.get("wait", "0")
        wait_ms = ascii_number(wait)
        if wait_ms is None or wait_ms > self.server.max_wait_ms:
            raise bad_query("wait", wait, f"wait is a number of milliseconds, 0-{self.server.max_wait_ms}.")
        args.update(queue=queue_of(request), syncpoint=True)
        async with self._handle(session):
            if args.get("correlid"):
                # The message a browse by this correlationId shows first (any of the id's stored forms), taken by
                # its own form: a GET and then a DELETE of the same id show and take the same message. None now:
                # the get (and its wait) is for the id as given.
                forms = correlid_forms(args["correlid"])
                first = await self._run(session, "browse", lambda: queue_ops.browse_matching(
                    self.server, session, args["queue"], "c", forms, 1, bodies=False)) if len(forms) > 1 else []
                if first:
                    args["correlid"] = first[0].correlid
            try:
                got = await self._get(session, args, wait_ms)
            except (NoMessageError, ClientGoneError):  # none, or its caller left: nothing taken
                await self._keep_moves(session)
                return self._nothing_taken(request)
            m = message_from_wire(got)
            text = message_text(m, "The message is not text in UTF-8: it was left on the queue.", "Get")
            headers = carried_headers(m, int(time.time() * 1000), "It was left on the queue.", "Get")
            outcome = None
            # The caller's connection decides (not the member's stop, which sets ``gone`` too: a message taken by
            # then is still delivered to a caller who is there).
            if not peer_has_finished(request.transport):
                outcome = await self._run(session, "commit", partial(self._commit_taken, session, request))
            if outcome is None:
                return self._nothing_taken(request)  # the caller left: backed out (the handle's end), not taken
        reply = text_reply(text, headers)
        if outcome:
            reply.headers[OUTCOME_HEADER] = outcome
        return reply

    @staticmethod
    def _nothing_taken(request: web.Request) -> web.Response:
        """The reply of a DELETE that took nothing: 204; but when its caller only half-closed its connection (the
        end of its stream, which TCP does not tell from a hang-up) a 400 saying so, so that such a client is not
        told "no message" while messages wait: a get hands a message over only on a connection open both ways."""
        if peer_has_finished(request.transport) and request.transport is not None \
                and not request.transport.is_closing():
            raise RestError(400, "MQWB0303E", "Nothing was taken: the client ended its side of the connection "
                            "(a half-close) before the get's reply.",
                            "A destructive get hands a message over only on a connection open both ways: the end of "
                            "a client's stream may be a hang-up, and a message sent to nobody would be lost.",
                            "Keep the connection open until the reply has been read.")
        return web.Response(status=204)

    async def _get(self, session: RestSession, args: dict[str, Any], wait_ms: int) -> dict[str, Any]:
        """The get of a DELETE: one that waits takes a waiting slot first (in line, on the event loop, for no
        longer than its wait) and waits what is left of its wait in a thread of the waiting gets; one whose slot
        did not come in time tries once without waiting. NoMessageError when there is no message."""
        if wait_ms > 0:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_ms / 1000
            if await self.waits.take(session.peer, deadline, session.gone):
                try:
                    left = max(0, int((deadline - loop.time()) * 1000))
                    return await self._run(session, "get", lambda: queue_ops.get(
                        self.server, session, {**args, "wait_ms": left}), executor=self.wait_executor)
                finally:
                    self.waits.give(session.peer)
            if session.gone.is_set():  # nothing taken: the member stops (503), or nobody is there to answer
                if self.server.stopping:
                    raise mq_failure(self.server.quiescing("DELETE"), "the request was not carried out")
                raise NoMessageError("the caller left while its get waited in line")
        return await self._run(session, "get", lambda: queue_ops.get(self.server, session, {**args, "wait_ms": 0}))

    async def _keep_moves(self, session: RestSession) -> None:
        """Commit what a get that found no message (or stopped, its caller gone) left in its unit of work: it can
        hold only the poison messages it moved to their backout queue on the way (a get and a put each). Backed out with the request's handle, a
        poison message alone on its queue went back to its head at every DELETE, its backout count climbing, and
        never reached its backout queue."""
        if session.conn is not None and session.conn.uow is not None:
            await self._run(session, "commit", lambda: queue_ops.commit(self.server, session, {}))

    def _commit_taken(self, session: RestSession, request: web.Request) -> str | None:
        """Commit a message's get; "" when it committed; None when its caller left while the commit waited for a
        thread (nothing committed: the handle's end backs the get out). A commit logged but pending (a structure could not take it
        then) answers "pending", one whose outcome is not known (the member's log failed as its COMMIT was written)
        "unknown": either way the message is delivered, as a get outside syncpoint delivers it with its error
        (docs/client.md, "Outcome pending"), never consumed for nobody, and the reply says its get is not known
        done."""
        if peer_has_finished(request.transport):  # looked at again in the thread, just before the commit
            return None
        try:
            queue_ops.commit(self.server, session, {})
        except OutcomePendingError as e:
            log.warning("REST: a message's get is delivered with its commit pending: %s", one_line(str(e), ERROR_CHARS))
            return "pending"
        except OutcomeUnknownError as e:
            log.warning("REST: a message's get is delivered with its commit's outcome not known: %s", one_line(str(e), ERROR_CHARS))
            return "unknown"
        return ""

    async def _browse(self, request: web.Request, session: RestSession, limit: int, *,
                      bodies: bool = True) -> list[Message]:
        """Up to ``limit`` messages in get order, not taken; with a messageId or correlationId, those with that id
        only, found through the CF's index of the id (queue_ops.browse_matching: a bounded batch per CF call,
        however long the queue), never by reading the queue."""
        sel = self._selection(request, "/v3/" in request.path)
        queue = queue_of(request)
        if sel.get("correlid") == b"":  # no correlation id to match: the next message, as a DELETE takes it
            del sel["correlid"]
        if sel:
            match, values = ("m", [sel["msgid"]]) if "msgid" in sel else ("c", correlid_forms(sel["correlid"]))
            return await self._run(session, "browse", lambda: queue_ops.browse_matching(
                self.server, session, queue, match, values, limit, bodies=bodies))
        # A REST reply says nothing of messages left out: the browse stops at its limit.
        return await self._run(session, "browse", lambda: list(queue_ops.browse_messages(
            self.server, session, queue, limit, exact_more=False)))

    async def browse_one(self, request: web.Request) -> web.Response:
        """The first message (or the first with the messageId or correlationId asked for), left on its queue."""
        session = await self._admit(request)
        self._accepts_text(request)
        async with self._handle(session):
            found = await self._browse(request, session, 1)
        if not found:
            return web.Response(status=204)
        text = message_text(found[0], "The message is not text in UTF-8.", "Browse")
        return text_reply(text, carried_headers(found[0], int(time.time() * 1000), "", "Browse"))

    async def message_list(self, request: web.Request) -> web.Response:
        """A summary of up to ``limit`` messages (no bodies), in the order a get would take them."""
        session = await self._admit(request)
        raw = request.query.get("limit", str(MAX_LIST))
        limit = ascii_number(raw)
        if limit is None or not 1 <= limit <= MAX_LIST:
            raise bad_query("limit", raw, f"limit is 1-{MAX_LIST}.")
        async with self._handle(session):
            found = await self._browse(request, session, limit, bodies=False)  # a summary carries no body
        now = int(time.time() * 1000)
        return json_reply({"messages": [summary(m, now) for m in found]})


__all__ = ["CSRF_HEADER", "RestEndpoint", "RestError", "RestServer", "RestSession", "decode_id", "encode_id"]
