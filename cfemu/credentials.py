"""The group's secrets: one CF user per role with only the commands its role needs, and where their passwords live.

A group is created with its secrets (``cfemu cluster up``, ``cfemu cf start``): a directory readable by its owner
only (0700) holding one file per secret (0600), made with ``secrets.token_urlsafe``. The CF's ``default`` user is
off; every process connects as the user of its role:

  member    qsg-member    ``sqm run`` and in-process queue managers: the CF scripts and reads
  backup    qsg-backup    ``cfbackup``: reads and the backup scripts, the catalog
  restore   qsg-restore   ``cfrestore``: restore's writes (wipe, load, purge), definitions after a lost CF
  operator  qsg-operator  ``cfemu``: definitions, status, one-shot put/get

Beside them, the group's backup key (``backup.key``): cfbackup signs every backup manifest with it (HMAC-SHA256,
backup.files), and everything that reads a backup (verify, list, restore, purge) checks the signature with it, so
that a backup someone else altered or made is refused. ``backup-previous.key``, when present, is still accepted
for reading (a rotated key: docs/security.md). And the two tokens of the ``sqm run`` service (sqm.service.protocol's roles): ``service.token`` for
applications (put, get, browse, commit, backout, prepare, resolve of their own in-doubt UOWs) and
``operator.token`` for operators (also define, status, resolve of any in-doubt UOW). They never cross the wire:
a client proves it holds one (HMAC-SHA256 of a fresh challenge).

Nobody gets CONFIG, MODULE, DEBUG, FLUSHALL/FLUSHDB, SAVE/BGSAVE, SHUTDOWN, SCRIPT FLUSH, KEYS, ACL, CLIENT,
MONITOR or REPLICAOF (Redis's @dangerous category), nor SCRIPT FLUSH, FUNCTION or FCALL; SCRIPT KILL only the
operator. Scripts run with their caller's
permissions (Redis checks every redis.call against the caller's ACL), so EVAL and SCRIPT LOAD give no more than
the commands a role already has.

Redis 6.2 (the bundled server) has no per-command key patterns, so the roles differ in commands, not in keys:
a member could still write a definition key with HSET. Redis 7's selectors close that; docs/security.md gives the
ACL file for an external Redis 7.
"""

from __future__ import annotations

import hashlib
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, quote, urlsplit, urlunsplit

from cfemu.private_files import private_dir, write_private

ROLES = ("member", "backup", "restore", "operator")
SERVICE_ROLES = ("application", "operator")  # the roles of the sqm run service (sqm.service.protocol.ROLES)
SERVICE_TOKEN_FILES = {"application": "service.token", "operator": "operator.token"}
BACKUP_KEY_FILE = "backup.key"  # signs new backups; checks them
SPARK_SECRET_FILE = "spark.secret"  # the standalone Spark cluster's shared secret (spark.authenticate)
BACKUP_PREVIOUS_KEY_FILE = "backup-previous.key"  # a rotated-out key: still checks the backups it signed
SECRETS_DIR = "secrets"  # inside the cluster directory or the ``cfemu cf start`` directory
ENV_SECRETS_DIR = "CFEMU_SECRETS_DIR"
URL_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")  # the CF URLs a role's user goes in

# Command rules per role (Redis 6.2 ACL syntax). Order matters: categories are added, then @dangerous removed.
# INFO (in @dangerous) is given back: it is read-only, and restore checks with it (INFO server's run_id) that it
# still talks to the CF it started on. TIME: the pseudo-clock (pclock.lua) counts on the CF's time, not a member's.
# Scripts: EVAL and EVALSHA by name, not @scripting, which on Redis 7 and Valkey also holds FUNCTION (LOAD and
# FLUSH: code kept in the server) and FCALL, which the group never uses. SCRIPT is taken out whole (Redis 6.2
# cannot take out one subcommand) and LOAD and EXISTS given back: redis-py loads a script on NOSCRIPT; FLUSH stays
# out, and KILL is the operator's alone: the group's supervisor, holding the operator's user, ends a script that
# keeps the CF BUSY (qsg.group_supervisor), which nobody else then can.
_BASE = ("-@all +@read +@write +@keyspace +eval +evalsha +@transaction +@connection -@dangerous -script "
         "+script|load +script|exists +ping +info +time")
_RULES = {"member": _BASE, "backup": _BASE, "restore": _BASE, "operator": _BASE + " +script|kill"}


class SecretsError(RuntimeError):
    """A secrets directory or file that is missing, or that others could read or write."""


def user(role: str) -> str:
    """The CF user name of a role."""
    if role not in _RULES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    return f"qsg-{role}"


def acl_lines(passwords: dict[str, str]) -> list[str]:
    """The CF's ACL file: the default user off, one user per role with its password and command rules."""
    lines = ["user default off nopass -@all"]
    for role in ROLES:
        lines.append(f"user {user(role)} on >{passwords[role]} ~* &* {_RULES[role]}")
    return lines


def _password_file(directory: Path, role: str) -> Path:
    return directory / f"cf-{role}.password"


def create(directory: Path) -> dict[str, str]:
    """The group's secrets, made now where missing (existing ones are kept: the CF's ACL file has them, clients
    have the service's tokens): the CF passwords, which are returned, and the service's two tokens."""
    private_dir(directory)
    out: dict[str, str] = {}
    for role in ROLES:
        path = _password_file(directory, role)
        if not path.exists():
            write_private(path, secrets.token_urlsafe(32).encode())
        out[role] = read_password(directory, role) or ""
    for service_role in SERVICE_ROLES:
        service_token(directory, service_role)
    create_backup_key(directory)
    return out


