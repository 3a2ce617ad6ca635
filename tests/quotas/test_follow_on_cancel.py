"""A cascade's follow-on reserve takes over the kept slot of the attempt it follows; where its answer is lost and it is
cancelled, that attempt (whose answer is still being handed over) gets its slot back, counted until its own release;
not where that attempt freed its slot before the cancel came (released, settled: it would free nothing again).
Real redis-server."""

from __future__ import annotations

from quotas.backends.redis import RedisBackend
from quotas.backends.redis_retries import CANCEL_ATTEMPTS
from quotas.limits import WINDOW_S, ReservationRequest, ScopeLimits

LIM = (ScopeLimits("t", max_concurrent=1),)


async def taken_over(b: RedisBackend) -> tuple[ReservationRequest, ReservationRequest]:
    """req1 billed with its slot kept (its answer being handed over), and a cascade follow-on admitted on that slot."""
    first = ReservationRequest("req1", "acme", LIM, 10, 100)
    assert (await b.reserve(first)).admitted
    await b.settle(first, tokens=5, money_pico=50, keep_slot=True)
    second = ReservationRequest("req1-cascade", "acme", LIM, 10, 100, follows="req1")
    assert (await b.reserve(second)).admitted
    return first, second


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
        lim = LIM
        _, second = await taken_over(b)
        await b.settle(second, tokens=5, money_pico=50)  # its answer is the client's: one slot, freed now
        assert await b.redis.zcard("{tg:acme}:t:inflight") == 0
        assert (await b.reserve(ReservationRequest("req2", "acme", lim, 10, 100))).admitted
    finally:
        await b.close()


async def test_a_late_cancel_gives_nothing_back_to_an_attempt_already_released(redis_url: str) -> None:
    """The follow-on's reserve timed out and its first cancel failed (`_retry_cancel` tries again a second later);
    meanwhile the first answer was handed over and released (freeing nothing: its slot was the follow-on's). The late
    cancel must not put the slot back under the first attempt: nothing would free it before its lease ended (900 s
    of `concurrency` refusals at max_concurrent=1)."""
    b = RedisBackend(redis_url, timeout_s=0.5)
    try:
        lim = LIM
        first, second = await taken_over(b)  # (its answer lost)
        await b.release(first)  # the first answer handed over: its slot is the follow-on's, nothing freed
        await b.cancel(second)  # the background retry lands late
        assert await b.redis.zcard("{tg:acme}:t:inflight") == 0
        assert (await b.reserve(ReservationRequest("req2", "acme", lim, 10, 100))).admitted
        # the release's trace, which told the cancel, outlives every retry of a cancel (20 tries a second apart, each
        # up to 3 s with its wait for a connection, then for 600 s)
        assert b.released_ttl_s > CANCEL_ATTEMPTS * 3 + max(b.settle_retry_s, WINDOW_S)
        assert 0 < await b.redis.ttl("{tg:acme}:released:req1") <= b.released_ttl_s
    finally:
        await b.close()


async def test_a_late_cancel_gives_nothing_back_to_a_floor_settled_since(redis_url: str) -> None:
    """A count's floor (gateway/pipeline/reserve.py `floor`) whose settle Redis did not answer still held its slot
    when the exact reservation took it over; the settle's retry then finished it (the slot gone: the follow-on's),
    and the follow-on's late cancel must not give the floor a slot no one frees. One still held when the cancel
    comes gets it back, and its settle frees it."""
    b = RedisBackend(redis_url, timeout_s=0.5)
    try:
        lim = (ScopeLimits("t", max_concurrent=1),)
        floor = ReservationRequest("req1:floor", "acme", lim, 10, 100)
        assert (await b.reserve(floor)).admitted
        exact = ReservationRequest("req1", "acme", lim, 10, 100, follows="req1:floor")
        assert (await b.reserve(exact)).admitted  # took the floor's slot over (its answer lost)
        await b.settle(floor, tokens=0, money_pico=0)  # the floor's settle, retried, lands
        await b.cancel(exact)
        assert await b.redis.zcard("{tg:acme}:t:inflight") == 0
        assert (await b.reserve(ReservationRequest("req2", "acme", lim, 10, 100))).admitted
        await b.settle(ReservationRequest("req2", "acme", lim, 10, 100), tokens=0, money_pico=0)

        floor = ReservationRequest("req3:floor", "acme", lim, 10, 100)
        assert (await b.reserve(floor)).admitted
        exact = ReservationRequest("req3", "acme", lim, 10, 100, follows="req3:floor")
        assert (await b.reserve(exact)).admitted
        await b.cancel(exact)  # before the floor's settle: the slot is the floor's again ...
        assert await b.redis.zrange("{tg:acme}:t:inflight", 0, -1) == [b"req3:floor"]
        await b.settle(floor, tokens=0, money_pico=0)  # ... which its settle frees
        assert (await b.reserve(ReservationRequest("req4", "acme", lim, 10, 100))).admitted
    finally:
        await b.close()
