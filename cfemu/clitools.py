"""What every command line of the project shares: the console and the one-line error convention."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

from rich.console import Console


def console() -> Console:
    """A rich console; plain (no colour, wide) when the output is not a terminal."""
    c = Console()
    return c if c.is_terminal else Console(width=200, no_color=True)


def run_command(prog: str, args: argparse.Namespace, func: Callable[[argparse.Namespace, Console], int],
                expected: tuple[type[BaseException], ...]) -> int:
    """Run a verb: an expected error is one line on stderr and exit status 2 (--verbose adds the traceback)."""
    try:
        return int(func(args, console()))
    except expected as e:
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
