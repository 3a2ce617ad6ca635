"""Every reservation comes back: leases, the reaper, late and repeated settles, on memory and a real
redis-server; settles Redis does not answer are retried in the background; one clock dates the money."""

from __future__ import annotations

import asyncio
import calendar
import os
import signal
import time
from decimal import Decimal
from pathlib import Path

import pytest
from redis.exceptions import TimeoutError as RedisTimeout

from quotas.backends.base import QuotaBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import SCRIPTS, RedisBackend
from quotas.ledger import Ledger
from quotas.ledger_rows import LedgerRow
from quotas.limits import ReservationRequest, ScopeLimits
from quotas.seed import ledger_billing, seed_from_ledger
from tests.conftest import RedisServer

LIMITS = ScopeLimits("t", tpm=1000, max_concurrent=1, budget_day_pico=1000)
LEASE_S = 0.3
_n = iter(range(10**9))


def req(money: int = 600, tokens: int = 400, lease_s: float = LEASE_S, rid: str | None = None,
        now: float | None = None, dated_at: float | None = None) -> ReservationRequest:
    return ReservationRequest(rid or f"r{next(_n)}", "acme", (LIMITS,), tokens, money, lease_s=lease_s,
                              now=time.time() if now is None else now, dated_at=dated_at)


async def spend(backend: QuotaBackend) -> int:
    spent = await backend.spent("acme", ["t"], time.time())
    assert spent is not None
    return spent["t"][0]


async def test_an_expired_reservation_comes_back_once_however_many_replicas_reap(backend: QuotaBackend) -> None:
    replicas = [backend]
    if isinstance(backend, RedisBackend):  # a second gateway's backend on the same Redis
        replicas.append(RedisBackend(_url(backend), timeout_s=0.5))
    try:
        held = req()
        assert (await backend.reserve(held)).admitted
        assert await backend.reap() == 0  # its lease runs
        refused = await backend.reserve(req(money=100))
        assert not refused.admitted and refused.reason == "concurrency"
        await asyncio.sleep(LEASE_S + 0.1)  # its gateway died: no settle comes
        counts = await asyncio.gather(*(r.reap() for r in replicas for _ in range(3)))
        assert sum(counts) == 1
        assert await spend(backend) == 0  # the money is back ...
        # ... and the tokens and the slot: the whole budget and the whole token window fit again
        assert (await backend.reserve(req(money=1000, tokens=1000))).admitted
    finally:
        for r in replicas[1:]:
            await r.close()


def _url(b: RedisBackend) -> str:
    kw = b.redis.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


async def test_a_late_settle_of_a_reaped_reservation_bills_the_real_use_once(backend: QuotaBackend) -> None:
    slow = req()
    assert (await backend.reserve(slow)).admitted
    await asyncio.sleep(LEASE_S + 0.1)
    assert await backend.reap() == 1
    assert await spend(backend) == 0
    await backend.settle(slow, tokens=100, money_pico=250)  # it was only slow: its settle comes after all
    await backend.settle(slow, tokens=100, money_pico=250)  # and again (a lost answer)
    assert await spend(backend) == 250
    assert await backend.reap() == 0


async def test_a_settle_sent_twice_changes_nothing_the_second_time(backend: QuotaBackend) -> None:
    first = req()
    assert (await backend.reserve(first)).admitted
    await backend.settle(first, tokens=100, money_pico=250)
    await backend.settle(first, tokens=100, money_pico=250)
    await backend.settle(first, tokens=5, money_pico=5)
    assert await spend(backend) == 250
    # the slot is free and the window holds 100 tokens for it, not 0 or 200
    assert (await backend.reserve(req(money=750, tokens=900))).admitted
    assert not (await backend.reserve(req(money=0, tokens=1))).admitted


async def test_a_settle_of_an_unknown_reservation_adds_its_real_use(backend: QuotaBackend) -> None:
    assert (await backend.reserve(req(money=300))).admitted
    await backend.settle(req(money=900), tokens=10, money_pico=40)  # never reserved here (its record is gone)
    assert await spend(backend) == 340  # added, not "replaced" by 40 - 900


async def test_the_reaper_bills_a_run_whose_ledger_row_was_written(backend: QuotaBackend) -> None:
    billed_run = req(money=500)
    assert (await backend.reserve(billed_run)).admitted
    await asyncio.sleep(LEASE_S + 0.1)
    asked: list[list[str]] = []

    async def billed(ids: list[str]) -> dict[str, int]:
        asked.append(ids)
        return {billed_run.request_id: 345}  # its row was durable before its gateway died

    assert await backend.reap(billed) == 1 and asked == [[billed_run.request_id]]
    assert await spend(backend) == 345
    await backend.settle(billed_run, tokens=1, money_pico=345)  # its own settle, late: nothing more
    assert await spend(backend) == 345


async def test_a_settle_redis_does_not_answer_is_retried_in_the_background(own_redis: RedisServer) -> None:
    b = RedisBackend(own_redis.url, timeout_s=0.05)
    try:
        held = req(lease_s=60)
        assert (await b.reserve(held)).admitted
        assert own_redis.proc is not None
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            await b.settle(held, tokens=100, money_pico=250)  # returns while Redis is still frozen
            assert b.num_settle_retries == 1 and len(b._background) == 1
            await asyncio.sleep(0.5)
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)
        await asyncio.wait(b._background, timeout=15)
        assert not b._background
        assert await spend(b) == 250
        assert (await b.reserve(req(money=750))).admitted  # the slot came back long before its lease
    finally:
        await b.close()


