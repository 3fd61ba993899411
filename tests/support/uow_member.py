"""A queue manager in its own process that a test drives through UOW conversations (sqm.conversations.conversation), for the
restart tests that kill members with real signals (tests/sqm/test_uow_restart.py).

    python -m tests.support.uow_member --redis-url URL --log-root DIR --name QM1 [--lease-ms 1000]

The child starts a QueueManager with its background threads on (heartbeat, peer recovery, the UOW sweeper), prints
one JSON line ``{"started": NAME, "epoch": E, "pid": P}``, then serves one JSON request per stdin line with one JSON
reply per stdout line (``{"ok": RESULT}`` or ``{"err": "ErrorClass: message"}``):

  {"op": "conv", "name": C, "user": U, "token": T}                   a Conversation on this member, named C
  {"op": "call", "conv": C, "method": M, "args": [...], "kwargs": {}} one Conversation method (send, commit, ...)
  {"op": "query", "uow": U}                                          QUERY through a fresh Conversation
  {"op": "drain", "service": S}                                      receive every ACCEPTED UOW whole, commit each
  {"op": "pclock", "structure": S}                                   the structure's pseudo-clock (ms of up-time)
  {"op": "counts"}                                                   the sweeper's counters so far
  {"op": "stop"}                                                     a clean stop (checkpoint, leave the group)

Bytes travel as {"hex": "..."}; a dataclass result as its dict. UowMember (below) is the test's side of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def encode(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return {"hex": bytes(value).hex()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encode(dataclasses.asdict(value))
    if isinstance(value, dict):
        if set(value) == {"hex"}:
            return {"hex": value["hex"]}
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"hex"}:
            return bytes.fromhex(value["hex"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


# --- the child --------------------------------------------------------------------------------------------------

def serve(argv: list[str] | None = None) -> int:
    from cfemu.errors import EndOfUowError, NoMessageError
    from sqm.conversations import uowcontrols as ctl
    from sqm.conversations import wing as conversations_wing
    from sqm.conversations.conversation import SYNC, Conversation
    from sqm.core.manager import QueueManager, QueueManagerConfig
    from sqm.wings import WINGS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--log-root", required=True, type=Path)
    ap.add_argument("--name", required=True)
    ap.add_argument("--lease-ms", type=int, default=1000)
    args = ap.parse_args(argv)

    qm = QueueManager(QueueManagerConfig(name=args.name, log_root=args.log_root, redis_url=args.redis_url,
                                         lease_ms=args.lease_ms, uow_sweep_interval_ms=250, background=True),
                      wings=WINGS)
    qm.start()
    convs: dict[str, Conversation] = {}

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    def drain(service: str) -> dict[str, Any]:
        """Every ACCEPTED UOW received whole (until EndOfUowError) and committed: uow -> [body, recv] in order."""
        conv = Conversation(qm, "drainer", "tok-drain")
        out: dict[str, Any] = {}
        while True:
            try:
                first = conv.receive(service, option=SYNC, wait_ms=1000)  # a status change holds one a moment
            except NoMessageError:
                break
            got = [[first.body, first.recv]]
            while True:
                try:
                    m = conv.receive(service, option=SYNC)
                except EndOfUowError:
                    break
                got.append([m.body, m.recv])
            conv.commit()
            out[first.uow] = got
        conv.close()
        return out

    def handle(req: dict[str, Any]) -> Any:
        op = req["op"]
        if op == "conv":
            convs[req["name"]] = Conversation(qm, req["user"], req.get("token", ""))
            return None
        if op == "call":
            method = getattr(convs[req["conv"]], req["method"])
            return method(*decode(req.get("args", [])), **decode(req.get("kwargs", {})))
        if op == "query":
            conv = Conversation(qm, "observer", "tok-obs")
            try:
                return conv.query(req["uow"])
            finally:
                conv.close()
        if op == "drain":
            return drain(req["service"])
        if op == "pclock":
            return ctl.pseudo_clock(qm, req["structure"])
        if op == "counts":
            found = conversations_wing.sweeper(qm)
            return dict(found.counts) if found is not None else {}
        raise ValueError(f"unknown op {op!r}")

    say({"started": qm.name, "epoch": qm.caller.epoch, "pid": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "stop":
            qm.stop()
            say({"ok": None})
            return 0
        try:
            say({"ok": encode(handle(req))})
        except Exception as e:  # noqa: BLE001 - the test reads the class and the message
            say({"err": f"{type(e).__name__}: {e}"})
    return 0


# --- the test's side --------------------------------------------------------------------------------------------

class MemberError(Exception):
    """The child's operation raised: ``kind`` is the error's class name."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.kind = text.split(":", 1)[0]


class UowMember:
    """One child process (a member of the group); ``request`` sends one operation and waits for its reply."""

    def __init__(self, url: str, log_root: Path, name: str, *, lease_ms: int = 1000) -> None:
        self.name = name
        env = {k: v for k, v in os.environ.items() if k != "SQM_FAILPOINTS"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.uow_member", "--redis-url", url, "--log-root", str(log_root),
             "--name", name, "--lease-ms", str(lease_ms)],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        self.started: dict[str, Any] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            del self.stderr[:-40]

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.name} answered nothing in {timeout} s; stderr: {''.join(self.stderr)}") \
                from None
        if line is None:
            raise RuntimeError(f"{self.name} exited (rc {self.proc.wait()}); stderr: {''.join(self.stderr)}")
        return dict(json.loads(line))

    def wait_started(self, timeout: float = 60.0) -> UowMember:
        self.started = self._next(timeout)
        return self

    def request(self, op: str, timeout: float = 30.0, **fields: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(encode({"op": op, **fields})) + "\n")
        self.proc.stdin.flush()
        reply = self._next(timeout)
        if "err" in reply:
            raise MemberError(reply["err"])
        return decode(reply["ok"])

    def conv(self, name: str, user: str, token: str = "") -> None:
        self.request("conv", name=name, user=user, token=token)

    def call(self, conv: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.request("call", conv=conv, method=method, args=list(args), kwargs=kwargs)

    def query(self, uow: str) -> str | None:
        """The UOW's status through QUERY, None when no trace of it is kept (UnknownUowError)."""
        try:
            status = self.request("query", uow=uow)["status"]
            return None if status is None else str(status)
        except MemberError as e:
            if e.kind == "UnknownUowError":
                return None
            raise

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing flushed, no checkpoint, the lease left to lapse."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._close_pipes()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("stop", timeout=30)
            except (TimeoutError, RuntimeError, BrokenPipeError):
                self.proc.kill()
            self.proc.wait(timeout=30)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


def start_members(url: str, log_root: Path, names: list[str], **kw: Any) -> list[UowMember]:
    """Several members started at once (their start-ups overlap), each waited for."""
    members = [UowMember(url, log_root, n, **kw) for n in names]
    t0 = time.monotonic()
    for m in members:
        m.wait_started(timeout=max(5.0, 60.0 - (time.monotonic() - t0)))
    return members


if __name__ == "__main__":
    sys.exit(serve())
