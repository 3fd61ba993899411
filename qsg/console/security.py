"""Who may use the console, and how a browser proves it is that person: the login, the session cookie and the
CSRF token of every action.

- Login: the operator proves they hold the group's operator token (operator.token in its secrets directory, what
  ``cfemu`` and the service's operator role use), typed into the login form, POSTed, compared in constant time.
  The token never appears in a URL, a cookie or a page. A failed login is answered after the delay of
  sqm.service.auth.Failures (per peer address, doubling), as the service answers a failed authentication.
- Session: a random id (256 bits) in a cookie that is HttpOnly, SameSite=Strict, Path=/, Secure when the console
  serves TLS; the session lives in this process only (a console restart logs everyone out), ends after
  SESSION_IDLE_S without a request and SESSION_MAX_S after the login, and on logout. At most MAX_SESSIONS at once
  (the oldest ended first).
- CSRF: each session has its own random token, put into every form the console renders (a hidden field) and
  checked in constant time on every POST; a POST whose Origin (when the browser sends one) is not the console's
  own is refused too.
- A token typed in clear may only travel over loopback or TLS: a login from another host without TLS is refused.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

SESSION_COOKIE = "cfemu_console"
SESSION_IDLE_S = 30 * 60.0
SESSION_MAX_S = 12 * 3600.0
MAX_SESSIONS = 256
CSRF_FIELD = "csrf_token"


@dataclass
class Session:
    """One logged-in browser: its id (the cookie's value), its CSRF token, when it began and was last used."""

    id: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    started: float = field(default_factory=time.monotonic)
    used: float = field(default_factory=time.monotonic)
    peer: str = ""
    flashes: list[tuple[str, str]] = field(default_factory=list)  # (kind, line) shown by the next page

    def csrf_ok(self, sent: str | None) -> bool:
        return sent is not None and hmac.compare_digest(self.csrf.encode(), sent.encode())


class Sessions:
    """The console's sessions, in memory, bounded in number and in time."""

    def __init__(self, *, idle_s: float = SESSION_IDLE_S, max_s: float = SESSION_MAX_S,
                 limit: int = MAX_SESSIONS) -> None:
        self.idle_s, self.max_s, self.limit = idle_s, max_s, limit
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def begin(self, peer: str) -> Session:
        session = Session(peer=peer)
        self._by_id[session.id] = session
        while len(self._by_id) > self.limit:
            self._by_id.popitem(last=False)
        return session

    def find(self, session_id: str | None, now: float | None = None) -> Session | None:
        """The live session whose id the cookie holds (its idle clock reset), else None (an expired one ended)."""
        if not session_id:
            return None
        session = self._by_id.get(session_id)
        if session is None:
            return None
        t = time.monotonic() if now is None else now
        if t - session.used > self.idle_s or t - session.started > self.max_s:
            self.end(session_id)
            return None
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


__all__ = ["CSRF_FIELD", "MAX_SESSIONS", "SESSION_COOKIE", "SESSION_IDLE_S", "SESSION_MAX_S", "Session", "Sessions",
           "token_matches"]
