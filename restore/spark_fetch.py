"""Bringing an RDD's elements to the Spark driver in pieces of bounded size (bytes, not records).

`collect()` (and `toLocalIterator()`, one partition per job) fails once one job's results pass
`spark.driver.maxResultSize` (1 GiB by default): a restore plan of 1M messages of 1 KiB is 1.07 GB.
Counting records cannot know that; sizes can. So:

  1. on the executors, each partition's elements are pickled into chunks of at most `chunk_bytes` (an element
     bigger than that is a chunk of its own), and the chunks are kept (MEMORY_AND_DISK);
  2. one small job brings back each partition's chunk sizes (one int per chunk);
  3. the driver fetches whole partitions, several in one job while they fit in `budget` bytes (a fraction of
     maxResultSize), and a partition bigger than that in runs of consecutive chunks, one job per run, and
     unpickles them one chunk at a time.

No job's results pass the budget unless one element alone is bigger than it. A run fetched again after a lost
executor recomputes the same chunks: the caller keeps each partition's output deterministic (its order
included), which the restore engine does by sorting its groups (restore.engine_spark.by_key).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

from pyspark import StorageLevel

DEFAULT_MAX_RESULT = 2**30  # Spark's own default for spark.driver.maxResultSize
BUDGET_CAP = 256 * 2**20  # bytes one fetch may bring at most, however high the limit
CHUNK_CAP = 8 * 2**20  # bytes of one pickled chunk at most


def result_budget(sc: Any) -> int:
    """Bytes one fetch may bring: half of spark.driver.maxResultSize (Spark counts its own framing and each
    task's metrics too, a few KiB), at most BUDGET_CAP; BUDGET_CAP when the limit is off (0)."""
    limit = int(sc._jsc.sc().conf().getSizeAsBytes("spark.driver.maxResultSize", str(DEFAULT_MAX_RESULT)))
    return BUDGET_CAP if limit <= 0 else max(1, min(BUDGET_CAP, limit // 2))


def pickled_chunks(items: Iterable[Any], chunk_bytes: int) -> Iterator[bytes]:
    """items as pickled lists, each at most chunk_bytes (measured by pickling each item once)."""
    batch: list[bytes] = []
    size = 0
    for item in items:
        one = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        if batch and size + len(one) > chunk_bytes:
            yield pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
            batch, size = [], 0
        batch.append(one)
        size += len(one)
    if batch:
        yield pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)


def _chunk_sizes(index: int, chunks: Iterator[bytes]) -> Iterator[tuple[int, list[int]]]:
    yield index, [len(c) for c in chunks]


def runs(sizes: list[int], budget: int) -> Iterator[tuple[int, int]]:
    """[start, end) runs of consecutive chunks whose sizes add up to at most budget (at least one chunk each)."""
    start = 0
    while start < len(sizes):
        end, total = start + 1, sizes[start]
        while end < len(sizes) and total + sizes[end] <= budget:
            total += sizes[end]
            end += 1
        yield start, end
        start = end


def stream(rdd: Any, budget: int | None = None) -> Iterator[Any]:
    """Every element of rdd, partition by partition, fetched in jobs of at most `budget` bytes of results each
    (default: result_budget of the RDD's context). The chunks are unpersisted when the iterator is done."""
    sc = rdd.context
    budget = result_budget(sc) if budget is None else budget
    chunk_bytes = max(1, min(CHUNK_CAP, budget // 2))
    chunks = rdd.mapPartitions(lambda it: pickled_chunks(it, chunk_bytes)).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        for partitions, start, end in fetches(sorted(chunks.mapPartitionsWithIndex(_chunk_sizes).collect()),
                                              budget):
            if end is None:  # whole partitions
                fetched = sc.runJob(chunks, lambda it: it, partitions)
            else:
                fetched = sc.runJob(chunks, lambda it, s=start, e=end: islice(it, s, e), partitions)
            for blob in fetched:
                for one in pickle.loads(blob):
                    yield pickle.loads(one)
            del fetched
    finally:
        chunks.unpersist()


def fetches(sizes: list[tuple[int, list[int]]], budget: int) -> Iterator[tuple[list[int], int, int | None]]:
    """The jobs that bring back partitions of these chunk sizes, each at most budget bytes: (partitions, 0, None)
    for whole partitions, consecutive ones together while they fit (a small plan is one job, as a collect
    was), and (partition, start, end) for the runs of a partition too big for one."""
    batch: list[int] = []
    total = 0
    for index, chunk_sizes in sizes:
        size = sum(chunk_sizes)
        if batch and total + size > budget:
            yield batch, 0, None
            batch, total = [], 0
        if size <= budget:
            batch.append(index)
            total += size
        else:
            for start, end in runs(chunk_sizes, budget):
                yield [index], start, end
    if batch:
        yield batch, 0, None
