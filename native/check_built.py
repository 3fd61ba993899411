"""Which of the package's native parts the build compiled: run by `make venv` after the install.

Every extension in pyproject.toml's ext-modules is optional (the package falls back to its Python path, or the CF to
its Lua scripts, at more CPU), so pip finishes without a word when one fails to compile; this check says so instead,
one line a missing part, and where NATIVE_REQUIRED=1 (CI, which has the compilers) exits 1 on any: a C change that
breaks the build fails the run rather than quietly making everything slower.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def declared(pyproject: Path) -> list[str]:
    """The dotted names of the extensions pyproject.toml declares."""
    return [ext["name"] for ext in _extensions(pyproject)]


def _extensions(pyproject: Path) -> list[dict]:  # type: ignore[type-arg]
    config = tomllib.loads(pyproject.read_text())
    return list(config["tool"]["setuptools"].get("ext-modules", []))


def built_file(root: Path, name: str) -> Path | None:
    """The compiled file of extension `name` in the source tree (an editable install builds in place), or None."""
    *package, leaf = name.split(".")
    folder = root.joinpath(*package)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = folder / (leaf + suffix)
        if candidate.is_file():
            return candidate
    return None


def missing(root: Path) -> list[str]:
    """The declared extensions with no compiled file, or one older than a file it is compiled from: a build that
    failed leaves the last one that worked in place, which is not the source's."""
    absent = []
    for ext in _extensions(root / "pyproject.toml"):
        built = built_file(root, ext["name"])
        inputs = [root / f for f in (*ext.get("sources", []), *ext.get("depends", []))]
        if built is None or any(f.is_file() and f.stat().st_mtime > built.stat().st_mtime for f in inputs):
            absent.append(ext["name"])
    return absent


def main(root: Path = ROOT) -> int:
    names = declared(root / "pyproject.toml")
    absent = missing(root)
    for name in absent:
        print(f"native part not built from its source: {name} (the package runs without it, or an older build of it; "
              f"`{sys.executable} -m pip install -e .` shows the compiler's error)", file=sys.stderr)
    if not absent:
        print(f"native parts built: {len(names)} of {len(names)}")
    required = os.environ.get("NATIVE_REQUIRED", "0") == "1"
    return 1 if absent and required else 0


if __name__ == "__main__":
    sys.exit(main())
