"""More Redis calls in one process than connections: each caller gets its turn, first come, first served, and
none is refused for want of a connection with Redis idle. Before, redis-py's blocking pool let a task asking again
in the same step take a released connection ahead of the woken waiter, so with more than 64 calls at once some
waited the whole pool_wait_s and became a 503 quota_backend_unavailable. Real redis-server."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import TimeoutError as RedisTimeout

from quotas.backends.redis import RedisBackend
from quotas.limits import ReservationRequest, ScopeLimits

LIM = ScopeLimits("t", rpm=10**6, tpm=10**9, budget_day_pico=10**15)


async def test_callers_beyond_the_connections_all_get_a_turn(redis_url: str) -> None:
    """24 request-like tasks, 4 connections, each task reserving and settling back to back for a second: no
    back-pressure refusal, no settle sent to the background, every task served (HEAD: the 4 tasks holding the
    connections took each one back as they released it, and the other 20 waited out pool_wait_s, refused)."""
    b = RedisBackend(redis_url, timeout_s=0.5, max_connections=4, pool_wait_s=0.4, prefix="tg-turns")
    end = time.monotonic() + 1.0
    rounds = [0] * 24

    async def caller(i: int) -> None:
        while time.monotonic() < end:
            r = ReservationRequest(f"c{i}-{rounds[i]}", f"t{i % 3}", (LIM,), 1, 1)
            assert (await b.reserve(r)).admitted
            await b.settle(r, tokens=1, money_pico=1)
            rounds[i] += 1

    try:
        await asyncio.gather(*(caller(i) for i in range(24)))
        assert b.num_settle_retries == 0 and b.num_register_timeouts == 0
        assert min(rounds) >= 2
        spent = [await b.spent(f"t{k}", ["t"], time.time()) for k in range(3)]
        assert sum(s["t"][0] for s in spent if s is not None) == sum(rounds)  # each settled at its 1
    finally:
        await b.close()


async def test_the_reaper_leaves_most_connections_to_requests(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reaper round over many tenants runs a batch of calls at once: at most a quarter of the connections at a
    time (HEAD: the whole batch queued at the pool, ahead of the requests arriving meanwhile)."""
    b = RedisBackend(redis_url, timeout_s=0.5, max_connections=8, reap_claim_s=0.0, prefix="tg-reap-turns")
    real = b._scripts["reap"]
    running = peak = 0

    async def counted(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            return await real(keys=keys, args=args)
        finally:
            running -= 1

    try:
        for i in range(60):
            assert (await b.reserve(ReservationRequest(f"r{i}", f"t{i}", (LIM,), 1, 1, lease_s=0.001))).admitted
        await asyncio.sleep(0.05)
        monkeypatch.setitem(b._scripts, "reap", counted)
        assert await b.reap() == 60
        assert peak <= 2
    finally:
        await b.close()


async def test_a_budget_read_answered_late_by_a_busy_loop_is_read_again(redis_url: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`spent` (read by `auto` routing for budget thresholds) gets the rule reserve has: a timeout this process
    noticed long after the deadline (its loop stalled) is tried again, so routing does not go on without the
    tenant's budget (HEAD: one try, the timeout raised)."""
    b = RedisBackend(redis_url, timeout_s=0.05, prefix="tg-spent-late")
    r = ReservationRequest("s1", "acme", (LIM,), 1, 700)
    assert (await b.reserve(r)).admitted
    real = b._scripts["spent"]
    stalled = 2

    async def read_late(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        nonlocal stalled
        out = await real(keys=keys, args=args)
        if stalled:
            stalled -= 1
            time.sleep(0.11)  # the loop busy elsewhere past the deadline: the answer is read as a timeout
            raise RedisTimeout("Timeout reading from socket")
        return out

    try:
        monkeypatch.setitem(b._scripts, "spent", read_late)
        assert (await b.spent("acme", ["t"], time.time()))["t"][0] == 700  # type: ignore[index]
        assert stalled == 0 and b.num_late_timeouts == 2
    finally:
        await b.close()
