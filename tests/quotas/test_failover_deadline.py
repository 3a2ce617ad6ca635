"""What a hung Redis costs a request: one call timeout per failed reserve, not one per step. A reserve is a
registration in the reapers' list, up to three tries of the script and, when they fail, a cancel of what the
script may have charged; each step waited out the whole call timeout (HEAD: a 503, or the switch to the
fallback, 4-5 timeouts after the request asked, and every request in a burst the same). Money stays exact:
a reserve whose answer was lost is still undone once Redis answers, and a request the fallback admitted is
billed once. Real redis-servers behind a proxy that hangs them (swallows the commands) or loses their
answers (Redis runs every command, no answer comes back)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from quotas.backends.base import QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.redis import RedisBackend
from quotas.limits import Decision, ReservationRequest, ScopeLimits
from tests.conftest import RedisServer
from tests.quotas.test_failover import redis_spend
from tests.quotas.test_failover_streak import HangingProxy

TIMEOUT_S = 0.1  # the call timeout: long enough that a loaded test machine's jitter is small beside it
LIMITS = ScopeLimits("t", max_concurrent=1, budget_day_pico=1000)
_n = iter(range(10**9))


class LosingProxy(HangingProxy):
    """`hung`: commands swallowed (a hung Redis). `deaf`: every command reaches Redis, which runs it, and its
    answers are swallowed (answers lost on the way back)."""

    deaf = False

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, hangs: bool) -> None:
        while data := await reader.read(65536):
            if (self.hung if hangs else self.deaf):
                continue
            writer.write(data)
            await writer.drain()


def failover(url: str) -> FailoverBackend:
    return FailoverBackend(RedisBackend(url, timeout_s=TIMEOUT_S), down_after_s=0.5, retry_every_s=1.0)


async def timed_reserve(b: FailoverBackend, tenant: str = "acme", money: int = 10,
                        ) -> tuple[float, ReservationRequest | QuotaBackendError]:
    """Seconds one reserve took, and the request if admitted, else the error."""
    r = ReservationRequest(f"d{next(_n)}", tenant, (LIMITS,), 10, money)
    began = time.monotonic()
    try:
        decision = await b.reserve(r)
    except QuotaBackendError as exc:
        return time.monotonic() - began, exc
    assert isinstance(decision, Decision) and decision.admitted
    return time.monotonic() - began, r


async def until_down(b: FailoverBackend, *, tenants: tuple[str, ...] = ("acme",), money: int = 10,
                     ) -> list[tuple[float, ReservationRequest | QuotaBackendError]]:
    """Reserves, 0.3 s apart (a lone client retrying: the third failed try in 0.5 s is an outage), the k-th for
    tenants[k % len(tenants)], until the fallback takes over (five at most)."""
    outs: list[tuple[float, ReservationRequest | QuotaBackendError]] = []
    while b.up and len(outs) < 5:
        if outs:
            await asyncio.sleep(0.3)
        outs.append(await timed_reserve(b, tenant=tenants[len(outs) % len(tenants)], money=money))
    return outs


async def held(url: str, tenant: str = "acme") -> tuple[int, int]:
    """Concurrency slots and leases Redis holds for the tenant (read past the proxy)."""
    probe = RedisBackend(url, timeout_s=1.0)
    try:
        return (await probe.redis.zcard(f"{probe.base(tenant, 't')}:inflight"),
                await probe.redis.zcard(probe.leases_key(tenant)))
    finally:
        await probe.close()


@pytest.fixture
async def proxy(own_redis: RedisServer) -> AsyncIterator[LosingProxy]:
    p = await LosingProxy(own_redis.port).start()
    yield p
    p.hung = p.deaf = False
    await p.close()


async def test_a_reserve_against_a_hung_redis_costs_about_one_call_timeout(proxy: LosingProxy) -> None:
    """Each failed reserve, the one that switches to the fallback included, and a tenant's first (which also
    registers it) answer within twice the call timeout (HEAD: 4 and 5 timeouts)."""
    b = failover(proxy.url)
    try:
        _, first = await timed_reserve(b)
        assert isinstance(first, ReservationRequest)
        await b.settle(first, tokens=1, money_pico=1)
        proxy.hung = True
        outs = await until_down(b, tenants=("acme", "newcomer"))
        kinds = [type(out).__name__ for _, out in outs]
        assert kinds == ["QuotaBackendError"] * 2 + ["ReservationRequest"] and not b.up
        assert all(out.transient for _, out in outs if isinstance(out, QuotaBackendError))
        assert max(t for t, _ in outs) < 2 * TIMEOUT_S, [t for t, _ in outs]
    finally:
        proxy.hung = False
        await b.close()


async def test_a_burst_against_a_hung_redis_is_answered_within_about_one_call_timeout(proxy: LosingProxy) -> None:
    """Twenty requests at once, from tenants this replica has not registered yet: all answered (a retryable
    503) within twice the call timeout of the burst's start (HEAD: about 7 timeouts)."""
    b = failover(proxy.url)
    try:
        proxy.hung = True
        began = time.monotonic()
        outs = await asyncio.gather(*(timed_reserve(b, tenant=f"t{i % 4}") for i in range(20)))
        took = time.monotonic() - began
        assert all(isinstance(out, QuotaBackendError) and out.transient for _, out in outs) and b.up
        assert took < 2 * TIMEOUT_S, took
    finally:
        proxy.hung = False
        await b.close()


