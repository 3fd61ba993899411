"""Who may use the console, and how a browser proves it is that person: the login, the session cookie and the
CSRF token of every action.

- Login: the operator proves they hold the group's operator token (operator.token in its secrets directory, what
  ``cfemu`` and the service's operator role use), typed into the login form, POSTed, compared in constant time.
  The token never appears in a URL, a cookie or a page. A failed login is answered after the delay of
  sqm.service.auth.Failures (per peer address, doubling), as the service answers a failed authentication.
- Session: a random id (256 bits) in a cookie that is HttpOnly, SameSite=Strict, Path=/, Secure when the console
  serves TLS; the session lives in this process only (a console restart logs everyone out), ends after
  SESSION_IDLE_S without a request and SESSION_MAX_S after the login, and on logout. At most MAX_SESSIONS at once
  (the oldest ended first). A session is bound to the fingerprint of the operator token it logged in with: once
  the token changes (it leaked and was replaced), every session begun with the old one ends at its next request.
  TokenWatch re-reads the token only when a cheap stamp of where it comes from changes (the flag, the
  environment, the token file's inode, size and modification time: one stat), and at least every
  TOKEN_RECHECK_S. Only the operator's own requests reset the idle clock: the page's automatic refresh
  (REFRESH_HEADER) does not, so a page left open still ends after SESSION_IDLE_S.
- CSRF: each session has its own random token, put into every form the console renders (a hidden field) and
  checked in constant time on every POST; a POST whose Origin (when the browser sends one) is not the console's
  own is refused too.
- Login attempts of one client address are taken one at a time (LoginGate): each waits for the one before it,
  that one's failure delay included, so parallel guesses are answered as slowly as consecutive ones; at most
  LOGIN_WAITING wait at once per address, more are refused at once (429). Every local client is the one loopback
  address, so a local peer keeping wrong guesses queued would keep the operator out: a strong token (at least
  STRONG_TOKEN_CHARS characters, as the group's generated tokens are: 32 random bytes) is therefore let in at once
  when it is right (fingerprint_matches against the token as it is now), never queued. The price: a guesser learns
  of a right guess at once, so for a strong token the throttle slows and counts failures but does not bound how
  fast guesses are checked; its strength does (not guessable at any rate). A shorter token (an operator's own,
  set by flag or environment) has no such path: every attempt waits its turn, so its guesses are checked no faster
  than the failures' delays allow.
- A token typed in clear may only travel over loopback or TLS: a login from another host without TLS is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

SESSION_COOKIE = "cfemu_console"
SESSION_IDLE_S = 30 * 60.0
SESSION_MAX_S = 12 * 3600.0
MAX_SESSIONS = 256
CSRF_FIELD = "csrf_token"
TOKEN_RECHECK_S = 5.0
STRONG_TOKEN_CHARS = 32  # a token this long is let in at once when right (the generated ones: 43 characters)
LOGIN_WAITING = 8  # login attempts of one address waiting for their turn (the one being checked included)
REFRESH_HEADER = "X-Console-Refresh"  # sent by the page's script on its automatic refresh: not the operator


@dataclass
class Session:
    """One logged-in browser: its id (the cookie's value), its CSRF token, when it began and was last used."""

    id: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    started: float = field(default_factory=time.monotonic)
    used: float = field(default_factory=time.monotonic)
    peer: str = ""
    token: str | None = None  # the fingerprint of the operator token it logged in with
    flashes: list[tuple[str, str]] = field(default_factory=list)  # (kind, line) shown by the next page

    def csrf_ok(self, sent: str | None) -> bool:
        return sent is not None and hmac.compare_digest(self.csrf.encode(), sent.encode())


class Sessions:
    """The console's sessions, in memory, bounded in number and in time."""

    def __init__(self, *, idle_s: float = SESSION_IDLE_S, max_s: float = SESSION_MAX_S,
                 limit: int = MAX_SESSIONS) -> None:
        self.idle_s, self.max_s, self.limit = idle_s, max_s, limit
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def begin(self, peer: str, token: str | None = None) -> Session:
        """A new session of peer, bound to the fingerprint of the token it proved (token_fingerprint)."""
        session = Session(peer=peer, token=token)
        self._by_id[session.id] = session
        while len(self._by_id) > self.limit:
            self._by_id.popitem(last=False)
        return session

    def find(self, session_id: str | None, now: float | None = None, *, touch: bool = True) -> Session | None:
        """The live session whose id the cookie holds (its idle clock reset when touch: the operator's own
        request), else None (an expired one ended)."""
        if not session_id:
            return None
        session = self._by_id.get(session_id)
        if session is None:
            return None
        t = time.monotonic() if now is None else now
        if t - session.used > self.idle_s or t - session.started > self.max_s:
            self.end(session_id)
            return None
        if touch:
            session.used = t
            self._by_id.move_to_end(session_id)
        return session

    def end(self, session_id: str) -> None:
        self._by_id.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._by_id)


