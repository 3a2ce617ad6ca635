"""Every limit type, reserve and settle, on both backends: memory and a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from quotas.backends.base import QuotaBackend
from quotas.backends.memory import MemoryBackend
from quotas.limits import ReservationRequest, ScopeLimits

_n = iter(range(10**9))


def res(*scopes: ScopeLimits, tokens: int = 10, money: int = 100, tenant: str = "acme",
        now: float = 1_800_000_000.0) -> ReservationRequest:
    return ReservationRequest(f"r{next(_n)}", tenant, scopes, tokens, money, now=now)


async def test_rpm_admits_exactly_the_limit(backend: QuotaBackend) -> None:
    lim = ScopeLimits("t", rpm=5)
    decisions = await asyncio.gather(*(backend.reserve(res(lim)) for _ in range(20)))
    assert sum(d.admitted for d in decisions) == 5
    refused = next(d for d in decisions if not d.admitted)
    assert refused.reason == "rpm" and refused.scope == "t" and 0 < refused.retry_after_s <= 60
    ok = next(d for d in decisions if d.admitted)
    assert ok.usage["t"].requests >= 1
    other = await backend.reserve(res(lim, tenant="globex"))  # tenants never share counters
    assert other.admitted


async def test_tpm_counts_reservations_and_settles_to_real_usage(backend: QuotaBackend) -> None:
    lim = ScopeLimits("t", tpm=100)
    first = res(lim, tokens=60)
    assert (await backend.reserve(first)).admitted
    d = await backend.reserve(res(lim, tokens=60))
    assert not d.admitted and d.reason == "tpm" and d.retry_after_s > 0
    await backend.settle(first, tokens=20, money_pico=0)  # it really used 20 tokens
    assert (await backend.reserve(res(lim, tokens=60))).admitted
    assert not (await backend.reserve(res(lim, tokens=21))).admitted
    assert (await backend.reserve(res(lim, tokens=20))).admitted


async def test_concurrency_slots_are_freed_by_settle(backend: QuotaBackend) -> None:
    lim = ScopeLimits("t", max_concurrent=2)
    a, b = res(lim), res(lim)
    assert (await backend.reserve(a)).admitted and (await backend.reserve(b)).admitted
    d = await backend.reserve(res(lim))
    assert not d.admitted and d.reason == "concurrency"
    await backend.settle(a, tokens=5, money_pico=50)
    assert (await backend.reserve(res(lim))).admitted


async def test_budgets_reserve_then_settle_and_refuse_with_the_period(backend: QuotaBackend) -> None:
    lim = ScopeLimits("t", budget_day_pico=1000, budget_month_pico=1500)
    big = res(lim, money=900)
    assert (await backend.reserve(big)).admitted
    d = await backend.reserve(res(lim, money=200))
    assert not d.admitted and d.reason == "budget_day" and d.retry_after_s > 0
    await backend.settle(big, tokens=10, money_pico=300)  # it cost less than reserved
    assert (await backend.reserve(res(lim, money=600))).admitted  # day: 900 of 1000
    assert not (await backend.reserve(res(lim, money=200))).admitted
    if isinstance(backend, MemoryBackend):  # Redis dates money by its own clock (tests/quotas/test_leases.py)
        nextday = res(lim, money=700, now=1_800_000_000.0 + 86400)  # a new day, same month
        d = await backend.reserve(nextday)
        assert not d.admitted and d.reason == "budget_month"  # month: 900 + 700 > 1500


async def test_a_refusal_in_one_scope_charges_no_scope(backend: QuotaBackend) -> None:
    tenant = ScopeLimits("t", rpm=100, tpm=1000, budget_day_pico=10_000)
    key = ScopeLimits("k:abc", rpm=1)
    assert (await backend.reserve(res(tenant, key))).admitted
    d = await backend.reserve(res(tenant, key))
    assert not d.admitted and d.reason == "rpm" and d.scope == "k:abc"
    # the tenant scope saw exactly one request, 10 tokens, 100 picodollars
    probe = await backend.reserve(res(tenant))
    assert probe.usage["t"].requests == 2 and probe.usage["t"].tokens == 20


async def test_unlimited_scope_never_refuses(backend: QuotaBackend) -> None:
    lim = ScopeLimits("t")
    assert all(d.admitted for d in await asyncio.gather(*(backend.reserve(res(lim)) for _ in range(50))))


async def test_memory_window_slides(monkeypatch: pytest.MonkeyPatch) -> None:
    b = MemoryBackend()
    lim = ScopeLimits("t", rpm=2)
    assert (await b.reserve(res(lim, now=1000.0))).admitted
    assert (await b.reserve(res(lim, now=1030.0))).admitted
    d = await b.reserve(res(lim, now=1059.0))
    assert not d.admitted and d.retry_after_s == pytest.approx(1.0)
    assert (await b.reserve(res(lim, now=1060.5))).admitted
