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

What it remembers is bounded (USERS_TRACKED user ids), and forgetting a user id gives it FREE guesses again: a
flood of logons of new user ids once pushed a guessed user out, and with it the brake (a token found at about 10
guesses a second). So the user id forgotten to make room is the least braked: those with one token in their window
first, then those with several, then by how far their brake has gone (its delays); within each, the one that got
there first (a logon again with a token seen does not move it: re-logons of many user ids cannot make a braked one
the oldest). To push a braked user out, a flood must bring the table's every other user id at least as far, after
her: FREE and more different tokens each, for tens of thousands of user ids, and again for each round of her
guesses: no faster than a few times the brake's own rate, with the member's log saying it (a braked user id
forgotten is said, once a minute). Nothing is paced member-wide: a flood of new user ids slows no other user."""

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
USERS_TRACKED = 32768  # user ids remembered (the least braked forgotten first)
RANKS = 11  # 0: one token in the window; 1: several; 1 + delays (at most RANKS - 1): braked
TOKENS_KEPT = 64  # digests remembered per user id (the oldest forgotten first)
WARN_EVERY_S = 60.0


@dataclass
class _User:
    seen: OrderedDict[bytes, float] = field(default_factory=OrderedDict)  # token digest -> last logon with it
    delays: int = 0  # tokens beyond FREE within the window: the next delay's exponent
    next_at: float = 0.0  # when the next new token may pass
    warned_at: float = float("-inf")
    rank: int = 0  # how far its brake has gone: what room is made of last

    def ranked(self) -> int:
        if self.delays:
            return min(RANKS - 1, 1 + self.delays)
        return 1 if len(self.seen) > 1 else 0


class LogonGuesses:
    """The brake of one member (thread-safe): wait_for(user, token, peer) before a logon is carried out."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)  # digests of tokens mean nothing outside this process
        self._users: dict[str, _User] = {}
        # by rank, in the order they reached it: whom room is made of, the least braked and first there first
        self._ranks: list[OrderedDict[str, _User]] = [OrderedDict() for _ in range(RANKS)]
        self._lock = threading.Lock()
        self._forgot_warned_at = float("-inf")

    def _digest(self, token: str) -> bytes:
        return hmac.new(self._key, token.encode(), hashlib.sha256).digest()[:16]

    def delay(self, user: str, token: str, peer: str, now: float) -> float:
        """Seconds this logon must wait before it is carried out (0: at once); LogonThrottledError if more than
        WAIT_MAX_S. Counts the logon."""
        digest = self._digest(token)
        with self._lock:
            u = self._users.get(user)
            if u is None:
                self._make_room(peer, now)
                u = self._users[user] = _User()
                self._ranks[0][user] = u
            try:
                return self._delay(user, u, digest, peer, now)
            finally:
                self._rerank(user, u)

    def _delay(self, user: str, u: _User, digest: bytes, peer: str, now: float) -> float:
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
            return 0.0
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

    def _rerank(self, user: str, u: _User) -> None:
        """Move the user id to the rank its brake is at now, behind those there before it (a logon that changes
        nothing leaves it where it was)."""
        rank = u.ranked()
        if rank != u.rank:
            del self._ranks[u.rank][user]
            u.rank = rank
            self._ranks[rank][user] = u

    def _make_room(self, peer: str, now: float) -> None:
        """Room for one more user id: one whose window is over (the first of a rank), else the least braked (the
        first of the lowest rank)."""
        if len(self._users) < USERS_TRACKED:
            return
        heads = [(rank, next(iter(r.items()))) for rank, r in enumerate(self._ranks) if r]
        over = next((h for h in heads if not h[1][1].seen or now - max(h[1][1].seen.values()) > FORGET_S), None)
        rank, (user, _) = over or heads[0]
        del self._ranks[rank][user]
        del self._users[user]
        if over is None and rank >= 2 and now - self._forgot_warned_at >= WARN_EVERY_S:
            self._forgot_warned_at = now
            log.warning("the brake of user %s on guessing its token was forgotten to make room for a new user id, "
                        "the latest from %s: %d user ids, every one as far braked or further (a flood of user ids "
                        "with many tokens, to free a guessed one?)", user, peer, len(self._users) + 1)

    def _warn(self, user: str, u: _User, peer: str, now: float, *, refused: bool) -> None:
        if now - u.warned_at < WARN_EVERY_S:
            return
        u.warned_at = now
        log.warning("user %s: logons with %d different tokens in the last %.0f s, the latest from %s (a token being "
                    "guessed?): each further new token %s", user, len(u.seen), FORGET_S, peer,
                    "is refused for now" if refused else f"waits, up to {WAIT_MAX_S:.0f} s")


__all__ = ["DELAY_BASE_S", "DELAY_MAX_S", "FORGET_S", "FREE", "RANKS", "USERS_TRACKED", "WAIT_MAX_S", "LogonGuesses"]
