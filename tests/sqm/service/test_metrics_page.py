"""A /metrics page is collected at most once per cache period and by one collection at a time: scrapes that come
while one runs wait for it and share its page (each collection reads the CF, several commands per queue)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

from prometheus_client.core import CollectorRegistry, GaugeMetricFamily, Metric

from sqm.service.http import MetricsPage


class SlowCounting:
    """A collector that takes 0.2 s and counts its collections (and how many ran at once)."""

    def __init__(self) -> None:
        self.calls = 0
        self.running = 0
        self.most_at_once = 0
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            self.calls += 1
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(0.2)
        with self.lock:
            self.running -= 1
        g = GaugeMetricFamily("collections", "collections made")
        g.add_metric([], self.calls)
        yield g


def page_of(cache_s: float) -> tuple[MetricsPage, SlowCounting]:
    collector = SlowCounting()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return MetricsPage(registry, cache_s), collector


def test_concurrent_scrapes_share_one_collection_even_without_a_cache() -> None:
    page, collector = page_of(0.0)

    async def scrapes() -> list[bytes]:
        return await asyncio.gather(*(page.get() for _ in range(10)))

    pages = asyncio.run(scrapes())
    assert collector.most_at_once == 1
    assert collector.calls == 1 and len(set(pages)) == 1


def test_a_page_serves_for_its_cache_period_then_is_collected_again() -> None:
    page, collector = page_of(0.5)

    async def scenario() -> None:
        first = await page.get()
        assert await page.get() == first and collector.calls == 1
        await asyncio.sleep(0.6)
        assert await page.get() != first and collector.calls == 2

    asyncio.run(scenario())