def create_backup_key(directory: Path) -> None:
    """The group's backup key in DIRECTORY, made now when missing (an existing one is kept: it signed the
    backups there are)."""
    private_dir(directory)
    if not (directory / BACKUP_KEY_FILE).exists():
        write_private(directory / BACKUP_KEY_FILE, secrets.token_urlsafe(32).encode())


def key_id(key: bytes) -> str:
    """A key's public name (16 hex digits of a hash of it): says which key signed a backup without giving any
    of the key away."""
    return hashlib.sha256(b"cfemu backup key id\0" + key).hexdigest()[:16]


@dataclass(frozen=True)
class BackupKeys:
    """The keys a process signs and checks backups with (never printed: repr shows their ids only).

    ``current`` signs what this process writes and checks; ``previous`` only checks (backups signed before a
    rotation). ``accept_unsigned`` is the operator's override for backups taken before backups were signed
    (``--accept-unsigned``). ``source`` says where the keys were looked for, for messages."""

    current: bytes | None = field(default=None, repr=False)
    previous: tuple[bytes, ...] = field(default=(), repr=False)
    accept_unsigned: bool = False
    source: str = ""

    def __repr__(self) -> str:
        ids = ", ".join(key_id(k) for k in self.checking())
        return (f"BackupKeys(ids=[{ids}], accept_unsigned={self.accept_unsigned}, source={self.source!r})")

    def checking(self) -> tuple[bytes, ...]:
        """Every key a signature may be checked with: the current one first."""
        return (*((self.current,) if self.current else ()), *self.previous)

    def find(self, wanted_id: str) -> bytes | None:
        """The key whose id is wanted_id, if this process holds it."""
        return next((k for k in self.checking() if key_id(k) == wanted_id), None)


def backup_keys(directory: Path | None, *, accept_unsigned: bool = False) -> BackupKeys:
    """The backup keys in a secrets directory (none when directory is None or holds no backup.key). A key file
    that others may read is refused, like every secret."""
    if directory is None:
        return BackupKeys(accept_unsigned=accept_unsigned, source="no secrets directory")
    found: list[bytes] = []
    for name in (BACKUP_KEY_FILE, BACKUP_PREVIOUS_KEY_FILE):
        path = directory / name
        text = _read_private(path) if path.exists() else None
        found.append(text.encode() if text else b"")
    return BackupKeys(current=found[0] or None, previous=(found[1],) if found[1] else (),
                      accept_unsigned=accept_unsigned, source=str(directory))


def service_token_file(directory: Path, role: str = "application") -> Path:
    if role not in SERVICE_TOKEN_FILES:
        raise ValueError(f"unknown service role {role!r}; roles: {', '.join(SERVICE_ROLES)}")
    return directory / SERVICE_TOKEN_FILES[role]


def service_token(directory: Path, role: str = "application", *, create: bool = True) -> str | None:
    """A role's token for the ``sqm run`` servers (application: service.token, operator: operator.token), made
    now when missing and create."""
    path = service_token_file(directory, role)
    if not path.exists():
        if not create:
            return None
        private_dir(directory)
        write_private(path, secrets.token_urlsafe(32).encode())
    return _read_private(path)


def spark_secret_file(directory: Path, *, create: bool = True) -> Path:
    """The file holding the group's standalone Spark cluster's shared secret (qsg.spark_standalone), made now
    (0600) when missing and create."""
    path = directory / SPARK_SECRET_FILE
    if create and not path.exists():
        private_dir(directory)
        write_private(path, secrets.token_hex(32).encode())
    return path


def spark_secret(directory: Path) -> str | None:
    """The Spark cluster's shared secret, None when there is none; refused when the file is not private."""
    path = spark_secret_file(directory, create=False)
    return _read_private(path) if path.exists() else None


def _read_private(path: Path) -> str | None:
    st = path.stat()
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise SecretsError(f"{path} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                           "chmod 600 it and rotate the secret (docs/security.md)")
    return path.read_text().strip() or None


def read_password(directory: Path, role: str) -> str | None:
    """A role's CF password from the secrets directory, or None when it has none. A password file that others
    may read is refused (the secret may already be out: rotate it)."""
    path = _password_file(directory, role)
    if not path.exists():
        return None
    return _read_private(path)


def with_user(url: str, role: str, password: str) -> str:
    """URL with the role's user and password in it, unless it names a user or password already."""
    parts = urlsplit(url)
    if parts.username or parts.password or parts.scheme not in URL_SCHEMES:
        return url
    netloc = f"{quote(user(role), safe='')}:{quote(password, safe='')}@{_address(parts, '127.0.0.1')}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _address(parts: SplitResult, default_host: str) -> str:
    """What follows the user information in a URL's netloc: host and port; nothing for unix:// (its socket is the
    URL's path)."""
    if parts.scheme == "unix":
        return ""
    host = parts.hostname or default_host
    return host + (f":{parts.port}" if parts.port else "")


def redact(url: str) -> str:
    """URL with its password replaced by ***, for messages and status (never print a secret)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    userinfo = f"{parts.username}:***" if parts.username else ":***"
    netloc = f"{userinfo}@{_address(parts, '')}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