async def test_a_settle_whose_answer_was_lost_is_applied_once(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    b = RedisBackend(redis_url, timeout_s=0.5)
    real = b._scripts["settle"]
    calls = []

    async def ran_then_timed_out(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        calls.append(args[3])
        out = await real(keys=keys, args=args)  # Redis did the work ...
        if len(calls) == 1:
            raise RedisTimeout("Timeout reading from socket")  # ... but the first answer never arrived
        return out

    try:
        held = req(lease_s=60)
        assert (await b.reserve(held)).admitted
        monkeypatch.setitem(b._scripts, "settle", ran_then_timed_out)
        await b.settle(held, tokens=100, money_pico=250)
        await asyncio.wait(b._background, timeout=10)
        assert calls == ["settle", "settle"]
        assert await spend(b) == 250
    finally:
        await b.close()


@pytest.mark.parametrize("skew_s", [-40 * 86400, 2 * 86400], ids=["40 days behind", "2 days ahead"])
@pytest.mark.parametrize("arrival", [True, False], ids=["arrival", "no arrival"])
async def test_money_is_dated_by_redis_clock_not_the_gateways(redis_url: str, skew_s: float, arrival: bool) -> None:
    """A gateway whose clock is off by more than MAX_DATING_LAG_S (here by days, so whatever the time of day) spends
    in Redis' today, with its arrival (`dated_at`, by its own clock, as the reserve stage sends it) or without: never
    in a long-ended day's counter (gone: a fresh budget) nor in a day to come. Its settle where Redis holds no
    reservation (undone after a lost answer) bills today too. The bound itself: tests/quotas/test_dating_lag.py."""
    b = RedisBackend(redis_url, timeout_s=0.5)
    try:
        now = time.time() + skew_s  # this gateway's clock
        skewed = req(money=100, now=now, dated_at=now if arrival else None)
        decision = await b.reserve(skewed)
        seconds, _ = await b.redis.time()
        today = time.strftime("%Y%m%d", time.gmtime(seconds))
        assert decision.admitted and decision.spent["t"].day == today
        assert int(await b.redis.get(f"{b.base('acme', 't')}:day:{today}")) == 100
        await b.settle(skewed, tokens=1, money_pico=70)
        assert await spend(b) == 70
        lost = req(money=100, now=now, dated_at=now if arrival else None)
        assert (await b.reserve(lost)).admitted
        await b.cancel(lost)  # its answer was lost: undone; the request ran elsewhere and settles here
        await b.settle(lost, tokens=1, money_pico=30)
        assert await spend(b) == 100
        assert [k.decode() async for k in b.redis.scan_iter(f"{b.base('acme', 't')}:day:*")] == [
            f"{b.base('acme', 't')}:day:{today}"]  # no other day's counter was touched
    finally:
        await b.close()


async def test_the_scripts_calendar_agrees_with_pythons(redis_url: str) -> None:
    b = RedisBackend(redis_url)
    days = [*range(0, 60_000, 37), *(calendar.timegm((y, m, 1, 0, 0, 0)) // 86400 + d
                                    for y in (1999, 2000, 2024, 2100) for m in (1, 2, 3, 12) for d in (-1, 0))]
    probe = SCRIPTS["spent"].split("local c = clock()")[0] + """
local out = {}
for i = 1, #ARGV do
  local y, m, d = civil_from_days(tonumber(ARGV[i]))
  table.insert(out, string.format('%04d%02d%02d', y, m, d) .. ' ' .. days_from_civil(y, m, 1))
end
return out
"""
    try:
        out = await b.redis.eval(probe, 0, *days)
        for day, got in zip(days, out, strict=True):
            t = time.gmtime(day * 86400)
            month_start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)) // 86400
            assert got.decode() == f"{time.strftime('%Y%m%d', t)} {month_start}"
    finally:
        await b.close()


async def test_a_killed_embedded_gateway_is_billed_only_what_its_ledger_has(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    try:
        before = MemoryBackend()  # the gateway that is killed
        answered, running = req(rid="answered", lease_s=900), req(rid="running", lease_s=900, money=300)
        assert (await before.reserve(answered)).admitted
        await ledger.record(_row("answered", Decimal("0.000000000250")))
        await before.settle(answered, tokens=100, money_pico=250)
        assert (await before.reserve(running)).admitted  # ... and is killed while this one runs
        assert await spend(before) == 550
        after = MemoryBackend()  # its restart: spend from the ledger alone
        seed_from_ledger(after, ledger)
        assert await spend(after) == 250  # the answered run once; the interrupted one not at all
        assert await ledger_billing(ledger)(["answered", "running"]) == {"answered": 250}
        assert (await after.reserve(req(money=750))).admitted  # and no slot is held
    finally:
        ledger.close()


def _row(request_id: str, price: Decimal) -> LedgerRow:
    return LedgerRow(request_id=request_id, ts=time.time(), tenant="acme", key_id="k", tier="mid", model="m",
                     status="ok", http_status=200, input_tokens=50, output_tokens=50, price_usd=price,
                     compute_cost_usd=Decimal(0), cost_basis="none", ttft_s=None, total_s=0.1)
