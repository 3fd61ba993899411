"""A user id logged on with ever new tokens is made to wait (sqm.conversations.logon_guesses): a token cannot be
guessed at the speed of a connection, and a client that logs on again with its own token is not slowed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cfemu.errors import LogonThrottledError
from sqm.conversations import logon_guesses
from sqm.conversations.logon_guesses import (
    DELAY_BASE_S,
    DELAY_MAX_S,
    FORGET_S,
    FREE,
    WAIT_MAX_S,
    LogonGuesses,
)
from tests.support.service_proc import fresh_group, logged_on, start_server


def test_the_first_tokens_pass_and_a_token_seen_passes_again_at_once() -> None:
    g = LogonGuesses()
    assert [g.delay("alice", f"t{i}", "peer", 100.0) for i in range(FREE)] == [0.0] * FREE
    assert [g.delay("alice", "t0", "peer", 100.0 + i) for i in range(50)] == [0.0] * 50


def test_each_new_token_beyond_the_free_ones_waits_longer_whichever_connection_it_comes_from() -> None:
    g = LogonGuesses()
    for i in range(FREE):
        g.delay("alice", f"t{i}", "a", 0.0)
    # Asked all at once (parallel connections): each passes only after the one before it, the delay doubling.
    waits = [g.delay("alice", f"guess{i}", f"peer{i}", 0.0) for i in range(5)]
    expected, at = [], 0.0
    for k in range(5):
        expected.append(at)
        at += min(DELAY_MAX_S, DELAY_BASE_S * 2 ** k)
    assert waits == pytest.approx(expected)
    # Once a logon would wait more than WAIT_MAX_S it is refused at once, naming the user id.
    with pytest.raises(LogonThrottledError, match="user alice has logged on with .* different tokens"):
        for i in range(100):
            assert g.delay("alice", f"more{i}", "peer", 0.0) <= WAIT_MAX_S
    assert LogonThrottledError.reason == 2035


def test_another_user_id_is_not_slowed_and_the_window_forgets() -> None:
    g = LogonGuesses()
    for i in range(FREE + 6):
        g.delay("alice", f"t{i}", "peer", 0.0)
    assert g.delay("bob", "bobs-token", "peer", 0.0) == 0.0
    later = FORGET_S + 1.0
    assert [g.delay("alice", f"new{i}", "peer", later) for i in range(FREE)] == [0.0] * FREE


def test_what_it_keeps_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logon_guesses, "USERS_TRACKED", 10)
    monkeypatch.setattr(logon_guesses, "TOKENS_KEPT", 8)
    g = LogonGuesses()
    for i in range(100):
        g.delay(f"user{i}", "t", "peer", 0.0)
    for i in range(100):
        try:
            g.delay("alice", f"t{i}", "peer", 0.0)
        except LogonThrottledError:
            pass
    assert len(g._users) == 10 and len(g._users["alice"].seen) <= 8


def test_a_flood_of_new_user_ids_does_not_push_a_guessed_user_out_of_the_brake(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The table was least recently used first: FREE guesses for the victim, then as many logons of new user ids
    as the table holds, pushed her out, and her next FREE guesses passed at once again (a token found at about 10
    guesses a second); re-logons of the other user ids, with a token they had used, made her the oldest just as
    well. Room is now made of the least braked user id first, in the order they got there; a flood slows no one."""
    monkeypatch.setattr(logon_guesses, "USERS_TRACKED", 8)
    g = LogonGuesses()
    for i in range(FREE + 2):  # dave's token guessed: braked (two delays)
        g.delay("dave", f"guess{i}", "attacker", 0.0)
    for i in range(7):
        assert g.delay(f"filler{i}", "t", "attacker", 1.0) == 0.0
    for i in range(7):  # again with their token: the fillers are the most recent now, dave the oldest
        assert g.delay(f"filler{i}", "t", "attacker", 2.0) == 0.0
    for i in range(7, 1000):  # a flood of new user ids: no one waits
        assert g.delay(f"filler{i}", "t", "attacker", 3.0) == 0.0
    assert "dave" in g._users and g._users["dave"].delays == 2
    g.delay("dave", "guess-after-the-flood", "attacker", 3.0)
    assert g._users["dave"].delays == 3  # her brake goes on where it was: no free guesses again


def test_a_braked_user_id_goes_only_after_every_other_is_as_far_braked_and_got_there_after_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(logon_guesses, "USERS_TRACKED", 4)
    g = LogonGuesses()

    def brake(user: str, delays: int, now: float) -> None:
        for i in range(FREE + delays):
            g.delay(user, f"{user}-{i}", "attacker", now)

    brake("dave", 1, 0.0)
    brake("a", 2, 1.0)  # further braked: goes after dave
    brake("b", 1, 2.0)  # as far, and after him
    brake("c", 1, 3.0)
    g.delay("new", "t", "attacker", 4.0)  # the first to reach the lowest rank: dave
    assert "dave" not in g._users and {"a", "b", "c", "new"} == set(g._users)
    assert "was forgotten to make room for a new user id" in caplog.text


def test_a_user_id_whose_window_is_over_makes_room_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logon_guesses, "USERS_TRACKED", 5)
    g = LogonGuesses()
    for i in range(5):
        g.delay(f"old{i}", "t", "peer", 0.0)
    assert [g.delay(f"new{i}", "t", "peer", FORGET_S + 1.0) for i in range(5)] == [0.0] * 5
    assert sorted(g._users) == [f"new{i}" for i in range(5)]


@pytest.mark.slow
def test_guessing_a_logon_token_through_the_service_is_slowed_and_said(redis_server: Any, tmp_path: Path) -> None:
    fresh_group(redis_server)
    srv = start_server(redis_server.url, tmp_path, "QM1")
    try:
        with logged_on(srv, "alice", "her-token") as own:
            t0 = time.monotonic()
            for _ in range(FREE + 3):
                own.logon("alice", "her-token")
            assert time.monotonic() - t0 < 2 * DELAY_BASE_S, "a logon again with the same token was slowed"
        with logged_on(srv, "mallory", "") as m:
            t0 = time.monotonic()
            for guess in range(FREE + 2):  # with her token, FREE pass at once, then 3 wait 0, 0.25 and 0.5 s
                m.logon("alice", f"{guess:04d}")
            took = time.monotonic() - t0
        assert took >= DELAY_BASE_S + 2 * DELAY_BASE_S - 0.05, took
        assert "user alice: logons with" in srv.log_text() and "a token being guessed?" in srv.log_text()
    finally:
        assert srv.stop() == 0, srv.log_text()
