"""An SQM as a network service: an asyncio TCP server (optionally TLS) in front of one QueueManager.

The server keeps the life cycle (start the queue manager, serve, shut down gracefully) and the sessions (what a
request may run, and the end of a connection's session); the rest is in its own modules:

- sqm.service.transport: the connections, their frames, the session loop and the direct loop, the limits;
- sqm.service.auth: the handshake (docs/security.md, "The service");
- sqm.service.ops: the one table of operations, each owner's rows and handlers (queue_ops; the wings' sqm/conversations/ops.py
  and sqm/pubsub/ops.py), which the dispatcher here reads for the handler and the roles of each request;
- sqm.service.http: /healthz, /readyz and /metrics on a second port (loopback unless ``--metrics-host``);
- sqm.service.rest: the IBM MQ messaging REST API on a third port (``--rest-port``; docs/rest.md);
- sqm.service.config: ServerConfig and the exit codes of ``sqm run``.

Each client connection gets one worker thread: its requests run there one after another, on one
sqm.core.connection.Connection; the puts and gets (outside syncpoint, and under it with their commits) that
arrive together on several plain connections run instead as one batch on the service's event loop (sqm.service.batch_loop, ``begin_together`` and
``finish_together`` here; ``--thread-per-connection`` turns it off). When the connection goes away its open UOW is backed out (MQ backs out on an abnormal
end); a prepared (in-doubt) UOW stays in doubt for its coordinator.

Exit codes of ``sqm run``: 0 after a graceful shutdown (SIGTERM/SIGINT, with a checkpoint), 1 on a failure,
2 for a bad configuration, 3 when peer recovery fenced this queue manager (restart it), 4 when its record log
cannot be written (disk full, I/O error: fix the disk, then restart it; meanwhile a peer recovers its work).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cfemu.admin import AdminError
from cfemu.errors import (
    BadRequestError,
    ClientGoneError,
    FencedError,
    MQError,
    OutcomeUnknownError,
    StructureFailedError,
)
from cfemu.latency import Latencies
from cfemu.repository import RepositoryError
from sqm.conversations import ops as conversation_ops
from sqm.core.lifecycles import Begun, Call, Lifecycles, OneGet
from sqm.core.manager import CF_DOWN, QueueManager, QueueManagerConfig
from sqm.log import LogCorruptError, LogFormatError, LogLockedError
from sqm.operations import OPERATOR, ROLES, Handler, NotLoggedOnError, short
from sqm.pubsub import ops as pubsub_ops
from sqm.pubsub.publication_bounds import DraftBudget
from sqm.request_slots import RequestSlots
from sqm.service import conn_ops, metrics, queue_ops
from sqm.service.auth import Authenticator
from sqm.service.config import (
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_FENCED,
    EXIT_LOG_FAILED,
    EXIT_OK,
    ServerConfig,
    ServerConfigError,
    is_loopback_host,
    is_loopback_ip,
)
from sqm.service.http import HealthEndpoint
from sqm.service.ops import OPERATIONS, OPS
from sqm.service.protocol import MAX_FRAME, NotAuthorizedError, QuiescingError, error_reply, ok_reply
from sqm.service.queue_activity import QueueActivity
from sqm.service.session import (
    AUTH_FAILURE_REASONS,
    AUTH_METHODS,
    CLOSE_REASONS,
    LIMITS,
    OP_LABEL_UNKNOWN,
    Session,
    Stats,
    Together,
    Warnings,
)
from sqm.service.transport import Transport

if TYPE_CHECKING:
    from sqm.service.rest import RestEndpoint
from sqm.wings import WINGS

log = logging.getLogger("sqm.service.server")


class SQMServer:
    def __init__(self, config: ServerConfig, qm: QueueManager | None = None) -> None:
        self.config = config
        config.check()
        self.ssl = config.ssl_context()
        self.qm = qm if qm is not None else QueueManager(QueueManagerConfig(
            name=config.name, log_root=Path(config.log_root), redis_url=config.redis_url, lease_ms=config.lease_ms,
            cf_connections=config.cf_connections, scan_slots=config.scan_slots,
            logload=config.logload, clock_skew_us=config.clock_skew_ms * 1000,
            log_mode=config.log_mode, log_ring=config.log_ring, log_archive_dir=config.log_archive_dir,
            segment_bytes=config.segment_bytes, checkpoint_interval_s=config.checkpoint_interval_s,
            cpl_entries=config.cpl_entries, max_umsgs=config.max_umsgs, pstore_report=config.pstore_report,
            recover_structure=config.recover_structure), wings=WINGS)
        self.stats = Stats()
        self.activity = QueueActivity()  # last put and get per queue through this member (DISPLAY QSTATUS)
        self.slots = RequestSlots(config.request_slots, config.slot_lease_ms / 1000)
        self.lifecycles = Lifecycles(self.qm)  # requests of several connections run together (run_together)
        self.port = config.port
        self.metrics_port = config.metrics_port
        self.exit_code = EXIT_OK
        self.serving = False  # True once it serves (its ready file written): a failure before is a failed start
        self._stop: asyncio.Event | None = None
        self._stopping = False
        self.warn = Warnings()
        self.authenticator = Authenticator(config, self.qm, self.stats, self.warn)
        self.transport = Transport(self, config, self.stats, self.authenticator, self.warn)
        # Publications being published hold their bytes until COMMIT: counted in the budget of requests in flight.
        self._draft_budget = DraftBudget(self.transport.budget, config.request_budget_wait_s)
        # The operations a request may name, and their handlers (each timed into op_seconds, which the metrics
        # show): the handshake's run before (the transport's).
        self.op_seconds = Latencies()
        self._handlers: dict[str, Handler] = metrics.timed_handlers(OPERATIONS, self.op_seconds)
        self.registry = metrics.make_registry(self.qm, self.server_stats, self.op_seconds)
        self.http = HealthEndpoint(self.qm, self.registry, lambda: self._stopping, cache_s=config.metrics_cache_s,
                                   head_timeout_s=config.http_head_timeout_s,
                                   max_connections=config.metrics_max_connections,
                                   max_connections_per_peer=config.metrics_max_connections_per_peer, warn=self.warn)
        self.rest: RestEndpoint | None = None
        if config.rest_port is not None:
            # Imported only when served: aiohttp costs every member that serves no REST (most) a tenth of a second
            # of its start, and each test that starts one.
            from sqm.service.rest import RestEndpoint
            self.rest = RestEndpoint(self, config, self.authenticator.tokens)
        self.rest_port = config.rest_port

    # --- what the operations' handlers may use (sqm.operations.Service and each owner's extension) ---------------
    @property
    def name(self) -> str:
        return self.qm.name

    @property
    def max_wait_ms(self) -> int:
        return self.config.max_wait_ms

    @property
    def draft_budget(self) -> DraftBudget:
        return self._draft_budget

    @property
    def stopping(self) -> bool:
        return self._stopping

    def quiescing(self, op: str) -> QuiescingError:
        """The refusal of a request the server does not carry out because it is stopping."""
        return QuiescingError(f"queue manager {self.qm.name} is shutting down; {op} not carried out")

    def sessions(self) -> list[Session]:
        """The connections open on this member (DISPLAY CONN: sqm.service.conn_ops)."""
        return self.transport.sessions()

    def service_status(self) -> dict[str, Any]:
        """The server's part of a status reply."""
        c = self.config
        return {"host": c.host, "port": self.port, "metrics_port": self.metrics_port, "rest_port": self.rest_port,
                "connections": self.stats.connections, "unauthenticated": self.stats.unauthenticated,
                "tls": self.ssl is not None, "auth": c.auth, "roles": sorted(self.authenticator.tokens),
                "limits": {"max_connections": c.max_connections, "max_connections_per_peer":
                           c.max_connections_per_peer, "max_unauthenticated": c.max_unauthenticated,
                           "auth_timeout_s": c.auth_timeout_s, "idle_timeout_s": c.idle_timeout_s,
                           "max_umsgs": self.qm.config.max_umsgs,
                           "max_request_bytes": self.transport.budget.limit},
                "request_bytes_in_flight": self.transport.budget.used,
                "event_loop": {"on": c.event_loop, **self.transport.loop_counts()}}

    # --- life cycle --------------------------------------------------------------------------------------
    def server_stats(self) -> dict[str, Any]:
        st = self.stats
        budget = self.transport.budget
        return {"connections": st.connections, "requests": dict(st.requests), "unauthenticated": st.unauthenticated,
                "auth_failures": {r: st.auth_failures[r] for r in AUTH_FAILURE_REASONS},
                "authenticated": {(role, m): st.authenticated[(role, m)] for role in ROLES for m in AUTH_METHODS},
                "refused": {limit: st.refused[limit] for limit in LIMITS},
                "closed": {r: st.closed[r] for r in CLOSE_REASONS},
                "request_slots": self.slots.n, "waiting_for_slot": self.slots.waiting,
                "slot_waits": self.slots.waits, "slot_leases_expired": self.slots.expired,
                "scan_slots": self.qm.scans.n, "waiting_for_scan_slot": self.qm.scans.waiting,
                "scan_slot_waits": self.qm.scans.waits, "scan_slot_leases_expired": self.qm.scans.expired,
                "request_bytes_in_flight": budget.used, "request_bytes_limit": budget.limit,
                "request_budget_waits": budget.waits, "request_budget_refusals": budget.refused}

    def request_stop(self, exit_code: int = EXIT_OK) -> None:
        """Begin a graceful shutdown (thread-safe only from the event loop; signals and the watcher use it)."""
        if exit_code != EXIT_OK:
            self.exit_code = exit_code
        if self._stop is not None:
            self._stop.set()

    async def run(self, *, install_signals: bool = True) -> int:
        """Start the queue manager, serve until stopped, shut down gracefully; return the exit code."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        # Every port is had (bound, not yet listening) before the queue manager starts (joins the group, opens its
        # log, recovers): a port that cannot be had stops the member as a configuration error, with nothing of it
        # left in the group. Not listening meanwhile, a client's connection is refused, and it goes to another
        # member, rather than waiting in a backlog for the whole of a restart.
        service_sock = _reserve(self.config.host, self.config.port, "--port")
        self.port = service_sock.getsockname()[1]
        metrics_sock = None
        if self.config.metrics_port is not None:
            metrics_sock = _reserve(self.config.metrics_host, self.config.metrics_port, "--metrics-port")
        if self.rest is not None and self.config.rest_port:
            _reserve(self.config.rest_host, self.config.rest_port, "--rest-port").close()  # aiohttp binds it later
        try:
            await loop.run_in_executor(None, self._start_queue_manager)
        except BaseException:
            service_sock.close()
            if metrics_sock is not None:
                metrics_sock.close()
            raise
        server = await asyncio.start_server(self.transport.serve, sock=service_sock, ssl=self.ssl, limit=2**16,
                                            backlog=128,
                                            ssl_handshake_timeout=self.config.auth_timeout_s if self.ssl else None)
        if not is_loopback_host(self.config.host) and self.ssl is None:
            log.warning("%s: the service on %s:%d has no TLS: logon tokens and message bodies cross the network in "
                        "clear, readable by whoever is on the path (the service's own tokens are proven, never "
                        "sent); use --tls-cert/--tls-key (docs/security.md)", self.qm.name, self.config.host,
                        self.port)
        http = None
        if metrics_sock is not None:
            http = await asyncio.start_server(self.http.serve, sock=metrics_sock)
            self.metrics_port = http.sockets[0].getsockname()[1]
            if not is_loopback_host(self.config.metrics_host):
                log.warning("%s: /metrics, /healthz and /readyz on %s:%d have no authentication: whoever reaches "
                            "them reads queue names, depths and counters (--metrics-host)", self.qm.name,
                            self.config.metrics_host, self.metrics_port)
        if self.rest is not None and self.config.rest_port is not None:
            self.rest_port = await self.rest.start(self.config.rest_host, self.config.rest_port)
            if not is_loopback_host(self.config.rest_host) and self.ssl is None:
                log.warning("%s: the REST API on %s:%d has no TLS: a token sent to it from another host is refused "
                            "(use --tls-cert/--tls-key)", self.qm.name, self.config.rest_host, self.rest_port)
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        watcher = asyncio.create_task(self._watch_fencing())
        self._write_ready_file()
        self.serving = True
        log.info("%s serving on %s:%d%s (metrics %s:%s, REST %s), epoch %d, MAXUMSGS %d, %s", self.qm.name,
                 self.config.host, self.port, " with TLS" if self.ssl else "", self.config.metrics_host,
                 self.metrics_port, f"{self.config.rest_host}:{self.rest_port}" if self.rest else "off",
                 self.qm.caller.epoch, self.qm.config.max_umsgs,
                 f"authentication on (roles: {', '.join(self.authenticator.tokens)})" if self.config.auth else
                 "authentication OFF (--no-auth: every local connection is an operator)")
        if self.config.auth and OPERATOR not in self.authenticator.tokens:
            log.warning("%s: no operator token (operator.token, $SQM_OPERATOR_TOKEN): define, status and resolving "
                        "another's in-doubt UOW are refused to every connection", self.qm.name)
        try:
            await self._stop.wait()
        finally:
            watcher.cancel()
            await self._shutdown(server, http)
        return self.exit_code

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("%s: %s received: shutting down", self.qm.name, sig.name)
        self.request_stop(EXIT_OK)

    def _start_queue_manager(self) -> None:
        # Wait for the CF first: a failed QueueManager.start leaves its log open, so it is started only once.
        deadline = time.monotonic() + self.config.cf_wait_s
        while True:
            try:
                self.qm.redis.ping()
                break
            except CF_DOWN as e:
                if time.monotonic() >= deadline:
                    raise StructureFailedError(f"the CF did not answer within {self.config.cf_wait_s:g}s: {e}") from None
                log.info("%s: waiting for the CF: %s", self.qm.name, e)
                time.sleep(0.5)
        report = self.qm.start()  # sqm.core.recovery logs each restart phase
        log.info("%s restarted in %.3fs: %d log records read, %d in doubt kept", self.qm.name, report.seconds,
                 report.records_read, report.in_doubt)
        if self.config.max_frame < MAX_FRAME:
            log.warning("%s: frames are limited to %d bytes (--max-frame), less than a message a queue may hold "
                        "needs (%d): a longer put fails at the client with MQRC_MSG_TOO_BIG_FOR_CHANNEL, a get of a "
                        "longer message fails with MQRC_TRUNCATED_MSG_FAILED and leaves it on its queue",
                        self.qm.name, self.config.max_frame, MAX_FRAME)

    def _write_ready_file(self) -> None:
        if self.config.ready_file is None:
            return
        path = Path(self.config.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "name": self.qm.name, "host": self.config.host,
                                   "port": self.port, "metrics_host": self.config.metrics_host,
                                   "metrics_port": self.metrics_port, "rest_host": self.config.rest_host,
                                   "rest_port": self.rest_port}))
        os.replace(tmp, path)

    async def _watch_fencing(self) -> None:
        while True:
            if self.qm.fenced:
                log.error("%s was fenced by peer recovery (epoch %d is stale); exiting with code %d: restart it",
                          self.qm.name, self.qm.caller.epoch, EXIT_FENCED)
                self.request_stop(EXIT_FENCED)
                return
            await asyncio.sleep(0.25)

    async def _shutdown(self, server: asyncio.Server, http: asyncio.Server | None) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = True
        self.slots.close()  # requests queued for a slot are refused, not run after the grace
        server.close()
        await self.transport.stop(self.config.shutdown_grace_s)
        if self.rest is not None:
            await self.rest.stop()
        if http is not None:
            http.close()
        checkpoint = self.exit_code not in (EXIT_FENCED, EXIT_LOG_FAILED)
        await loop.run_in_executor(None, lambda: self.qm.stop(checkpoint=checkpoint))
        if self.qm.log_failed and self.exit_code == EXIT_OK:
            self.exit_code = EXIT_LOG_FAILED  # stopped by the operator with its log failed: say so to a supervisor
        if checkpoint and not self.qm.fenced and not self.qm.log_failed:
            log.info("%s stopped: shutdown checkpoint taken", self.qm.name)
        else:
            log.info("%s stopped without a checkpoint (%s)", self.qm.name, "fenced" if self.qm.fenced else "log failed")
        if self.config.ready_file is not None:
            with contextlib.suppress(FileNotFoundError):
                Path(self.config.ready_file).unlink()

    # --- sessions: what a request may run, and the end of a connection's session ----------------------------------
    def refusal(self, session: Session, rid: int, op: str) -> dict[str, Any] | None:
        """The error reply to an authenticated session's request that must not run (an unknown operation, one its
        role may not do, any while the queue manager stops, one that needs a logon on a connection without one),
        counted; None when it may run. Both transport loops ask it before a request runs."""
        row = OPERATIONS.get(op)
        if row is None or row.handler is None:
            bad = BadRequestError(f"unknown operation {short(op)}; known: {', '.join(OPS)}")
            self.stats.count((OP_LABEL_UNKNOWN, bad.reason_name))
            return error_reply(rid, bad, uow=session.uow_open())
        if session.role not in row.roles:
            denied = NotAuthorizedError(f"{op}: not authorized for the {session.role} role (an operator's "
                                        "request: connect with the operator token)")
            self.stats.count((op, denied.reason_name))
            self.warn(f"denied-{op}", "%s: connection %d (%s, %s): %s refused to the %s role", self.qm.name,
                      session.number, session.peer, session.named, op, session.role)
            return error_reply(rid, denied, uow=session.uow_open())
        if self._stopping:
            return error_reply(rid, self.quiescing(op), **session.flags())
        if row.needs_logon and session.conversation is None:
            alone = NotLoggedOnError(f"{op}: this connection has not logged on: send logon with a user id (and a "
                                     "token) first; a session ends with its connection")
            self.stats.count((op, alone.reason_name))
            return error_reply(rid, alone, **session.flags())
        return None

    def dispatch(self, session: Session, rid: int, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run a request the dispatcher let run (``refusal``), in its connection's worker thread, under a request
        slot (sqm.request_slots); its reply, or the error reply to what it raised."""
        try:
            with self.slots.running() as waited:
                if waited:
                    self._still_wanted(session, op)
                session.served += 1
                session.last_request = time.time()
                result = self._handlers[op](self, session, args)
            return ok_reply(rid, result, **session.flags())
        except Exception as e:
            return error_reply(rid, self._as_error(op, e), **session.flags())

    def _as_error(self, op: str, e: Exception) -> MQError:
        """What a request's client is told of what its handler raised."""
        if isinstance(e, MQError):
            return e
        if isinstance(e, AdminError):
            return BadRequestError(str(e))
        if isinstance(e, ValueError):  # names and values the CF layer refuses
            return BadRequestError(f"{op}: {e}")
        if isinstance(e, CF_DOWN):
            return StructureFailedError(f"the CF is unavailable: {e}")
        log.error("%s: %s failed", self.qm.name, op, exc_info=e)  # the server stays up; the failure is in its log
        return MQError(f"internal error in {op}: {type(e).__name__}: {e}")

    def may_run_together(self, op: str, args: dict[str, Any]) -> bool:
        """Whether a request is of the kinds begin_together runs together (queue_ops.runs_together)."""
        return queue_ops.runs_together(op, args)

    def begin_together(self, requests: list[tuple[Session, int, str, dict[str, Any]]]) -> Together:
        """Requests of several connections that the dispatcher let run (``refusal``), each connection's one, begun
        together where they can be (queue_ops.together: puts and gets outside syncpoint, puts, gets and commits under syncpoint;
        sqm.core.lifecycles):
        their CF scripts in one round trip, their records appended. ``finish_together`` forces and commits them
        and makes their replies; a reply left None is for a request to run by ``dispatch`` (any other request, or
        one the batch leaves to its own path). Runs on the service's event loop (sqm.service.batch_loop), under no
        request slot: one thread runs the whole batch."""
        t = Together(requests, [None] * len(requests))
        calls: list[Call] = []
        for k, (session, rid, op, args) in enumerate(requests):
            started = time.perf_counter()
            try:
                call = queue_ops.together(self, session, op, args)
            except Exception as e:  # refused for its arguments: run, counted and timed, as dispatch's are
                session.served += 1
                session.last_request = time.time()
                self.op_seconds[op].observe(time.perf_counter() - started)
                t.replies[k] = error_reply(rid, self._as_error(op, e), **session.flags())
                continue
            if call is not None:
                t.index.append(k)
                calls.append(call)
        if calls:
            t.started = time.perf_counter()
            try:
                t.begun = self.lifecycles.begin(calls)
            except Exception as e:  # each request hears it, as each would alone (named by its own operation)
                t.begun = Begun(calls, [self._as_error(requests[k][2], e) for k in t.index])
        return t

    def finish_together(self, batches: list[Together]) -> None:
        """Force and commit begun batches together (one fsync, one CF round trip), then make their replies."""
        begun = [t.begun for t in batches if t.begun is not None]
        try:
            self.lifecycles.finish(begun)
        except Exception as e:  # each call the batch was committing and not finished hears it (its COMMIT may be on
            # disk); the others' outcomes stand (a put or get under syncpoint is in its unit of work whatever happened)
            failed = self._as_error("commit", e)
            for b in begun:
                decided = b.decided.errors if b.decided is not None else [None] * len(b.together)
                for (i, _, message), known in zip(b.together, decided, strict=True):
                    if b.out[i] is not None:
                        continue
                    if known is not None and not isinstance(known, OutcomeUnknownError):
                        b.out[i] = known  # refused or backed out before its COMMIT was appended: that stands
                        continue
                    unknown = b.out[i] = OutcomeUnknownError(f"its batch's force or commit failed ({failed}): "
                                                             "committed if its COMMIT reached the disk")
                    if isinstance(b.calls[i], OneGet):  # its message delivered with it, never consumed for nobody
                        unknown.message = message
        now = time.time()
        for t in batches:
            if t.begun is None:
                continue
            took = time.perf_counter() - t.started
            for k, call, outcome in zip(t.index, t.begun.calls, t.begun.out, strict=True):
                if outcome is None:
                    continue
                session, rid, op, _ = t.requests[k]
                session.served += 1
                session.last_request = now
                self.op_seconds[op].observe(took)
                try:
                    t.replies[k] = ok_reply(rid, queue_ops.together_result(self, session, call, outcome),
                                            **session.flags())
                except Exception as e:
                    t.replies[k] = error_reply(rid, self._as_error(op, e), **session.flags())

    def _still_wanted(self, session: Session, op: str) -> None:
        """A request that waited for its slot runs only if the server is not stopping and its client is still
        there: queued, it may have outlived both (its client, told the outcome is unknown, may send it again)."""
        if self._stopping:
            raise self.quiescing(op)
        if session.gone.is_set():
            raise ClientGoneError(f"{op}: the client left while the request waited for a request slot")

    async def end_session(self, session: Session) -> None:
        """Like MQDISC after an abnormal end: the connection's in-flight UOW is backed out, in its own thread, and
        its conversation and publish/subscribe sessions with it."""
        loop = asyncio.get_running_loop()
        conn = session.conn
        if (conn is not None and conn.uow is not None) or session.conversation is not None or session.pubsub:
            def backout() -> None:
                conversation_ops.logoff(self, session, "closed connection")
                pubsub_ops.end_session(self, session)
                try:
                    if conn is not None:
                        conn.close()
                except MQError as e:
                    log.warning("%s: backing out the UOW of closed connection %d: %s", self.qm.name,
                                session.number, e)
            backed_out = loop.run_in_executor(session.executor, backout)
            try:
                await asyncio.shield(backed_out)
            except asyncio.CancelledError:  # the shutdown: the backout still ends before its checkpoint
                with contextlib.suppress(asyncio.CancelledError):
                    await backed_out
        session.executor.shutdown(wait=False)


