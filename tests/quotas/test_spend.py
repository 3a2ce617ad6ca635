"""Reading a tenant's spend (for the router's budget thresholds), on both backends and through failover."""

from __future__ import annotations

import time
from decimal import Decimal

from quotas.backends.base import QuotaBackend
from quotas.backends.failover import FailoverBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend
from quotas.limits import ReservationRequest, ScopeLimits
from quotas.plans import Limits, Plan
from quotas.reservations import QuotaService


async def test_spend_counts_reservations_and_settlements_per_scope(backend: QuotaBackend) -> None:
    now = time.time()  # Redis keys its day and month by the request's date
    scopes = (ScopeLimits("t", budget_day_pico=1000), ScopeLimits("k:1", budget_day_pico=1000))
    req = ReservationRequest("r1", "acme", scopes, 10, 300, now=now)
    assert (await backend.reserve(req)).admitted
    assert await backend.spent("acme", ["t", "k:1", "k:2"], now) == {"t": (300, 300), "k:1": (300, 300),
                                                                      "k:2": (0, 0)}
    await backend.settle(req, tokens=5, money_pico=120)
    assert (await backend.spent("acme", ["t"], now))["t"] == (120, 120)
    assert (await backend.spent("other", ["t"], now))["t"] == (0, 0)


async def test_budget_left_is_the_smallest_share_over_periods_and_scopes() -> None:
    memory = MemoryBackend()
    quotas = QuotaService(memory)
    plan = Plan(allowed_tiers=["mid"], default_tier="mid",
                limits=Limits(budget_day_usd=Decimal("1"), budget_month_usd=Decimal("10")))
    now = time.time()
    assert await quotas.budget_left(tenant="acme", plan=plan, key_id="k", key_limits=None, now=now) == 1.0
    key_limits = Limits(budget_day_usd=Decimal("0.5"))  # the key's own budget, the tighter one
    _, adm = await quotas.reserve(request_id="r", tenant="acme", plan=plan, key_id="k", key_limits=key_limits,
                                  tokens=1, price=Decimal("0.25"))
    assert adm is not None
    assert await quotas.budget_left(tenant="acme", plan=plan, key_id="k", key_limits=None, now=now) == 0.75
    assert await quotas.budget_left(tenant="acme", plan=plan, key_id="k", key_limits=key_limits, now=now) == 0.5
    unlimited = Plan(allowed_tiers=["mid"], default_tier="mid")
    assert await quotas.budget_left(tenant="acme", plan=unlimited, key_id="k", key_limits=None, now=now) is None


async def test_failover_reads_local_spend_while_the_primary_is_down(redis_url: str) -> None:
    redis = RedisBackend(redis_url, timeout_s=0.5)
    backend = FailoverBackend(redis)
    now = time.time()
    try:
        assert await backend.spent("acme", ["t"], now) == {"t": (0, 0)}
        backend.up = False
        await backend.local.reserve(ReservationRequest("r", "acme", (ScopeLimits("t"),), 1, 50, now=now))
        assert await backend.spent("acme", ["t"], now) == {"t": (50, 50)}
    finally:
        await redis.close()
