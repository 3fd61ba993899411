"""A queue manager in its own process, for crash and fencing tests.

    python -m tests.support.sqm_child --redis-url URL --log-root DIR --name QM2 --scenario put [--count 6]

Starts a QueueManager (background threads on, a short lease), runs one scenario and prints one progress line per
step on stdout (flushed, so a test reading the pipe sees how far it got before a crash). Failpoints armed by
SQM_FAILPOINTS (sqm.core.failpoints) kill it with SIGKILL at the chosen point. The group must be defined already:
queue Q1 on structure APP1 and Q2 on APP2 (tests.test_sqm_crash.define_two_structures).

Scenarios (one UOW each):
  put           put --count persistent messages alternately on Q1 and Q2 (bodies put-<i>), commit
  put-backout   the same, then back out
  get           get --count messages from Q1 and put a reply for each on Q2 (reply-<body>), commit
  get-backout   the same, then back out
  pause         put one message in a UOW, print "ready" and wait for a line on stdin (the test stops the process
                meanwhile, past its lease, and lets a peer recover it); then make one CF call and try to commit,
                printing the error each one gets
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

from cfemu.entry import Entry
from cfemu.errors import MQError
from sqm.core.clock import now_ms
from sqm.core.connection import Connection
from sqm.core.manager import QueueManager, QueueManagerConfig
from sqm.wings import WINGS


def say(line: str) -> None:
    print(line, flush=True)


def put_scenario(conn: Connection, count: int, commit: bool) -> None:
    for i in range(count):
        conn.put("Q1" if i % 2 == 0 else "Q2", f"put-{i}".encode())
        say(f"put {i}")
    finish(conn, commit)


def get_scenario(conn: Connection, count: int, commit: bool) -> None:
    for i in range(count):
        m = conn.get("Q1")
        say(f"got {m.body.decode()} backout_count={m.backout_count}")
        conn.put("Q2", b"reply-" + m.body)
        say(f"replied {i}")
    finish(conn, commit)


def finish(conn: Connection, commit: bool) -> None:
    say("committing" if commit else "backing out")
    if commit:
        conn.commit()
    else:
        conn.backout()
    say("committed" if commit else "backed out")


def pause_scenario(qm: QueueManager, conn: Connection) -> None:
    conn.put("Q1", b"pause-0")
    say("ready")
    sys.stdin.readline()  # the test stops us here, lets a peer recover us, continues us, then writes a line
    say("woke")
    late = Entry(id=os.urandom(12).hex(), queue="Q1", persistent=False, msgid=os.urandom(24).hex(), put_time=now_ms())
    try:
        qm.cf_call(partial(qm.structure("APP1").put, qm.caller, late, b"late"))
        say("cf-call: accepted")
    except MQError as e:
        say(f"cf-call: {type(e).__name__}: {e}")
    try:
        conn.commit()
        say("commit: accepted")
    except MQError as e:
        say(f"commit: {type(e).__name__}: {e}")
    say(f"fenced={qm.fenced}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--log-root", required=True, type=Path)
    ap.add_argument("--name", required=True)
    ap.add_argument("--scenario", required=True, choices=["put", "put-backout", "get", "get-backout", "pause"])
    ap.add_argument("--count", type=int, default=6)
    ap.add_argument("--lease-ms", type=int, default=1000)
    ap.add_argument("--logload", type=int, default=10_000)
    args = ap.parse_args(argv)

    qm = QueueManager(QueueManagerConfig(name=args.name, log_root=args.log_root, redis_url=args.redis_url,
                                         lease_ms=args.lease_ms, logload=args.logload,
                                         background=True), wings=WINGS)
    qm.start()
    say(f"started {qm.name} epoch={qm.caller.epoch} pid={os.getpid()}")
    conn = qm.connect()
    if args.scenario == "pause":
        pause_scenario(qm, conn)
        return 0  # fenced: no checkpoint, no leaving the group (the peer already recovered us)
    if args.scenario.startswith("put"):
        put_scenario(conn, args.count, commit=args.scenario == "put")
    else:
        get_scenario(conn, args.count, commit=args.scenario == "get")
    qm.stop()
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
