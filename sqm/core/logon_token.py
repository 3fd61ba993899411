"""Logon tokens are never stored: a conversation's or a subscription's owner is kept as its user id and a keyed hash
of the user id and token (HMAC-SHA256 under the group's logon key), compared in constant time.

A logon's token (the TOKEN of EntireX's LOGON: docs/uow.md, docs/pubsub.md) is what keeps one user's units of work
and subscriptions from another user of the same application token, so it is a password: the control entries, the
LAST pointers, the subscription entries and every message id derived from them hold the *sealed* form
``k1:<64 hex>`` of this module, never the token. The CF, the members' logs and the backups therefore hold nothing an
application could log on with, and a guess at a token cannot be checked against them without the key.

A member opens the key when it starts (open_group_key), never later: a key file that others may read, or that is
not a key, refuses the start in one line, rather than every logon with a token after it. The group repository
records the key's fingerprint (a keyed hash of a constant, never the key): a member that finds the file missing
where the group has a key does not make another (its members would seal with different keys and each find only its
own users' work), and refuses to start, naming the file; a running member, which holds the key, writes the file
back when it finds it gone (restore_key_file, from its housekeeping), so the refused member starts on its next try.

The key lives in the group repository's directory on the log root (``<log root>/_group/logon.key``, 0600 in the
0700 directory, cfemu.repository): the place every member, peer recovery and restore of the group share (a member
whose log root is not the group's is refused at start), and which outlives a CF loss (the entries are restored from
backups and logs, so a key kept in the CF would be lost with them). It is made once, by the first process that
needs it: written to a file of its own, then linked into place, which fails when another process made it first
(then that one is used); a group never needs a step for it. A key file others may read is refused. Losing or
replacing it makes every sealed owner unmatchable: the owners' units of work and subscriptions are then an
operator's to settle (docs/security.md, "Logon tokens").

An entry made before tokens were sealed holds the token itself: it still matches its owner (``matches``), and a
control entry is sealed when it is next replaced (``seal_control``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
from dataclasses import replace
from pathlib import Path
from typing import Protocol, TypeVar

from cfemu.private_files import open_private, private_dir
from cfemu.repository import DIRECTORY

KEY_FILE = "logon.key"
KEY_BYTES = 32
PREFIX = "k1:"
SEALED_LENGTH = len(PREFIX) + 2 * hashlib.sha256().digest_size  # longer than any token a logon takes (32)
_DOMAIN = b"cfemu-logon-token\0"

_keys: dict[Path, bytes] = {}
_lock = threading.Lock()


class LogonKeyError(PermissionError):
    """The group's logon key cannot be used (others may read it, or it is not a key)."""


class HasLogRoot(Protocol):
    @property
    def log_root(self) -> str | os.PathLike[str]: ...


class HasConfig(Protocol):
    @property
    def config(self) -> HasLogRoot: ...


def key_path(log_root: str | os.PathLike[str]) -> Path:
    return Path(log_root).absolute() / DIRECTORY / KEY_FILE


def group_key(log_root: str | os.PathLike[str]) -> bytes:
    """The group's logon key under ``log_root``, made when there is none yet (read once per process)."""
    path = key_path(log_root)
    with _lock:
        key = _keys.get(path)
        if key is None:
            key = _keys[path] = _read(path) if path.exists() else _create(path)
    return key


class KeyRecord(Protocol):
    """Where the group records its key's fingerprint (cfemu.repository.GroupRepository)."""

    def logon_key_fingerprint(self) -> str | None: ...

    def record_logon_key_fingerprint(self, fingerprint: str) -> str: ...


def fingerprint(key: bytes) -> str:
    """What the group repository keeps of the key: a keyed hash of a constant, which says nothing of the key."""
    return hmac.new(key, _DOMAIN + b"fingerprint", hashlib.sha256).hexdigest()[:32]


