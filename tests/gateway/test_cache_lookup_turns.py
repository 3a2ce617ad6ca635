"""One tenant's flood of costly cache lookups waits on itself, not every tenant's lookups behind it.

A lookup's blocking steps (the store's reads, the faiss search, up to two meaning-check passes of tens of
milliseconds each) ran on asyncio's default executor, first come first served, and the check's passes took a
plain semaphore: a tenant with dozens of near-miss lookups in flight (a plan with `cache.meaning_check`) queued
another tenant's exact hit behind all of them. The gateway now gives the cache FairThreads (tenants in turn), and
the check's slots go to the waiting tenant holding the fewest (cache/fair_slots.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from cache import Embedder, SemanticCache, SQLiteStore
from cache.meaning_check import MeaningCheck
from cache.results import Hit, TenantPolicy
from gateway.app import LOOKUP_THREADS
from gateway.fair_threads import FairThreads
from tests.cache.conftest import chat, scope
from tests.conftest import Gateway

PASS_S = 0.05  # a meaning-check pass, as long as a short pair's on one core
FLOOD = 40
CHECKED = TenantPolicy(meaning_check=True, similarity_threshold=0.5)
STORED = "how should i water a tomato plant"
VARIANTS = [f"{STORED} {a} {b}" for a, b in itertools.product(
    ("please", "kindly", "simply", "honestly", "truly"), ("today", "now", "again", "here", "there", "tonight",
                                                         "outside", "soon"))]


class SlowCheck(MeaningCheck):
    """The real check's slots and turns around a pass that only takes time (and accepts)."""

    def load(self) -> MeaningCheck:
        return self

    def _pass(self, cached: str, new: str) -> float:
        time.sleep(PASS_S)
        return 10.0


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    e = Embedder()
    e.encode_one("warm up")
    return e


async def flood_then_victim(cache: SemanticCache) -> tuple[int, int]:
    """FLOOD near-miss lookups of tenant flood (one pass each), then acme's exact hit and acme's checked near miss
    once the flood holds the threads; how many flood lookups ended before each of acme's."""
    cache.store(scope(chat(STORED), tenant="flood"), chat(STORED), "deeply, twice a week")
    cache.store(scope(chat(STORED)), chat(STORED), "deeply, twice a week")
    cache.store(scope(chat("what is the capital of peru")), chat("what is the capital of peru"), "Lima")
    cache.recent.clear()  # acme's exact hit is read from the store, in a worker thread, as on another replica's
    done: list[str] = []

    async def one(tenant: str, text: str, policy: TenantPolicy, name: str) -> object:
        found = await cache.alookup(scope(chat(text), tenant=tenant), chat(text), policy=policy)
        done.append(name)
        return found

    flood = [asyncio.create_task(one("flood", v, CHECKED, "flood")) for v in VARIANTS[:FLOOD]]
    while cache.meaning._slots.held("flood") < cache.meaning._slots.n:
        await asyncio.sleep(0.005)
    exact = asyncio.create_task(one("acme", "what is the capital of peru", TenantPolicy(), "acme exact"))
    near = asyncio.create_task(one("acme", VARIANTS[-1], CHECKED, "acme near"))
    results = await asyncio.gather(exact, near, *flood)
    # acme's are served; some of the flood's may be refused as busy (each waits on the flood ahead of it)
    assert isinstance(results[0], Hit) and isinstance(results[1], Hit), results[:2]
    assert sum(isinstance(r, Hit) for r in results[2:]) >= FLOOD // 2
    return done.index("acme exact"), done.index("acme near") - 1


async def test_another_tenants_lookups_wait_for_the_running_passes_not_for_the_flood(embedder: Embedder) -> None:
    cache = SemanticCache(SQLiteStore(":memory:", max_entries=1000), embedder, meaning=SlowCheck(),
                          threads=FairThreads(LOOKUP_THREADS, "test-lookup"))
    try:
        before_exact, before_near = await flood_then_victim(cache)
    finally:
        cache.close()
    # the exact hit waits for a thread to free (one of the flood's lookups running), the near miss for that, its
    # embedding, a thread again and the passes running: some of the flood's lookups end first, a number that does
    # not grow with the flood. Before (asyncio's executor, a plain semaphore): 22 and all 40 of them.
    assert before_exact <= LOOKUP_THREADS + 2 and before_near <= FLOOD // 2, (before_exact, before_near)


def test_the_gateways_cache_runs_its_lookups_on_fair_threads(gateway: Gateway) -> None:
    cache = gateway.app.state.services.cache.cache
    assert isinstance(cache._owner_threads, FairThreads) and cache._owner_threads.threads == LOOKUP_THREADS
