"""The console's web application (aiohttp; pages from jinja2 templates, charts as inline SVG: qsg.console.charts).

  GET  /login, POST /login     the login form: the group's operator token (qsg.console.security)
  POST /logout
  GET  /                       the overview: structures, queues, members, connections, in-doubt UOWs, backups,
                               restores, actions under way, events, charts
  GET  /fragment               the overview alone: what the page's script fetches every few seconds
  GET  /api/snapshot           the same as one JSON document (for scripts and tests; the session's cookie)
  POST /action/NAME            an operator action (qsg.console.actions): first a confirmation page, then, with
                               confirmed=yes, the action starts as a job and the browser goes back to /

Every request must name the console in its Host header (host_allowed): an IP address, localhost, the host it
serves on, this machine's name, or a name given with allowed_hosts; another name is a page of a site whose DNS name
was re-pointed at the console (DNS rebinding), refused. Every page but the login needs a session; every POST its CSRF token. The group is read by a poller every
``interval_s`` seconds in one worker thread (qsg.console.snapshot), never by a page request, so that a slow CF
or member slows the picture's refresh, not the pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web
from markupsafe import Markup

from qsg.console import charts, snapshot
from qsg.console.actions import ACTIONS, ActionError
from qsg.console.history import History
from qsg.console.jobs import RUNNING, Job, JobRefusedError, Jobs
from qsg.console.security import (
    CSRF_FIELD,
    REFRESH_HEADER,
    SESSION_COOKIE,
    LoginBusyError,
    LoginGate,
    Session,
    Sessions,
    TokenWatch,
    fingerprint_matches,
    token_fingerprint,
    token_matches,
)
from qsg.console.source import GroupSource
from sqm.http_guard import GuardedSite, HttpLimits, read_body, runner_kwargs
from sqm.operations import one_line
from sqm.service.auth import Failures
from sqm.service.config import is_loopback_ip
from sqm.throttled_log import ThrottledLog

log = logging.getLogger("qsg.console")

STATIC = Path(__file__).parent / "static"
EVENTS_SHOWN = 30
MAX_FORM_BYTES = 16 * 1024
SESSION_KEY = web.RequestKey("console_session", Session)  # where the middleware leaves the request's Session
# Everything from the console itself, no inline script or style, no framing: what an injected string could use.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "same-origin", "Cache-Control": "no-store"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _clock(t: float | None) -> str:
    return datetime.fromtimestamp(t).strftime("%H:%M:%S") if t else "-"


def _wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


async def _form(request: web.Request, head_timeout_s: float) -> Any:
    """The request's form, its body whole within the door's time (sqm.http_guard.read_body, else 408); a body that is
    not one (bytes that are not UTF-8 in a urlencoded form) is a 400."""
    await read_body(request, head_timeout_s)
    try:
        return await request.post()
    except ValueError as e:  # UnicodeDecodeError among them
        raise web.HTTPBadRequest(text=f"the form could not be read: {type(e).__name__} (send it as UTF-8)") from None


def _session(request: web.Request) -> Session:
    return request[SESSION_KEY]


class Console:
    """One console: its sessions, jobs and history, the latest snapshot, and the aiohttp application."""

    def __init__(self, source: GroupSource, *, interval_s: float = 2.0, allowed_hosts: Iterable[str] = ()) -> None:
        self.source = source
        self.allowed_hosts = {"localhost", *(h.lower() for h in allowed_hosts)}
        self.interval_s = interval_s
        self.sessions = Sessions()
        self.token = TokenWatch(source.operator_token, source.operator_token_stamp)
        self.history = History()
        self.jobs = Jobs(on_change=self._job_changed)
        self.failures = Failures()
        self.login_gate = LoginGate()
        self.limits = HttpLimits(max_connections=64, max_connections_per_peer=32)  # serve's default
        self._errors = ThrottledLog(log)  # a peer's requests must not be able to flood the log with tracebacks
        self.snapshot: dict[str, Any] | None = None
        self.charts = self._draw_charts()  # drawn once per snapshot, in the poller's thread; pages reuse them
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="console-poll")
        self._poller: asyncio.Task[None] | None = None
        self._refresh = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.templates = jinja2.Environment(loader=jinja2.PackageLoader("qsg.console", "templates"),
                                            autoescape=True)
        self.templates.filters.update(age=_age, size=_size, clock=_clock)
        self.templates.globals["static_url"] = self._static_url
        self.app = web.Application(middlewares=[self._security], client_max_size=MAX_FORM_BYTES)
        r = self.app.router
        r.add_get("/login", self.login_page)
        r.add_post("/login", self.login)
        r.add_post("/logout", self.logout)
        r.add_get("/", self.index)
        r.add_get("/fragment", self.fragment)
        r.add_get("/api/snapshot", self.api_snapshot)
        r.add_post("/action/{name}", self.action)
        r.add_static("/static", STATIC, name="static", append_version=True)
        self.app.on_response_prepare.append(self._headers_on_every_reply)
        self.app.on_startup.append(self._start_poller)
        self.app.on_cleanup.append(self._stop_poller)

    def _job_changed(self, job: Job) -> None:
        """An operator action's start and end are events; its end also asks for a fresh picture at once. Called
        from the job's thread: the history and the poller are the event loop's, so the loop does both."""
        text = f"{job.title}: {job.state}" + (f": {job.result}" if job.result else "")
        if self._loop is None:
            self.history.note("action", text)
            return
        self._loop.call_soon_threadsafe(self.history.note, "action", text)
        if job.state != RUNNING:
            self._loop.call_soon_threadsafe(self._refresh.set)

    # --- the poller ----------------------------------------------------------------------------------------------
    async def poll_once(self) -> dict[str, Any]:
        """Take a snapshot now (in the poller's thread) and remember it."""
        loop = asyncio.get_running_loop()
        snap = await loop.run_in_executor(self._executor, snapshot.take, self.source)
        self.history.add(snap)
        self.charts = await loop.run_in_executor(self._executor, self._draw_charts)
        self.snapshot = snap
        return snap

    def _draw_charts(self) -> dict[str, Markup]:
        """The overview's charts from the history's samples (which only the event loop's poll_once adds to, and
        not while this runs): drawn once per snapshot, never per page, since every open tab fetches the page."""
        return {"depth_chart": Markup(charts.line_chart("queue depth", self.history.depth_series(), unit="msgs")),
                "rate_chart": Markup(charts.line_chart("throughput", self.history.rate_series(), unit="/s"))}

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - the next poll tries again
                log.exception("console: a poll failed")
            self._refresh.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._refresh.wait(), self.interval_s)

    async def _start_poller(self, app: web.Application) -> None:
        self._loop = asyncio.get_running_loop()
        self._poller = asyncio.create_task(self._poll_forever())

    async def _stop_poller(self, app: web.Application) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- what every request goes through -------------------------------------------------------------------------
    @web.middleware
    async def _security(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Security headers on every reply; a session for every page but the login and the static files; the
        CSRF token and a same-origin Origin on every POST but the login's (which has no session yet)."""
        public = request.path == "/login" or request.path.startswith("/static/")
        try:
            if not self.host_allowed(request.host):
                raise web.HTTPMisdirectedRequest(text=f"Host {request.host[:100]!r} is not this console's address: "
                                                      "refused (give it with --allow-host if it is)")
            if not public:
                session = self.sessions.find(request.cookies.get(SESSION_COOKIE),
                                             touch=REFRESH_HEADER not in request.headers)
                if session is not None and session.token != self.token.current():
                    log.warning("console: the operator token changed: the session from %s ends", session.peer)
                    self.sessions.end(session.id)
                    session = None
                if session is None:
                    if request.method == "GET" and request.path == "/":
                        raise web.HTTPSeeOther("/login")
                    raise web.HTTPUnauthorized(text="log in first: /login")
                request[SESSION_KEY] = session
            if request.method == "POST":
                origin = request.headers.get("Origin")
                if origin is not None and origin != f"{request.scheme}://{request.host}":
                    # repr: an Origin of bytes that are not UTF-8 cannot be written back as they came
                    raise web.HTTPForbidden(text=f"a form from another origin ({origin[:100]!r}) is refused")
                if not public:
                    form = await _form(request, self.limits.head_timeout_s)
                    sent = form.get(CSRF_FIELD)
                    if not _session(request).csrf_ok(sent if isinstance(sent, str) else None):
                        raise web.HTTPForbidden(text="missing or wrong CSRF token: reload the page and try again")
            response = await handler(request)
        except web.HTTPException as e:  # a redirect or a refusal: raised on, with the same headers
            e.headers.update(SECURITY_HEADERS)
            raise
        except Exception as e:  # noqa: BLE001 - a request the code did not expect: a 500 that still has the headers
            self._errors("error", "console: %s %r from %s failed: %s: %s", request.method, request.path[:100],
                         request.remote, type(e).__name__, one_line(str(e), 200), exc_info=e)
            return web.Response(status=500, text="the console failed on this request (its log says why)",
                                headers=SECURITY_HEADERS)
        response.headers.update(SECURITY_HEADERS)
        return response

    @staticmethod
    async def _headers_on_every_reply(request: web.Request, response: web.StreamResponse) -> None:
        """The security headers on whatever reply the application sends, what the middleware did not see too."""
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)

    def host_allowed(self, host: str) -> bool:
        """Does a Host header name this console (see the module doc)? Its port is not compared."""
        name = host.strip().lower()
        if name.startswith("["):  # [IPv6]:port
            name = name[1:name.find("]")] if "]" in name else name
        elif name.count(":") == 1:
            name = name.rsplit(":", 1)[0]
        name = name.rstrip(".")
        try:
            ipaddress.ip_address(name)
            return True  # an address: no name for a rebinding to re-point
        except ValueError:
            pass
        return name in self.allowed_hosts

    def _static_url(self, filename: str) -> str:
        """A static file's URL with its content's hash (a changed file is fetched anew)."""
        return str(self.app.router["static"].url_for(filename=filename))

    def _render(self, name: str, status: int = 200, **context: Any) -> web.Response:
        text = self.templates.get_template(name).render(csrf_field=CSRF_FIELD, **context)
        return web.Response(text=text, content_type="text/html", charset="utf-8", status=status)

    # --- login ---------------------------------------------------------------------------------------------------
    def _clear_allowed(self, request: web.Request) -> bool:
        """A token typed in clear may travel over TLS or loopback only."""
        return request.secure or is_loopback_ip(request.remote or "")

    async def login_page(self, request: web.Request) -> web.StreamResponse:
        if self.sessions.find(request.cookies.get(SESSION_COOKIE)) is not None:
            raise web.HTTPSeeOther("/")
        return self._render("login.html", error="", insecure=not self._clear_allowed(request))

    async def login(self, request: web.Request) -> web.StreamResponse:
        if not self._clear_allowed(request):
            return self._render("login.html", 403, insecure=True,
                                error="this console serves no TLS: log in from its own host, or start it with "
                                      "--tls-cert and --tls-key")
        form = await _form(request, self.limits.head_timeout_s)
        sent = form.get("token")
        fingerprint = self.token.strong()  # cheap: a stat, the token read again only when it may have changed
        if isinstance(sent, str) and fingerprint_matches(fingerprint, sent):
            # A strong token is let in at once, never queued behind its address's failures: every local client is
            # the one loopback address, so a local peer keeping wrong guesses queued would keep the operator out.
            # A weak one waits its turn, so that guesses of it are checked no faster than the failures' delays.
            return self._logged_in(request, fingerprint)
        try:
            async with self.login_gate.turn(request.remote or "?"):
                return await self._check_login(request, sent)
        except LoginBusyError as e:
            return self._render("login.html", 429, insecure=False, error=str(e))

    async def _check_login(self, request: web.Request, sent: Any) -> web.StreamResponse:
        """The login's check, in its address's turn: a failure is answered after its delay, which the address's
        next attempt waits for."""
        expected = await asyncio.get_running_loop().run_in_executor(None, self.token.refresh)
        if not expected:
            return self._render("login.html", 503, insecure=False,
                                error="the group has no operator token (operator.token in its secrets directory; "
                                      "'cfemu secrets init' makes one)")
        if not isinstance(sent, str) or not token_matches(expected, sent):
            n, delay = self.failures.record(request.remote or "?", time.monotonic())
            log.warning("console: failed login from %s (%d in a row)", request.remote, n)
            await asyncio.sleep(delay)
            return self._render("login.html", 401, insecure=False, error="wrong token")
        return self._logged_in(request, token_fingerprint(expected))

    def _logged_in(self, request: web.Request, fingerprint: str | None) -> web.StreamResponse:
        session = self.sessions.begin(request.remote or "", fingerprint)
        log.info("console: operator logged in from %s", request.remote)
        response = web.HTTPSeeOther("/")
        response.set_cookie(SESSION_COOKIE, session.id, httponly=True, samesite="Strict", secure=request.secure,
                            path="/")
        raise response

    async def logout(self, request: web.Request) -> web.StreamResponse:
        self.sessions.end(_session(request).id)
        response = web.HTTPSeeOther("/login")
        response.del_cookie(SESSION_COOKIE, path="/")
        raise response

    # --- pages ---------------------------------------------------------------------------------------------------
    def _overview(self, session: Session) -> dict[str, Any]:
        flashes, session.flashes = session.flashes, []
        return {"snap": self.snapshot, "jobs": self.jobs.list(), "csrf": session.csrf, "flashes": flashes,
                "events": list(reversed(self.history.events))[:EVENTS_SHOWN], "actions": ACTIONS,
                "interval_ms": int(self.interval_s * 1000), **self.charts}

    async def index(self, request: web.Request) -> web.StreamResponse:
        return self._render("index.html", **self._overview(_session(request)))

    async def fragment(self, request: web.Request) -> web.StreamResponse:
        return self._render("overview.html", **self._overview(_session(request)))

    async def api_snapshot(self, request: web.Request) -> web.StreamResponse:
        jobs = [{**vars(j), "percent": j.percent, "seconds": j.seconds} for j in self.jobs.list()]
        events = [vars(e) for e in self.history.events]
        return web.json_response({"snapshot": self.snapshot, "jobs": jobs, "events": events},
                                 dumps=lambda d: json.dumps(d, default=str))

    # --- actions -------------------------------------------------------------------------------------------------
    async def action(self, request: web.Request) -> web.StreamResponse:
        session = _session(request)
        action = ACTIONS.get(request.match_info["name"])
        if action is None:
            raise web.HTTPNotFound(text=f"no action {request.match_info['name'][:40]}")
        form = await _form(request, self.limits.head_timeout_s)
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        if self.snapshot is None:
            session.flashes.append(("error", "the console has not read the group yet: try again in a moment"))
            raise web.HTTPSeeOther("/")
        try:
            params = action.check(fields, self.snapshot)
        except ActionError as e:
            session.flashes.append(("error", f"{action.label}: {e}"))
            raise web.HTTPSeeOther("/") from None
        if fields.get("confirmed") != "yes":
            return self._render("confirm.html", action=action, question=action.confirm(params), csrf=session.csrf,
                                fields={k: fields.get(k, "") for k in action.fields})
        source = self.source
        try:
            job = self.jobs.start(action.name, action.target(params), action.title(params),
                                  lambda progress: action.run(source, params, progress))
        except JobRefusedError as e:
            session.flashes.append(("error", f"{action.label}: {e}"))
            raise web.HTTPSeeOther("/") from None
        log.info("console: %s started by the operator from %s", job.title, request.remote)
        session.flashes.append(("info", f"{job.title} started"))
        self._refresh.set()
        raise web.HTTPSeeOther("/#jobs")

    # --- serving -------------------------------------------------------------------------------------------------
    async def serve(self, host: str, port: int, ssl_context: ssl.SSLContext | None,
                    limits: HttpLimits | None = None) -> web.AppRunner:
        """Start serving, under ``limits`` (sqm.http_guard: a cap on connections, a wait for a request's head, a
        keep-alive timeout, a throttled error log); the runner (its address: runner.addresses) to clean up when
        done."""
        limits = self.limits = limits or self.limits
        if host and not _wildcard(host):
            self.allowed_hosts.add(host.lower())
        else:  # every address of this machine: its names too
            self.allowed_hosts |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False, **runner_kwargs(limits, log))
        await runner.setup()
        await GuardedSite(runner, host, port, limits, "console", log, ssl_context=ssl_context, backlog=64).start()
        return runner


__all__ = ["CSP", "Console", "SECURITY_HEADERS"]
