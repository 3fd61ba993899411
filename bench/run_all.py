"""Run every benchmark script (bench/bench_*.py), one after the other, and summarise.

    .venv/bin/python bench/run_all.py [--quick] [--only NAME ...]

Each script prints its own tables (shown as they come) and appends its result as a JSON line to
bench/results/<name>.jsonl; BENCHMARKS.md is the written record. --quick passes --quick to every script (a short
run, for a smoke test). The exit code is non-zero when any script failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

BENCH_DIR = Path(__file__).resolve().parent
# Options a script always gets from run_all (its comparisons that are part of the record).
EXTRA_ARGS = {"bench_lifecycle.py": ["--duplex"]}  # simplex against a duplexed CF


def bench_scripts(only: list[str] | None) -> list[Path]:
    scripts = sorted(BENCH_DIR.glob("bench_*.py"))
    if only:
        wanted = {n.removeprefix("bench_").removesuffix(".py") for n in only}
        unknown = wanted - {s.stem.removeprefix("bench_") for s in scripts}
        if unknown:
            raise SystemExit(f"run_all: no benchmark named {', '.join(sorted(unknown))} in {BENCH_DIR}")
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in wanted]
    return scripts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (a short run)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these benchmarks (e.g. lifecycle)")
    args = ap.parse_args(argv)
    console = Console()
    outcomes: list[tuple[str, int, float]] = []
    for script in bench_scripts(args.only):
        console.rule(script.name)
        t0 = time.monotonic()
        # Output goes straight to our stdout, so long runs show their progress as they go.
        rc = subprocess.run([sys.executable, str(script), *(["--quick"] if args.quick else []),
                             *EXTRA_ARGS.get(script.name, [])],
                            cwd=BENCH_DIR.parent).returncode
        outcomes.append((script.name, rc, time.monotonic() - t0))
    table = Table("benchmark", "result", "seconds", title="benchmarks" + (" (quick)" if args.quick else ""))
    for name, rc, seconds in outcomes:
        table.add_row(name, "ok" if rc == 0 else f"FAILED (exit {rc})", f"{seconds:.1f}")
    console.print(table)
    console.print(f"results: {BENCH_DIR / 'results'}/*.jsonl")
    return 0 if all(rc == 0 for _, rc, _ in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
