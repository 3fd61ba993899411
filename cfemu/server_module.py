"""The CF's server module: CF operations compiled in C (cfemu/_cfmodule.c) that the CF's server runs instead of
their Lua scripts, each with the script's KEYS and ARGV and the script's replies (the script stays the
specification: tests/cfemu/test_module_differential.py holds the module to it).

The package's build compiles it where it can (setup.py fetches the module API's header); the embedded server
loads it (cfemu.embedded, --loadmodule), and a CF object calls an operation's command when the server it talks to
has that command (loaded_ops), else the script. A server that cannot load the module (none built, another server
build, a CF run elsewhere) runs the scripts: the same operations, at more CPU per call (BENCHMARKS.md, "the CF's
server module").
"""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path
from typing import Any

import redis

__all__ = ["COMMANDS", "ENV_MODULE", "LOAD", "TO_SCRIPT", "loaded_ops", "loads", "path"]

# The operations the module runs, by script name, and their commands.
COMMANDS = {"put": "CF.PUT", "get": "CF.GET", "commit": "CF.COMMIT"}

# A restore's load batch (cfemu/scripts/load.lua, cfemu.bulk.Owner.load): not an operation of a CF object, and it
# takes its script's KEYS and ARGV alone (the module runs every case itself).
LOAD = "CF.LOAD"

# A module command takes its script's sha first, then the script's KEYS and ARGV: a call it leaves to the script (the
# rarer cases of an operation: cfemu/_cfmodule.c) it runs with that script itself, in the call's place among the
# caller's, so that a pipeline's calls apply in the order sent. The error it replies, having done nothing, where the
# server will not run the script for it: the CF then runs the script for that call.
TO_SCRIPT = "CFSCRIPT"

# "0": the embedded server does not load the module (the CF runs its scripts).
ENV_MODULE = "CFEMU_CF_MODULE"

_NAME = "_cfmodule"


def path() -> Path | None:
    """The built module (a shared object beside this file), or None where the build made none or $CFEMU_CF_MODULE
    is 0."""
    if os.environ.get(ENV_MODULE, "1") == "0":
        return None
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / (_NAME + suffix)
        if candidate.is_file():
            return candidate
    return None


def loaded_ops(client: redis.Redis) -> dict[str, str]:
    """The operations whose command the server behind `client` has (op -> command)."""
    found = _has(client, list(COMMANDS.values()))
    return {op: cmd for (op, cmd), there in zip(COMMANDS.items(), found, strict=True) if there}


def loads(client: redis.Redis) -> bool:
    """Whether the server behind `client` has LOAD, the command of a restore's load batch."""
    return _has(client, [LOAD])[0]


def _has(client: redis.Redis, commands: list[str]) -> list[bool]:
    """Whether the server behind `client` has each of `commands`: one COMMAND INFO, read unparsed (redis-py's
    parser of its reply fails on the null it gives for a command the server lacks). A server or user that may not
    ask: none."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_command("COMMAND", "INFO", *commands)
        info: Any = conn.read_response()
    except redis.exceptions.ResponseError:
        return [False] * len(commands)
    finally:
        pool.release(conn)
    return [bool(found) for found in (info or [None] * len(commands))]