if TYPE_CHECKING:  # the server and its sessions are what each owner's handlers take (checked by mypy)
    def _fits(server: SQMServer, session: Session) -> None:
        _queue: tuple[queue_ops.Service, queue_ops.Session] = (server, session)
        _connections: conn_ops.Service = server
        _conversation: tuple[conversation_ops.Service, conversation_ops.Session] = (server, session)
        _pubsub: tuple[pubsub_ops.Service, pubsub_ops.Session] = (server, session)


def _reserve(host: str, port: int, option: str) -> socket.socket:
    """host:port bound, not listening (a connection to it is refused until the server listens on it);
    ServerConfigError naming the option when it cannot be had (taken, not an address of this host)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ServerConfigError(f"cannot listen on {host}:{port} ({option}): {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's own servers do
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ServerConfigError(f"cannot listen on {host}:{port} ({option}): {e.strerror or e}") from None
    return sock


class StartFailed(Exception):  # noqa: N818 - what the command says: the start failed
    """The server did not start (a configuration it refused, a CF that did not answer, a log it cannot read): one
    line for the operator, and the exit code the process ends with (EXIT_*)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def serve(config: ServerConfig) -> int:
    """Run one SQM server until it is stopped; the return value is the process exit code. A failure before it
    serves raises StartFailed (one line and its exit code); one after is logged and its exit code returned."""
    try:
        server = SQMServer(config)
    except ServerConfigError as e:
        raise StartFailed(str(e), EXIT_CONFIG) from e
    try:
        return asyncio.run(server.run())
    except (ServerConfigError, LogLockedError, RepositoryError, LogCorruptError, LogFormatError, OSError,
            MQError) as e:
        message, code = _failure(config.name, e)
        if not server.serving:
            raise StartFailed(message, code) from e
        log.error("%s", message)
        return code


