"""Guessing a logon's token, slowed down: a user id logged on with ever new tokens is made to wait.

A logon takes any token (EntireX's LOGON checks nothing), and what the token guards (LAST, QUERY, SETUSTATUS, a
receiver's conversation) answers at once whether it matched: without a brake a token could be guessed at the speed
of a connection (about 500 guesses a second). Applications use one token per user id, so a guess has a shape: many
different tokens for one user id in a short time. Per user id, the member remembers the tokens its logons used in
the last FORGET_S seconds (keyed digests, never the tokens); the first FREE different ones pass at once; each
further one passes only DELAY_BASE_S, doubling to DELAY_MAX_S, after the one before it, whichever connection or peer
it comes from, so that parallel connections do not multiply the rate; a logon that would wait more than WAIT_MAX_S is
refused at once (LogonThrottledError). A token seen in the window passes at once: a client that logs on again with
its token is not slowed.

The price, as for any lockout: while a user id's token is being guessed, a logon with a token the window has not
seen (the right one too) waits or is refused. Said in the member's log, once a minute per user id.

What it remembers is bounded (USERS_TRACKED user ids), and forgetting a user id gives it FREE guesses again:
flooding the table with logons of new user ids pushed a guessed user out, and with it the brake (a token found at
about 10 guesses a second). So user ids whose window is over are forgotten first, and while more than
USERS_UNPACED user ids are in their window, each logon of a user id not remembered waits EVICT_DELAY_S after the
one before it, member-wide (refused past WAIT_MAX_S); only then, at USERS_TRACKED, is the least recently used
pushed out. To push a guessed user out a flood must add at least USERS_TRACKED - USERS_UNPACED user ids at that
pace, longer than the window: the brake holds. The price: while more than USERS_UNPACED user ids have logged on
within FORGET_S (a flood of new user ids, or a member with that many users), logons of user ids not remembered are
paced at 1/EVICT_DELAY_S a second; users remembered are not. Said in the member's log, once a minute."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from cfemu.errors import LogonThrottledError

log = logging.getLogger("sqm.service.server")  # the service's log lines keep one logger name

FREE = 4  # different tokens a user id may use within FORGET_S without waiting
FORGET_S = 300.0
DELAY_BASE_S = 0.25
DELAY_MAX_S = 5.0
WAIT_MAX_S = 10.0  # a logon is refused rather than held longer than this (well inside a client's request timeout)
USERS_TRACKED = 32768  # user ids remembered (those whose window is over forgotten first)
USERS_UNPACED = 8192  # user ids in their window beyond which a new one is paced
EVICT_DELAY_S = 0.0125  # between logons of new user ids beyond USERS_UNPACED (member-wide)
TOKENS_KEPT = 64  # digests remembered per user id (the oldest forgotten first)
WARN_EVERY_S = 60.0


@dataclass
class _User:
    seen: OrderedDict[bytes, float] = field(default_factory=OrderedDict)  # token digest -> last logon with it
    delays: int = 0  # tokens beyond FREE within the window: the next delay's exponent
    next_at: float = 0.0  # when the next new token may pass
    warned_at: float = float("-inf")


class LogonGuesses:
    """The brake of one member (thread-safe): wait_for(user, token, peer) before a logon is carried out."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)  # digests of tokens mean nothing outside this process
        self._users: OrderedDict[str, _User] = OrderedDict()
        self._lock = threading.Lock()
        self._evict_next_at = 0.0  # when the next logon that pushes out a live user id may pass
        self._evict_warned_at = float("-inf")

    def _digest(self, token: str) -> bytes:
        return hmac.new(self._key, token.encode(), hashlib.sha256).digest()[:16]

    def delay(self, user: str, token: str, peer: str, now: float) -> float:
        """Seconds this logon must wait before it is carried out (0: at once); LogonThrottledError if more than
        WAIT_MAX_S. Counts the logon."""
        digest = self._digest(token)
        with self._lock:
            u = self._users.get(user)
            wait = 0.0
            if u is None:
                wait = self._make_room(peer, now)
                u = self._users[user] = _User()
            else:
                self._users.move_to_end(user)
            for d, at in list(u.seen.items()):
                if now - at > FORGET_S:
                    del u.seen[d]
            if not u.seen:
                u.delays = 0
            if digest in u.seen:
                u.seen.move_to_end(digest)
                u.seen[digest] = now
                return 0.0
            if len(u.seen) < FREE:
                u.seen[digest] = now
                return wait
            start = max(now, u.next_at)
            if start - now > WAIT_MAX_S:
                self._warn(user, u, peer, now, refused=True)
                raise LogonThrottledError(
                    f"logon: user {user} has logged on with {len(u.seen)} different tokens in the last "
                    f"{FORGET_S:.0f} s (a token being guessed?): try again later")
            u.next_at = start + min(DELAY_MAX_S, DELAY_BASE_S * 2 ** min(u.delays, 30))
            u.delays += 1
            u.seen[digest] = now
            while len(u.seen) > TOKENS_KEPT:
                u.seen.popitem(last=False)
            self._warn(user, u, peer, now, refused=False)
            return start - now

    def _make_room(self, peer: str, now: float) -> float:
        """Room for one more user id (the seconds it waits first, or LogonThrottledError): those whose window is
        over forgotten first (two at most a call: the table drains as fast as it fills); past USERS_UNPACED one
        at a time, EVICT_DELAY_S apart; at USERS_TRACKED the least recently used pushed out."""
        for _ in range(2):
            oldest = next(iter(self._users.values()), None)
            if oldest is None or (oldest.seen and now - max(oldest.seen.values()) <= FORGET_S):
                break
            self._users.popitem(last=False)
        if len(self._users) < min(USERS_UNPACED, USERS_TRACKED):
            return 0.0
        start = max(now, self._evict_next_at)
        if start - now > WAIT_MAX_S:
            self._warn_full(peer, now, refused=True)
            raise LogonThrottledError(
                f"logon: {len(self._users)} user ids have logged on in the last {FORGET_S:.0f} s, more than this "
                "member lets in at once (a flood of new user ids?): a user id not among them must try again later")
        self._evict_next_at = start + EVICT_DELAY_S
        if len(self._users) >= USERS_TRACKED:
            self._users.popitem(last=False)
        self._warn_full(peer, now, refused=False)
        return start - now

    def _warn_full(self, peer: str, now: float, *, refused: bool) -> None:
        if now - self._evict_warned_at < WARN_EVERY_S:
            return
        self._evict_warned_at = now
        log.warning("logons of %d user ids in the last %.0f s, more than the member lets in at once, the latest from %s "
                    "(a flood of new user ids, to push a guessed one out?): logons of user ids not among them %s",
                    len(self._users), FORGET_S, peer,
                    "are refused for now" if refused else f"wait {EVICT_DELAY_S * 1000:.0f} ms each, one at a time")

    def _warn(self, user: str, u: _User, peer: str, now: float, *, refused: bool) -> None:
        if now - u.warned_at < WARN_EVERY_S:
            return
        u.warned_at = now
        log.warning("user %s: logons with %d different tokens in the last %.0f s, the latest from %s (a token being "
                    "guessed?): each further new token %s", user, len(u.seen), FORGET_S, peer,
                    "is refused for now" if refused else f"waits, up to {WAIT_MAX_S:.0f} s")


__all__ = ["DELAY_BASE_S", "DELAY_MAX_S", "EVICT_DELAY_S", "FORGET_S", "FREE", "USERS_TRACKED", "USERS_UNPACED",
           "WAIT_MAX_S",
           "LogonGuesses"]
