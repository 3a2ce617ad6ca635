"""The in-process quota store reserves in the request's own task (reserve.py `reserves_at_once`): it never suspends,
so no client can leave in the middle of it, and the shield's task, future and loop turn were paid for nothing. A
store whose reserve may suspend (Redis; a subclass of the in-process one that awaits) is still shielded, and what
it admits for a request that left is given back (tests/gateway/test_reserve_cancel_in_flight.py for Redis)."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal
from typing import Any

from gateway.pipeline.context import RequestContext
from gateway.pipeline.gate import TenantGate
from gateway.pipeline.reserve import ReserveStage, reserves_at_once
from gateway.tenants.records import ApiKey, Principal, Tenant
from quotas.backends.memory import MemoryBackend
from quotas.limits import Decision, ReservationRequest
from quotas.plans import Limits, Plan
from quotas.reservations import QuotaService

PLAN = Plan(allowed_tiers=["mid"], default_tier="mid", limits=Limits(max_concurrent=1, tpm=1000))


def ctx(request_id: str) -> RequestContext:
    key = ApiKey("k1", "acme", "k", ("user",), 0.0, None, None, None)
    return RequestContext(request_id, Principal(key, Tenant("acme", "pro", 0.0)), PLAN, {}, time.time(),
                          time.perf_counter())


async def test_the_in_process_store_reserves_without_a_task_of_its_own() -> None:
    stage = ReserveStage(quotas=QuotaService(MemoryBackend()), gate=TenantGate())
    loop = asyncio.get_running_loop()
    created: list[Any] = []
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        created.append(coro)
        return factory(loop, coro, **kwargs) if factory else asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)
    try:
        reservation = await stage.reserve(ctx("r1"), "r1", tokens=10, price=Decimal("0.01"))
    finally:
        loop.set_task_factory(factory)
    assert reservation.decision.admitted and created == []
    await stage.quotas.settle(reservation, tokens=0, price=Decimal(0))


class Held(MemoryBackend):
    """The in-process store with a reserve that suspends once it has admitted, until `release`."""

    def __init__(self) -> None:
        super().__init__()
        self.ran, self.release = asyncio.Event(), asyncio.Event()

    async def reserve(self, req: ReservationRequest) -> Decision:
        decision = self.reserve_now(req)
        self.ran.set()
        await self.release.wait()
        return decision


async def test_a_store_whose_reserve_suspends_is_shielded_and_gives_back_a_left_request() -> None:
    backend = Held()
    stage = ReserveStage(quotas=QuotaService(backend), gate=TenantGate())
    assert not reserves_at_once(stage.quotas) and reserves_at_once(QuotaService(MemoryBackend()))
    first = asyncio.create_task(stage.reserve(ctx("r1"), "r1", tokens=600, price=Decimal("0.01")))
    await backend.ran.wait()  # admitted: the tenant's one concurrent slot is r1's
    first.cancel()  # its client leaves before the reserve returns
    backend.release.set()
    try:
        await first
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the request was not cancelled")
    await stage.drain()  # the reservation nobody owns is settled at zero use
    second = await stage.reserve(ctx("r2"), "r2", tokens=600, price=Decimal("0.01"))
    assert second.decision.admitted  # the slot and the tokens are free again
    await stage.quotas.settle(second, tokens=0, price=Decimal(0))