def _failure(name: str, e: Exception) -> tuple[str, int]:
    """What a failure of the server says, and the exit code it ends with."""
    if isinstance(e, ServerConfigError):  # a port that cannot be had: before the member joined the group
        return f"{name}: {e}", EXIT_CONFIG
    if isinstance(e, LogLockedError):
        return f"{name}: its log is in use by another process (is {name} already running?): {e}", EXIT_CONFIG
    if isinstance(e, RepositoryError):  # a log root that is not the group's: a configuration error
        return str(e), EXIT_CONFIG
    if isinstance(e, (LogCorruptError, LogFormatError)):  # its own log cannot be read: restart cannot recover
        return (f"{name}: its record log cannot be read, so it cannot restart (docs/runbook.md, \"Reading the "
                f"logs\"): {e}", EXIT_LOG_FAILED)
    if isinstance(e, MQError):
        return f"{name}: {e}", EXIT_FENCED if isinstance(e, FencedError) else EXIT_ERROR
    return f"{name}: {e}", EXIT_ERROR  # an OSError, e.g. the port is taken


__all__ = ["EXIT_CONFIG", "EXIT_ERROR", "EXIT_FENCED", "EXIT_LOG_FAILED", "EXIT_OK", "SQMServer", "ServerConfig",
           "ServerConfigError", "StartFailed", "is_loopback_host", "is_loopback_ip", "serve"]
