"""A fuzzy backup that yields to the group's work: without it a backup running beside the group takes much of the
group's throughput (its fetches hold the single-threaded CF, and its process takes a CPU the members need), and
nice only helps with the second (BENCHMARKS.md, "backup", its section on backup speed and foreground drop).

The Pacer sits before each of the backup's reads (cfemu.bulk.fetch_raw's before_read). Every PROBE_EVERY_S it
asks the CF how many commands it has served (INFO stats, total_commands_processed) and takes away the backup's
own (its reads and probes): the rest is the group's work. While the group keeps the CF busier than
IDLE_OPS_PER_S, the backup works only `share` of the time: after each batch it pauses (1 - share) / share times
as long as the batch took, read and written. On an idle CF it never pauses, so a backup at night runs at full
speed, and a backup by day takes about `share` of the machine. The share is a setting (cfbackup run
--backup-share, $CFEMU_BACKUP_SHARE: cfemu.settings); 1 turns pacing off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from cfemu import bulk, rcluster

log = logging.getLogger("backup.pacing")

IDLE_OPS_PER_S = 200.0  # other commands a second below which the CF counts as idle (a quiet group's heartbeats)
PROBE_EVERY_S = 0.05  # how often the CF's command count is read (an INFO: one round trip)
MAX_PAUSE_S = 1.0  # the longest pause after one batch, whatever the batch took
IDLE_BATCH_FACTOR = 2  # an idle CF's reads ask for this many times the backup's batch (1,000 ids by default)


def probe_commands(client: redis.Redis, structure: str) -> Callable[[], int]:
    """How to read the command count of the server that holds the structure (a cluster's: its master)."""
    node = rcluster.node_client(client, structure, fresh=False)

    def commands() -> int:
        return int(node.info("stats")["total_commands_processed"])

    return commands


@dataclass
class PaceStats:
    batches: int = 0
    paused: int = 0  # batches after which the backup paused
    pause_s: float = 0.0  # time spent paused
    probes: int = 0
    loaded_probes: int = 0  # probes that found the group working


class Pacer:
    """Pauses a backup's reads while the CF serves the group's work; see the module doc. `commands` reads the
    CF's command count (probe_commands); clock and sleep are the process's (tests may pass their own)."""

    def __init__(self, commands: Callable[[], int], share: float, *, idle_ops_per_s: float = IDLE_OPS_PER_S,
                 probe_every_s: float = PROBE_EVERY_S, max_pause_s: float = MAX_PAUSE_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"the backup's share must be above 0 and at most 1, not {share}")
        self.share = share
        self.idle_ops_per_s = idle_ops_per_s
        self.probe_every_s = probe_every_s
        self.max_pause_s = max_pause_s
        self._commands = commands
        self._clock = clock
        self._sleep = sleep
        self.stats = PaceStats()
        self.loaded = False  # the last probe's verdict
        self._judged = False  # whether any probe has given one yet
        self._base: tuple[float, int] | None = None  # (time, command count) of the last probe
        self._own = 0  # commands the backup sent since the last probe
        self._resumed = clock()  # when the backup last went back to work

    def new_step(self) -> None:
        """A copy step begins: its snapshot's commands (a script and its calls) are the backup's own; the next
        probe starts counting afresh."""
        self._base = None
        self._resumed = self._clock()

    def before_read(self) -> None:
        """Called before each of the backup's reads (bulk.READ_COMMANDS commands): pause if the group is
        working, for the share's proportion of the time worked since the last pause."""
        now = self._clock()
        self.stats.batches += 1
        if self.share < 1:
            # The first verdict comes after the first batch (a short backup must not run unpaced for the whole
            # interval); later ones every probe_every_s.
            if self._base is None or not self._judged or now - self._base[0] >= self.probe_every_s:
                self._probe(now)
            if self.loaded:
                pause = min((now - self._resumed) * (1 - self.share) / self.share, self.max_pause_s)
                if pause > 0:
                    # The time it was away, not the time it asked for: a loaded machine wakes a sleeper late, and
                    # the manifest says how long the backup held back.
                    self._sleep(pause)
                    self.stats.paused += 1
                    self.stats.pause_s += self._clock() - now
        self._own += bulk.READ_COMMANDS
        self._resumed = self._clock()

    def reads_in_flight(self) -> int:
        """How many reads the backup may have in flight (cfemu.bulk.fetch_raw's depth): all of them on an idle CF,
        one while the group works. The pauses share the backup's working time, not the CF's: two reads in flight
        held the CF twice as much per second worked, and the group's paced drop rose from 5.6% to 13-16%
        (BENCHMARKS.md, backup)."""
        return 1 if self.loaded else bulk.FETCH_DEPTH

    def batch_size(self, batch: int) -> int:
        """How many ids the backup's next read asks for (cfemu.bulk.fetch_raw's batch, asked after before_read):
        `batch` while the group works, so that each read holds the CF as briefly as the share was measured with;
        IDLE_BATCH_FACTOR times as many on an idle CF, where nothing waits behind a read and each read's own cost
        (its round trips, its threads' hand-overs) is spread over more entries."""
        return batch if self.loaded else batch * IDLE_BATCH_FACTOR

    def _probe(self, now: float) -> None:
        try:
            count = self._commands()
        except redis.exceptions.ResponseError as e:  # INFO refused: yield as if the group were working
            if self._base is None:
                log.warning("the CF refuses INFO (%s): the backup paces itself as if the group were working", e)
            self.loaded = True
            self._base = (now, 0)
            return
        self.stats.probes += 1
        if self._base is not None and now > self._base[0]:
            # -1: the previous probe's own INFO; and one command more of slack: the first verdict comes after the
            # first batch, a few milliseconds, where one stray command (a member's heartbeat, a connection's set-up)
            # reads as hundreds a second, and an idle CF's backup paused (seen once, in tests/backup's real-CF test
            # on a loaded machine). A busy group is thousands a second: it still reads as busy.
            others = count - self._base[1] - self._own - 1 - 1
            self.loaded = others / (now - self._base[0]) > self.idle_ops_per_s
            self._judged = True
            self.stats.loaded_probes += self.loaded
        self._base = (now, count)
        self._own = 0
