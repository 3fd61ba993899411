"""The CF's Lua scripts, found by glob in cfemu/scripts/ (as dramatiq's Redis broker loads its scripts): adding an
operation is adding its file, with no list to keep in step.

Two kinds, told apart by the file name:
  <op>.lua        a CF operation on one structure: loaded after _prelude.lua, which names the KEYS every such
                  script receives (cfemu.keys.script_keys) and the helpers they share;
  admin_<op>.lua  an operation on the admin structure {ADMIN}: standalone, its header names its own KEYS.
Files whose name starts with '_' are not operations (the prelude).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import redis
from redis.commands.core import Script

PRELUDE = "_prelude"
ADMIN_PREFIX = "admin_"


@cache
def _files() -> dict[str, str]:
    """Every script's text by name (the file name without .lua), read once per process."""
    folder = resources.files("cfemu") / "scripts"
    return {f.name[:-len(".lua")]: f.read_text() for f in folder.iterdir() if f.name.endswith(".lua")}


def operations() -> list[str]:
    """The names of every operation, structure and admin ones, sorted."""
    return sorted(n for n in _files() if not n.startswith("_"))


def structure_operations() -> list[str]:
    return [n for n in operations() if not n.startswith(ADMIN_PREFIX)]


def admin_operations() -> list[str]:
    return [n for n in operations() if n.startswith(ADMIN_PREFIX)]


def source(name: str) -> str:
    """The full source of one script: a structure operation comes after the shared prelude (Redis Lua has no
    include); an admin operation stands alone."""
    files = _files()
    if name not in files or name.startswith("_"):
        raise KeyError(f"no CF script {name!r} in cfemu/scripts/")
    if name.startswith(ADMIN_PREFIX):
        return files[name]
    return files[PRELUDE] + "\n" + files[name]


def register(client: redis.Redis, names: list[str]) -> dict[str, Script]:
    """The named scripts registered on a client (EVALSHA, loaded on first use), by name."""
    return {n: client.register_script(source(n)) for n in names}
