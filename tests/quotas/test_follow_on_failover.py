"""A cascade's retry whose first attempt lives on the other store: Redis failed between the two attempts (the first
reserved on Redis, the retry on the fail-open fallback), or came back between them (the first on the fallback, the
retry on Redis). The client's one request still holds one place in a requests-per-minute window, the first
attempt's (the retry takes none on either store), and one concurrency slot where it runs; the first attempt's slot
is freed once, by its settle once Redis answers or by its lease; each attempt's money reaches Redis' counters once,
the fallback's through its ledger row's mark. A real redis-server, frozen (SIGSTOP) so that it keeps its data and
runs what was sent to it once thawed, as a partitioned one does when the network heals."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from quotas.backends.failover import FailoverBackend
from quotas.ledger import Ledger
from quotas.limits import Decision, ReservationRequest, ScopeLimits
from quotas.reservations import QuotaService, Reservation
from quotas.seed import LedgerFallbackRows, ledger_billing
from tests.conftest import RedisServer
from tests.quotas.test_failover import failover, redis_spend, reserve
from tests.quotas.test_failover_durable import chat_settle, marked_row

LIMITS = ScopeLimits("t", rpm=3, max_concurrent=1, budget_day_pico=10_000)


def attempt(request_id: str, money: int, follows: str | None = None, lease_s: float = 900.0) -> ReservationRequest:
    return ReservationRequest(request_id, "acme", (LIMITS,), 10, money, lease_s=lease_s, follows=follows)


async def on_redis(url: str) -> tuple[set[str], set[str]]:
    """The ids holding places in Redis' requests-per-minute window of the tenant, and those holding its slots."""
    r = aioredis.from_url(url)
    try:
        return ({m.decode() for m in await r.zrange("{tg:acme}:t:rpm", 0, -1)},
                {m.decode() for m in await r.zrange("{tg:acme}:t:inflight", 0, -1)})
    finally:
        await r.aclose()


def on_fallback(b: FailoverBackend) -> tuple[set[str], set[str]]:
    """The same on this replica's fallback."""
    st = b.local._state.get(("acme", "t"))
    return ({rid for _, rid in st.requests}, set(st.inflight)) if st else (set(), set())


async def settle(b: FailoverBackend, ledger: Ledger, r: ReservationRequest, decision: Decision, pico: int) -> None:
    """As the gateway settles an attempt: its row (with the reservation's fallback mark) first, then the quota."""
    row = marked_row(r.request_id, pico, decision.fallback)
    await chat_settle(ledger, QuotaService(b), ledger.submit(row), Reservation(r, decision), row)


async def settled(url: str, spend: int, rpm: set[str], slots: set[str]) -> None:
    """Wait (5 s at most) for Redis to show what the background settles and cancels leave, then that exactly."""
    for _ in range(100):
        if await redis_spend(url) == spend and await on_redis(url) == (rpm, slots):
            return
        await asyncio.sleep(0.05)
    assert (await redis_spend(url), await on_redis(url)) == (spend, (rpm, slots))


