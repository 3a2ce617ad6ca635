"""A client that leaves while the quota store reserves (Redis has run the script, its reply not yet read) must not
leave the reservation held for its lease: gateway/pipeline/reserve.py settles it at zero use once the reserve ends.
Deterministic: the store's reserve is held after its script ran until the caller has been cancelled."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest

from gateway.errors import TiergateError
from gateway.pipeline.context import RequestContext
from gateway.pipeline.gate import TenantGate
from gateway.pipeline.reserve import ReserveStage
from gateway.tenants.records import ApiKey, Principal, Tenant
from quotas.backends.redis import RedisBackend
from quotas.plans import Limits, Plan
from quotas.reservations import QuotaService

PLAN = Plan(allowed_tiers=["mid"], default_tier="mid",
            limits=Limits(max_concurrent=1, tpm=1000, budget_day_usd=Decimal("1")))


def ctx(request_id: str) -> RequestContext:
    key = ApiKey("k1", "acme", "k", ("user",), 0.0, None, None, None)
    return RequestContext(request_id, Principal(key, Tenant("acme", "pro", 0.0)), PLAN, {}, time.time(),
                          time.perf_counter())


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[RedisBackend]:
    b = RedisBackend(redis_url, timeout_s=0.5)
    yield b
    await b.close()


def hold_reply(backend: RedisBackend) -> tuple[asyncio.Event, asyncio.Event]:
    """The reserve script runs in Redis, then its reply is held until `release` (`ran` is set meanwhile)."""
    ran, release = asyncio.Event(), asyncio.Event()
    script = backend._scripts["reserve"]

    async def late(*args: Any, **kwargs: Any) -> Any:
        out = await script(*args, **kwargs)
        ran.set()
        await release.wait()
        return out

    backend._scripts["reserve"] = late
    return ran, release


async def test_a_reservation_whose_client_left_in_flight_is_given_back(backend: RedisBackend) -> None:
    stage = ReserveStage(quotas=QuotaService(backend), gate=TenantGate())
    ran, release = hold_reply(backend)
    first = asyncio.create_task(stage.reserve(ctx("r1"), "r1", tokens=600, price=Decimal("0.6")))
    await ran.wait()  # Redis holds r1's slot, tokens and money
    assert await backend.redis.zcard(backend.leases_key("acme")) == 1
    first.cancel()  # the client leaves before the reply is read
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    await stage.drain()  # the reservation, handed off, is settled at zero use
    assert await backend.redis.zcard(backend.leases_key("acme")) == 0
    assert int(await backend.redis.get(f"{backend.base('acme', 't')}:inflight") or 0) == 0
    # the tenant's one slot, its tokens per minute and its money are free: the next request is admitted at once
    second = await stage.reserve(ctx("r2"), "r2", tokens=600, price=Decimal("0.6"))
    assert second.decision.admitted
    await stage.quotas.settle(second, tokens=0, price=Decimal(0))


async def test_a_refusal_whose_client_left_settles_nothing(backend: RedisBackend) -> None:
    stage = ReserveStage(quotas=QuotaService(backend), gate=TenantGate())
    held = await stage.reserve(ctx("r0"), "r0", tokens=1, price=Decimal(0))  # the one slot, taken
    ran, release = hold_reply(backend)
    first = asyncio.create_task(stage.reserve(ctx("r1"), "r1", tokens=1, price=Decimal(0)))
    await ran.wait()  # refused: nothing held for r1
    first.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    await stage.drain()
    assert await backend.redis.zcard(backend.leases_key("acme")) == 1  # r0's only, still held
    with pytest.raises(TiergateError):  # still at its one slot (the held reply is released: it passes at once)
        await stage.reserve(ctx("r2"), "r2", tokens=1, price=Decimal(0))
    await stage.quotas.settle(held, tokens=0, price=Decimal(0))
