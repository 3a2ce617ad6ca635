"""Tenants whose names are neighbours (a prefix of another, a separator away, or a word the shared stores use in
their own key names) never share a Redis key, on a real redis-server: the quota counters (`{tg:<tenant>}:...`), the
cache's per-tenant sets (`tg:cache:t:<tenant>`, `l:<tenant>`), and the Idempotency-Key records
(`tg:idem:<tenant>:<key>`). Each format relies on NAME_RE: a tenant name holds no ':' (the separator), no '{' or
'}' (the quota keys' hash tag), no glob character and no control, so the tenant is what comes before the first
separator. A purge by tenant reads the tenant's own set, never a pattern, so 'a' never reaches 'ab'."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import redis

from cache import Entry, RedisStore
from gateway.tenants.rules import NAME_RE
from quotas.backends.redis import RedisBackend
from quotas.idempotency import Claim, Replay
from quotas.idempotency_redis import RedisIdempotency
from quotas.limits import ReservationRequest, ScopeLimits

# a prefix of another, separated by each character NAME_RE allows, and the stores' own words
NEIGHBOURS = ["a", "ab", "a.b", "a-b", "a_b", "a.", "a-", "tenants", "replicas", "cache", "idem", "idem-live", "t",
              "res", "leases"]
KEY_ID = "0123456789ab"


@pytest.mark.parametrize("name", ["a:b", "a{b}", "{a}", "a*", "a?", "a[b]", "a|b", "a\nb", "a\n", "a\x1fb", "a,b",
                                  "a b", "a/b", "A", "-a", ".a", "", "a" * 65])
def test_a_tenant_name_holds_nothing_a_shared_key_reads_as_structure(name: str) -> None:
    assert NAME_RE.fullmatch(name) is None
    assert all(NAME_RE.fullmatch(n) for n in NEIGHBOURS)


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[RedisBackend]:
    b = RedisBackend(redis_url, timeout_s=1.0)
    yield b
    await b.close()


async def test_quota_counters_of_neighbouring_tenants_are_apart(backend: RedisBackend, redis_url: str) -> None:
    """One concurrency slot and a budget each: had two tenants one counter, the second would be refused, and one
    tenant's spend would show in another's."""
    limits = (ScopeLimits("t", max_concurrent=1, budget_day_pico=1000), ScopeLimits(f"k:{KEY_ID}", max_concurrent=1))
    now = time.time()
    for i, tenant in enumerate(NEIGHBOURS):
        decision = await backend.reserve(ReservationRequest(f"r{i}", tenant, limits, 10, 100 + i, now=now))
        assert decision.admitted, (tenant, decision)
    for i, tenant in enumerate(NEIGHBOURS):
        spent = await backend.spent(tenant, ["t", f"k:{KEY_ID}"], now)
        assert spent is not None and spent["t"][0] == spent[f"k:{KEY_ID}"][0] == 100 + i, (tenant, spent)
    keys = [k.decode() for k in redis.Redis.from_url(redis_url).keys("*")]
    for key in keys:
        if key.startswith("{"):  # a tenant's: its hash tag names exactly one tenant
            assert key[len("{tg:"):key.index("}")] in NEIGHBOURS, key
        else:
            assert key in ("tg:tenants", "tg:replicas"), key
    for tenant in NEIGHBOURS:
        assert any(k.startswith(f"{{tg:{tenant}}}:") for k in keys), tenant


@pytest.fixture
def cache_store(redis_url: str) -> Iterator[RedisStore]:
    store = RedisStore(redis_url, max_entries=1000, max_entries_per_tenant=2)
    yield store
    store.close()


def _entry(tenant: str, i: int, version: str = "1") -> Entry:
    return Entry(entry_id=f"{tenant}/{i}", scope_id="s" + tenant, tenant=tenant, data_version=version,
                 model_version="m", exact_key=f"k{i}", partition="p", semantic_text="q", response="r",
                 usage={}, created_at=1.0, expires_at=None, last_used=float(i), embedding=np.ones(4, np.float32))


def test_cache_purges_and_bounds_of_neighbouring_tenants_are_apart(cache_store: RedisStore) -> None:
    for tenant in NEIGHBOURS:
        for i in range(2):
            assert cache_store.put(_entry(tenant, i)) == []  # at the bound of 2 each: nobody else's counts
    for tenant in NEIGHBOURS:
        assert cache_store.ids_of_tenant(tenant) == [f"{tenant}/0", f"{tenant}/1"]
    # 'a' is at a new data version: its old entries go, and only its
    assert sorted(cache_store.drop_data_versions("a", "2", created_before=time.time())) == ["a/0", "a/1"]
    # and a third entry of 'ab' evicts its own oldest, not a neighbour's
    assert cache_store.put(_entry("ab", 2)) == ["ab/0"]
    assert len(cache_store) == 2 * len(NEIGHBOURS) - 2
    assert all(len(cache_store.ids_of_tenant(t)) == 2 for t in NEIGHBOURS if t != "a")


async def test_idempotency_records_of_neighbouring_tenants_are_apart(redis_url: str) -> None:
    """The same Idempotency-Key (with the separator in it, too) is each tenant's own: every first use is a claim,
    and an answer replays for its tenant only."""
    store = RedisIdempotency(redis_url)
    try:
        keys = ["k", "b:k", ":", "*"]
        for tenant in NEIGHBOURS:
            for key in keys:
                assert isinstance(await store.begin(tenant, key, "body", f"{tenant}|{key}", lease_s=60), Claim)
        await store.finish(Claim("a", "b:k", "body", "a|b:k"), {"answer": "a's"}, 3600)
        assert await store.begin("a", "b:k", "body", "again", lease_s=60) == Replay({"answer": "a's"})
        for tenant in NEIGHBOURS[1:]:
            assert not isinstance(await store.begin(tenant, "b:k", "body", "again", lease_s=60), Replay), tenant
    finally:
        await store.close()
