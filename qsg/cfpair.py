"""The local cluster's duplexed CF: two redis-servers, the secondary a Redis replica of the primary, and the
controller that degrades, promotes and resynchronises them (the cluster's CF supervisor runs ``tend()``).

    cluster = LocalGroup.up(dir, duplex=True)      # cfemu cluster up --duplex
    cluster.pair.kill_secondary()               # the copy lost: the pair degrades to simplex, then resyncs
    cluster.kill_cf()                           # the primary lost: the secondary is promoted, nothing restored

cluster.json keeps the pair under ``duplex``: the generation, the mode (DUPLEX only once confirmed: see
cfemu.duplex_control), the secondary's {dir, port, pid}, the two addresses of the URL (fixed for the cluster's
life: a promotion swaps the roles, never the ports, so members keep their URL), and the count of each event.
``cf`` (settings.CLUSTER_CF) is always the current primary.

Promotion is the product's own, by the process that owns both servers, not Redis Sentinel (docs/architecture.md):
the primary holds a lease (it must answer the controller's PING within ``lease_ms``); one that does not (stopped,
wedged, or held by a script: Redis answers nobody while one runs) is killed (SIGKILL: it can no longer act) and, only if the pair is DUPLEX-confirmed and the secondary runs, the secondary
is promoted at the next generation; else (both lost, or the copy was not in sync) the primary is restarted empty at
the next generation, and RECAUTO restores the structures from the backups and the logs.

Messages (the controller's log; the cluster's CF supervisor log for a detached cluster), numbered like MQ's:
  CSQE250W duplexing of the CF stopped: <why>; the CF is simplex (the secondary is resynchronised)
  CSQE251I duplexing of the CF re-established (generation N): the secondary at H:P is in sync
  CSQE252I the primary CF at H:P was lost; the secondary at H:P is the primary now (generation N), nothing restored
  CSQE253E the primary CF at H:P was lost and <both were lost | the copy was not in sync>: restarted empty
           (generation N); structures with RECAUTO are restored by a member
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import redis

from cfemu import credentials, duplex_control
from cfemu.duplex import DUPLEX, SIMPLEX, duplex_url
from cfemu.embedded import EmbeddedRedis, ServerNotRunningError, discard_data
from cfemu.procs import pid_alive, pid_is_redis
from cfemu.settings import CLUSTER_CF, CLUSTER_REDIS_URL

log = logging.getLogger("qsg.cfpair")

LEASE_MS = 2000  # the primary must answer the controller's PING within this
SYNC_TIMEOUT_S = 30.0


def _runs(pid: Any) -> bool:
    if not pid or not pid_alive(int(pid)):
        return False
    return pid_is_redis(int(pid))


class PairOwner(Protocol):
    """What the pair needs of the local group that owns it (qsg.local_group.LocalGroup, which imports this module):
    its host, its secrets and its live state (cluster.json's dict, saved by the owner), and its CF server, which a
    promotion replaces (``_cf``) and a pair lost entirely restarts empty (``_start_cf``, ``cf_restarts``)."""

    state: dict[str, Any]
    cf_restarts: int
    _cf: EmbeddedRedis | None

    @property
    def host(self) -> str: ...

    @property
    def secrets_dir(self) -> Path: ...

    def kill_cf(self) -> None: ...

    def _start_cf(self, port: int | None) -> None: ...


class CFPair:
    def __init__(self, cluster: PairOwner) -> None:
        self.c = cluster
        self._secondary: EmbeddedRedis | None = None

    # --- state ----------------------------------------------------------------------------------------------
    @staticmethod
    def new_state(directory: Path, lease_ms: int = LEASE_MS) -> dict[str, Any]:
        return {"gen": 0, "mode": SIMPLEX, "lease_ms": lease_ms, "secondary": {"dir": str(directory)},
                "addresses": [], "promotions": 0, "degrades": 0, "resyncs": 0, "empty_restarts": 0,
                "last_event": ""}

    @property
    def primary_address(self) -> tuple[str, int]:
        return (self.c.host, int(self.c.state[CLUSTER_CF]["port"]))

    @property
    def secondary_address(self) -> tuple[str, int]:
        return (self.c.host, int(self.state["secondary"]["port"]))

    @property
    def state(self) -> dict[str, Any]:
        duplex: dict[str, Any] = self.c.state["duplex"]  # the live dict, saved with cluster.json
        return duplex

    def _control(self, address: tuple[str, int], timeout: float = 2.0) -> redis.Redis:
        return duplex_control.control_client(*address, self.c.secrets_dir, timeout=timeout)

    def acl(self) -> list[str]:
        return duplex_control.acl_lines(self.c.secrets_dir)

    # --- start ----------------------------------------------------------------------------------------------
    def establish(self) -> None:
        """After the primary started (LocalGroup.up): its generation, the secondary, the URL; DUPLEX confirmed."""
        st = self.state
        st["gen"] = max(1, int(st["gen"]))
        self._set(self.primary_address, SIMPLEX, gen=st["gen"])
        self.start_secondary()
        st["addresses"] = [list(self.primary_address), list(self.secondary_address)]
        self.c.state[CLUSTER_REDIS_URL] = self.url()
        if not self.wait_in_sync(SYNC_TIMEOUT_S):
            raise RuntimeError(f"the secondary CF at {self._fmt(self.secondary_address)} was not in sync within "
                               f"{SYNC_TIMEOUT_S:g}s; see {st['secondary']['dir']}/redis.log")
        self._confirm_duplex()

    def url(self) -> str:
        """The pair's URL: the addresses as first planned (a promotion swaps the roles, not the ports)."""
        first, second = (tuple(a) for a in self.state["addresses"])
        return duplex_url(f"redis://{first[0]}:{first[1]}/0", (str(second[0]), int(second[1])))

    def start_secondary(self) -> None:
        """Start the secondary empty (a resynchronisation replaces what it held) as a replica of the primary; its
        masterauth set through the controller's connection, never on its command line."""
        sec = self.state["secondary"]
        sdir = Path(sec["dir"])
        discard_data(sdir)
        host, port = self.primary_address
        srv = EmbeddedRedis(port=sec.get("port"), data_dir=sdir, host=self.c.host, detach=self.c.state["detached"],
                            acl_users=[*credentials.acl_lines(credentials.create(self.c.secrets_dir)), *self.acl()],
                            config={"replica-read-only": "yes"},
                            extra_args=["--replicaof", host, str(port), "--masteruser", duplex_control.REPLICA_USER])
        srv.start()
        self._secondary = srv
        sec.update(port=srv.port, pid=srv.pid)
        duplex_control.attach(self._control(self.secondary_address), self.primary_address, self.c.secrets_dir)

    def wait_in_sync(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._in_sync():
                return True
            time.sleep(0.05)
        return False

    def _in_sync(self) -> bool:
        try:
            return duplex_control.in_sync(self._control(self.secondary_address))
        except redis.RedisError:
            return False

    def _set(self, address: tuple[str, int], mode: str, *, gen: int | None = None) -> bool:
        client = self._control(address)
        try:
            return duplex_control.set_mode(client, mode, gen=gen)
        finally:
            client.close()

    def _confirm_duplex(self) -> bool:
        if self._set(self.primary_address, DUPLEX):
            self.state["mode"] = DUPLEX
            return True
        return False

    # --- the controller ------------------------------------------------------------------------------------
    def tend(self) -> str | None:
        """One look at the pair; the event it acted on (None: nothing to do). What the CF supervisor runs."""
        st = self.state
        primary_ok = self._primary_holds_lease()
        secondary_runs = _runs(st["secondary"].get("pid"))
        if primary_ok:
            if st["mode"] == DUPLEX and (not secondary_runs or not self._in_sync()):
                why = "the secondary CF is lost" if not secondary_runs else "the secondary CF is out of sync"
                self._set(self.primary_address, SIMPLEX)
                st["mode"] = SIMPLEX
                st["degrades"] += 1
                return self._event(f"CSQE250W duplexing of the CF stopped: {why}; the CF is simplex (the secondary "
                                   "is resynchronised)")
            if not secondary_runs:
                self.start_secondary()
                return self._event(f"resynchronising the secondary CF at {self._fmt(self.secondary_address)}")
            if st["mode"] == SIMPLEX and self._in_sync() and self._confirm_duplex():
                st["resyncs"] += 1
                return self._event(f"CSQE251I duplexing of the CF re-established (generation {st['gen']}): the "
                                   f"secondary at {self._fmt(self.secondary_address)} is in sync")
            return None
        lost = self.primary_address
        st["gen"] = int(st["gen"]) + 1
        if st["mode"] == DUPLEX and secondary_runs:
            client = self._control(self.secondary_address)
            try:
                duplex_control.promote(client, st["gen"], grace_ms=int(self.c.state.get("lease_ms", 5000)))
            finally:
                client.close()
            self._swap()
            st["mode"] = SIMPLEX
            st["promotions"] += 1
            message = (f"CSQE252I the primary CF at {self._fmt(lost)} was lost; the secondary at "
                       f"{self._fmt(self.primary_address)} is the primary now (generation {st['gen']}), nothing "
                       "restored")
            with contextlib.suppress(Exception):  # the old primary comes back as the new secondary (resync)
                self.start_secondary()
            return self._event(message)
        why = "the copy was not in sync" if secondary_runs else "the secondary was lost too"
        st["gen"] -= 1  # restarted_empty takes the next one
        self.c._start_cf(port=lost[1])  # empty, as a lost CF comes back
        self.restarted_empty()
        self.c.cf_restarts += 1
        return self._event(f"CSQE253E the primary CF at {self._fmt(lost)} was lost and {why}: restarted empty "
                           f"(generation {st['gen']}); structures with RECAUTO are restored by a member")

    def restarted_empty(self) -> None:
        """The primary was started again, empty (both lost, or an operator's restart): a new generation, simplex;
        a running secondary replaces its copy with the empty primary's, and the controller re-duplexes later."""
        st = self.state
        st["gen"] = int(st["gen"]) + 1
        self._set(self.primary_address, SIMPLEX, gen=st["gen"])
        st["mode"] = SIMPLEX
        st["empty_restarts"] += 1
        if self.secondary_runs():
            with contextlib.suppress(redis.RedisError):
                duplex_control.attach(self._control(self.secondary_address), self.primary_address,
                                      self.c.secrets_dir)

    def _primary_holds_lease(self) -> bool:
        """The primary runs and answers PING within the lease; one that runs but does not answer is killed
        (it must not act once its secondary is promoted)."""
        cf = self.c.state[CLUSTER_CF]
        if not _runs(cf.get("pid")):
            return False
        lease_s = int(self.state.get("lease_ms", LEASE_MS)) / 1000
        try:
            client = self._control(self.primary_address, timeout=lease_s)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except redis.RedisError as e:
            log.error("the primary CF at %s did not answer within its lease (%s): killing it",
                      self._fmt(self.primary_address), e)
            with contextlib.suppress(Exception):
                self.c.kill_cf()
            return False

    def _swap(self) -> None:
        st, state = self.state, self.c.state
        state[CLUSTER_CF], st["secondary"] = st["secondary"], state[CLUSTER_CF]
        self.c._cf, self._secondary = self._secondary, None
        st["secondary"]["pid"] = None  # the old primary: dead (killed if it did not hold its lease)

    def _event(self, message: str) -> str:
        self.state["last_event"] = message
        (log.warning if "W " in message[:10] or "E " in message[:10] else log.info)("%s", message)
        return message

    @staticmethod
    def _fmt(address: tuple[str, int]) -> str:
        return f"{address[0]}:{address[1]}"

    # --- faults, status, stop ------------------------------------------------------------------------------
    def _secondary_server(self) -> EmbeddedRedis:
        if self._secondary is not None and self._secondary.is_running():
            return self._secondary
        try:
            self._secondary = EmbeddedRedis.attach(self.state["secondary"]["dir"])
        except ServerNotRunningError as e:
            raise RuntimeError(f"the secondary CF is not running: {e}") from None
        return self._secondary

    def kill_secondary(self) -> None:
        """kill -9 the secondary (the copy is lost; the primary carries on)."""
        if self._secondary is not None and self._secondary.is_running():
            self._secondary.kill()
        elif _runs(self.state["secondary"].get("pid")):
            self._secondary_server().kill()
        self.state["secondary"]["pid"] = None

    def stop_secondary(self, timeout: float = 10.0) -> None:
        pid = self.state["secondary"].get("pid")
        if self._secondary is not None:
            self._secondary.stop(timeout=timeout)
        elif _runs(pid):
            with contextlib.suppress(RuntimeError):
                self._secondary_server().stop(timeout=timeout)
        self.state["secondary"]["pid"] = None

    def secondary_runs(self) -> bool:
        return _runs(self.state["secondary"].get("pid"))

    def status(self) -> dict[str, Any]:
        """The pair as ``cluster status`` shows it: each server's role and state, the mode and the counts."""
        st = self.state
        out: dict[str, Any] = {"mode": st["mode"], "generation": st["gen"],
                               "primary": self._fmt(self.primary_address),
                               **{k: st[k] for k in ("promotions", "degrades", "resyncs", "empty_restarts")},
                               "last_event": st.get("last_event", "")}
        secondary = "down"
        if self.secondary_runs():
            secondary = "in sync" if self._in_sync() else "resynchronising"
        out["secondary"] = self._fmt(self.secondary_address) if st["secondary"].get("port") else ""
        out["secondary_state"] = secondary
        return out
