"""In-memory exact hits (cache/recent.py) per tenant: one tenant's flood pushes out its own entries, not another's."""

from __future__ import annotations

import pytest

from cache.recent import RecentEntries
from cache.store import Entry


def _entry(tenant: str, n: int, entry_id: str | None = None) -> Entry:
    return Entry(entry_id=entry_id or f"{tenant}-{n}", scope_id=f"s-{tenant}", tenant=tenant, data_version="1",
                 model_version="m1", exact_key=f"k{n}", partition="p", semantic_text="q", response="a")


def test_a_flood_of_one_tenants_answers_evicts_its_own_not_another_tenants() -> None:
    recent = RecentEntries()  # the cache's defaults
    mine = [_entry("acme", n) for n in range(10)]
    for e in mine:
        recent.put(e)
    for n in range(recent.limit):
        recent.put(_entry("flood", n))
    assert all(recent.get("s-acme", f"k{n}", now=0.0) is e for n, e in enumerate(mine))
    assert len(recent) == recent.per_tenant + len(mine)
    assert recent.get("s-flood", f"k{recent.limit - 1}", now=0.0) is not None  # its newest kept
    assert recent.get("s-flood", "k0", now=0.0) is None  # its oldest gone


def test_each_tenants_least_recently_used_goes_first_and_the_process_bound_holds() -> None:
    recent = RecentEntries(limit=5, per_tenant=3)
    for n in range(3):
        recent.put(_entry("a", n))
    assert recent.get("s-a", "k0", now=0.0) is not None  # a's k1 is now its least recently used
    recent.put(_entry("a", 3))
    assert recent.get("s-a", "k1", now=0.0) is None and recent.get("s-a", "k0", now=0.0) is not None
    again = _entry("a", 3, entry_id="a-3-again")  # the same key answered again takes its place, not a slot
    recent.put(again)
    assert recent.get("s-a", "k3", now=0.0) is again and len(recent) == 3
    for n in range(3):
        recent.put(_entry(f"t{n}", 0))
    assert len(recent) == 5  # the oldest overall went, whoever's
    recent.drop_ids(["a-3-again"])
    recent.drop_where(lambda e: e.tenant == "t2")
    recent.put(_entry("a", 9))
    assert recent.get("s-a", "k9", now=0.0) is not None
    recent.clear()
    assert len(recent) == 0
    recent.put(_entry("a", 0))
    assert recent.get("s-a", "k0", now=0.0) is not None


def test_the_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        RecentEntries(per_tenant=0)


def _long(tenant: str, n: int, size: int) -> Entry:
    entry = _entry(tenant, n)
    entry.response = "x" * size
    return entry


def test_one_tenants_long_answers_are_bounded_in_bytes_and_evict_only_its_own() -> None:
    recent = RecentEntries()  # the cache's defaults
    mine = _entry("acme", 0)
    recent.put(mine)
    for n in range(200):  # 200 answers of 1 MB: under the count bound, 200 MB held before
        recent.put(_long("flood", n, 1 << 20))
    assert len(recent) <= 1 + 16  # the flood's newest 15 (16 MiB a tenant), and acme's one
    assert recent.num_bytes <= recent.per_tenant_bytes + 4096
    assert recent.get("s-acme", "k0", now=0.0) is mine
    assert recent.get("s-flood", "k199", now=0.0) is not None and recent.get("s-flood", "k0", now=0.0) is None
    recent.put(_long("flood", 500, recent.per_tenant_bytes + 1))  # larger than a tenant's share: not kept here
    assert recent.get("s-flood", "k500", now=0.0) is None and recent.get("s-flood", "k199", now=0.0) is not None
    recent.drop_where(lambda e: e.tenant == "flood")
    assert len(recent) == 1 and 0 < recent.num_bytes < 4096
