"""A money counter near int64's end (a tenant with no budget, $9.2M spent on a scope in a month): a reserve that would
raise it past the end is refused for its own reason (on memory too) before it writes anything, a settle or journal
row past it leaves the counter at its cap instead of failing halfway, and a script's own error is that request's
failure, not Redis down for every tenant. Real redis-servers."""

from __future__ import annotations

import time

import pytest
from redis.exceptions import BusyLoadingError, ReadOnlyError, ResponseError

from quotas.backends.base import COUNTER_MAX, QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend
from quotas.backends.redis_errors import QuotaScriptError, backend_error
from quotas.limits import ReservationRequest, ScopeLimits

NEAR_END = 2**63 - 50  # picodollars: an INCRBY of 100 more fails with "increment or decrement would overflow"
CAP = 2**63 - 4096  # the most a counter holds (shared.lua COUNTER_MAX)
assert CAP == COUNTER_MAX


def _month_key(tenant: str = "acme") -> str:
    return f"{{tg:{tenant}}}:t:month:{time.strftime('%Y%m', time.gmtime())}"


def _day_key(tenant: str = "acme") -> str:
    return f"{{tg:{tenant}}}:t:day:{time.strftime('%Y%m%d', time.gmtime())}"


async def test_a_reserve_past_a_counters_end_is_refused_before_it_writes_anything(redis_url: str) -> None:
    b = RedisBackend(redis_url, timeout_s=0.5)
    try:
        await b.redis.set(_month_key(), NEAR_END)
        lim = (ScopeLimits("t", rpm=10, max_concurrent=3),)  # no budget
        for i in range(4):
            decision = await b.reserve(ReservationRequest(f"r{i}", "acme", lim, tokens=10, money_pico=100))
            # its own reason (before: budget_month, for a scope with no budget: "the monthly budget is spent")
            assert not decision.admitted and (decision.reason, decision.scope) == ("overflow_month", "t")
            assert decision.retry_after_s > 0  # the next month's start
        assert await b.redis.zcard("{tg:acme}:t:inflight") == 0  # no orphaned slot
        assert await b.redis.zcard("{tg:acme}:t:rpm") == 0
        assert await b.redis.get(_day_key()) is None  # the day is not charged
        assert int(await b.redis.get(_month_key())) == NEAR_END
        assert not await b.redis.keys("{tg:acme}:res:*")
        # a request that costs nothing still passes: it adds nothing to the counter
        assert (await b.reserve(ReservationRequest("free", "acme", lim, tokens=10, money_pico=0))).admitted
    finally:
        await b.close()


@pytest.mark.parametrize("counter", ["tpm", "day", "month"])
async def test_the_in_process_store_refuses_what_redis_would_overflow(counter: str) -> None:
    """The same bound as Redis' (the failover's fallback and the embedded gateway answer as Redis does): Python's
    integers never overflow, and the memory store admitted what Redis refuses."""
    b = MemoryBackend()
    lim = (ScopeLimits("t", rpm=10, max_concurrent=3),)
    first = ReservationRequest("r0", "acme", lim, tokens=10, money_pico=100)
    scope = b._scope("acme", "t")
    if counter == "tpm":
        scope.token_sum = CAP - 5
    else:
        getattr(scope, f"spent_{counter}")[first.day if counter == "day" else first.month] = CAP - 50
    refused = await b.reserve(first)  # before: admitted (a Python integer past int64)
    assert not refused.admitted and (refused.reason, refused.scope) == (f"overflow_{counter}", "t")
    assert refused.retry_after_s > 0
    assert not b._held and not scope.inflight and not scope.requests  # nothing taken
    # one that fits passes (a token more in the window, nothing more on the money counters)
    assert (await b.reserve(ReservationRequest("r1", "acme", lim, tokens=1, money_pico=0))).admitted


async def test_a_settle_past_a_counters_end_applies_whole_at_the_cap(redis_url: str) -> None:
    b = RedisBackend(redis_url, timeout_s=0.5)
    try:
        await b.redis.set(_month_key(), NEAR_END)
        r = ReservationRequest("late", "acme", (ScopeLimits("t"),), tokens=10, money_pico=100)
        await b.settle_elsewhere(r, money_pico=100)  # none held: the real use added on its day and month
        assert int(await b.redis.get(_day_key())) == 100
        assert int(await b.redis.get(_month_key())) == CAP
        assert (await b.spent("acme", ["t"], time.time()))["t"] == (100, CAP)  # read back as it is, not negative
    finally:
        await b.close()


async def test_a_scripts_own_error_fails_its_request_not_every_tenants(redis_url: str) -> None:
    fb = FailoverBackend(RedisBackend(redis_url, timeout_s=0.5), down_after_s=0.0, down_after_tries=1)
    try:
        await fb.primary.redis.set(_month_key(), "not a number")  # one tenant's counter the script cannot read
        for i in range(3):
            with pytest.raises(QuotaScriptError):
                await fb.reserve(ReservationRequest(f"x{i}", "acme", (ScopeLimits("t"),), 10, 100))
            assert fb.up
        rpm1 = (ScopeLimits("t", rpm=1),)
        first = await fb.reserve(ReservationRequest("y1", "beta", rpm1, 10, 0))
        second = await fb.reserve(ReservationRequest("y2", "beta", rpm1, 10, 0))
        assert first.admitted and not second.admitted and second.reason == "rpm"  # Redis' shared limit held
        assert fb.up and fb.num_local_reservations == 0
    finally:
        await fb.close()


def test_only_a_scripts_own_error_is_the_requests() -> None:
    own = backend_error(ResponseError("increment or decrement would overflow script: 0f, on @user_script:128."))
    assert isinstance(own, QuotaScriptError) and not own.transient
    for outage in (ReadOnlyError("You can't write against a read only replica."),
                   BusyLoadingError("Redis is loading the dataset in memory"),
                   ResponseError("BUSY Redis is busy running a script.", status_code="BUSY"),
                   ResponseError("MISCONF Redis is configured to save RDB snapshots script: 0f, on @user_script:3.",
                                 status_code="MISCONF"),
                   # min-replicas-to-write: every write refused, a script's as Redis 7 words it
                   ResponseError("NOREPLICAS Not enough good replicas to write. script: 0f, on @user_script:1.",
                                 status_code="NOREPLICAS")):
        error = backend_error(outage)
        assert isinstance(error, QuotaBackendError) and not isinstance(error, QuotaScriptError)
