"""Outages do not reset budgets: the fail-open fallback starts from the last known spend (Redis' last answers,
the ledger's totals), takes only its share of what is left, and what it settles is added to Redis exactly
once when Redis is back. A busy connection pool is back-pressure, not an outage. Real redis-servers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from decimal import Decimal
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout

from quotas.backends.base import QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.redis import RedisBackend
from quotas.ledger import Ledger
from quotas.limits import Decision, ReservationRequest, ScopeLimits
from quotas.seed import ledger_spend_source
from tests.conftest import RedisServer
from tests.quotas.test_leases import _row

BUDGET = ScopeLimits("t", budget_day_pico=1000)
_n = iter(range(10**9))


def req(money: int, tenant: str = "acme") -> ReservationRequest:
    return ReservationRequest(f"f{next(_n)}", tenant, (BUDGET,), 10, money)


def failover(url: str, **kwargs: object) -> FailoverBackend:
    return FailoverBackend(RedisBackend(url, timeout_s=0.05), down_after_s=0.1, retry_every_s=0.1,
                           **kwargs)  # type: ignore[arg-type]


async def reserve(backend: FailoverBackend, r: ReservationRequest) -> Decision:
    """Reserve, retrying the retryable 503s a frozen Redis gives before it counts as down."""
    for _ in range(200):
        try:
            return await backend.reserve(r)
        except QuotaBackendError as exc:
            assert exc.transient
            await asyncio.sleep(0.02)
    raise AssertionError("no answer")


async def admit(backend: FailoverBackend, money: int, *, settle_to: int | None = None,
                tenant: str = "acme") -> Decision:
    """Reserve (retrying the retryable 503s a frozen Redis gives before it counts as down) and settle."""
    r = req(money, tenant)
    decision = await reserve(backend, r)
    if decision.admitted and settle_to is not None:
        await backend.settle(r, tokens=1, money_pico=settle_to)
    return decision


async def redis_spend(url: str, tenant: str = "acme") -> int:
    probe = RedisBackend(url, timeout_s=1.0)
    try:
        return (await probe.spent(tenant, ["t"], time.time()))["t"][0]  # type: ignore[index]
    finally:
        await probe.close()


async def test_the_fallback_starts_from_the_last_spend_redis_answered(own_redis: RedisServer) -> None:
    b = failover(own_redis.url)
    try:
        assert (await admit(b, 700, settle_to=700)).admitted
        assert (await admit(b, 200)).admitted  # Redis answers: 900 spent (this one still held)
        own_redis.stop()
        refused = await admit(b, 200)
        assert not b.up and not refused.admitted and refused.reason == "budget_day"  # not a fresh budget
        assert (await admit(b, 100)).admitted and not (await admit(b, 1)).admitted
    finally:
        await b.close()


async def test_each_replica_takes_only_its_share_of_what_was_left(own_redis: RedisServer) -> None:
    a, b = failover(own_redis.url), failover(own_redis.url)
    try:
        for r in (a, b, a):  # each says it is alive (a reaper round), and hears of the other
            await r.reap()
        assert a.num_replicas == b.num_replicas == 2
        assert (await admit(a, 400, settle_to=400)).admitted
        assert (await admit(b, 0, settle_to=0)).admitted  # b has seen the tenant's 400 too
        own_redis.stop()
        admitted = [sum([(await admit(r, 100)).admitted for _ in range(5)]) for r in (a, b)]
        assert admitted == [3, 3]  # 600 left, 300 each: together never more than the budget
    finally:
        await a.close()
        await b.close()


async def test_a_tenant_this_replica_never_saw_starts_from_the_ledgers_total(own_redis: RedisServer,
                                                                              tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    ledger.start()
    b = failover(own_redis.url, ledger_spend=ledger_spend_source(ledger))
    try:
        await ledger.record(_row("served-by-another-replica", Decimal("0.000000000950")))
        own_redis.stop()
        refused = await admit(b, 100)
        assert not refused.admitted and refused.reason == "budget_day"
        assert (await admit(b, 50)).admitted
    finally:
        await b.close()
        ledger.close()


async def test_outage_spend_reaches_redis_exactly_once(own_redis: RedisServer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    b = failover(own_redis.url)
    assert own_redis.proc is not None
    try:
        assert (await admit(b, 100, settle_to=100)).admitted
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(3):
                assert (await admit(b, 100, settle_to=60)).admitted
            assert not b.up and b.num_local_reservations == 3
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)
        real = b.primary.apply_journal
        lost = []

        async def applied_but_answer_lost(batch_id: str, tenant: str, entries: list) -> bool:  # type: ignore[type-arg]
            await real(batch_id, tenant, entries)
            if not lost:
                lost.append(batch_id)
                raise QuotaBackendError("redis: Timeout reading from socket", transient=True)
            return True

        monkeypatch.setattr(b.primary, "apply_journal", applied_but_answer_lost)
        await asyncio.sleep(0.15)  # Redis is tried again after retry_every_s
        assert (await admit(b, 0, settle_to=0)).admitted and b.up  # back: the journal is sent ...
        for _ in range(3):  # ... its first answer is lost, and a reaper round sends the same batch again
            await asyncio.sleep(0.05)
            await b.reap()
        assert lost and len(b.journal) == 0
        assert await redis_spend(own_redis.url) == 100 + 3 * 60
    finally:
        await b.close()


async def test_what_was_settled_while_a_batch_was_in_flight_reaches_redis_at_close(
        own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chaos test's drift: a replica stopped before it saw Redis again sent only its sealed batch."""
    b = failover(own_redis.url)
    assert own_redis.proc is not None
    try:
        assert (await admit(b, 100, settle_to=100)).admitted
        os.kill(own_redis.proc.pid, signal.SIGSTOP)
        try:
            held = [req(100) for _ in range(5)]
            for r in held:
                for _ in range(200):  # the retryable 503s a frozen Redis gives before it counts as down
                    with contextlib.suppress(QuotaBackendError):
                        assert (await b.reserve(r)).admitted
                        break
                    await asyncio.sleep(0.02)
            assert not b.up and b.num_local_reservations == 5
            for r in held[:3]:
                await b.settle(r, tokens=1, money_pico=60)
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)

        async def no_answer(batch_id: str, tenant: str, entries: list) -> bool:  # type: ignore[type-arg]
            raise QuotaBackendError("redis: Timeout reading from socket", transient=True)

        with monkeypatch.context() as m:  # a flush whose batch gets no answer: the batch stays sealed ...
            m.setattr(b.primary, "apply_journal", no_answer)
            with pytest.raises(QuotaBackendError):
                await b.flush_journal()
        for r in held[3:]:  # ... and what is settled meanwhile waits for the next batch
            await b.settle(r, tokens=1, money_pico=50)
        await b.close()  # the replica stops before it admits through Redis again: one flush sends both
        assert len(b.journal) == 0
        assert await redis_spend(own_redis.url) == 100 + 3 * 60 + 2 * 50
    finally:
        await b.close()


