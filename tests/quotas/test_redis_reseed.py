"""A Redis that lost its data resets no budget: a reserve that finds its tenant's seeded sentinel gone charges
nothing until the day's and month's money counters are raised to the ledger's totals (quotas/backends/redis.py,
reseed.lua), and a re-seed never lowers a counter that spend since (or another replica's re-seed) has raised.
A re-seed reads the one tenant's rows (the ledger's (tenant, ts) index), never every tenant's. Real redis-servers;
ledger rows are written before their settle, as the pipeline's settle stage does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import pytest

from quotas.backends.base import QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.redis import RedisBackend
from quotas.ledger import Ledger
from quotas.limits import ReservationRequest, ScopeLimits, Spend
from quotas.seed import ledger_spend, ledger_spend_source, tenant_spend, tenant_spend_source
from tests.conftest import RedisServer
from tests.quotas.test_leases import _row

BUDGET = ScopeLimits("t", budget_day_pico=1000, budget_month_pico=5000)
_n = iter(range(10**9))


def req(money: int, tenant: str = "acme") -> ReservationRequest:
    return ReservationRequest(f"rs{next(_n)}", tenant, (BUDGET,), 10, money)


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[Ledger]:
    led = Ledger(tmp_path / "ledger.sqlite3")
    led.start()
    yield led
    led.close()


async def spend_settled(b: RedisBackend | FailoverBackend, ledger: Ledger, money: int) -> None:
    """Reserve, write the row, settle: as a served request does."""
    r = req(money)
    assert (await b.reserve(r)).admitted
    await ledger.record(_row(r.request_id, Decimal(money) / 10**12))
    await b.settle(r, tokens=1, money_pico=money)


async def counters(url: str, tenant: str = "acme") -> tuple[int, int]:
    probe = RedisBackend(url, timeout_s=1.0)
    try:
        return (await probe.spent(tenant, ["t"], time.time()))["t"]  # type: ignore[index]
    finally:
        await probe.close()


async def test_a_flushed_redis_does_not_reset_the_budget(own_redis: RedisServer, ledger: Ledger) -> None:
    b = RedisBackend(own_redis.url, timeout_s=0.5, tenant_spend=tenant_spend_source(ledger))
    try:
        for _ in range(3):
            await spend_settled(b, ledger, 250)
        assert await counters(own_redis.url) == (750, 750)
        reads = b.num_reseeds  # one so far: the tenant was new
        own_redis.flush()  # Redis lost everything: the counters, the sentinel
        refused = await b.reserve(req(300))  # 750 + 300 > 1000: the ledger's 750 still counts
        assert not refused.admitted and refused.reason == "budget_day"
        assert refused.spent["t"].day_pico == 750 and refused.spent["t"].month_pico == 750
        assert (await b.reserve(req(250))).admitted and not (await b.reserve(req(1))).admitted
        assert await counters(own_redis.url) == (1000, 1000)
        assert b.num_reseeds == reads + 1  # one ledger read per loss, not one per request
    finally:
        await b.close()


async def test_a_redis_restarted_empty_behind_the_failover_keeps_the_budget(own_redis: RedisServer,
                                                                             ledger: Ledger) -> None:
    """hunter h6's F3 (B): a restart without persistence, seen by the failover's next reserve."""
    b = FailoverBackend(RedisBackend(own_redis.url, timeout_s=0.5, tenant_spend=tenant_spend_source(ledger)),
                        ledger_spend=ledger_spend_source(ledger),
                        down_after_s=0.1, retry_every_s=0.1)
    try:
        for _ in range(4):
            await spend_settled(b, ledger, 200)
        own_redis.stop()
        own_redis.start()  # same port, no data
        admitted = 0
        for _ in range(12):  # the first finds the connection closed: Redis is down, the fallback admits (its
            r = req(100)     # share of what the ledger says is left); once Redis is tried again, it re-seeds
            try:
                decision = await b.reserve(r)
            except QuotaBackendError as exc:
                assert exc.transient
                continue
            if decision.admitted:
                admitted += 1
                await ledger.record(_row(r.request_id, Decimal(100) / 10**12))
                await b.settle(r, tokens=1, money_pico=100)
            await asyncio.sleep(0.05)
        await b.flush_journal()
        assert admitted == 2  # 800 spent before the restart: 200 left, not a fresh 1000
        assert b.up and b.num_local_reservations >= 1 and b.primary.num_reseeds == 2
        # the outage journal went in before the ledger was read: its 100 counted once, not on top of the ledger's
        assert await counters(own_redis.url) == (1000, 1000)
    finally:
        await b.close()


async def test_a_reseed_racing_spend_never_lowers_a_counter(own_redis: RedisServer, ledger: Ledger) -> None:
    """Replica `slow` finds the sentinel gone and reads the ledger (500) slowly; meanwhile replica `fast` re-seeds
    and reserves 300 more. `slow`'s late re-seed must leave 800, not set 500: max(held, ledger), never a plain set."""
    source = tenant_spend_source(ledger)
    fast_done = asyncio.Event()
    read_started = asyncio.Event()

    async def slow_source(tenant: str, now: float) -> dict[str, Spend]:
        totals = await source(tenant, now)  # read before `fast` spends: 500
        read_started.set()
        await fast_done.wait()
        return totals

    fast = RedisBackend(own_redis.url, timeout_s=0.5, tenant_spend=source)
    slow = RedisBackend(own_redis.url, timeout_s=0.5, tenant_spend=slow_source)
    try:
        for _ in range(2):
            await spend_settled(fast, ledger, 250)
        own_redis.flush()
        slow_reserve = asyncio.create_task(slow.reserve(req(100)))
        await read_started.wait()  # `slow` saw the sentinel gone and has read the ledger
        held = [req(100) for _ in range(3)]
        for r in held:  # reserved, not settled: money in Redis' counters the ledger does not have
            assert (await fast.reserve(r)).admitted
        assert await counters(own_redis.url) == (800, 800)
        fast_done.set()
        assert (await slow_reserve).admitted  # 800 + 100
        assert await counters(own_redis.url) == (900, 900)
        assert (await fast.reserve(req(100))).admitted and not (await slow.reserve(req(1))).admitted
        assert await counters(own_redis.url) == (1000, 1000)
        for r in held:  # settling to real use moves the counters from there, exactly
            await fast.settle(r, tokens=1, money_pico=50)
        assert await counters(own_redis.url) == (850, 850)
    finally:
        await fast.close()
        await slow.close()


