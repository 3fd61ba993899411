"""A duplexed CF for tests: two real redis-servers, the second a replica of the first, secured as a group's, with
the controller's steps of cfemu.duplex_control (what qsg.cfpair does in a cluster) at hand."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis

from cfemu import credentials, duplex_control
from cfemu.duplex import DUPLEX, duplex_url
from cfemu.embedded import EmbeddedRedis


class Pair:
    def __init__(self, root: Path) -> None:
        self.secrets = root / "secrets"
        self.passwords = credentials.create(self.secrets)
        self.harness_password = self.passwords["operator"] + "-harness"
        self.acl = [*credentials.acl_lines(self.passwords), *duplex_control.acl_lines(self.secrets),
                    f"user qsg-harness on >{self.harness_password} ~* &* +@all"]
        self.servers = [EmbeddedRedis(data_dir=root / "a", acl_users=self.acl),
                        EmbeddedRedis(data_dir=root / "b", acl_users=self.acl)]
        self.primary = 0
        self.gen = 1

    @property
    def secondary(self) -> int:
        return 1 - self.primary

    def start(self) -> Pair:
        for srv in self.servers:
            srv.start()
        duplex_control.set_mode(self.control(self.primary), "SIMPLEX", gen=self.gen)
        self.attach(self.secondary)
        assert self.wait_in_sync(10)
        assert duplex_control.set_mode(self.control(self.primary), DUPLEX)
        return self

    def address(self, i: int) -> tuple[str, int]:
        return (self.servers[i].host, self.servers[i].port)

    def control(self, i: int) -> redis.Redis:
        return duplex_control.control_client(*self.address(i), self.secrets)

    def harness(self, i: int) -> redis.Redis:
        return self.servers[i].client(username="qsg-harness", password=self.harness_password)

    def attach(self, i: int) -> None:
        duplex_control.attach(self.control(i), self.address(1 - i), self.secrets)

    def wait_in_sync(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if duplex_control.in_sync(self.control(self.secondary)):
                return True
            time.sleep(0.05)
        return False

    def url(self, role: str = "member") -> str:
        a = self.address(0)
        plain = credentials.with_user(f"redis://{a[0]}:{a[1]}/0", role, self.passwords[role])
        return duplex_url(plain, self.address(1))

    def promote(self) -> None:
        """The secondary becomes the primary at the next generation (the caller dealt with the old primary)."""
        self.gen += 1
        duplex_control.promote(self.control(self.secondary), self.gen, grace_ms=60_000)
        self.primary = self.secondary

    def stop(self) -> None:
        # The secondary first: a primary stopped with its replica attached waits for the replica's next
        # acknowledgement (about a second) before it exits.
        for srv in (self.servers[self.secondary], self.servers[self.primary]):
            srv.stop()

    def __enter__(self) -> Pair:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
