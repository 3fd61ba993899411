"""Placeholder for the `cfemu` verbs of issue 14 (being built): refuses with a clear message until it lands."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    print(f"cfemu {' '.join(argv[:1])}: not built yet (issue 14)", file=sys.stderr)
    return 2
