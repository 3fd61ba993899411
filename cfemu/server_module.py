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

__all__ = ["COMMANDS", "ENV_MODULE", "TO_SCRIPT", "loaded_ops", "path"]

# The operations the module runs, by script name, and their commands.
COMMANDS = {"put": "CF.PUT", "get": "CF.GET", "commit": "CF.COMMIT"}

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
    """The operations whose command the server behind `client` has (op -> command): one COMMAND INFO, read
    unparsed (redis-py's parser of its reply fails on the null it gives for a command the server lacks)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_command("COMMAND", "INFO", *COMMANDS.values())
        info: Any = conn.read_response()
    except redis.exceptions.ResponseError:  # a server or user that may not ask: the scripts
        return {}
    finally:
        pool.release(conn)
    return {op: cmd for (op, cmd), found in zip(COMMANDS.items(), info or []) if found}
