"""Authentication of the service's connections (docs/security.md, "The service"; the wire: sqm.service.protocol).

A connection proves it holds the token of a role by a challenge and response (``hello`` with a nonce, then
``auth`` with an HMAC of the transcript); version 2's bearer token in the hello is accepted only on loopback or
over TLS. Each role may then run its own operations (the roles of each operation's row: sqm.service.ops).

A failed authentication is answered after AUTH_DELAY_BASE_S * 2**(n-1) seconds, n the failures from that address
in a row (forgotten AUTH_FORGET_S after the last), at most AUTH_DELAY_MAX_S; the connection (and its slot under
the limits) is held meanwhile, so one address gets at most max_connections_per_peer / delay guesses a second.
Addresses remembered: at most AUTH_TRACKED (the least recent forgotten first). Every outcome is counted
(sqm.service.session.Stats), with bounded labels.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from cfemu.errors import BadRequestError, MQError
from sqm.core.manager import QueueManager
from sqm.operations import arg, short
from sqm.service.config import ServerConfig, is_loopback_ip
from sqm.service.protocol import (
    AUTH_METHOD,
    MIN_FRAME,
    PROOF_BYTES,
    PROTOCOL_VERSION,
    NotAuthorizedError,
    auth_proof,
    auth_transcript,
    error_reply,
    new_nonce,
    ok_reply,
)
from sqm.service.session import Session, Stats

log = logging.getLogger("sqm.service.server")  # the service's log lines keep one logger name

AUTH_DELAY_BASE_S = 0.1
AUTH_DELAY_MAX_S = 3.0
AUTH_FORGET_S = 60.0
AUTH_TRACKED = 4096


class Failures:
    """Failed authentications per peer address, for the delay before answering the next one (bounded)."""

    def __init__(self) -> None:
        self._by_ip: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def record(self, ip: str, now: float) -> tuple[int, float]:
        """Count a failure from ip; (failures in a row, seconds to wait before answering it)."""
        n, last = self._by_ip.pop(ip, (0, now))
        n = 1 if now - last > AUTH_FORGET_S else n + 1
        self._by_ip[ip] = (n, now)
        while len(self._by_ip) > AUTH_TRACKED:
            self._by_ip.popitem(last=False)
        return n, min(AUTH_DELAY_MAX_S, AUTH_DELAY_BASE_S * 2 ** min(n - 1, 30))


class Authenticator:
    """The handshake of a server's connections: hello, auth, and what they count and log."""

    def __init__(self, config: ServerConfig, qm: QueueManager, stats: Stats,
                 warn: Callable[..., None]) -> None:
        self.config = config
        self.qm = qm
        self.stats = stats
        self.warn = warn
        self.tokens = config.role_tokens() if config.auth else {}
        self._decoy = secrets.token_urlsafe(32)  # what a proof naming an unknown role is compared with
        self._failures = Failures()

    def refused(self, session: Session, reason: str) -> None:
        """Count a refusal of a peer that has not authenticated (its connection is closed after the reply)."""
        if not session.authenticated:
            self.stats.auth_failures[reason] += 1

    def authenticated(self, session: Session, role: str, method: str) -> None:
        session.authenticated = True
        session.role = role
        session.auth_method = method
        session.request_limit = self.config.max_frame
        self.stats.unauthenticated -= 1
        self.stats.authenticated[(role, method)] += 1
        log.debug("%s: connection %d (%s, %s) authenticated as %s (%s)", self.qm.name, session.number,
                  session.peer, session.named, role, method)

    async def _failed(self, session: Session, rid: int, reason: str, why: str,
                      message: str = "authentication failed") -> dict[str, Any]:
        """A failed authentication: counted, logged (throttled), answered after the address's delay."""
        self.stats.auth_failures[reason] += 1
        self.stats.count(("auth", NotAuthorizedError.reason_name))
        n, delay = self._failures.record(session.peer_ip, time.monotonic())
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th... failure in a row from that address
            log.warning("%s: connection %d (%s, %s): authentication failed: %s (%d failures in a row from %s; "
                        "answers to it now wait %.1fs)", self.qm.name, session.number, session.peer,
                        session.named, why, n, session.peer_ip, delay)
        await asyncio.sleep(delay)
        return error_reply(rid, NotAuthorizedError(message))

    async def hello(self, session: Session, rid: int, args: dict[str, Any]) -> dict[str, Any]:
        try:
            token = arg(args, "hello", "token", str, None)  # version 2's bearer token
            session.client_name = arg(args, "hello", "client", str, "")
            client_max = arg(args, "hello", "max_frame", int, None)  # the longest frame the client accepts
            client_nonce = arg(args, "hello", "nonce", bytes, None)
            if client_max is not None and client_max < MIN_FRAME:
                raise BadRequestError(f"hello: max_frame must be at least {MIN_FRAME} bytes, not {client_max}")
            if len(session.client_name) > 256:
                raise BadRequestError("hello: a client name is at most 256 characters")
            if client_nonce is not None and not 16 <= len(client_nonce) <= 64:
                raise BadRequestError("hello: nonce must be 16-64 bytes")
        except MQError as e:
            self.refused(session, "malformed")
            return error_reply(rid, e)
        session.said_hello = True
        session.client_max = client_max or 0
        session.reply_limit = min(self.config.max_frame, client_max or self.config.max_frame)
        session.client_nonce = client_nonce or b""
        session.nonce = new_nonce()
        if token is not None and self.config.auth:
            return await self._bearer(session, rid, token)
        self.stats.count(("hello", "ok"))
        return ok_reply(rid, self._hello_result(session))

    def _hello_result(self, session: Session) -> dict[str, Any]:
        result: dict[str, Any] = {
            "qmgr": self.qm.name, "version": PROTOCOL_VERSION, "max_frame": self.config.max_frame,
            "reply_frame": session.reply_limit, "session": session.number,
            "auth": {"required": not session.authenticated, "methods": [AUTH_METHOD] if self.config.auth else [],
                     "nonce": session.nonce}}
        if session.authenticated:
            result.update(role=session.role, epoch=self.qm.caller.epoch)
        return result

    async def _bearer(self, session: Session, rid: int, token: str) -> dict[str, Any]:
        """Version 2's hello with the token itself: accepted only where it did not travel in clear off the host."""
        matched = [role for role, tok in self.tokens.items() if hmac.compare_digest(tok.encode(), token.encode())]
        if not (session.tls or is_loopback_ip(session.peer_ip)):
            self.warn("bearer", "%s: connection %d (%s) sent a token in clear on a non-loopback connection%s; "
                      "refused", self.qm.name, session.number, session.peer,
                      ": IT WAS VALID, treat it as exposed and rotate it (docs/security.md)" if matched else "")
            return await self._failed(session, rid, "bearer_in_clear", "a token in clear off loopback",
                                      "a token sent in clear is refused on a non-loopback connection without TLS: "
                                      "use the challenge-response (hello with a nonce, then auth) or TLS")
        if not matched:
            return await self._failed(session, rid, "bad_proof", "wrong token")
        self.authenticated(session, matched[0], "bearer")
        self.stats.count(("hello", "ok"))
        return ok_reply(rid, self._hello_result(session))

    def _transcript(self, session: Session, side: str, role: str) -> bytes:
        return auth_transcript(side, role=role, server_nonce=session.nonce, client_nonce=session.client_nonce,
                               qmgr=self.qm.name, session=session.number, client=session.client_name,
                               client_max_frame=session.client_max, server_max_frame=self.config.max_frame)

    async def auth(self, session: Session, rid: int, args: dict[str, Any]) -> dict[str, Any]:
        try:
            role = arg(args, "auth", "role", str)
            proof = arg(args, "auth", "proof", bytes)
            if not session.said_hello or not session.client_nonce:
                raise BadRequestError("auth: send hello with a nonce first")
        except MQError as e:
            self.refused(session, "malformed")
            return error_reply(rid, e)
        # The same work and the same answer for an unknown role, a role with no token here and a wrong proof.
        token = self.tokens.get(role)
        expected = auth_proof(token or self._decoy, self._transcript(session, "client", role))
        if token is None or len(proof) != PROOF_BYTES or not hmac.compare_digest(expected, proof):
            why = "wrong proof" if token is not None else f"no such role here: {short(role)}"
            return await self._failed(session, rid, "bad_proof", why)
        self.authenticated(session, role, "challenge")
        self.stats.count(("auth", "ok"))
        return ok_reply(rid, {"role": role, "epoch": self.qm.caller.epoch,
                              "proof": auth_proof(token, self._transcript(session, "server", role))})


__all__ = ["AUTH_DELAY_BASE_S", "AUTH_DELAY_MAX_S", "AUTH_FORGET_S", "AUTH_TRACKED", "Authenticator", "Failures"]