def open_group_key(log_root: str | os.PathLike[str], record: KeyRecord) -> bytes:
    """The group's logon key, for a member that starts: read, or made when the group has none yet, and checked
    against the fingerprint the group records (recorded when there is none). LogonKeyError when the file cannot
    be used, is missing where the group has a key, or is another key than the group's."""
    path = key_path(log_root)
    recorded = record.logon_key_fingerprint()
    with _lock:
        if path.exists() or path.is_symlink():
            key = _read(path)
        elif recorded is not None:
            raise LogonKeyError(
                f"{path} is missing, and the group has a logon key (fingerprint {recorded}): another key would "
                "leave every sealed logon token unmatched; a running member of the group writes the file back "
                "within a second, or put it back from a copy (docs/security.md, \"Logon tokens\")")
        else:
            key = _create(path)
        mine = fingerprint(key)
        recorded = recorded or record.record_logon_key_fingerprint(mine)
        if not hmac.compare_digest(mine, recorded):
            raise LogonKeyError(
                f"{path} is not the group's logon key (its fingerprint {mine}, the group's {recorded}): with it this "
                "member would find no user's sealed token; put the group's key back from a copy or a running "
                "member (docs/security.md, \"Logon tokens\")")
        _keys[path] = key
    return key


def restore_key_file(log_root: str | os.PathLike[str]) -> bool:
    """Write the key file back when it is gone and this process holds the group's key (a member's housekeeping):
    whether it was written back."""
    path = key_path(log_root)
    key = _keys.get(path)
    if key is None or path.exists() or path.is_symlink():
        return False
    with _lock:
        if path.exists() or path.is_symlink():
            return False
        _create(path, key)
    return True


def _read(path: Path) -> bytes:
    st = path.stat()  # a symbolic link to the key (a secrets mount) is read through
    if not stat.S_ISREG(st.st_mode):
        raise LogonKeyError(f"{path} is not a regular file: the group's logon key must be one ({KEY_BYTES} bytes in "
                            "hex, mode 600)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise LogonKeyError(f"{path} is readable or writable by others (mode {mode:o}): chmod 600 it; whoever read "
                            "it can check guesses at logon tokens against the group's entries (docs/security.md)")
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise LogonKeyError(f"{path} is not a logon key ({KEY_BYTES} bytes in hex)")
    return key


def _create(path: Path, key: bytes | None = None) -> bytes:
    """A new key (or ``key``, written back), linked into place only if no other process made one first (then the
    other one is used)."""
    directory = private_dir(path.parent)
    tmp = directory / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, (key or secrets.token_bytes(KEY_BYTES)).hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # exclusive: FileExistsError when another process made the key first
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return _read(path)


def seal_with(key: bytes, user: str, token: str) -> str:
    """The stored form of ``user``'s ``token`` ("" for no token: there is nothing to keep secret)."""
    if not token:
        return ""
    mac = hmac.new(key, _DOMAIN + user.encode() + b"\0" + token.encode(), hashlib.sha256).hexdigest()
    return PREFIX + mac


def seal(qm: HasConfig, user: str, token: str) -> str:
    """The stored form of ``user``'s ``token`` under the group's key (the group of ``qm``'s log root)."""
    return seal_with(group_key(qm.config.log_root), user, token) if token else ""


def is_sealed(stored: str) -> bool:
    return len(stored) == SEALED_LENGTH and stored.startswith(PREFIX)


def matches(stored: str, token: str, sealed: str) -> bool:
    """Whether a stored token is this logon's (``token`` as given, ``sealed`` its stored form), in constant time. A
    stored token that is not sealed (an entry made before tokens were sealed) is compared with the token itself."""
    if is_sealed(stored):
        return hmac.compare_digest(stored, sealed)
    return hmac.compare_digest(stored.encode(), token.encode())


class _Owned(Protocol):
    sender: str
    token: str
    receiver: str
    receiver_token: str


C = TypeVar("C", bound=_Owned)


def seal_control(qm: HasConfig, c: C) -> C:
    """A control record with its sender's and receiver's tokens in the stored form (an entry made before tokens were
    sealed is sealed when it is replaced)."""
    token = c.token if not c.token or is_sealed(c.token) else seal(qm, c.sender, c.token)
    receiver_token = c.receiver_token if not c.receiver_token or is_sealed(c.receiver_token) else seal(
        qm, c.receiver, c.receiver_token)
    if (token, receiver_token) == (c.token, c.receiver_token):
        return c
    return replace(c, token=token, receiver_token=receiver_token)  # type: ignore[type-var]


__all__ = ["group_key", "key_path", "seal", "seal_with", "is_sealed", "matches", "seal_control", "LogonKeyError",
           "KEY_FILE", "KeyRecord", "fingerprint", "open_group_key", "restore_key_file"]
