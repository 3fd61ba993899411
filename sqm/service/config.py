"""The configuration of an SQM server (``sqm run``'s options) and the exit codes of ``sqm run``.

Exit codes: 0 after a graceful shutdown (SIGTERM/SIGINT, with a checkpoint), 1 on a failure, 2 for a bad
configuration, 3 when peer recovery fenced this queue manager (restart it), 4 when its record log cannot be written
(disk full, I/O error: fix the disk, then restart it; meanwhile a peer recovers its work).
"""

from __future__ import annotations

import math
import os
import ssl
from dataclasses import dataclass, field, fields
from pathlib import Path

from cfemu.settings import DEFAULT_MAX_UMSGS, MAX_MAX_UMSGS
from cfemu.sockets import is_loopback_host, is_loopback_ip
from sqm.core.recauto import RecoverStructure
from sqm.core.scans import DEFAULT_SCAN_SLOTS, MAX_SCAN_SLOTS
from sqm.operations import APPLICATION, OPERATOR
from sqm.request_slots import LEASE_S, MAX_SLOTS, default_slots
from sqm.service.protocol import DEFAULT_MAX_FRAME, MAX_FRAME, MIN_FRAME

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_FENCED, EXIT_LOG_FAILED = 0, 1, 2, 3, 4

DEFAULT_REQUEST_BUDGET = 256 * 2**20  # the least default budget of request bytes in flight on a member
MAX_REST_WORKERS = 1024  # threads for REST requests (twice this: as many again for waiting gets); more is a mistake


class ServerConfigError(ValueError):
    """A server option that cannot work (a missing TLS file, no token, --no-auth on a non-loopback host...)."""


