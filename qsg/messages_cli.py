"""`cfemu put|get|browse`: messages on a queue, in process (a short-lived SQM whose log goes to the log root, so
restore sees what it did) or through --server HOST:PORT endpoints.

  cfemu put Q1 MESSAGE... | get Q1 | browse Q1  [--server HOST:PORT ...]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import msgpack

from cfemu.clitools import CLIError, Output, PhaseBars, cf_name, require_url, settings
from cfemu.errors import FencedError, NoMessageError
from cfemu.signals import handling
from cfemu.uow_attributes import CONTROL_SUFFIX, DATA_SUFFIX
from qsg.cli_common import FIRST_CONNECT_S, Parents, RetryLaterError, whole
from sqm.conversations.convrecord import RECORD_LETTER, ConvRecord
from sqm.conversations.uowcontrols import LAST_LETTER
from sqm.conversations.uowstatus import Control
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.log.format import LogLockedError
from sqm.service.client import Client
from sqm.wings import WINGS

#: The most messages one `cfemu put` writes (its bodies are made up front): a bulk load beyond it is a program's job.
MAX_PUT_COUNT = 10_000_000

log = logging.getLogger("qsg.messages_cli")


def _body_text(body: bytes, limit: int = 60) -> str:
    try:
        text = body.decode()
    except UnicodeDecodeError:
        text = body.hex()
    return text if len(text) <= limit else text[: limit - 3] + "..."



class MessagingHandle(Protocol):
    """What put/get/browse need: sqm.core.connection.Connection and sqm.service.client.Client both have it."""

    def put(self, queue: str, body: bytes, *, persistent: bool = ..., priority: int = ...,
            correlid: bytes = ...) -> Any: ...

    def get(self, queue: str, *, wait_ms: int = ...) -> Any: ...

    def browse(self, queue: str, limit: int = ...) -> list[Any]: ...

    def commit(self) -> None: ...

    def backout(self) -> None: ...


@contextmanager
def messaging(args: argparse.Namespace) -> Iterator[MessagingHandle]:
    """A client of --server endpoints, or a short-lived in-process SQM (OPS) whose log goes to the log root, so
    restore sees what it did. Whatever is left uncommitted when the block fails is backed out."""
    found = settings(args)
    if args.server:
        client = Client(args.server, token=found.token, role=found.token_role, client_name="cfemu",
                        first_connect_timeout=FIRST_CONNECT_S)
        try:
            yield client
        finally:
            client.close()
        return

    # A command's member relogs nothing (cpl_entries=0, as 'sqm run --cpl-entries 0'): its start and shutdown
    # checkpoints would otherwise each copy every entry of the structure into its log (a termination pass copies
    # all), seconds for one message with tens of thousands on the queues. Relogging the structures is the
    # long-running members' work, like the rest of their housekeeping (LeaseKeeper).
    qm = QueueManager(QueueManagerConfig(name=args.qm_name, log_root=found.log_root, redis_url=require_url(found),
                                         lease_ms=args.lease_ms, cpl_entries=0, background=False), wings=WINGS)
    lease = LeaseKeeper(qm)  # from the join on: restart recovery and its checkpoint may outlast the lease
    try:
        try:
            qm.start()
        except LogLockedError as e:  # another in-process command holds the member name (a `get --wait` left running)
            raise RetryLaterError(f"{e}: another cfemu command runs as {args.qm_name}; wait for it, or give this one "
                                  "--qm-name NAME (or --server HOST:PORT)") from None
        try:
            conn = qm.connect()
            try:
                yield conn
            finally:
                conn.close()
        finally:
            qm.stop()  # its shutdown checkpoint (a relog pass over the structure) runs under the heartbeat too
    finally:
        lease.stop()


class LeaseKeeper:
    """Renews an in-process member's lease every third of it from its join to its leave, as a member's heartbeat
    does, so that its peers never fence it however long the command works (restart recovery and its checkpoint, a
    long put, its commit, the shutdown checkpoint). Made before ``qm.start()``: it renews once the member has
    joined (``qm.running``). Only the heartbeat: the member runs without its background threads (background=False), because
    the rest of a member's housekeeping (peer recovery, RECAUTO restores, expiry and UOW sweeps, checkpoints by
    time) is the long-running members' work, not that of a command that may end at any moment.

    No renewal follows the member's leave (a renewal of a member that left would join the group again): the
    member's ``admin.leave`` first stops this thread. A renewal that fails is tried again at the next period (the
    lease is ours until it lapses); once fenced the thread ends, and the command's next call fails with
    MQRC_CONNECTION_BROKEN."""

    def __init__(self, qm: QueueManager) -> None:
        self.qm = qm
        self.period = qm.config.lease_ms / 3000
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"{qm.name}-lease", daemon=True)
        admin = qm.admin
        leave = admin.leave

        def leave_after_the_last_renewal(member: str) -> None:
            self.stop()
            leave(member)

        admin.leave = leave_after_the_last_renewal  # type: ignore[method-assign]
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            if not self.qm.running or self.qm.fenced:  # not joined yet (no epoch of ours to renew), or fenced
                if self.qm.fenced:
                    return
                continue
            try:
                self.qm.renew_membership()
            except FencedError:
                return
            except Exception as e:  # noqa: BLE001 - a dead or busy CF: the next period tries again
                log.warning("%s: lease renewal failed (will retry every %.1fs): %s", self.qm.name, self.period, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self.period))



def _message_row(m: Any) -> dict[str, Any]:
    return {"queue": m.queue, "msgid": m.msgid.hex(), "correlid": m.correlid.hex(), "priority": m.priority,
            "persistent": m.persistent, "backout_count": m.backout_count, "put_time": m.put_time,
            "body": _body_text(m.body, 10_000), "length": len(m.body), **_uow_of(m)}


def _uow_of(m: Any) -> dict[str, Any]:
    """What a message is to a service (docs/uow.md): a message of a UOW on <SVC>.UOWDATA (the UOW id is its
    correlid; its position, from 1, its ``uow.seq`` property + 1), or a UOW's control entry on <SVC>.UOWCTL (the
    UOW id is its msgid; its status in the body), a user's LAST pointer there (status LAST, the UOW it points to) or
    a conversation's record (status CONVERSATION: its id, the receiver it is bound to, how it ended). A plain
    message: an empty UOW."""
    queue = str(m.queue or "")
    seq = (m.properties or {}).get("uow.seq")
    if queue.endswith(DATA_SUFFIX) and isinstance(seq, int):
        return {"uow": m.correlid.hex(), "uow_position": seq + 1, "uow_status": ""}
    if queue.endswith(CONTROL_SUFFIX):
        try:
            if m.correlid == LAST_LETTER.encode():  # a user's pointer to the last UOW it sent (SYNCPOINT LAST)
                return {"uow": str(msgpack.unpackb(m.body)["uow"]), "uow_position": None, "uow_status": "LAST"}
            if m.correlid == RECORD_LETTER.encode():  # a conversation's record: its id, and whose it is
                rec = ConvRecord.unpack(m.body)
                return {"uow": rec.conversation, "uow_position": None, "uow_status": "CONVERSATION",
                        "bound_to": rec.receiver, "ended": rec.eoc}
            return {"uow": m.msgid.hex(), "uow_position": None, "uow_status": Control.unpack(m.body).status}
        except Exception:  # noqa: BLE001 - not a control entry (put there by hand): shown as such, not fatal
            return {"uow": m.msgid.hex(), "uow_position": None, "uow_status": "?"}
    return {"uow": "", "uow_position": None, "uow_status": ""}


def _uow_cell(r: dict[str, Any]) -> str:
    if not r["uow"]:
        return ""
    return f"{r['uow'][:16]} " + (f"#{r['uow_position']}" if r["uow_position"] else r["uow_status"])


def _print_messages(out: Output, title: str, messages: list[Any], as_json: bool) -> None:
    rows = [_message_row(m) for m in messages]
    if as_json:
        out.json({"messages": rows, "count": len(rows)})
        return
    out.table(title, ["#", "priority", "persistent", "backouts", "length", "msgid", "UOW", "body"],
              [(i + 1, r["priority"], "yes" if r["persistent"] else "no", r["backout_count"], r["length"],
                r["msgid"][:16], _uow_cell(r), _body_text(r["body"].encode())) for i, r in enumerate(rows)])


def cmd_put(args: argparse.Namespace, out: Output) -> int:
    """The messages in units of work of at most --per-commit messages each (a unit of work may hold at most the
    member's MAXUMSGS): each committed before the next begins; a failure backs out only the one it was in."""
    bodies = [b.encode() for b in args.messages] * args.count
    put: list[Any] = []
    # Ctrl-C is taken between two puts, not wherever it lands: raised inside the member's own calls (a commit half
    # applied, a lock just taken), it left the in-process member unable to back the unit of work out or stop.
    interrupted = threading.Event()
    with (messaging(args) as h, _bars(out) as bars,
          handling((signal.SIGINT,), lambda *_: interrupted.set(), in_thread=True)):
        for first in range(0, len(bodies), args.per_commit):
            bars("put", len(put), len(bodies))
            try:
                done = []
                for b in bodies[first:first + args.per_commit]:
                    _raise_if(interrupted)
                    done.append(h.put(args.queue, b, persistent=not args.non_persistent, priority=args.priority,
                                      correlid=args.correlid.encode()))
                _raise_if(interrupted)
                h.commit()
            except BaseException as e:
                h.backout()
                if put and isinstance(e, Exception):
                    raise CLIError(f"{len(put)} of {len(bodies)} message(s) were put on {args.queue} and committed; "
                                   f"the next unit of work was backed out: {e}") from e
                if put and isinstance(e, KeyboardInterrupt):
                    # What is committed stays: said (and, with --json, listed) so that a rerun does not put it twice.
                    _report_put(out, args, put, interrupted=True)
                    print(f"cfemu: {len(put)} of {len(bodies)} message(s) were put on {args.queue} and committed "
                          "before the interrupt; the next unit of work was backed out", file=sys.stderr)
                raise
            put.extend(done)
        bars("put", len(put), len(bodies))
    _report_put(out, args, put)
    return 0


def _raise_if(interrupted: threading.Event) -> None:
    if interrupted.is_set():
        raise KeyboardInterrupt


def _bars(out: Output) -> PhaseBars:
    """A bar of the messages done, on a terminal (not with --json): a put of thousands takes seconds."""
    return PhaseBars(out.console, disabled=out.as_json or not out.console.is_terminal)


def _report_put(out: Output, args: argparse.Namespace, put: list[Any], *, interrupted: bool = False) -> None:
    if args.json:
        out.json({"queue": args.queue, "put": len(put), "msgids": [m.msgid.hex() for m in put],
                  **({"interrupted": True} if interrupted else {})})
    else:
        out.line(f"put {len(put)} message(s) on {args.queue} (committed)")


def cmd_get(args: argparse.Namespace, out: Output) -> int:
    got: list[Any] = []
    # Ctrl-C is taken between two of the member's calls, as put takes it; a long --wait-ms is asked in slices
    # (_waiting_get) so that it still ends within a slice of the interrupt.
    interrupted = threading.Event()
    with (messaging(args) as h, _bars(out) as bars,
          handling((signal.SIGINT,), lambda *_: interrupted.set(), in_thread=True)):
        try:
            while args.all or len(got) < args.count:
                try:
                    got.append(_waiting_get(h, args.queue, args.wait_ms, interrupted))
                except NoMessageError:
                    break
                if len(got) % 100 == 0:
                    bars("got", len(got), None if args.all else args.count)
            h.commit()
        except BaseException:
            h.backout()
            raise
    _print_messages(out, f"got {len(got)} message(s) from {args.queue} (committed)", got, args.json)
    return 0 if got or args.all else 1


#: The longest wait of one get a waiting `cfemu get` asks: how long a Ctrl-C may take to be acted on.
WAIT_SLICE_MS = 200


def _waiting_get(h: MessagingHandle, queue: str, wait_ms: int, interrupted: threading.Event) -> Any:
    """``h.get(queue, wait_ms=wait_ms)``, its wait asked in slices of at most WAIT_SLICE_MS, the interrupt looked at
    before each: a message that comes during the wait is taken by the slice under way, as one long wait would."""
    deadline = time.monotonic() + wait_ms / 1000
    while True:
        _raise_if(interrupted)
        left = max(0, round((deadline - time.monotonic()) * 1000))
        try:
            return h.get(queue, wait_ms=min(left, WAIT_SLICE_MS))
        except NoMessageError:
            if left <= WAIT_SLICE_MS:
                raise


def cmd_browse(args: argparse.Namespace, out: Output) -> int:
    with messaging(args) as h:
        msgs = h.browse(args.queue, args.limit)
    more = ", more on the queue" if getattr(msgs, "more", False) else ""
    _print_messages(out, f"{args.queue}: {len(msgs)} message(s) (browsed{more})", msgs, args.json)
    return 0



def put_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    p.add_argument("queue", type=cf_name("queue"))
    p.add_argument("messages", nargs="+", metavar="MESSAGE")
    p.add_argument("--count", type=whole(1, MAX_PUT_COUNT), default=1,
                   help=f"put the messages this many times (1-{MAX_PUT_COUNT})")
    p.add_argument("--per-commit", type=whole(1), default=1000, metavar="N",
                   help="messages per unit of work (default 1000; at most the member's MAXUMSGS)")
    p.add_argument("--priority", type=whole(0, 9), default=0, help="0-9")
    p.add_argument("--non-persistent", action="store_true")
    p.add_argument("--correlid", default="")


def get_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    p.add_argument("queue", type=cf_name("queue"))
    how_many = p.add_mutually_exclusive_group()
    how_many.add_argument("--count", type=whole(1), default=1)
    how_many.add_argument("--all", action="store_true", help="until the queue is empty")
    p.add_argument("--wait-ms", type=whole(0), default=0)


def browse_arguments(p: argparse.ArgumentParser, parents: Parents) -> None:
    p.add_argument("queue", type=cf_name("queue"))
    p.add_argument("--limit", type=whole(1), default=100)
