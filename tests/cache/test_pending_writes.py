"""Answers remembered but not yet written (cache/pending.py): one tenant's flood leaves room for everyone else's."""

from __future__ import annotations

import pytest

from cache import Embedder, Hit, SemanticCache, SQLiteStore
from cache.pending import PendingWrites
from cache.store import Entry
from tests.cache.conftest import FakeClock, chat, scope


def _entry(tenant: str, n: int, entry_id: str | None = None) -> Entry:
    return Entry(entry_id=entry_id or f"{tenant}-{n}", scope_id=f"s-{tenant}", tenant=tenant, data_version="1",
                 model_version="m1", exact_key=f"k{n}", partition="p", semantic_text="q", response="a")


async def test_one_tenants_flood_of_pending_answers_leaves_another_its_own_repeat(
        embedder: Embedder, clock: FakeClock) -> None:
    cache = SemanticCache(SQLiteStore(":memory:", max_entries=1000), embedder, clock=clock)
    try:
        # a tenant's answers in flight (each pending while it is embedded and queued for the writer), as many as
        # the whole process keeps: remembered only, nothing written yet
        for i in range(cache.pending.limit):
            body = chat(f"flood question {i}")
            cache.remember(scope(body, tenant="flood"), body, f"answer {i}")
        body = chat("How many kilometres are there in 5 miles?")
        mine = cache.remember(scope(body), body, "8.05 km")
        assert mine is not None
        repeat = await cache.alookup(scope(body), body)  # before it is written: served from memory
        assert isinstance(repeat, Hit) and repeat.response == "8.05 km", repeat
        assert cache.pending.pending_of("flood") == cache.pending.per_tenant < cache.pending.limit
    finally:
        cache.close()


def test_pending_entries_are_counted_per_tenant_as_they_come_and_go() -> None:
    pending = PendingWrites(limit=5, per_tenant=2)
    a0, a1, a2 = _entry("a", 0), _entry("a", 1), _entry("a", 2)
    for e in (a0, a1, a2):
        pending.add(e)
    assert pending.get("s-a", "k2") is None and pending.pending_of("a") == 2  # a's third waits for the store
    again = _entry("a", 1, entry_id="a-1-again")  # the same request answered again takes its place, not a slot
    pending.add(again)
    assert pending.get("s-a", "k1") is again and pending.pending_of("a") == 2
    pending.forget(a1)  # the older answer's write ending does not forget the newer one
    assert pending.get("s-a", "k1") is again and pending.pending_of("a") == 2
    pending.forget(a0)
    pending.add(a2)
    assert pending.get("s-a", "k2") is a2 and pending.pending_of("a") == 2
    for n in range(3):
        pending.add(_entry(f"t{n}", 0))
    assert len(pending) == 5
    pending.add(_entry("late", 0))  # the whole process's bound still holds
    assert pending.get("s-late", "k0") is None and pending.pending_of("late") == 0
    pending.cancel_where(lambda e: e.tenant == "a")
    assert pending.pending_of("a") == 0 and pending.cancelled(again) and len(pending) == 3
    pending.add(_entry("late", 0))
    assert pending.pending_of("late") == 1


def test_the_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PendingWrites(limit=10, per_tenant=0)


def test_one_tenants_long_pending_answers_are_bounded_in_bytes() -> None:
    pending = PendingWrites()  # the cache's defaults
    for n in range(200):  # 200 answers of 1 MB in flight: under the count bound, 200 MB held before
        entry = _entry("flood", n)
        entry.response = "x" * (1 << 20)
        pending.add(entry)
    assert pending.pending_of("flood") <= 16  # its first 15 (16 MiB a tenant)
    assert pending.num_bytes <= pending.per_tenant_bytes
    assert pending.get("s-flood", "k0") is not None and pending.get("s-flood", "k199") is None
    mine = _entry("acme", 0)
    pending.add(mine)
    assert pending.get("s-acme", "k0") is mine
    pending.cancel_where(lambda e: e.tenant == "flood")
    assert len(pending) == 1 and 0 < pending.num_bytes < 4096