def token_matches(expected: str | None, sent: str) -> bool:
    """Does the token typed at login equal the group's operator token (constant time; never with no token)."""
    if not expected:
        return False
    return hmac.compare_digest(expected.encode(), sent.strip().encode())


def fingerprint_matches(fingerprint: str | None, sent: str) -> bool:
    """Is the token typed at login the one whose fingerprint is ``fingerprint`` (constant time; never with no
    token)."""
    theirs = token_fingerprint(sent.strip())
    if not fingerprint or theirs is None:
        return False
    return hmac.compare_digest(fingerprint.encode(), theirs.encode())


class LoginBusyError(RuntimeError):
    """Too many login attempts from one address at once."""


class LoginGate:
    """One login attempt at a time per client address (see the module doc). Used from the event loop only."""

    def __init__(self, *, waiting: int = LOGIN_WAITING) -> None:
        self.waiting = waiting
        self._by_peer: dict[str, tuple[asyncio.Lock, int]] = {}  # only addresses with an attempt under way

    @asynccontextmanager
    async def turn(self, peer: str) -> AsyncIterator[None]:
        lock, n = self._by_peer.get(peer) or (asyncio.Lock(), 0)
        if n >= self.waiting:
            raise LoginBusyError(f"{n} login attempts from {peer} are waiting already: try again later")
        self._by_peer[peer] = (lock, n + 1)
        try:
            async with lock:
                yield
        finally:
            lock, n = self._by_peer[peer]
            if n <= 1:
                del self._by_peer[peer]
            else:
                self._by_peer[peer] = (lock, n - 1)


def token_fingerprint(token: str | None) -> str | None:
    """What a session remembers of the token it logged in with: a hash (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest() if token else None


class TokenWatch:
    """The operator token's fingerprint now. read() finds the token (settings, files: not cheap); stamp() is a
    cheap mark that changes whenever read() may answer otherwise. The token is read again when the stamp changed
    or TOKEN_RECHECK_S after the last read."""

    def __init__(self, read: Callable[[], str | None], stamp: Callable[[], Hashable], *,
                 recheck_s: float = TOKEN_RECHECK_S) -> None:
        self._read, self._stamp, self.recheck_s = read, stamp, recheck_s
        self._lock = threading.Lock()
        # (stamp, fingerprint, strong, when read)
        self._seen: tuple[Hashable, str | None, bool, float] | None = None

    def refresh(self) -> str | None:
        """Read the token now; the token (its fingerprint and strength are remembered)."""
        stamp = self._stamp()  # before the read: a change in between makes the next current() read again
        token = self._read()
        strong = token is not None and len(token.strip()) >= STRONG_TOKEN_CHARS
        with self._lock:
            self._seen = (stamp, token_fingerprint(token), strong, time.monotonic())
        return token

    def _now(self) -> tuple[Hashable, str | None, bool, float]:
        seen = self._seen
        if seen is None or seen[0] != self._stamp() or time.monotonic() - seen[3] > self.recheck_s:
            self.refresh()
            seen = self._seen
        assert seen is not None
        return seen

    def current(self) -> str | None:
        """The fingerprint of the operator token as it is now."""
        return self._now()[1]

    def strong(self) -> str | None:
        """The fingerprint of the operator token as it is now when the token is strong (STRONG_TOKEN_CHARS or
        more), else None: what a login may be let in with at once."""
        _, fingerprint, strong, _ = self._now()
        return fingerprint if strong else None


__all__ = ["CSRF_FIELD", "LOGIN_WAITING", "LoginBusyError", "LoginGate", "MAX_SESSIONS", "SESSION_COOKIE", "SESSION_IDLE_S", "SESSION_MAX_S", "Session", "Sessions",
           "REFRESH_HEADER", "STRONG_TOKEN_CHARS", "TOKEN_RECHECK_S", "TokenWatch", "fingerprint_matches", "token_fingerprint",
           "token_matches"]
