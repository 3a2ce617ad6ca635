"""One instant dates a request's money: its arrival. The quota's day counters and the ledger's day totals agree for
a request that arrives just before midnight and reserves and settles after it, on memory and a real redis-server.

The arrival is the injected clock: 1 ms before today's UTC midnight (as the gateway stamps `ctx.arrived`), while
reserve and settle run now, after it (Redis' own clock included), as they would 2 ms later. The stores let an arrival
date money at most MAX_DATING_LAG_S before their clock, and a real midnight is up to a day behind the clocks these
tests run on, so the stores here let it lag WIDE_LAG_S: they stand for stores 2 ms past midnight under the real
bound (tested at a real midnight, with skewed clocks: tests/quotas/test_dating_lag.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.pipeline.context import RequestContext
from gateway.pipeline.gate import TenantGate
from gateway.pipeline.reserve import ReserveStage
from gateway.tenants.records import ApiKey, Principal, Tenant
from quotas.backends.base import QuotaBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend
from quotas.ledger import Ledger
from quotas.ledger_rows import LedgerRow
from quotas.limits import utc_dates
from quotas.money import to_pico
from quotas.plans import Limits, Plan
from quotas.report import usage_report
from quotas.reservations import QuotaService

PLAN = Plan(allowed_tiers=["mid"], default_tier="mid", limits=Limits(budget_day_usd=Decimal("1")))
RESERVED, USED = Decimal("0.000002"), Decimal("0.0000012")
MIDNIGHT = time.time() // 86400 * 86400  # today's, UTC
BEFORE, AFTER = MIDNIGHT - 0.001, MIDNIGHT + 0.001  # 23:59:59.999 yesterday, 00:00:00.001 today
WIDE_LAG_S = 2 * 86400.0  # covers BEFORE until the test ends, whenever it runs


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[QuotaBackend]:
    """tests/quotas/conftest.py's, letting an arrival lag the store's clock by WIDE_LAG_S."""
    if request.param == "memory":
        yield MemoryBackend(max_dating_lag_s=WIDE_LAG_S)
        return
    b = RedisBackend(request.getfixturevalue("redis_url"), timeout_s=0.5, max_dating_lag_s=WIDE_LAG_S)
    yield b
    await b.close()


def ctx(request_id: str, arrived: float) -> RequestContext:
    key = ApiKey("k1", "acme", "k", ("user",), 0.0, None, None, None)
    return RequestContext(request_id, Principal(key, Tenant("acme", "pro", 0.0)), PLAN, {}, arrived,
                          time.perf_counter())


def row(c: RequestContext, price: Decimal) -> LedgerRow:
    """The row settle writes for it (gateway/pipeline/settle.py: `ts=ctx.arrived`)."""
    return LedgerRow(request_id=c.request_id, ts=c.arrived, tenant="acme", key_id="k1", tier="mid", model="m",
                     status="ok", http_status=200, input_tokens=1, output_tokens=1, price_usd=price,
                     compute_cost_usd=Decimal(0), cost_basis="none", ttft_s=None, total_s=0.1)


async def day_counter(backend: QuotaBackend, day: str) -> int:
    """What the tenant scope's counter for `day` (YYYYMMDD) holds, in picodollars."""
    if isinstance(backend, MemoryBackend):
        return backend.spend_of("acme", "t", day, day[:6])[0]
    assert isinstance(backend, RedisBackend)
    return int(await backend.redis.get(f"{backend.base('acme', 't')}:day:{day}") or 0)


def ledger_days(ledger: Ledger) -> dict[str, int]:
    """The ledger's price per UTC day (YYYYMMDD), in picodollars: finance's daily report."""
    return {r["day"].replace("-", ""): to_pico(r["price_usd"]) for r in usage_report(ledger, by=("day",))}


async def test_reserve_and_settle_date_the_money_by_arrival_as_the_ledger_row_is(
        backend: QuotaBackend, tmp_path: Path) -> None:
    quotas = QuotaService(backend)
    stage = ReserveStage(quotas=quotas, gate=TenantGate())
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    yesterday, today = utc_dates(int(BEFORE // 86400))[0], utc_dates(int(AFTER // 86400))[0]
    try:
        late, early = ctx("late", BEFORE), ctx("early", AFTER)
        held = await stage.reserve(late, late.request_id, tokens=10, price=RESERVED)  # reserved after midnight
        assert await day_counter(backend, yesterday) == to_pico(RESERVED)
        await ledger.record(row(late, USED))
        await quotas.settle(held, tokens=5, price=USED)  # settled after midnight: adjusts the day it reserved in
        other = await stage.reserve(early, early.request_id, tokens=10, price=RESERVED)
        await ledger.record(row(early, RESERVED))
        await quotas.settle(other, tokens=10, price=RESERVED)
        assert ledger_days(ledger) == {yesterday: to_pico(USED), today: to_pico(RESERVED)}
        assert {d: await day_counter(backend, d) for d in (yesterday, today)} == ledger_days(ledger)
    finally:
        ledger.close()


async def test_a_settle_the_store_holds_no_reservation_for_bills_the_arrivals_day(backend: QuotaBackend) -> None:
    """Redis: a reservation undone after its answer was lost (the request ran on the fallback); memory: one the
    backend no longer holds. Either way the real use is billed on the arrival's day, not the settle's."""
    c = ctx("lost", BEFORE)
    yesterday, today = utc_dates(int(BEFORE // 86400))[0], utc_dates(int(AFTER // 86400))[0]
    reservation = await ReserveStage(quotas=QuotaService(backend), gate=TenantGate()).reserve(
        c, c.request_id, tokens=10, price=RESERVED)
    if isinstance(backend, RedisBackend):
        await backend.cancel(reservation.request)
        settling = backend
    else:
        settling = MemoryBackend(max_dating_lag_s=WIDE_LAG_S)  # holds nothing for it
    assert {d: await day_counter(settling, d) for d in (yesterday, today)} == {yesterday: 0, today: 0}
    await QuotaService(settling).settle(reservation, tokens=5, price=USED)
    assert {d: await day_counter(settling, d) for d in (yesterday, today)} == {yesterday: to_pico(USED), today: 0}
