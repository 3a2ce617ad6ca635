"""What the quota backends log while Redis (or the ledger) is down: each fault once, then one line when it works
again (quotas/fault_log.py), not a line per request in flight, per background flush or per outage begun."""

from __future__ import annotations

import asyncio
import logging

import pytest

from quotas.backends import settle_backoff
from quotas.backends.base import QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.redis import RedisBackend
from tests.conftest import RedisServer
from tests.quotas.test_failover import failover, req, reserve


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tiergate.quotas"]


async def test_settles_of_the_requests_in_flight_as_redis_stops_are_one_line_then_one(
        own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """20 requests reserved on Redis settle while it is stopped, their retries give up, Redis is back: a line for
    each fault (the connection closed, then refused; the retries given up), one when a settle works (was 20
    warnings and 20 errors)."""
    monkeypatch.setattr(settle_backoff, "SETTLE_BACKOFF_S", (0.01, 0.02))
    b = failover(own_redis.url)
    b.primary.settle_retry_s = 0.2
    try:
        inflight = [req(10) for _ in range(20)]
        for r in inflight:
            assert (await reserve(b, r)).admitted
        caplog.set_level(logging.INFO, logger="tiergate.quotas")
        caplog.clear()
        own_redis.stop()
        for r in inflight:
            await b.settle(r, tokens=1, money_pico=5)
        await asyncio.wait(set(b.primary._background))  # every retry given up
        own_redis.start()
        r = req(1)
        assert (await reserve(b, r)).admitted
        await b.settle(r, tokens=1, money_pico=1)
    finally:
        await b.close()
    got = lines(caplog)
    assert 2 <= len(got) <= 4, got
    assert all(line.startswith("settling reservations in Redis (retried in the background) failed (logged once")
               for line in got[:-1])
    assert "given up" in got[-2]
    assert got[-1] == "settling reservations in Redis (retried in the background) recovered after 40 failed settles"


async def test_failed_journal_flushes_are_one_line_then_one(own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Redis back, and applying the outage journal fails: each local settle's flush failed with a line of its
    own; now one line, then one when a flush works."""
    b = failover(own_redis.url)
    try:
        assert (await reserve(b, req(1))).admitted
        own_redis.stop()
        local = [req(1) for _ in range(20)]
        for r in local:
            assert (await reserve(b, r)).admitted
        assert not b.up
        own_redis.start()
        await asyncio.sleep(0.15)  # Redis is tried again after retry_every_s
        real = b.primary.apply_journal

        async def refused(*args: object) -> bool:
            raise QuotaBackendError("redis: Error 111 connecting to 127.0.0.1", transient=True)

        monkeypatch.setattr(b.primary, "apply_journal", refused)
        assert (await reserve(b, req(1))).admitted and b.up
        await asyncio.wait(set(b._tasks))  # the flush Redis' return began
        caplog.set_level(logging.INFO, logger="tiergate.quotas")
        caplog.clear()  # the outage's own two lines
        for r in local:
            await b.settle(r, tokens=1, money_pico=1)
            await asyncio.sleep(0)
        await asyncio.wait(set(b._tasks))
        monkeypatch.setattr(b.primary, "apply_journal", real)
        b._spawn(b.flush_journal())  # a flush that works, as after a settle
        await asyncio.wait(set(b._tasks))
        assert len(b.journal) == 0
    finally:
        await b.close()
    got = lines(caplog)
    assert len(got) == 2, got
    assert "outage journal" in got[0] and "Error 111" in got[0]
    assert got[1].startswith("applying the quota fallback's outage journal to Redis (retried later) recovered after")


async def test_a_ledger_down_at_each_outage_start_is_one_line_then_one(redis_url: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A flapping Redis begins an outage again and again; the ledger, down too, failed each start's read with a
    traceback. Now one line (no traceback: a store's fault), then one when a read works."""
    down = True

    async def ledger_spend(at: float) -> dict:  # type: ignore[type-arg]
        if down:
            raise ConnectionRefusedError(111, "Connection refused")
        return {}

    b = FailoverBackend(RedisBackend(redis_url, timeout_s=0.5), ledger_spend=ledger_spend)
    try:
        with caplog.at_level(logging.INFO, logger="tiergate.quotas"):
            for _ in range(10):
                await b._seed_from_ledger()
            down = False
            await b._seed_from_ledger()
    finally:
        await b.close()
    got = [r for r in caplog.records if r.name == "tiergate.quotas"]
    assert len(got) == 2, [r.getMessage() for r in got]
    assert got[0].exc_info is None and "Connection refused" in got[0].getMessage()
    assert got[1].getMessage().endswith("recovered after 10 failed reads")
