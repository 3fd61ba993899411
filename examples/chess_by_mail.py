#!/usr/bin/env python3
"""Chess by mail over a queue-sharing group (seed 003, "A 'Real-world' Example: Chess-by-Mail").

Two players, white and black, each a client of the group's network service (sqm.service.client.Client), play a
fixed game (Morphy's Opera Game, Paris 1858: 33 plies, then black's resignation) through two services:

    CHESS.WHITE  the moves white receives (black sends its moves there)
    CHESS.BLACK  the moves black receives

Each service holds persistent units of work with persistent status (STORE on, UWSTATP 2). A move is one UOW of two
messages: the move (ply, SAN, from and to squares) and the digest of the board after it. A player's turn:

    1. RECEIVE (SYNC) the opponent's UOW whole: RECV_FIRST, then RECV_LAST;
    2. check it is the ply expected, play it on the board and check the digest: a lost, repeated or different
       move is found here (GameError), never played;
    3. SEND the reply UOW (its user status names the ply: "ply=7");
    4. SETUSTATUS on the received UOW: "ply=6 reply=<the reply's UOW id>" (how the last receiver of the game can
       tell, after a failure, whether it already took the last UOW: see below);
    5. SYNCPOINT COMMIT BOTH: the received UOW becomes PROCESSED and the reply ACCEPTED in one atomic step.

White's first move is a SEND with COMMIT; the last UOW of the game (black's resignation, ply 34) is received by
white and committed alone. At the end each player's last UOW is PROCESSED.

After any failure (the connection lost, OutcomeUnknownError, the member killed, the CF lost and restored) the player
logs on again, with the same user id (its colour) and token (the game's name), on whichever member answers, and
asks SYNCPOINT LAST: the status of the last UOW it sent, whose user status says which ply it was.

    RECEIVED                      still being settled (its session died, recovery has not run yet): ask again
    ACCEPTED, DELIVERED,          that ply was committed: the next turn is two plies on
    POSTPONED, PROCESSED
    BACKEDOUT, DISCARDED, ...     it was not: play the same turn again (the received UOW is ACCEPTED again, and
                                  comes back with its delivery count raised)
    TIMEOUT                       the opponent never took it within its lifetime: the game is abandoned

One case LAST alone cannot see: the last UOW of the game is received, not sent. So a player whose last ply is
PROCESSED and whose opponent's reply is the game's last UOW asks QUERY on the reply's id (from the user status the
opponent set in step 4): PROCESSED means it took it already, and the game is over.

Run it (the services defined first with --setup, which needs the operator token):

    python examples/chess_by_mail.py --server 127.0.0.1:7001,127.0.0.1:7002 --token-file SECRETS/service.token \\
        --setup APP1 --operator-token-file SECRETS/operator.token --both --json
    python examples/chess_by_mail.py --server ... --token-file ... --player white --game g2   # one side

Progress goes to stderr, the result to stdout (--json: one JSON object). The exit status is 0 when the game was
played to its end, 1 when it was not (a GameError or the time limit), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cfemu.errors import MQError, NoMessageError, StructureFailedError, UnknownUowError
from sqm.service.client import Client, parse_endpoint

# --- the game --------------------------------------------------------------------------------------------------

# Morphy v Duke of Brunswick and Count Isouard, Paris 1858: (SAN, from, to). Castling is the king's move; the
# rook follows (Board.apply).
GAME: tuple[tuple[str, str, str], ...] = (
    ("e4", "e2", "e4"), ("e5", "e7", "e5"),
    ("Nf3", "g1", "f3"), ("d6", "d7", "d6"),
    ("d4", "d2", "d4"), ("Bg4", "c8", "g4"),
    ("dxe5", "d4", "e5"), ("Bxf3", "g4", "f3"),
    ("Qxf3", "d1", "f3"), ("dxe5", "d6", "e5"),
    ("Bc4", "f1", "c4"), ("Nf6", "g8", "f6"),
    ("Qb3", "f3", "b3"), ("Qe7", "d8", "e7"),
    ("Nc3", "b1", "c3"), ("c6", "c7", "c6"),
    ("Bg5", "c1", "g5"), ("b5", "b7", "b5"),
    ("Nxb5", "c3", "b5"), ("cxb5", "c6", "b5"),
    ("Bxb5+", "c4", "b5"), ("Nbd7", "b8", "d7"),
    ("O-O-O", "e1", "c1"), ("Rd8", "a8", "d8"),
    ("Rxd7", "d1", "d7"), ("Rxd7", "d8", "d7"),
    ("Rd1", "h1", "d1"), ("Qe6", "e7", "e6"),
    ("Bxd7+", "b5", "d7"), ("Nxd7", "f6", "d7"),
    ("Qb8+", "b3", "b8"), ("Nxb8", "d7", "b8"),
    ("Rd8#", "d1", "d8"),
)
MOVES = len(GAME)  # 33 plies
RESULT = "1-0"
LAST_PLY = MOVES + 1  # black's resignation: a UOW like a move, with the result instead of a move
WHITE, BLACK = "white", "black"
COLORS = (WHITE, BLACK)

# What the services are defined with: persistent UOWs, status kept for two UOW lifetimes of up-time, two messages
# to a UOW (the move and the digest: a third is refused).
SERVICE_UOW: dict[str, Any] = {"store": True, "status_lifetime": 2, "lifetime_s": 86400, "max_messages": 2}

# Statuses (sqm.conversations.uowstatus), as the service returns them.
COMMITTED = ("ACCEPTED", "DELIVERED", "POSTPONED", "PROCESSED")  # the sender committed it
NOT_COMMITTED = ("BACKEDOUT", "DISCARDED", "CANCELLED", None)  # it never was: the turn is played again


WAITING_FOR_STRUCTURE = "the service's structure is being recovered: waiting for LAST"

class GameError(Exception):
    """The game cannot go on: a move lost, repeated or not the one expected, or the board digests differ."""


def owner(ply: int) -> str:
    return WHITE if ply % 2 else BLACK


def notation(ply: int) -> str:
    """'7. Bg5' or '7... b5' (ply 34: black's resignation)."""
    if ply > MOVES:
        return f"{RESULT} (black resigns)"
    number = (ply + 1) // 2
    return f"{number}. {GAME[ply - 1][0]}" if ply % 2 else f"{number}... {GAME[ply - 1][0]}"


_PIECES = "RNBQKBNR"


class Board:
    """Just enough of a chess board to play a known game and digest the position: the script's moves are checked
    against it (the right piece, of the side to move, to an empty square or onto an opponent's piece)."""

    def __init__(self) -> None:
        self.squares: dict[str, str] = {}
        for i, file in enumerate("abcdefgh"):
            self.squares[f"{file}1"], self.squares[f"{file}2"] = "w" + _PIECES[i], "wP"
            self.squares[f"{file}8"], self.squares[f"{file}7"] = "b" + _PIECES[i], "bP"
        self.plies = 0

    @classmethod
    def after(cls, plies: int) -> Board:
        """The position after the game's first ``plies`` moves (the resignation moves nothing)."""
        board = cls()
        for san, frm, to in GAME[:min(plies, MOVES)]:
            board.apply(san, frm, to)
        return board

    @property
    def side(self) -> str:
        return "w" if self.plies % 2 == 0 else "b"

    def apply(self, san: str, frm: str, to: str) -> None:
        piece = self.squares.get(frm)
        kind = "K" if san.startswith("O-O") else (san[0] if san[0] in "KQRBN" else "P")
        if piece != self.side + kind:
            raise GameError(f"ply {self.plies + 1} {san}: {frm} holds {piece or 'nothing'}, not {self.side + kind}")
        target = self.squares.get(to)
        if ("x" in san) != (target is not None) or (target is not None and target[0] == self.side):
            raise GameError(f"ply {self.plies + 1} {san}: {to} holds {target or 'nothing'}")
        del self.squares[frm]
        self.squares[to] = piece
        if kind == "K" and abs(ord(to[0]) - ord(frm[0])) == 2:  # castling: the rook jumps over the king
            rank = frm[1]
            rook_from, rook_to = (f"h{rank}", f"f{rank}") if to[0] == "g" else (f"a{rank}", f"d{rank}")
            self.squares[rook_to] = self.squares.pop(rook_from)
        self.plies += 1

    def placement(self) -> str:
        """The FEN piece placement, rank 8 first."""
        rows = []
        for rank in "87654321":
            row, empty = "", 0
            for file in "abcdefgh":
                piece = self.squares.get(file + rank)
                if piece is None:
                    empty += 1
                    continue
                row += (str(empty) if empty else "") + (piece[1] if piece[0] == "w" else piece[1].lower())
                empty = 0
            rows.append(row + (str(empty) if empty else ""))
        return "/".join(rows)

    def digest(self) -> str:
        return hashlib.sha256(f"{self.placement()} {self.side} {self.plies}".encode()).hexdigest()[:32]


def uow_bodies(game: str, ply: int) -> tuple[bytes, bytes]:
    """The two messages of ply's UOW: the move (or the result) and the digest of the board after it."""
    if ply > MOVES:
        move: dict[str, Any] = {"game": game, "ply": ply, "result": RESULT}
    else:
        san, frm, to = GAME[ply - 1]
        move = {"game": game, "ply": ply, "san": san, "from": frm, "to": to}
    digest = {"ply": ply, "digest": Board.after(ply).digest()}
    return json.dumps(move).encode(), json.dumps(digest).encode()


def check_uow(game: str, ply: int, move_body: bytes, digest_body: bytes) -> None:
    """The opponent's UOW must be ply ``ply`` of this game, and the board after it what the opponent says."""
    try:
        move, digest = json.loads(move_body), json.loads(digest_body)
    except ValueError as e:
        raise GameError(f"ply {ply}: a message that is not a move: {e}") from None
    if move.get("game") != game:
        raise GameError(f"ply {ply}: received a move of game {move.get('game')!r}, not {game!r}")
    got = move.get("ply")
    if got != ply:
        why = "repeated" if isinstance(got, int) and got < ply else "lost"
        raise GameError(f"expected ply {ply} ({notation(ply)}), received ply {got}: a move was {why}")
    board = Board.after(ply - 1)
    if ply <= MOVES:
        board.apply(str(move.get("san")), str(move.get("from")), str(move.get("to")))
    elif move.get("result") != RESULT:
        raise GameError(f"ply {ply}: expected the result {RESULT}, received {move!r}")
    if digest.get("ply") != ply or digest.get("digest") != board.digest():
        raise GameError(f"ply {ply} ({notation(ply)}): board digest {digest.get('digest')} differs from ours, "
                        f"{board.digest()}")


# --- a player ----------------------------------------------------------------------------------------------------

class Session(Protocol):
    """What a player needs of sqm.service.client.Client (the network service's UOW operations)."""

    qmgr: str

    def logon(self, user: str, token: str = "") -> None: ...

    def send(self, service: str, body: bytes, *, option: str = "SYNC", commit: bool = False,
             user_status: bytes | None = None, conversation: str = "") -> dict[str, Any]: ...

    def receive(self, service: str, *, option: str = "ANY", wait_ms: int = 0) -> dict[str, Any]: ...

    def syncpoint(self, option: str, uow: str = "", *, user_status: bytes | None = None) -> dict[str, Any]: ...

    def close(self) -> None: ...


def services(prefix: str) -> dict[str, str]:
    """Each colour's service: the one its opponent's moves arrive on."""
    return {WHITE: f"{prefix}.WHITE", BLACK: f"{prefix}.BLACK"}


@dataclass
class Turn:
    """The turn being played: receive ply-1 (when ply > 1), send ply (when ply <= LAST_PLY); settled by commit."""

    ply: int
    received_uow: str = ""
    deliveries: int = 0
    member: str = ""
    sent_uow: str = ""


@dataclass
class Transcript:
    sent: list[dict[str, Any]] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)


