"""The store's clock bounds the instant that dates a request's money: its arrival counts only within the lag
(quotas/limits.py MAX_DATING_LAG_S) before the store's clock, at a real UTC midnight, on memory and a real
redis-server; and the fail-open fallback dates as Redis does, for a gateway whose clock is skewed."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

import quotas.backends.failover as failover_module
from quotas.backends.base import QuotaBackend
from quotas.backends.failover import FailoverBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend
from quotas.limits import ReservationRequest, ScopeLimits, dating_instant, utc_dates
from tests.conftest import RedisServer
from tests.quotas.test_failover import reserve

BUDGET = ScopeLimits("t", budget_day_pico=1000)
_n = iter(range(10**9))


def req(money: int, at: float | None, now: float | None = None) -> ReservationRequest:
    return ReservationRequest(f"d{next(_n)}", "acme", (BUDGET,), 10, money, dated_at=at,
                              now=time.time() if now is None else now)


def day_of(t: float) -> str:
    return utc_dates(int(t // 86400))[0]


async def day_counter(backend: QuotaBackend, day: str) -> int:
    if isinstance(backend, MemoryBackend):
        return backend.spend_of("acme", "t", day, day[:6])[0]
    assert isinstance(backend, RedisBackend)
    return int(await backend.redis.get(f"{backend.base('acme', 't')}:day:{day}") or 0)


def test_dating_instant_clamps_the_arrival_into_the_lag_before_now() -> None:
    assert dating_instant(None, 1000.0, 60) == 1000.0
    assert dating_instant(990.0, 1000.0, 60) == 990.0
    assert dating_instant(940.0, 1000.0, 60) == 940.0
    assert dating_instant(939.0, 1000.0, 60) == 940.0  # behind by more than the lag
    assert dating_instant(1000.5, 1000.0, 60) == 1000.0  # ahead of the store's clock


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_an_arrival_dates_money_only_within_the_lag_before_the_stores_clock(
        store: str, request: pytest.FixtureRequest) -> None:
    """An arrival 0.5 s before the last real midnight: dated on that day where the lag reaches back to it, on
    today (the clamped instant, past midnight) where it does not. The lags are set around that midnight."""
    url = request.getfixturevalue("redis_url") if store == "redis" else ""

    async def store_now() -> float:
        if store == "memory":
            return time.time()
        probe = RedisBackend(url)
        try:
            seconds, micros = await probe.redis.time()
            return seconds + micros / 1e6
        finally:
            await probe.close()

    now = await store_now()
    if now % 86400 < 4:  # too close to midnight to set a lag that stops short of it: wait a moment
        await asyncio.sleep(4)
        now = await store_now()
    midnight = now // 86400 * 86400
    arrival, yesterday, today = midnight - 0.5, day_of(midnight - 1), day_of(midnight)
    since = now - midnight
    for lag, dated_on in ((since + 30, yesterday), (since / 2, today)):
        b: QuotaBackend = (MemoryBackend(max_dating_lag_s=lag) if store == "memory"
                           else RedisBackend(url, timeout_s=0.5, max_dating_lag_s=lag))
        try:
            first = req(600, arrival)
            assert (await b.reserve(first)).admitted
            assert {d: await day_counter(b, d) for d in (yesterday, today)} == {
                yesterday: 600 if dated_on == yesterday else 0, today: 600 if dated_on == today else 0}
            refused = await b.reserve(req(600, arrival))
            assert refused.reason == "budget_day"
            if dated_on == yesterday:  # that day's budget is spent, and that day is over: no wait
                assert refused.retry_after_s == 0
            else:
                assert abs(refused.retry_after_s - (midnight + 86400 - time.time())) < 5
            await b.settle(first, tokens=1, money_pico=400)
            assert await day_counter(b, dated_on) == 400
        finally:
            if isinstance(b, RedisBackend):
                await b.redis.flushdb()  # the next lag starts from no spend
            await b.close()


def skew_clock(monkeypatch: pytest.MonkeyPatch, skew_s: float) -> float:
    """The failover's `time` as a gateway whose wall clock is `skew_s` off Redis' sees it (its monotonic clock is
    unaffected); the skewed time now."""
    monkeypatch.setattr(failover_module, "time", SimpleNamespace(time=lambda: time.time() + skew_s,
                                                                 monotonic=time.monotonic))
    return time.time() + skew_s


async def test_a_gateway_far_behind_spends_on_redis_today_on_redis_and_on_its_fallback(
        own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway 40 days behind sends its own arrival: Redis dates it today, and so does its fallback during an
    outage, starting from today's spend and share, not from a long-ended day's empty budget; what the fallback
    settled reaches today's counter in Redis when it is back."""
    honest = RedisBackend(own_redis.url, timeout_s=0.5)
    skewed = FailoverBackend(RedisBackend(own_redis.url, timeout_s=0.05), down_after_s=0.1, retry_every_s=0.1)
    try:
        assert (await honest.reserve(req(700, time.time()))).admitted
        now = skew_clock(monkeypatch, -40 * 86400)
        first = await reserve(skewed, req(100, now, now))
        seconds, _ = await honest.redis.time()
        today = day_of(seconds)
        assert first.admitted and (first.spent["t"].day, first.spent["t"].day_pico) == (today, 800)
        own_redis.stop()
        now = time.time() - 40 * 86400
        refused = await reserve(skewed, req(300, now, now))
        assert not skewed.up and refused.reason == "budget_day"  # 800 of 1000 spent today, not 0 of a fresh day
        now = time.time() - 40 * 86400
        admitted = req(200, now, now)
        assert (await reserve(skewed, admitted)).admitted
        assert skewed.local.spend_of("acme", "t", today, today[:6])[0] == 1000
        await skewed.settle(admitted, tokens=1, money_pico=150)
        own_redis.start()  # back, empty
        await asyncio.sleep(0.15)  # tried again after retry_every_s
        now = time.time() - 40 * 86400
        assert (await reserve(skewed, req(0, now, now))).admitted and skewed.up
        await skewed.flush_journal()
        counters = [k.decode() async for k in honest.redis.scan_iter(f"{honest.base('acme', 't')}:day:*")]
        assert counters == [f"{honest.base('acme', 't')}:day:{today}"]
        assert int(await honest.redis.get(counters[0])) == 150
    finally:
        await honest.close()
        await skewed.close()


