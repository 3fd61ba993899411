"""The CF's Lua scripts, found by glob in cfemu/scripts/ (as dramatiq's Redis broker loads its scripts): adding an
operation is adding its file, with no list to keep in step.

Two kinds, told apart by the file name:
  <op>.lua        a CF operation on one structure: loaded after _prelude.lua, which names the KEYS every such
                  script receives (cfemu.keys.script_keys) and the helpers they share (of the helpers, those the
                  script uses: see source);
  admin_<op>.lua  an operation on the admin structure {ADMIN}: standalone, its header names its own KEYS.
Files whose name starts with '_' are not operations (the prelude).
"""

from __future__ import annotations

import re
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


_DEFINITION = re.compile(r"^local\s+(?:function\s+([A-Za-z_]\w*)|([A-Za-z_][\w\s,]*?)\s*(?:=|--|$))")
_NAME = re.compile(r"[A-Za-z_]\w*")


@cache
def _prelude_parts() -> tuple[str, tuple[tuple[frozenset[str], frozenset[str], str], ...]]:
    """The prelude's opening comment, and its top-level definitions in order: for each, the names it defines, the
    names its code mentions, and its text (with the comment lines above it). A definition starts at a line that
    starts with `local` and runs to the next one (the prelude's top level holds nothing else)."""
    lines = _files()[PRELUDE].splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith("local ")]
    if not starts:
        return "".join(lines), ()
    firsts = []
    for n, i in enumerate(starts):  # the comment lines right above a definition belong to it
        while i > (starts[n - 1] if n else 0) and lines[i - 1].startswith("--"):
            i -= 1
        firsts.append(i)
    opening = "".join(lines[:firsts[0]])
    parts = []
    for n, (first, start) in enumerate(zip(firsts, starts, strict=True)):
        end = firsts[n + 1] if n + 1 < len(firsts) else len(lines)
        m = _DEFINITION.match(lines[start])
        if m is None:
            raise ValueError(f"_prelude.lua line {start + 1}: a top-level line that defines no name: {lines[start]!r}")
        defined = frozenset(x.strip() for x in (m.group(1) or m.group(2)).split(",") if x.strip())
        code = "".join(line for line in lines[start:end] if not line.lstrip().startswith("--"))
        parts.append((defined, frozenset(_NAME.findall(code)) - defined, "".join(lines[first:end])))
    return opening, tuple(parts)


def prelude_for(body: str) -> str:
    """The part of the prelude a script needs: its opening comment and the definitions the script's text mentions,
    with every definition they mention in turn, in the prelude's order. Each call of a script runs the whole
    prelude again (Redis keeps no state between calls), and a definition that the script cannot reach still costs
    its closure at every call. Names are read from the code, not from whole-line comments; a name in a string or in
    a comment after code is taken too: more than needed, never less."""
    opening, parts = _prelude_parts()
    wanted = set(_NAME.findall("".join(line for line in body.splitlines(keepends=True)
                                       if not line.lstrip().startswith("--"))))
    keep = [False] * len(parts)
    changed = True
    while changed:
        changed = False
        for i, (defined, mentions, _) in enumerate(parts):
            if not keep[i] and defined & wanted:
                keep[i] = True
                wanted |= mentions
                changed = True
    return opening + "".join(text for i, (_, _, text) in enumerate(parts) if keep[i])


@cache
def source(name: str) -> str:
    """The full source of one script: a structure operation comes after the shared prelude, of which it gets the
    definitions it uses (prelude_for; Redis Lua has no include); an admin operation stands alone. Made once per
    process (every CF object registers its scripts: cutting the prelude each time had cost a member's start, and
    each command's, a millisecond a script)."""
    files = _files()
    if name not in files or name.startswith("_"):
        raise KeyError(f"no CF script {name!r} in cfemu/scripts/")
    if name.startswith(ADMIN_PREFIX):
        return files[name]
    return prelude_for(files[name]) + "\n" + files[name]


def register(client: redis.Redis, names: list[str]) -> dict[str, Script]:
    """The named scripts registered on a client (EVALSHA, loaded on first use), by name."""
    return {n: client.register_script(source(n)) for n in names}