class Player:
    """One side of the game. ``connect(attempt)`` opens a new session (a Client on the group's endpoints, the
    attempt's rotation first: after a failure the next member is tried first)."""

    def __init__(self, color: str, connect: Callable[[int], Session], *, game: str = "opera-1858",
                 prefix: str = "CHESS", think_s: float = 0.0, timeout_s: float = 600.0,
                 say: Callable[[str], None] | None = None) -> None:
        if color not in COLORS:
            raise ValueError(f"player must be white or black, not {color!r}")
        self.color = color
        self.opponent = BLACK if color == WHITE else WHITE
        self.connect = connect
        self.game = game
        self.own_service, self.opponent_service = services(prefix)[color], services(prefix)[self.opponent]
        self.think_s = think_s
        self.timeout_s = timeout_s
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.session: Session | None = None
        self.attempts = 0
        self.members: list[str] = []  # the members this player was connected to, in order
        self.failures: list[str] = []
        self.transcript = Transcript()
        self.turn: Turn | None = None  # the turn in hand, until it is known to be committed or not
        self.resumed_at = 0
        self.last: dict[str, Any] = {}
        self.first_turn = 1 if color == WHITE else 2
        # The closing turn of the player who does not send the last UOW receives it and sends nothing.
        self.last_turn = LAST_PLY if owner(LAST_PLY) == color else LAST_PLY + 1
        self._deadline = 0.0

    # --- the game loop ---------------------------------------------------------------------------------------
    def play(self) -> dict[str, Any]:
        """Play to the end of the game (or raise GameError), whatever fails in between."""
        self._deadline = time.monotonic() + self.timeout_s
        self._logon()
        turn = self._resume()
        self.resumed_at = turn or 0
        if turn and turn > self.first_turn:
            self.say(f"[{self.color}] resuming at ply {turn}: LAST says ply {self._ply_of(self.last)} is "
                     f"{self.last.get('status')}")
        while turn is not None:
            try:
                self._play_turn(turn)
                turn = turn + 2 if turn + 2 <= self.last_turn else None
            except (MQError, OSError) as e:
                self._failed(e)
                turn = self._resume()
        self._await_processed()
        return self.report()

    def _play_turn(self, ply: int) -> None:
        s = self._session()
        self.turn = t = Turn(ply, member=s.qmgr)
        if ply > 1:
            t.received_uow, t.deliveries = self._receive(s, ply - 1)
            if self.think_s:
                time.sleep(self.think_s)  # thinking, with the opponent's move DELIVERED to us
        if ply <= LAST_PLY:
            move, digest = uow_bodies(self.game, ply)
            sent = s.send(self.opponent_service, move, option="SYNC", user_status=f"ply={ply}".encode(),
                          conversation=self.game)
            t.sent_uow = str(sent["uow"])
            s.send(self.opponent_service, digest, option="SYNC", commit=(ply == 1))
        if 1 < ply <= LAST_PLY:
            s.syncpoint("SETUSTATUS", t.received_uow, user_status=f"ply={ply - 1} reply={t.sent_uow}".encode())
            s.syncpoint("COMMIT", "BOTH")
        elif ply > LAST_PLY:
            s.syncpoint("COMMIT", t.received_uow)
        self._settled(t)

    def _receive(self, s: Session, ply: int) -> tuple[str, int]:
        """The opponent's UOW for ply, whole and checked; (its id, its delivery count)."""
        while True:
            self._check_deadline(f"waiting for ply {ply}")
            try:
                first = s.receive(self.own_service, option="SYNC", wait_ms=1000)
                break
            except NoMessageError:
                continue
        second = s.receive(self.own_service, option="SYNC")
        if first["recv"] != "RECV_FIRST" or second["recv"] != "RECV_LAST" or second["uow"] != first["uow"]:
            raise GameError(f"ply {ply}: the UOW came as {first['recv']} {first['uow']}, {second['recv']} "
                            f"{second['uow']}, not a move and its digest")
        check_uow(self.game, ply, bytes(first["body"]), bytes(second["body"]))
        return str(first["uow"]), int(first.get("deliveries") or 0)

    def _settled(self, t: Turn) -> None:
        """The turn is committed: write it in the transcript, once."""
        if t.ply > 1:
            self.transcript.received.append({"ply": t.ply - 1, "move": notation(t.ply - 1), "uow": t.received_uow,
                                             "deliveries": t.deliveries, "member": t.member})
        if t.ply <= LAST_PLY:
            self.transcript.sent.append({"ply": t.ply, "move": notation(t.ply), "uow": t.sent_uow,
                                         "member": t.member})
        got = f"received {notation(t.ply - 1)}" if t.ply > 1 else ""
        sent = f"sent {notation(t.ply)}" if t.ply <= LAST_PLY else "game over"
        self.say(f"[{self.color}] ply {min(t.ply, LAST_PLY)} on {t.member}: {', '.join(x for x in (got, sent) if x)}")
        self.turn = None

    # --- recovery ----------------------------------------------------------------------------------------------
    def _resume(self) -> int | None:
        """The next turn to play (None: none is left), from SYNCPOINT LAST; the turn in hand is settled by it."""
        while True:
            self._check_deadline("resuming")
            try:
                nxt = self._next_turn(self._session())
            except StructureFailedError as e:
                # The structure the services live on failed (the CF was lost) and is being recovered: LAST cannot
                # tell yet. Waiting is the only safe move: starting over, or guessing, would repeat or skip a move.
                self.say(f"[{self.color}] {WAITING_FOR_STRUCTURE} ({e.reason_name})")
                time.sleep(0.5)
                continue
            except UnknownUowError:
                if self.transcript.sent or self.resumed_at > self.first_turn:
                    # We know a move of ours was committed: its status is only away for now (the structure is
                    # being recovered), not gone. Starting the game again would repeat a move.
                    self.say(f"[{self.color}] LAST knows no UOW of ours yet: waiting for the service")
                    time.sleep(0.5)
                    continue
                self.last = {}
                nxt = self.first_turn  # nothing sent yet in this game
            except (MQError, OSError) as e:
                self._failed(e)
                continue
            if nxt == -1:  # still being settled
                time.sleep(0.25)
                continue
            t, self.turn = self.turn, None
            if t is not None:
                if nxt is None or nxt > t.ply:
                    if self._ply_of(self.last) == t.ply:  # LAST names the UOW this turn sent
                        if t.sent_uow and self.last.get("uow") != t.sent_uow:
                            raise GameError(f"ply {t.ply}: LAST names UOW {self.last.get('uow')}, not the one "
                                            f"this turn sent, {t.sent_uow}")
                        t.sent_uow = str(self.last.get("uow"))
                    self._settled(t)
                else:
                    self.say(f"[{self.color}] ply {t.ply} was not committed "
                             f"(LAST: ply {self._ply_of(self.last)} {self.last.get('status')}): playing it again")
            return nxt

    def _next_turn(self, s: Session) -> int | None:
        """-1: ask again later; None: no turn left."""
        last = self.last = s.syncpoint("LAST")
        status = last.get("status")
        ply = self._ply_of(last)
        if ply is None:
            if self.turn is not None and last.get("uow") == self.turn.sent_uow:
                ply = self.turn.ply  # the status is not kept (so neither is the user status): it was not committed
            else:
                raise GameError(f"LAST names UOW {last.get('uow')} with no ply in its status {last!r}: cannot resume")
        if status == "RECEIVED":
            return -1
        if status == "TIMEOUT":
            raise GameError(f"ply {ply} timed out: the opponent never took it within its lifetime")
        if status in NOT_COMMITTED:
            return ply
        if status not in COMMITTED:
            raise GameError(f"LAST: ply {ply} in unexpected status {status}")
        if ply >= LAST_PLY:
            return None
        if ply + 1 == LAST_PLY and status == "PROCESSED":
            # The opponent took our last move and sent the game's last UOW: did we take that already?
            reply = _field(str(last.get("user_status") or ""), "reply")
            if reply:
                try:
                    taken = s.syncpoint("QUERY", reply).get("status") == "PROCESSED"
                except UnknownUowError:
                    taken = False
                if taken:
                    return None
        return ply + 2

    def _await_processed(self) -> None:
        """At the end: wait until the last UOW this player sent is PROCESSED (the opponent took it)."""
        while True:
            self._check_deadline("waiting for the opponent to take the last move")
            try:
                self.last = self._session().syncpoint("LAST")
            except (MQError, OSError) as e:
                self._failed(e)
                continue
            if self.last.get("status") == "PROCESSED":
                return
            if self.last.get("status") not in ("ACCEPTED", "DELIVERED", "RECEIVED"):
                raise GameError(f"the last move, ply {self._ply_of(self.last)}, ended {self.last.get('status')}")
            time.sleep(0.2)

    def _failed(self, e: BaseException) -> None:
        self.failures.append(f"{type(e).__name__}: {e}")
        self.say(f"[{self.color}] {type(e).__name__}: {e}: logging on again")
        self._drop()
        time.sleep(min(0.2 * len(self.failures), 2.0))
        self._logon()

    def _logon(self) -> None:
        """A new session on whichever member answers, logged on as this player (user id: colour, token: game)."""
        while True:
            self._check_deadline("logging on")
            self.attempts += 1
            try:
                s = self.connect(self.attempts - 1)
                try:
                    s.logon(self.color, self.game)
                except BaseException:
                    s.close()
                    raise
            except (MQError, OSError) as e:
                self.failures.append(f"logon: {type(e).__name__}: {e}")
                time.sleep(0.5)
                continue
            self.session = s
            if not self.members or self.members[-1] != s.qmgr:
                self.members.append(s.qmgr)
            return

    def _session(self) -> Session:
        if self.session is None:
            self._logon()
        assert self.session is not None
        return self.session

    def _drop(self) -> None:
        if self.session is not None:
            try:
                self.session.close()
            except (MQError, OSError):
                pass
        self.session = None

    def close(self) -> None:
        self._drop()

    def _check_deadline(self, doing: str) -> None:
        if time.monotonic() > self._deadline:
            raise GameError(f"{self.color}: no end of the game within {self.timeout_s:g} s ({doing})")

    @staticmethod
    def _ply_of(status: dict[str, Any]) -> int | None:
        value = _field(str(status.get("user_status") or ""), "ply")
        return int(value) if value and value.isdigit() else None

    def report(self) -> dict[str, Any]:
        return {"color": self.color, "user": self.color, "game": self.game, "resumed_at": self.resumed_at,
                "sent": self.transcript.sent, "received": self.transcript.received, "failures": self.failures,
                "members": self.members, "last": {k: self.last.get(k) for k in ("uow", "status", "user_status")},
                "complete": self.last.get("status") == "PROCESSED"}


