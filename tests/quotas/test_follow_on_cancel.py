"""A cascade's follow-on reserve takes over the kept slot of the attempt it follows; where its answer is lost and it is
cancelled, that attempt (whose answer is still being handed over) gets its slot back, counted until its own release.
Real redis-server."""

from __future__ import annotations

from quotas.backends.redis import RedisBackend
from quotas.limits import ReservationRequest, ScopeLimits


async def test_a_cancelled_follow_on_gives_the_slot_it_took_over_back(redis_url: str) -> None:
    b = RedisBackend(redis_url, timeout_s=0.5)
    try:
        lim = (ScopeLimits("t", max_concurrent=1),)
        first = ReservationRequest("req1", "acme", lim, 10, 100)
        assert (await b.reserve(first)).admitted
        await b.settle(first, tokens=5, money_pico=50, keep_slot=True)  # billed; its answer is being handed over
        lease = await b.redis.zscore("{tg:acme}:t:inflight", "req1")
        second = ReservationRequest("req1-cascade", "acme", lim, 10, 100, follows="req1")
        assert (await b.reserve(second)).admitted  # took req1's slot over ...
        await b.cancel(second)  # ... but its answer was lost (`_cancel_lost`): the first answer stands
        assert await b.redis.zrange("{tg:acme}:t:inflight", 0, -1, withscores=True) == [(b"req1", lease)]
        assert await b.redis.pttl("{tg:acme}:t:inflight") > 0  # (emptied by the cancel, then written again)
        other = ReservationRequest("req2", "acme", lim, 10, 100)
        refused = await b.reserve(other)
        assert not refused.admitted and refused.reason == "concurrency"
        await b.release(first)  # the first answer handed over: its slot freed, by its own release
        assert (await b.reserve(other)).admitted
    finally:
        await b.close()


async def test_a_settled_follow_on_keeps_the_slot_it_took_over(redis_url: str) -> None:
    b = RedisBackend(redis_url, timeout_s=0.5)
    try:
        lim = (ScopeLimits("t", max_concurrent=1),)
        first = ReservationRequest("req1", "acme", lim, 10, 100)
        assert (await b.reserve(first)).admitted
        await b.settle(first, tokens=5, money_pico=50, keep_slot=True)
        second = ReservationRequest("req1-cascade", "acme", lim, 10, 100, follows="req1")
        assert (await b.reserve(second)).admitted
        await b.settle(second, tokens=5, money_pico=50)  # its answer is the client's: one slot, freed now
        assert await b.redis.zcard("{tg:acme}:t:inflight") == 0
        assert (await b.reserve(ReservationRequest("req2", "acme", lim, 10, 100))).admitted
    finally:
        await b.close()