@pytest.mark.parametrize("first", ["cancel", "reaper"])
async def test_a_reserve_redis_ran_unanswered_then_admitted_by_the_fallback_is_billed_once(
        first: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    b = failover(redis_url)
    real = b.primary._scripts["reserve"]

    async def ran_then_connection_closed(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        await real(keys=keys, args=args)  # Redis charged the upper bound ...
        raise RedisConnectionError("Connection closed by server.")  # ... and went away before answering

    if first == "reaper":  # the reaper reaches Redis' reservation before the cancel does
        monkeypatch.setattr(b.primary, "_cancel_lost", lambda r: asyncio.sleep(0))
    try:
        monkeypatch.setitem(b.primary._scripts, "reserve", ran_then_connection_closed)
        r = ReservationRequest("unanswered", "acme", (BUDGET,), 10, 600, lease_s=0.2)
        assert (await b.reserve(r)).admitted and not b.up  # admitted on the fallback, same request id
        monkeypatch.setitem(b.primary._scripts, "reserve", real)
        await b.settle(r, tokens=1, money_pico=250)  # it ran: its row says 250
        await asyncio.sleep(0.3)
        await b.primary.reap(lambda ids: asyncio.sleep(0, {rid: 250 for rid in ids}))
        await b.flush_journal()
        await b.flush_journal()
        assert await redis_spend(redis_url) == 250  # once: not the upper bound, not twice
    finally:
        await b.close()


async def test_a_busy_connection_pool_is_back_pressure_not_an_outage(redis_url: str) -> None:
    impatient = FailoverBackend(RedisBackend(redis_url, timeout_s=0.5, max_connections=1, pool_wait_s=0.001))
    patient = FailoverBackend(RedisBackend(redis_url, timeout_s=0.5, max_connections=1, pool_wait_s=5.0))
    lim = ScopeLimits("t")
    try:
        out = await asyncio.gather(*(impatient.reserve(ReservationRequest(f"i{i}", "acme", (lim,), 1, 1))
                                     for i in range(50)), return_exceptions=True)
        busy = [e for e in out if isinstance(e, QuotaBackendError)]
        assert busy and all(e.back_pressure and e.transient for e in busy)
        assert impatient.up and impatient.num_local_reservations == 0  # never failed over
        out = await asyncio.gather(*(patient.reserve(ReservationRequest(f"p{i}", "acme", (lim,), 1, 1))
                                     for i in range(50)))
        assert all(d.admitted for d in out) and patient.up
    finally:
        await impatient.close()
        await patient.close()


class _Clock:
    """The failover's clock (its module's `time`), moved by hand; the wall clock stays real."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


def _failing(b: FailoverBackend, monkeypatch: pytest.MonkeyPatch, script: str) -> dict[str, bool]:
    """Makes the primary's `script` time out at once (on time: not a late read) while the switch is on."""
    real = b.primary._scripts[script]
    switch = {"on": False}

    async def maybe(*, keys: list[str], args: list) -> object:  # type: ignore[type-arg]
        if switch["on"]:
            raise RedisTimeout("Timeout reading from socket")
        return await real(keys=keys, args=args)

    monkeypatch.setitem(b.primary._scripts, script, maybe)
    return switch


@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_failures_far_apart_are_blips_and_only_continuous_ones_an_outage(
        redis_url: str, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Two failed reserves a minute apart with none in between (a quiet replica) leave Redis up: each is a
    retryable 503 (HEAD: the second marked it down, failing every request closed, or shared limits per replica,
    for retry_every_s). Failures that go on for down_after_s still mark it down."""
    import quotas.backends.failover as failover_module

    clock = _Clock()
    monkeypatch.setattr(failover_module, "time", clock)
    b = FailoverBackend(RedisBackend(redis_url, timeout_s=0.5), mode=mode,  # type: ignore[arg-type]
                        down_after_s=1.0, retry_every_s=1.0)
    fail = _failing(b, monkeypatch, "reserve")
    lim = ScopeLimits("t")

    async def reserve_at(t: float, *, failing: bool) -> Decision | QuotaBackendError:
        clock.now, fail["on"] = t, failing
        try:
            return await b.reserve(ReservationRequest(f"g{next(_n)}", "acme", (lim,), 1, 1))
        except QuotaBackendError as exc:
            return exc

    try:
        assert isinstance(await reserve_at(1000.0, failing=False), Decision)
        for t in (1010.0, 1070.0):  # a minute apart, nothing in between
            out = await reserve_at(t, failing=True)
            assert isinstance(out, QuotaBackendError) and out.transient and b.up
        assert isinstance(await reserve_at(1070.5, failing=False), Decision) and b.up
        for t in (1080.0, 1080.6):  # failing on, with no quiet stretch: not yet down_after_s
            assert isinstance(await reserve_at(t, failing=True), QuotaBackendError) and b.up
        await reserve_at(1081.2, failing=True)
        assert not b.up  # down_after_s of failures: an outage
        assert isinstance(await reserve_at(1082.5, failing=False), Decision) and b.up  # back at the next try
    finally:
        await b.close()


async def test_a_budget_read_that_fails_answers_the_last_known_spend(redis_url: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` routing reads the tenant's spend for its budget thresholds: when Redis does not answer that read,
    the spend Redis' last reserve answered stands in (HEAD: the read failed and routing ignored the budget); a
    tenant never seen still raises, and a later day or month starts at nothing."""
    b = failover(redis_url)
    try:
        assert (await admit(b, 700, settle_to=600)).admitted
        assert (await admit(b, 100)).admitted  # Redis answered 700 + 100 spent (this one held)
        fail = _failing(b, monkeypatch, "spent")
        fail["on"] = True
        now = time.time()
        assert await b.spent("acme", ["t"], now) == {"t": (700, 700)}
        assert b.up
        assert await b.spent("acme", ["t"], now + 40 * 86_400) == {"t": (0, 0)}
        with pytest.raises(QuotaBackendError):
            await b.spent("nobody", ["t"], now)
        fail["on"] = False
        assert await b.spent("acme", ["t"], now) == {"t": (700, 700)}
    finally:
        await b.close()