async def test_a_new_tenant_reads_its_own_rows_once(own_redis: RedisServer, ledger: Ledger) -> None:
    """A tenant with no sentinel yet (new, or first seen since this feature) reads only its own totals, once, and
    the other tenants' sentinels and counters are not touched."""
    for _ in range(3):
        await ledger.record(_row(f"old{next(_n)}", Decimal(100) / 10**12))  # tenant acme's history
    reads: list[str] = []
    source = tenant_spend_source(ledger)

    async def counting(tenant: str, now: float) -> dict[str, Spend]:
        reads.append(tenant)
        return await source(tenant, now)

    b = RedisBackend(own_redis.url, timeout_s=0.5, tenant_spend=counting)
    try:
        await asyncio.gather(*(b.reserve(req(100, tenant="new")) for _ in range(3)))  # concurrent: one read
        assert (await b.reserve(req(100, tenant="new"))).admitted
        assert reads == ["new"] and b.num_reseeds == 1 and b.num_reseeds_raised == 0
        assert await counters(own_redis.url, "new") == (400, 400)
        assert await counters(own_redis.url, "acme") == (0, 0)  # not seeded: acme has not asked
        assert (await b.reserve(req(100))).admitted  # acme's first: its ledger's 300 + 100
        assert reads == ["new", "acme"] and b.num_reseeds_raised == 1
        assert await counters(own_redis.url, "acme") == (400, 400)
    finally:
        await b.close()


def test_a_tenants_totals_are_the_ledger_wide_sums_of_its_rows(ledger: Ledger) -> None:
    """`tenant_spend` (one tenant's rows, summed by the ledger) equals `ledger_spend` (every row, summed here) for
    each tenant and scope, on the day and month of `now`: rows of other days, months, keys and tenants included."""
    now = time.time()
    rows = []
    for i, (tenant, key, age_s, price) in enumerate([("acme", "k", 0, "0.000001"), ("acme", "k2", 60, "0.25"),
                                                      ("acme", "k", 26 * 3600, "1.5"), ("acme", "k", 40 * 86400, "7"),
                                                      ("beta", "k", 0, "0.333333333333"), ("acme", "k2", 10, "2")]):
        row = _row(f"tot{i}", Decimal(price))
        rows.append(replace(row, tenant=tenant, key_id=key, ts=now - age_s))
    ledger.record_now(rows)
    wide = ledger_spend(ledger, now)
    for tenant in ("acme", "beta", "nobody"):
        assert tenant_spend(ledger, tenant, now) == {scope: s for (t, scope), s in wide.items() if t == tenant}


async def test_a_tenant_the_ledger_never_saw_is_seeded_once(own_redis: RedisServer, ledger: Ledger) -> None:
    reads = 0
    source = tenant_spend_source(ledger)

    async def counting(tenant: str, now: float) -> dict[str, Spend]:
        nonlocal reads
        reads += 1
        return await source(tenant, now)

    b = RedisBackend(own_redis.url, timeout_s=0.5, tenant_spend=counting)
    try:
        for _ in range(3):
            assert (await b.reserve(req(100, tenant="new"))).admitted
        assert reads == 1 and await counters(own_redis.url, "new") == (300, 300)
    finally:
        await b.close()


BIG = ScopeLimits("t", budget_day_pico=10**18, budget_month_pico=10**18)  # $1,000,000


async def test_money_past_17_digits_stays_an_integer_in_redis(own_redis: RedisServer, ledger: Ledger) -> None:
    """Lua writes a number with 17 significant digits: 1.2e17 picodollars ($120,000) went to Redis as '1.2e+17',
    which INCRBY refuses as no integer. Every script now hands Redis money as the integer's digits: a request of
    $120,000 reserves and settles, and a re-seed to a ledger's total of $120,000.000001 leaves a counter that
    later spend can still be added to."""
    b = RedisBackend(own_redis.url, timeout_s=0.5, tenant_spend=tenant_spend_source(ledger))
    try:
        big = 120_000 * 10**12
        r = ReservationRequest(f"rs{next(_n)}", "acme", (BIG,), 10, big)
        assert (await b.reserve(r)).admitted
        await ledger.record(_row(r.request_id, Decimal(big + 10**6) / 10**12))
        await b.settle(r, tokens=1, money_pico=big + 10**6)
        assert await counters(own_redis.url) == (big + 10**6, big + 10**6)
        own_redis.flush()  # lost: the next reserve re-seeds from the ledger's total
        again = ReservationRequest(f"rs{next(_n)}", "acme", (BIG,), 10, 10**6)  # (a multiple of 2**6: Lua reads
        assert (await b.reserve(again)).admitted                                 # it back exactly at this size)
        assert await counters(own_redis.url) == (big + 2 * 10**6, big + 2 * 10**6)
    finally:
        await b.close()