async def test_a_reserve_whose_answer_is_lost_fails_fast_and_is_undone_once_redis_answers(
        proxy: LosingProxy, own_redis: RedisServer) -> None:
    """Redis runs the reserve and its answer is lost, then hangs: the request's 503 comes within twice the call
    timeout (the undo no longer waits on the request's path), what the script charged (the tenant's one
    concurrency slot, its money) is held while Redis does not answer, and undone once it does, so the client's
    retry is admitted."""
    b = failover(proxy.url)
    try:
        _, first = await timed_reserve(b)
        assert isinstance(first, ReservationRequest)
        await b.settle(first, tokens=1, money_pico=100)
        proxy.deaf = True
        took, lost = await timed_reserve(b, money=500)
        proxy.hung, proxy.deaf = True, False  # before the undo is sent: its first try gets no answer either
        assert isinstance(lost, QuotaBackendError) and lost.transient and b.up
        assert took < 2 * TIMEOUT_S, took
        await asyncio.sleep(0.3)
        assert await held(own_redis.url) == (1, 1) and await redis_spend(own_redis.url) == 600  # it did run
        proxy.hung = False
        for _ in range(30):  # the undo is tried again once a second until Redis answers
            if await held(own_redis.url) == (0, 0):
                break
            await asyncio.sleep(0.1)
        assert await held(own_redis.url) == (0, 0) and await redis_spend(own_redis.url) == 100
        _, retry = await timed_reserve(b, money=500)
        assert isinstance(retry, ReservationRequest)  # the one slot is free again
        await b.settle(retry, tokens=1, money_pico=300)
        assert await redis_spend(own_redis.url) == 400
    finally:
        proxy.hung = proxy.deaf = False
        await b.close()


async def test_a_request_the_fallback_admitted_after_lost_answers_is_billed_once(proxy: LosingProxy,
                                                                                 own_redis: RedisServer) -> None:
    """Answers lost for long enough that the replica fails open: each reserve ran on Redis (three charged
    there, the failed ones undone), the third is admitted by the fallback under the same id and settled there;
    once Redis answers, its real use replaces what Redis held for it, once, and nothing stays held."""
    b = failover(proxy.url)
    try:
        _, first = await timed_reserve(b)
        assert isinstance(first, ReservationRequest)
        await b.settle(first, tokens=1, money_pico=100)
        proxy.deaf = True
        outs = await until_down(b, money=200)
        assert [type(out).__name__ for _, out in outs] == ["QuotaBackendError"] * 2 + ["ReservationRequest"]
        assert max(t for t, _ in outs) < 2 * TIMEOUT_S, [t for t, _ in outs]
        local = outs[2][1]
        assert isinstance(local, ReservationRequest) and b.num_local_reservations == 1
        await b.settle(local, tokens=1, money_pico=40)
        proxy.deaf = False
        await asyncio.sleep(1.0)  # Redis is tried again after retry_every_s
        _, back = await timed_reserve(b, money=0)
        assert isinstance(back, ReservationRequest) and b.up
        await b.settle(back, tokens=1, money_pico=0)
        for _ in range(40):
            await b.flush_journal()
            if await held(own_redis.url) == (0, 0):
                break
            await asyncio.sleep(0.1)
        assert await held(own_redis.url) == (0, 0)
        assert await redis_spend(own_redis.url) == 100 + 40
    finally:
        proxy.deaf = False
        await b.close()