@pytest.mark.parametrize("first_freed_by", ["settle", "lease"])
async def test_redis_failing_between_the_attempts(own_redis: RedisServer, tmp_path: Path,
                                                  first_freed_by: str) -> None:
    """The retry is the request that finds Redis frozen: its reserve, sent, runs once Redis thaws and takes over the
    first's slot there, while the fallback admits it with a slot of its own and no place in its window. `settle`: the
    first attempt settles while Redis is frozen (retried in the background); once thawed, the retry's cancel frees
    the slot its reserve took over, and its row (marked by id) bills its money. `lease`: the replica dies after the
    first attempt's row is written and before its quota settles; another replica's reaper returns both by their
    leases, the first billed what its row says, the retry (no row) nothing."""
    assert own_redis.proc is not None
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    rows = LedgerFallbackRows(ledger)
    b = failover(own_redis.url, rows=rows)
    b.retry_every_s = 60.0  # once down, Redis is tried again when the test says so (no probes in between)
    other = failover(own_redis.url, rows=rows)
    try:
        first = attempt("c1", 400, lease_s=1.0)
        d1 = await b.reserve(first)
        assert d1.admitted and b.up  # on Redis: the client request's place and slot
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            second = attempt("c1-cascade", 600, follows="c1", lease_s=1.0)
            d2 = await reserve(b, second)  # it finds Redis frozen (its reserve was sent: Redis runs it once thawed)
            assert d2.admitted and not b.up and (d2.fallback or "").startswith("id:")
            assert on_fallback(b) == (set(), {"c1-cascade"})  # the replica's slot, and no place in its window
            refused = await b.reserve(attempt("x", 1))
            assert not refused.admitted and refused.reason == "concurrency"
            if first_freed_by == "settle":
                await settle(b, ledger, first, d1, 300)  # Redis does not answer: retried in the background
                await settle(b, ledger, second, d2, 500)
                assert on_fallback(b) == (set(), set())
            else:  # the replica dies after the first attempt's row (durable before its settle): its background
                await ledger.record(marked_row("c1", 300, None))  # retries and its fallback's reservation go with it
                for task in (*b.primary._background, *b._tasks):
                    task.cancel()
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        if first_freed_by == "settle":
            b._retry_at = 0.0  # Redis is tried again
            await b.reap(ledger_billing(ledger))  # the reaper round: the retry's row reaches Redis by its id
            await settled(own_redis.url, 300 + 500, {"c1"}, set())
        else:
            await asyncio.sleep(1.5)  # the leases run out: the first's, and the retry's that Redis ran once thawed
            await other.reap(ledger_billing(ledger))
            await settled(own_redis.url, 300, {"c1"}, set())  # the retry never ran: it has no row, nothing billed
        for replica in (b, other):  # again: nothing more
            await replica.reap(ledger_billing(ledger))
        await asyncio.sleep(0.2)
        assert await redis_spend(own_redis.url) == (800 if first_freed_by == "settle" else 300)
        assert await on_redis(own_redis.url) == ({"c1"}, set()) and await rows.pending(10) == []
        after = attempt("after", 1)  # the client's next request: the slot is free (one, not two) ...
        assert (await other.reserve(after)).admitted
        assert (await other.reserve(attempt("too-many", 1))).reason == "concurrency"
        await other.settle(after, tokens=1, money_pico=1)
        third = attempt("third", 1)  # ... and the window holds the cascade once: rpm 3 admits two more requests
        assert (await other.reserve(third)).admitted
        await other.settle(third, tokens=1, money_pico=1)
        assert (await other.reserve(attempt("over-rpm", 1))).reason == "rpm"
    finally:
        await b.close()
        await other.close()
        ledger.close()


async def test_redis_coming_back_between_the_attempts(own_redis: RedisServer, tmp_path: Path) -> None:
    """The first attempt, admitted on the fallback, holds the client's place in its window; the retry on Redis takes
    a slot there (or the one the first's reserve took once Redis thawed, until its cancel) and no place."""
    assert own_redis.proc is not None
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    rows = LedgerFallbackRows(ledger)
    b = failover(own_redis.url, rows=rows)
    b.retry_every_s = 60.0
    try:
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            first = attempt("c1", 400)
            d1 = await reserve(b, first)  # it finds Redis frozen (sent: Redis runs it once thawed, then its cancel)
            assert d1.admitted and not b.up and (d1.fallback or "").startswith("id:")
            assert on_fallback(b) == ({"c1"}, {"c1"})
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        b._retry_at = 0.0  # Redis is tried again
        second = attempt("c1-cascade", 600, follows="c1")
        d2 = await b.reserve(second)
        assert d2.admitted and b.up and d2.fallback is None  # on Redis
        rpm, slots = await on_redis(own_redis.url)
        assert "c1-cascade" not in rpm and "c1-cascade" in slots
        refused = await b.reserve(attempt("x", 1))
        assert not refused.admitted and refused.reason == "concurrency"  # the client's one slot on Redis
        await settle(b, ledger, first, d1, 300)
        await settle(b, ledger, second, d2, 500)
        await b.reap(ledger_billing(ledger))
        # the client request's place is the first's, on the fallback's window; none on Redis'
        await settled(own_redis.url, 300 + 500, set(), set())
        assert on_fallback(b) == ({"c1"}, set())
        await b.reap(ledger_billing(ledger))
        await asyncio.sleep(0.2)
        assert await redis_spend(own_redis.url) == 800 and await rows.pending(10) == []
        assert b.primary.num_reaped == 0
    finally:
        await b.close()
        ledger.close()
