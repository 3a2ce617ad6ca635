"""A reserve call whose answer is lost (the gateway timed out, the script ran) leaves nothing charged.

The gateway answers such a request with a retryable 503, so the tenant must not pay a request, tokens,
money or a concurrency slot for it; before this, a burst on a loaded machine admitted fewer requests than
the limit (the lost reservations used up the window). Real redis-server.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import TimeoutError as RedisTimeout

from quotas.backends.base import QuotaBackendError
from quotas.backends.redis import LATE_BUDGET_S, RESERVE_ATTEMPTS, RedisBackend
from quotas.backends.redis_retries import CANCEL_ATTEMPTS
from quotas.limits import ReservationRequest, ScopeLimits

NOW = 1_800_000_000.0
LIMITS = ScopeLimits("t", rpm=3, tpm=1000, max_concurrent=1, budget_day_pico=1000)


def req(rid: str) -> ReservationRequest:
    return ReservationRequest(rid, "acme", (LIMITS,), 400, 400, now=NOW)


async def spent(b: RedisBackend) -> tuple[int, int, int, int]:
    """Requests in the window, tokens in the window, concurrency slots held, money spent today."""
    base = b.base("acme", "t")
    day = (await b.spent("acme", ["t"], NOW))["t"][0]
    return (await b.redis.zcard(f"{base}:rpm"), int(await b.redis.get(f"{base}:tpmsum") or 0),
            await b.redis.zcard(f"{base}:inflight"), day)


async def test_a_reserve_answered_after_timeouts_is_admitted_once(redis_url: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy event loop misses an answer or two: the retries with the same id find the reservation made by the
    first one, and the request is admitted, charged once, with no 503 and nothing to undo."""
    b = RedisBackend(redis_url, timeout_s=0.5, prefix="tg-late")
    real = b._scripts["reserve"]
    lost = RESERVE_ATTEMPTS - 1

    async def late(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        nonlocal lost
        out = await real(keys=keys, args=args)
        if lost:
            lost -= 1
            raise RedisTimeout("Timeout reading from socket")
        return out

    try:
        monkeypatch.setitem(b._scripts, "reserve", late)
        assert (await b.reserve(req("late"))).admitted and lost == 0
        assert await spent(b) == (1, 400, 1, 400)
    finally:
        await b.close()


async def test_cancel_undoes_a_reservation_once_and_nothing_else(redis_url: str) -> None:
    b = RedisBackend(redis_url, timeout_s=0.5, prefix="tg-cancel")
    try:
        kept, undone = req("kept"), req("undone")
        assert (await b.reserve(kept)).admitted
        await b.settle(kept, tokens=400, money_pico=400)  # frees its concurrency slot, keeps its charge
        assert (await b.reserve(undone)).admitted
        assert await spent(b) == (2, 800, 1, 800)
        await b.cancel(undone)
        await b.cancel(undone)  # idempotent
        await b.cancel(req("never-reserved"))  # harmless
        assert await spent(b) == (1, 400, 0, 400)
    finally:
        await b.close()


async def test_a_reservation_whose_answer_was_lost_is_undone(redis_url: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    b = RedisBackend(redis_url, timeout_s=0.5, prefix="tg-lost")
    real = b._scripts["reserve"]
    tries = 0

    async def ran_then_timed_out(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        nonlocal tries
        tries += 1
        await real(keys=keys, args=args)  # Redis did the work ...
        raise RedisTimeout("Timeout reading from socket")  # ... but the answer never arrived

    try:
        monkeypatch.setitem(b._scripts, "reserve", ran_then_timed_out)
        with pytest.raises(QuotaBackendError) as err:
            await b.reserve(req("lost"))
        assert err.value.transient
        assert tries == RESERVE_ATTEMPTS  # retried with the same id, then given up
        # undone before the 503 went out: nothing is left for the client's retry to be refused by
        assert not b._background and await spent(b) == (0, 0, 0, 0)
        monkeypatch.setitem(b._scripts, "reserve", real)
        # the client's retry gets the one concurrency slot the lost reservation would otherwise hold
        assert (await b.reserve(req("retry"))).admitted
    finally:
        await b.close()


async def test_a_lost_reservation_is_undone_however_long_redis_takes_to_answer_the_cancel(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis ran the reserve, its answer was lost, and the cancel that undoes it is not answered for longer than
    CANCEL_ATTEMPTS tries a second apart (an outage of over 20 s): it is still undone once Redis answers. Before, the
    cancel was given up after its 20 tries, and the tenant's rpm place and tokens stayed taken until the window passed
    (60 s), its concurrency slot and money until the lease's reaper (15 minutes), for a request never admitted."""
    b = RedisBackend(redis_url, timeout_s=0.5, prefix="tg-lost-long")
    real, real_cancel, real_sleep = b._scripts["reserve"], b.cancel, asyncio.sleep
    unanswered = CANCEL_ATTEMPTS + 5  # cancels Redis does not answer

    async def ran_then_timed_out(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        await real(keys=keys, args=args)
        raise RedisTimeout("Timeout reading from socket")

    async def cancel(r: ReservationRequest) -> None:
        nonlocal unanswered
        if unanswered:
            unanswered -= 1
            raise QuotaBackendError("redis: Timeout reading from socket", transient=True)
        await real_cancel(r)

    async def no_wait(_seconds: float, *args: object) -> object:  # the retries' waits, not the outage's length
        return await real_sleep(0, *args)

    try:
        monkeypatch.setitem(b._scripts, "reserve", ran_then_timed_out)
        monkeypatch.setattr(b, "cancel", cancel)
        monkeypatch.setattr(asyncio, "sleep", no_wait)
        with pytest.raises(QuotaBackendError):
            await b.reserve(req("lost"))
        assert b._background  # Redis held the reservation, and did not answer its cancel: retried in the background
        await asyncio.wait(set(b._background))
        assert await spent(b) == (0, 0, 0, 0)  # its rpm place, tokens, slot and money are the tenant's again
        assert unanswered == 0
        monkeypatch.setitem(b._scripts, "reserve", real)
        assert (await b.reserve(req("retry"))).admitted  # the client's retry gets the one concurrency slot
    finally:
        await b.close()


async def test_timeouts_read_late_by_a_busy_loop_are_retried_beyond_the_attempts(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop stalled past twice the call timeout reads Redis' answer late: not Redis' fault, so those tries do
    not count, and the request is admitted instead of a 503 (Redis here answered every time)."""
    b = RedisBackend(redis_url, timeout_s=0.05, prefix="tg-stalled")
    real = b._scripts["reserve"]
    stalled = RESERVE_ATTEMPTS + 1  # more than the attempts an on-time timeout gets

    async def read_late(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        nonlocal stalled
        out = await real(keys=keys, args=args)
        if stalled:
            stalled -= 1
            time.sleep(0.11)  # the event loop busy elsewhere past the deadline ...
            raise RedisTimeout("Timeout reading from socket")  # ... so the answer is read as a timeout
        return out

    try:
        monkeypatch.setitem(b._scripts, "reserve", read_late)
        assert (await b.reserve(req("stalled"))).admitted and stalled == 0
        assert b.num_late_timeouts == RESERVE_ATTEMPTS + 1
        assert await spent(b) == (1, 400, 1, 400)  # charged once
    finally:
        await b.close()


async def test_late_timeouts_are_retried_for_a_bounded_time_only(redis_url: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every try late (a loop that never catches up, or a hung Redis behind a full pool): the reserve still
    fails, after LATE_BUDGET_S plus the counted attempts, not forever."""
    b = RedisBackend(redis_url, timeout_s=0.05, prefix="tg-always-late")
    tries = 0

    async def always_late(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        nonlocal tries
        tries += 1
        time.sleep(0.11)
        raise RedisTimeout("Timeout reading from socket")

    try:
        monkeypatch.setitem(b._scripts, "reserve", always_late)
        started = time.monotonic()
        with pytest.raises(QuotaBackendError) as err:
            await b.reserve(req("never"))
        took = time.monotonic() - started
        assert err.value.transient
        assert LATE_BUDGET_S <= took < LATE_BUDGET_S + (RESERVE_ATTEMPTS + 1) * 0.2
        assert tries == b.num_late_timeouts + RESERVE_ATTEMPTS
    finally:
        await b.close()


async def test_a_registration_that_times_out_does_not_refuse_the_request(redis_url: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Putting the tenant in the reapers' list again (each reaper round) timed out under a stalled loop and
    made the request a 503; now it is retried by the next request, and this one is reserved as usual."""
    b = RedisBackend(redis_url, timeout_s=0.5, prefix="tg-register")
    real_sadd = b.redis.sadd
    timeouts = 1

    async def sadd(*args: object) -> object:
        nonlocal timeouts
        if timeouts:
            timeouts -= 1
            raise RedisTimeout("Timeout reading from socket")
        return await real_sadd(*args)

    try:
        monkeypatch.setattr(b.redis, "sadd", sadd)
        assert (await b.reserve(req("first"))).admitted  # registration timed out: reserved all the same
        assert b.num_register_timeouts == 1 and not await b.redis.sismember(b.tenants_key, "acme")
        await b.settle(req("first"), tokens=400, money_pico=400)
        assert (await b.reserve(req("second"))).admitted
        assert await b.redis.sismember(b.tenants_key, "acme")  # the next request registered it
    finally:
        await b.close()