async def test_the_fallback_dates_the_arrival_as_redis_does_within_the_lag(
        own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway whose clock reads 10 s before the last midnight, behind Redis' by less than the lag (widened to
    two days here, as a real midnight is up to a day behind: the same holds for one 30 s behind under the 60 s
    lag at midnight): Redis dates its arrival as its clock reads it, on the day its ledger rows are dated, and so
    does its fallback (which knows Redis' clock only as an offset, and must not shift the arrival by it)."""
    lag = 2 * 86400.0
    probe = RedisBackend(own_redis.url)
    seconds, micros = await probe.redis.time()
    await probe.close()
    redis_now = seconds + micros / 1e6
    midnight = redis_now // 86400 * 86400
    yesterday, today = day_of(midnight - 1), day_of(midnight)
    skewed = FailoverBackend(RedisBackend(own_redis.url, timeout_s=0.05, max_dating_lag_s=lag), down_after_s=0.1,
                             retry_every_s=60)
    try:
        skew = -(redis_now - midnight + 10)
        now = skew_clock(monkeypatch, skew)
        first = await reserve(skewed, req(100, now, now))
        assert first.admitted and first.spent["t"].day == yesterday
        own_redis.stop()
        now = time.time() + skew
        assert day_of(now) == yesterday and day_of(now - skew) == today
        assert (await reserve(skewed, req(50, now, now))).admitted and not skewed.up
        assert skewed.local.spend_of("acme", "t", yesterday, yesterday[:6])[0] == 150  # 100 known, 50 here
        assert skewed.local.spend_of("acme", "t", today, today[:6])[0] == 0
    finally:
        await skewed.close()