def _field(user_status: str, name: str) -> str | None:
    """A field of a user status like 'ply=7 reply=<uow>'."""
    for part in user_status.split():
        key, _, value = part.partition("=")
        if key == name:
            return value
    return None


# --- the command line ------------------------------------------------------------------------------------------

def client_factory(endpoints: Sequence[tuple[str, int]], token: str, name: str) -> Callable[[int], Session]:
    """Sessions on the group: each attempt starts at the next member (a failed one is tried last)."""
    def connect(attempt: int) -> Session:
        k = attempt % len(endpoints)
        order = list(endpoints[k:]) + list(endpoints[:k])
        client: Session = Client(order, token=token, client_name=name, connect_timeout=2.0, request_timeout=20.0,
                                 reconnect_timeout=5.0)
        return client
    return connect


def define_services(endpoints: Sequence[tuple[str, int]], operator_token: str, structure: str, prefix: str) -> None:
    """Define the two services (persistent UOWs, persistent status) unless they are defined already."""
    with Client(list(endpoints), token=operator_token, role="operator", client_name="chess-setup") as c:
        for name in services(prefix).values():
            try:
                c.define_queue(name, structure, uow=SERVICE_UOW)
            except MQError as e:
                if "already defined" not in str(e):
                    raise


def play_both(endpoints: Sequence[tuple[str, int]], token: str, *, game: str, prefix: str, think_s: float,
              timeout_s: float) -> dict[str, Any]:
    """Both sides, each in a thread with its own client; black starts on the second member."""
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}

    def run(color: str, first: int) -> None:
        order = list(endpoints[first:]) + list(endpoints[:first])
        p = Player(color, client_factory(order, token, f"chess-{color}"), game=game, prefix=prefix,
                   think_s=think_s, timeout_s=timeout_s)
        try:
            results[color] = p.play()
        except GameError as e:
            errors[color] = str(e)
            results[color] = p.report()
        finally:
            p.close()
    threads = [threading.Thread(target=run, args=(c, i % len(endpoints)), name=c) for i, c in enumerate(COLORS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return game_result(game, results, errors)


def game_result(game: str, players: dict[str, dict[str, Any]], errors: dict[str, str]) -> dict[str, Any]:
    moves = " ".join(notation(p) if p % 2 else GAME[p - 1][0] for p in range(1, MOVES + 1)) + " " + RESULT
    players = {c: players[c] for c in COLORS if c in players}  # white first, whichever ended first
    complete = not errors and all(report.get("complete") for report in players.values())
    return {"game": game, "result": RESULT if complete else None, "moves": moves, "plies": LAST_PLY,
            "complete": complete, "errors": errors, "players": players}


def _read_token(path: str, what: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise SystemExit(f"chess_by_mail: cannot read the {what} token file {path}: {e.strerror}") from None
    if not token:
        raise SystemExit(f"chess_by_mail: the {what} token file {path} is empty")
    return token


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Chess by mail over a queue-sharing group (seed 003).")
    ap.add_argument("--server", required=True, help="HOST:PORT[,HOST:PORT...]: the group's members")
    ap.add_argument("--token-file", required=True, help="the application token of the group's service")
    side = ap.add_mutually_exclusive_group(required=True)
    side.add_argument("--player", choices=COLORS, help="play one side")
    side.add_argument("--both", action="store_true", help="play both sides, in two threads")
    ap.add_argument("--game", default="opera-1858", help="the game's name: the players' logon token")
    ap.add_argument("--services", default="CHESS", help="the services' prefix (PREFIX.WHITE, PREFIX.BLACK)")
    ap.add_argument("--think", type=float, default=0.2, help="seconds each move is thought over")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    ap.add_argument("--setup", metavar="STRUCTURE", help="define the services on STRUCTURE first")
    ap.add_argument("--operator-token-file", help="the operator token, for --setup")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = ap.parse_args(argv)
    try:
        endpoints = [parse_endpoint(e.strip()) for e in args.server.split(",") if e.strip()]
    except ValueError as e:
        ap.error(str(e))
    if not endpoints:
        ap.error("--server names no endpoint")
    if not 1 <= len(args.game) <= 32 or not args.game.isprintable() or " " in args.game:
        ap.error(f"--game must be 1-32 printable characters without spaces, not {args.game!r}")
    if args.setup and not args.operator_token_file:
        ap.error("--setup needs --operator-token-file")
    token = _read_token(args.token_file, "application")
    if args.setup:
        define_services(endpoints, _read_token(args.operator_token_file, "operator"), args.setup, args.services)
    if args.both:
        result = play_both(endpoints, token, game=args.game, prefix=args.services, think_s=args.think,
                           timeout_s=args.timeout)
    else:
        p = Player(args.player, client_factory(endpoints, token, f"chess-{args.player}"), game=args.game,
                   prefix=args.services, think_s=args.think, timeout_s=args.timeout)
        errors: dict[str, str] = {}
        try:
            report = p.play()
        except GameError as e:
            errors[args.player] = str(e)
            report = p.report()
        finally:
            p.close()
        result = game_result(args.game, {args.player: report}, errors)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"game {result['game']}: {result['moves']}")
        for color, report in result["players"].items():
            print(f"{color}: sent {len(report['sent'])}, received {len(report['received'])}, members "
                  f"{' -> '.join(report['members'])}, {len(report['failures'])} failures, last UOW "
                  f"{report['last'].get('status')}")
        for color, why in result["errors"].items():
            print(f"{color}: {why}")
        print("complete" if result["complete"] else "NOT complete")
    return 0 if result["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
