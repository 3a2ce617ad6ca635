"""A request that runs longer than its reservation's lease (a long stream: nothing bounds a whole answer's time) is
not taken for a dead replica's: its replica renews the lease at each reaper round (quotas/reaper.py), so the money it
reserved stays reserved and its concurrency slot held until it settles. Before, the reaper returned it mid-answer:
refunded and freed while it ran, so the tenant was let past its budget and its limit. A reservation whose request
is gone without settling it is renewed no more, and comes back when its lease runs out. On memory and a real
redis-server."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal

from quotas.backends.base import QuotaBackend
from quotas.limits import ReservationRequest, ScopeLimits
from quotas.money import to_pico
from quotas.plans import Limits, Plan
from quotas.reaper import run_reaper
from quotas.reservations import QuotaService

LEASE_S = 0.3
TWO = ScopeLimits("t", max_concurrent=2, budget_day_pico=2000)
PLAN = Plan(allowed_tiers=["mid"], default_tier="mid",
            limits=Limits(max_concurrent=2, budget_day_usd=Decimal("1")))


async def spend(backend: QuotaBackend) -> int:
    spent = await backend.spent("acme", ["t"], time.time())
    assert spent is not None
    return spent["t"][0]


def req(rid: str, money: int = 600) -> ReservationRequest:
    return ReservationRequest(rid, "acme", (TWO,), 10, money, lease_s=LEASE_S)


async def test_a_renewed_reservation_keeps_its_money_and_slot_past_its_lease(backend: QuotaBackend) -> None:
    running, dead = req("running"), req("dead")
    assert (await backend.reserve(running)).admitted and (await backend.reserve(dead)).admitted
    for _ in range(3):  # past its lease, renewed at a third of it
        await asyncio.sleep(LEASE_S / 2)
        await backend.renew([running])
    assert await backend.reap() == 1  # the dead one only
    assert await spend(backend) == 600  # the running one's money is still reserved ...
    assert (await backend.reserve(req("next"))).admitted  # ... the dead one's slot is free ...
    refused = await backend.reserve(req("one-too-many", money=0))
    assert not refused.admitted and refused.reason == "concurrency"  # ... and the running one's held
    await backend.settle(running, tokens=5, money_pico=100)
    await backend.renew([running])  # settled: a renewal brings nothing back
    assert await spend(backend) == 700
    assert (await backend.reserve(req("after", money=0))).admitted


async def test_the_reaper_renews_what_its_requests_hold_and_returns_the_rest(backend: QuotaBackend) -> None:
    quotas = QuotaService(backend, lease_s=LEASE_S)

    async def reserve(rid: str) -> object:
        _, reservation = await quotas.reserve(request_id=rid, tenant="acme", plan=PLAN, key_id="k", key_limits=None,
                                              tokens=10, price=Decimal("0.4"))
        assert reservation is not None
        return reservation

    running = await reserve("running")  # held by its request, which still runs
    await reserve("lost")  # its request ended without settling it (a bug): nothing holds it
    reaper = asyncio.create_task(run_reaper(backend, every_s=LEASE_S / 6, renew=quotas.renew_leases))
    try:
        await asyncio.sleep(3 * LEASE_S)
    finally:
        reaper.cancel()
    assert await spend(backend) == to_pico(Decimal("0.4"))  # the lost one was refunded, the running one is not
    await reserve("next")  # the lost one's slot is free, the running one's held:
    _, refused = await quotas.reserve(request_id="one-too-many", tenant="acme", plan=PLAN, key_id="k",
                                      key_limits=None, tokens=10, price=Decimal(0))
    assert refused is None
    await quotas.settle(running, tokens=5, price=Decimal("0.1"))  # type: ignore[arg-type]
    assert await spend(backend) == to_pico(Decimal("0.5"))  # its real use, once, with the next one's reservation
