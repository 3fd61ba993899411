"""The digest of a backup's entry files, as its manifest names it (docs/backup-format.md, "The signature").

The signed manifest holds each entry file's digest, which is how the signature covers the entry files: the digest
must resist collisions as the MAC does. A manifest's format says which digest its files carry, in a field of that
name on each file's record: BLAKE3-256 in format 3 (what backups are written in: about a fifth of SHA-256's CPU
a byte here, where hashing was the larger part of what a backup spends beyond a raw read), SHA-256 in formats 2
and 1 (backups taken before, still read). A record with another digest than its format's is refused before any
file is read.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any, Protocol

import blake3


class Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...

    def hexdigest(self) -> str: ...


WRITTEN_FORMAT = 3  # the signed manifest's format a backup is written in
_DIGEST_OF_FORMAT = {1: "sha256", 2: "sha256", WRITTEN_FORMAT: "blake3"}
_NEW: dict[str, Callable[[], Hasher]] = {"sha256": hashlib.sha256, "blake3": blake3.blake3}
_HEX = re.compile(r"[0-9a-f]{64}")  # both are 256-bit digests, written in lowercase hex
WRITTEN = _DIGEST_OF_FORMAT[WRITTEN_FORMAT]
_SIGNED_FORMAT = {"sha256": 2, "blake3": WRITTEN_FORMAT}  # a signed manifest's format, by its files' digest


def digest_of_format(fmt: Any) -> str | None:
    """The digest a manifest of format `fmt` carries for its files; None for a format that is not read."""
    return _DIGEST_OF_FORMAT.get(fmt) if type(fmt) is int else None


def signed_format(files: list[dict[str, Any]]) -> int:
    """The format of a signed manifest of these entry files' records: the one whose digest they carry (a backup
    signed again keeps its files' digest)."""
    return _SIGNED_FORMAT[file_digest(files[0])[0]] if files else WRITTEN_FORMAT


def new_hasher(name: str = WRITTEN) -> Hasher:
    """A fresh hasher of digest `name` (as digest_of_format or file_digest gives it)."""
    return _NEW[name]()


class Gathered:
    """A hasher fed in pieces of at least GATHER_BYTES: a reader that hashes a file frame by frame hands it pieces
    of a few hundred bytes, and BLAKE3's binding costs about ten times more a byte at that size (no SIMD across
    chunks, a call's own cost) than over a few hundred KiB."""

    GATHER_BYTES = 256 * 1024

    def __init__(self, name: str) -> None:
        self._hasher = new_hasher(name)
        self._pending = bytearray()

    def update(self, data: Any, /) -> None:
        self._pending += data
        if len(self._pending) >= self.GATHER_BYTES:
            self._hasher.update(self._pending)
            self._pending.clear()

    def hexdigest(self) -> str:
        if self._pending:
            self._hasher.update(self._pending)
            self._pending.clear()
        return self._hasher.hexdigest()


def well_formed(value: Any) -> bool:
    """A digest as a file's record holds it: 64 lowercase hex digits."""
    return isinstance(value, str) and _HEX.fullmatch(value) is not None


def file_digest(info: dict[str, Any]) -> tuple[str, str]:
    """(digest name, expected hex) of an entry file's record: the one digest field it holds. ValueError when it
    holds none or more than one, or one that is not 64 lowercase hex digits."""
    found = [name for name in _NEW if name in info]
    if len(found) != 1 or not well_formed(info[found[0]]):
        raise ValueError(f"entry file record {info.get('name')!r}: not one well-formed digest ({', '.join(_NEW)})")
    return found[0], info[found[0]]
