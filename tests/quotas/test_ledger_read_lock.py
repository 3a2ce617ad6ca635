"""A re-seed's ledger reads wait for another session's table lock at most TIERGATE_LEDGER_READ_LOCK_TIMEOUT_S.

A Redis that lost a tenant's counters is re-seeded from the ledger before that tenant's reserve (quotas/seed.py
`tenant_spend`, after the failover's fallback rows, `LedgerFallbackRows.pending`). An operator's `LOCK TABLE requests`
(or an ALTER) held those reads for their 60 s statement timeout, and every request of the tenant waited on them. Now
each gives up at its lock timeout (0.5 s by default): the request gets a retryable 503 `quota_backend_unavailable`
with nothing charged and nothing seeded, the failover does not take it for Redis down (no fallback from figures that
may lack the ledger's spend), and once the lock is gone the tenant's next reserve counts the ledger's spend. The
pooled connection's lock timeout is RESET after the read: writes and other reads wait for locks as before.
Real PostgreSQL and redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis

from gateway.errors import client_error
from gateway.settings import Settings
from gateway.stores import open_ledger
from quotas.backends.base import QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.redis import RedisBackend
from quotas.ledger import LedgerReadLocked
from quotas.ledger_postgres import PostgresLedger
from quotas.seed import LedgerFallbackRows, ledger_spend_source, tenant_spend, tenant_spend_source
from tests.conftest import RedisServer
from tests.quotas.test_leases import _row
from tests.quotas.test_ledger_read_bounds import ended_with as read_ended_with
from tests.quotas.test_redis_reseed import req, spend_settled

BOUND_S = 5.0  # far past the 0.5 s lock timeout, far short of the 60 s statement timeout the reads waited before


def ended_with(read: Callable[[], Any]) -> BaseException | None:
    """What `read` raised, or None if it returned; a read still waiting for the lock after BOUND_S fails the test."""
    return read_ended_with(read, BOUND_S)


@pytest.fixture
def ledger(database_url: str) -> Iterator[PostgresLedger]:
    led = PostgresLedger(database_url, max_read_connections=1)  # one pool connection: the reads after share it
    yield led
    led.close()


@pytest.fixture
def blocker(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(database_url)
    yield conn
    conn.close()


def test_a_tenant_spend_read_blocked_by_a_lock_is_refused_and_its_connection_waits_again_after(
        ledger: PostgresLedger, blocker: psycopg.Connection[Any]) -> None:
    ledger.record_now([_row("before", Decimal("0.000000000250"))])
    blocker.execute("LOCK TABLE requests IN ACCESS EXCLUSIVE MODE")
    try:
        refused = ended_with(lambda: tenant_spend(ledger, "acme", time.time()))
        assert isinstance(refused, LedgerReadLocked), refused
        assert isinstance(refused.__cause__, psycopg.errors.LockNotAvailable)
    finally:
        blocker.rollback()
    assert tenant_spend(ledger, "acme", time.time())["t"].day_pico == 250  # the lock gone, the same read answers
    # the pool's one connection had its lock timeout RESET: a read or write not lock-bounded waits for locks again
    assert ledger._query("SHOW lock_timeout", ()) == [("0",)]


async def test_a_reseed_blocked_by_a_lock_is_a_503_that_charges_nothing_and_is_no_redis_outage(
        own_redis: RedisServer, ledger: PostgresLedger, blocker: psycopg.Connection[Any]) -> None:
    b = FailoverBackend(RedisBackend(own_redis.url, timeout_s=0.5, tenant_spend=tenant_spend_source(ledger)),
                        ledger_spend=ledger_spend_source(ledger), rows=LedgerFallbackRows(ledger),
                        down_after_s=0.1, down_after_tries=2, retry_every_s=0.1)
    probe = aioredis.Redis.from_url(own_redis.url)
    ledger.start()  # its writer, for the rows the spend below writes
    try:
        for _ in range(3):
            await spend_settled(b, ledger, 250)
        own_redis.flush()  # Redis lost the tenant's counters and its seeded sentinel
        await asyncio.to_thread(blocker.execute, "LOCK TABLE requests IN ACCESS EXCLUSIVE MODE")
        try:
            for _ in range(3):  # past the failover's streak (2 tries over 0.1 s), had these counted as Redis down
                with pytest.raises(QuotaBackendError) as caught:
                    await asyncio.wait_for(b.reserve(req(300)), BOUND_S)
                assert caught.value.back_pressure and caught.value.transient
                answer = client_error(caught.value)  # what the request sees: OpenAI's error shape, retryable
                assert (answer.status_code, answer.code, answer.retry_after) == (503, "quota_backend_unavailable", 1)
                await asyncio.sleep(0.1)
            assert b.up and b.num_local_reservations == 0  # no fallback admitting from a spend of 0
            assert await probe.exists(b.primary.seeded_key("acme")) == 0  # nothing seeded, nothing charged
            assert b.primary.num_reseeds == 1  # the tenant's first reserve only
        finally:
            await asyncio.to_thread(blocker.rollback)
        refused = await b.reserve(req(300))  # the lock gone: the re-seed reads the ledger's 750 first
        assert not refused.admitted and refused.reason == "budget_day" and refused.spent["t"].day_pico == 750
        assert (await b.reserve(req(250))).admitted
    finally:
        await probe.aclose()
        await b.close()


async def test_the_fallback_rows_read_before_a_reseed_is_refused_at_its_lock_timeout_too(
        ledger: PostgresLedger, blocker: psycopg.Connection[Any]) -> None:
    rows = LedgerFallbackRows(ledger)
    await asyncio.to_thread(blocker.execute, "LOCK TABLE requests IN ACCESS EXCLUSIVE MODE")
    try:
        with pytest.raises(QuotaBackendError) as caught:
            await asyncio.wait_for(rows.pending(10), BOUND_S)
        assert caught.value.back_pressure and isinstance(caught.value.__cause__, LedgerReadLocked)
    finally:
        await asyncio.to_thread(blocker.rollback)
    assert await rows.pending(10) == []


def test_the_setting_bounds_the_fleet_ledger_the_gateway_opens(database_url: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_LEDGER_READ_LOCK_TIMEOUT_S", "0.25")
    ledger = open_ledger(Settings(database_url=database_url))
    try:
        assert isinstance(ledger, PostgresLedger) and ledger.read_lock_timeout_s == 0.25
    finally:
        ledger.close()
