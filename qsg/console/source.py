"""Where the console finds the group: its settings (the CF, the logs, the backups, the secrets, as every cfemu
command finds them: cfemu.settings), its local cluster when there is one (qsg.local_group: processes, member
endpoints, restarts), the members' service endpoints, and the TLS the service uses."""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from cfemu import credentials
from cfemu import settings as cfsettings
from cfemu.admin import Admin
from cfemu.connection import connect
from qsg.local_group import LocalGroup, LocalGroupError
from sqm.operations import OPERATOR
from sqm.service.client import Client

CLIENT_NAME = "cfemu-console"
CF_TIMEOUT_S = 5.0  # a CF call the console makes: a hung CF must not hang a poll for longer


@dataclass
class GroupSource:
    """What the console reads the group through. ``where`` holds the settings flags (cfemu.settings.resolve's
    keyword arguments: redis_url, log_root, backup_dir, cluster_dir, cf_dir), ``servers`` the members' endpoints
    given on the command line (HOST:PORT; a local cluster's are found in its cluster.json), ``member_tls`` the
    context that checks the members' certificates when their service has TLS."""

    where: dict[str, Any] = field(default_factory=dict)
    servers: Sequence[str] = ()
    member_tls: ssl.SSLContext | None = None
    _token_file: Path | None = field(default=None, init=False, repr=False, compare=False)

    def settings(self, role: str = "operator") -> cfsettings.Settings:
        """The settings as a command of that CF role finds them (its user and password in the CF's URL)."""
        return cfsettings.resolve(role=role, **self.where)

    def operator_token(self) -> str | None:
        """The group's operator token (the service's operator role): what the login compares with, and what the
        console's own service connections prove they hold."""
        found = self.settings()
        self._token_file = credentials.service_token_file(found.secrets_dir, OPERATOR) if found.secrets_dir else None
        return found.token if found.token_role == OPERATOR else None

    def operator_token_stamp(self) -> tuple[Any, ...]:
        """A cheap mark that changes whenever operator_token() may answer otherwise: the token flag,
        $SQM_OPERATOR_TOKEN, and the token file (the one the last operator_token() found): its inode, size and
        modification time, one stat."""
        try:
            st = os.stat(self._token_file) if self._token_file is not None else None
        except OSError:
            st = None
        return (self.where.get("token"), os.environ.get(cfsettings.ENV_OPERATOR_TOKEN), self._token_file,
                (st.st_ino, st.st_size, st.st_mtime_ns) if st is not None else None)

    def cluster(self) -> LocalGroup | None:
        """The local cluster the settings found (cluster.json read afresh), None when the group is not one."""
        found = self.settings()
        if found.cluster_dir is None:
            return None
        try:
            return LocalGroup.load(found.cluster_dir)
        except LocalGroupError:
            return None

    def endpoints(self, cluster: LocalGroup | None = None) -> dict[str, str]:
        """Member name (or the endpoint itself, for one given by hand) -> HOST:PORT of its service."""
        out = {name: f"{host}:{port}" for name, host, port in (cluster.endpoints if cluster else [])}
        for spec in self.servers:
            if spec not in out.values():
                out[spec] = spec
        return out

    @contextmanager
    def admin(self, role: str = "operator") -> Iterator[Admin]:
        """An Admin of the CF as that role, with short timeouts; closed after the block."""
        url = self.settings(role).redis_url
        if not url:
            raise RuntimeError("no CF found: give --redis-url, or run the console beside a cluster "
                               "(--cluster-dir) or a 'cfemu cf start' CF")
        client = connect(url, socket_timeout=CF_TIMEOUT_S, socket_connect_timeout=CF_TIMEOUT_S)
        try:
            yield Admin(client)
        finally:
            client.close()

    def cf_client(self, role: str) -> redis.Redis:
        """A CF client as role (backup, restore) for a long operation: the caller closes it."""
        url = self.settings(role).redis_url
        if not url:
            raise RuntimeError("no CF found")
        return connect(url)

    def member_client(self, endpoint: str, *, timeout_s: float = 5.0) -> Client:
        """A service connection to one member as the operator (its token proved by challenge-response)."""
        return Client([endpoint], token=self.operator_token(), role=OPERATOR, tls=self.member_tls,
                      client_name=CLIENT_NAME, connect_timeout=timeout_s, request_timeout=timeout_s,
                      reconnect_timeout=0.0)

    @property
    def backup_dir(self) -> Path:
        return self.settings().backup_dir


__all__ = ["CLIENT_NAME", "GroupSource"]