@dataclass
class ServerConfig:
    name: str
    log_root: Path
    redis_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (see ready_file)
    token: str | None = None  # the application role's token (sqm.service.protocol.ROLES)
    operator_token: str | None = None  # the operator role's token; None: nobody may run operator requests
    auth: bool = True  # False (--no-auth, loopback only): every connection is an operator, unauthenticated
    auth_timeout_s: float = 5.0  # a connection not authenticated by then is closed
    idle_timeout_s: float = 3600.0  # an authenticated connection with no request for this long is closed; 0: never
    max_connections: int = 512  # connections at once, all peers
    max_connections_per_peer: int = 128  # connections at once from one address
    max_unauthenticated: int = 64  # connections at once that have not authenticated yet (full: the oldest is closed)
    # Bytes of requests in flight on this member (a frame over FREE_FRAME reserves its length before its body is
    # read); None: the larger of DEFAULT_REQUEST_BUDGET and 4 frames of max_frame (request_budget()).
    max_request_bytes: int | None = None
    request_budget_wait_s: float = 5.0  # a large frame waits this long for the budget before it is refused
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # with cert and key: mutual TLS, clients must present a certificate from this CA
    metrics_port: int | None = None  # /healthz, /readyz and /metrics; None: no HTTP endpoint
    # They have no authentication (what they show: queue names, depths, counters), so they listen on loopback
    # unless the operator says otherwise, whatever ``host`` the service itself listens on.
    metrics_host: str = "127.0.0.1"
    # The IBM MQ messaging REST API (sqm.service.rest, docs/rest.md); None: off. Loopback unless the operator says
    # otherwise, like the metrics port; it authenticates with the service's tokens and uses its TLS settings.
    rest_port: int | None = None
    rest_host: str = "127.0.0.1"
    rest_workers: int = 32  # REST requests carried out at once, and waiting gets at once (sqm.service.rest_waits)
    rest_max_body: int = 4 * 2**20  # the longest body a REST put takes (a queue's default MAXMSGL)
    # The bounds of the HTTP doors against peers that have not authenticated (sqm.http_guard, docs/security.md)
    http_head_timeout_s: float = 10.0  # a new REST or metrics connection's request head must be whole by then
    rest_keepalive_timeout_s: float = 30.0  # a REST connection idle between requests this long is closed
    rest_max_connections: int = 256  # REST connections open at once (past it a new one is closed at once)
    rest_max_connections_per_peer: int = 64  # REST connections open at once from one address
    metrics_max_connections: int = 32  # metrics-port connections open at once
    metrics_max_connections_per_peer: int = 8  # metrics-port connections open at once from one address
    metrics_cache_s: float = 1.0  # a /metrics page is collected at most once per this long; 0: every scrape
    lease_ms: int = 5000
    cf_connections: int = 64
    # requests doing their work at once, up to their first wait (sqm.request_slots); the rest wait for a slot
    request_slots: int = field(default_factory=default_slots)
    slot_lease_ms: int = int(LEASE_S * 1000)  # a request holding its slot this long counts as waiting
    # calls of multi-call scans (browse pages, peek scans) in the CF at once (sqm.core.scans); the rest wait here
    scan_slots: int = DEFAULT_SCAN_SLOTS
    # Authenticated plain connections served by one event loop that runs the puts and gets outside syncpoint that
    # arrive together as one batch (sqm.service.batch_loop); False: each by its own thread (the direct loop)
    event_loop: bool = True
    logload: int = 10000  # LOGLOAD: a checkpoint every this many log records
    max_umsgs: int = DEFAULT_MAX_UMSGS  # MAXUMSGS: messages put and got in one unit of work (QueueManagerConfig)
    # Log management (sqm.core.manager.QueueManagerConfig, docs/log-management.md)
    log_mode: str = "linear"
    log_ring: int = 8
    log_archive_dir: Path | None = None
    segment_bytes: int = 64 * 2**20
    checkpoint_interval_s: float = 300.0
    cpl_entries: int = 3
    pstore_report: Path | None = None  # the running store report's file (PSTORE-REPORT=YES); None: none
    max_frame: int = DEFAULT_MAX_FRAME  # MIN_FRAME-MAX_FRAME; less than MAX_FRAME cannot carry every message
    max_wait_ms: int = 60_000  # longest get wait a request may ask for
    shutdown_grace_s: float = 10.0  # in-flight requests get this long to finish at shutdown
    cf_wait_s: float = 30.0  # how long to wait for the CF to answer at start
    ready_file: Path | None = None  # JSON {pid, host, port, metrics_port} written once serving
    clock_skew_ms: int = 0  # added to the physical time the LRSN clock reads (tests of a skewed member)
    recover_structure: RecoverStructure | None = None  # RECAUTO's restore (sqm.core.recauto), injected by qsg.member

    def check(self) -> None:
        for f in fields(self):  # a duration is compared below: NaN would pass every comparison, infinity most
            value = getattr(self, f.name)
            if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
                raise ServerConfigError(f"{f.name} must be a finite number of seconds >= 0, not {value}")
        if not MIN_FRAME <= self.max_frame <= MAX_FRAME:
            raise ServerConfigError(f"max frame must be {MIN_FRAME}-{MAX_FRAME} bytes, not {self.max_frame}")
        if self.auth and not (self.token or self.operator_token):
            raise ServerConfigError("authentication is on and no token was given (the application's or the "
                                    "operator's)")
        if self.auth and self.token and self.token == self.operator_token:
            raise ServerConfigError("the application and operator tokens are the same: an application would be "
                                    "an operator; give each role its own")
        if not self.auth and not is_loopback_host(self.host):
            raise ServerConfigError(f"--no-auth is refused on {self.host!r}, which is not a loopback address: anyone "
                                    "who reaches it could do anything; listen on 127.0.0.1, or run with a token")
        if self.auth_timeout_s <= 0 or self.idle_timeout_s < 0:
            raise ServerConfigError("the authentication timeout must be > 0 s and the idle timeout >= 0 s (0: none)")
        if min(self.max_connections, self.max_connections_per_peer, self.max_unauthenticated) < 1:
            raise ServerConfigError("connection limits must be at least 1")
        if self.http_head_timeout_s <= 0 or self.rest_keepalive_timeout_s <= 0 or self.metrics_cache_s < 0:
            raise ServerConfigError("the HTTP head and keep-alive timeouts must be > 0 s, the metrics cache >= 0 s")
        if min(self.rest_max_connections, self.rest_max_connections_per_peer, self.metrics_max_connections,
               self.metrics_max_connections_per_peer) < 1:
            raise ServerConfigError("the HTTP connection caps must be at least 1")
        for flag, port in (("--port", self.port), ("--metrics-port", self.metrics_port),
                           ("--rest-port", self.rest_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ServerConfigError(f"{flag} must be 0-65535 (0: any free port), not {port}")
        if not 1 <= self.rest_workers <= MAX_REST_WORKERS or self.rest_max_body < 1:
            raise ServerConfigError(f"the REST workers must be 1-{MAX_REST_WORKERS} (not {self.rest_workers}) and "
                                    f"the REST body limit at least 1 (not {self.rest_max_body})")
        if self.rest_port is not None and not self.auth and not is_loopback_host(self.rest_host):
            raise ServerConfigError(f"--no-auth is refused with --rest-host {self.rest_host!r}, which is not a "
                                    "loopback address: anyone who reaches it could take every message")
        if self.max_request_bytes is not None and self.max_request_bytes < self.max_frame:
            raise ServerConfigError(f"the request budget ({self.max_request_bytes} bytes) must hold at least one "
                                    f"frame of the max frame ({self.max_frame} bytes)")
        if self.request_budget_wait_s < 0:
            raise ServerConfigError("the wait for the request budget must be >= 0 s")
        if not 1 <= self.request_slots <= MAX_SLOTS:
            raise ServerConfigError(f"request slots must be at least 1 and at most {MAX_SLOTS}, not "
                                    f"{self.request_slots}")
        if not 1 <= self.scan_slots <= MAX_SCAN_SLOTS:
            raise ServerConfigError(f"scan slots must be at least 1 and at most {MAX_SCAN_SLOTS}, not {self.scan_slots}")
        if self.slot_lease_ms < 1:
            raise ServerConfigError(f"a request slot's lease must be at least 1 ms, not {self.slot_lease_ms}")
        if not 1 <= self.max_umsgs <= MAX_MAX_UMSGS:
            raise ServerConfigError(f"MAXUMSGS must be 1-{MAX_MAX_UMSGS}, not {self.max_umsgs}")

    def request_budget(self) -> int:
        """Bytes of requests in flight this member accepts at once (--max-request-bytes-per-member)."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return max(DEFAULT_REQUEST_BUDGET, 4 * self.max_frame)

    def role_tokens(self) -> dict[str, str]:
        return {role: tok for role, tok in ((APPLICATION, self.token), (OPERATOR, self.operator_token)) if tok}

    def ssl_context(self) -> ssl.SSLContext | None:
        if not (self.tls_cert or self.tls_key or self.tls_ca):
            return None
        if not (self.tls_cert and self.tls_key):
            raise ServerConfigError("TLS needs both --tls-cert and --tls-key")
        for what, path in (("certificate", self.tls_cert), ("key", self.tls_key), ("CA", self.tls_ca)):
            if path is not None and not os.path.isfile(path):
                raise ServerConfigError(f"TLS {what} file not found: {path}")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except ssl.SSLError as e:  # not PEM, or a key that is not the certificate's
            raise ServerConfigError(f"TLS certificate {self.tls_cert} and key {self.tls_key}: not a PEM certificate "
                                    f"and its private key ({e.reason or e})") from None
        except OSError as e:
            raise ServerConfigError(f"TLS certificate {self.tls_cert} and key {self.tls_key}: {e.strerror or e}") \
                from None
        if self.tls_ca:
            try:
                ctx.load_verify_locations(self.tls_ca)
            except (ssl.SSLError, OSError) as e:
                raise ServerConfigError(f"TLS CA {self.tls_ca}: not a PEM certificate ({e})") from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx



__all__ = ["DEFAULT_REQUEST_BUDGET", "EXIT_CONFIG", "EXIT_ERROR", "EXIT_FENCED", "EXIT_LOG_FAILED", "EXIT_OK", "ServerConfig",
           "ServerConfigError", "is_loopback_host", "is_loopback_ip"]
