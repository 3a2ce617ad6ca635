"""Dispatch: priority classes first, then the Virtual Token Counter between tenants; capacity is a hard cap."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotas.dispatch import QueueFull, Ticket, TierQueue


async def drive(queue: TierQueue, jobs: list[tuple[str, int, float, int]]) -> list[Ticket]:
    """Submit every job at once, then finish dispatched ones one at a time; return the dispatch order."""
    order: list[Ticket] = []
    pending = {asyncio.ensure_future(queue.acquire(t, priority=p, weight=w, tokens=n)) for t, p, w, n in jobs}
    running: list[Ticket] = []
    while pending or running:
        await asyncio.sleep(0)
        for task in [t for t in pending if t.done()]:
            pending.discard(task)
            running.append(task.result())
            order.append(task.result())
        assert queue.in_flight <= queue.capacity
        if running:
            done = running.pop(0)
            queue.release(done, done.tokens)
    return order


async def test_higher_priority_class_goes_first() -> None:
    q = TierQueue("mid", capacity=1, max_waiting=1000)
    blocker = await q.acquire("x", priority=1, weight=1, tokens=1)
    jobs = [("batchy", 2, 1.0, 10)] * 3 + [("inter", 0, 1.0, 10)] * 3 + [("std", 1, 1.0, 10)] * 3
    tasks = [asyncio.ensure_future(q.acquire(t, priority=p, weight=w, tokens=n)) for t, p, w, n in jobs]
    await asyncio.sleep(0)
    order = []
    q.release(blocker, 1)
    for _ in range(9):
        await asyncio.sleep(0)
        t = next(t for t in tasks if t.done() and t.result() not in order)
        order.append(t.result())
        q.release(t.result(), 10)
    assert [t.tenant for t in order] == ["inter"] * 3 + ["std"] * 3 + ["batchy"] * 3


async def test_a_flooding_tenant_waits_behind_itself() -> None:
    q = TierQueue("mid", capacity=1, max_waiting=1000)
    jobs = [("flood", 1, 1.0, 100)] * 20 + [("steady", 1, 1.0, 100)] * 3
    order = await drive(q, jobs)
    steady_at = [i for i, t in enumerate(order) if t.tenant == "steady"]
    # FIFO would serve steady at positions 20-22; VTC interleaves it at once
    assert steady_at[-1] <= 6


async def test_weights_share_service_proportionally() -> None:
    q = TierQueue("mid", capacity=1, max_waiting=1000)
    jobs = [("gold", 1, 3.0, 10)] * 40 + [("basic", 1, 1.0, 10)] * 40
    order = await drive(q, jobs)
    first_40 = [t.tenant for t in order[:40]]
    assert 28 <= first_40.count("gold") <= 32  # 3:1 → 30 of 40


async def test_bounded_queue_and_cancellation() -> None:
    q = TierQueue("mid", capacity=1, max_waiting=2)
    held = await q.acquire("a", priority=1, weight=1, tokens=5)
    w1 = asyncio.ensure_future(q.acquire("a", priority=1, weight=1, tokens=5))
    w2 = asyncio.ensure_future(q.acquire("b", priority=1, weight=1, tokens=5))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await q.acquire("c", priority=1, weight=1, tokens=5)
    w1.cancel()
    await asyncio.sleep(0)
    assert q.num_waiting == 1
    q.release(held, 5)
    assert (await w2).tenant == "b" and q.in_flight == 1


async def test_predicted_wait_uses_tokens_ahead_and_measured_throughput() -> None:
    q = TierQueue("mid", capacity=1, max_waiting=1000)
    assert q.predicted_wait_s(1) == 0.0
    held = await q.acquire("a", priority=1, weight=1, tokens=100)
    waiters = [asyncio.ensure_future(q.acquire("b", priority=p, weight=1, tokens=100)) for p in (0, 1, 2)]
    await asyncio.sleep(0)
    q.tokens_per_s = 50.0
    assert q.predicted_wait_s(0) == pytest.approx(2.0)  # only the interactive request is ahead
    assert q.predicted_wait_s(2) == pytest.approx(6.0)  # everything is ahead of batch
    q.release(held, 100)
    for w in waiters:
        q.release(await w, 100)


async def test_another_tenants_backlog_is_not_a_newcomers_predicted_wait() -> None:
    """A tenant flooding a tier queues its own requests; fair share dispatches a newcomer after one of them, so the
    newcomer's predicted wait is that one ticket, not the flood (which refused everyone over `max_queue_wait_s`)."""
    q = TierQueue("mid", capacity=1, max_waiting=1000)
    held = await q.acquire("flood", priority=1, weight=1, tokens=100)
    flood = [asyncio.ensure_future(q.acquire("flood", priority=1, weight=1, tokens=100)) for _ in range(50)]
    await asyncio.sleep(0)
    q.tokens_per_s = 100.0
    assert q.predicted_wait_s(1) == pytest.approx(50.0)  # as FIFO would serve it: everything queued
    assert q.predicted_wait_s(1, "flood") == pytest.approx(50.0)  # the flood waits for its own
    assert q.predicted_wait_s(1, "victim") == pytest.approx(1.0)  # one flood ticket: the tie goes to the older
    victim = asyncio.ensure_future(q.acquire("victim", priority=1, weight=1, tokens=100))
    await asyncio.sleep(0)
    q.release(held, 100)
    second = await flood[0]
    assert not victim.done()
    q.release(second, 100)
    q.release(await victim, 100)  # dispatched second, as predicted: one flood ticket before it
    for f in flood:
        q.release(await f, 100)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(costs=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 50)), min_size=30, max_size=120),
       capacity=st.integers(1, 3))
def test_backlogged_tenants_never_drift_apart_by_more_than_the_bound(costs: list[tuple[str, int]],
                                                                       capacity: int) -> None:
    """While two tenants are both backlogged, their served tokens differ by at most 2 × (capacity) × max cost."""
    max_cost = max(c for _, c in costs)

    async def run() -> list[Ticket]:
        return await drive(TierQueue("t", capacity=capacity, max_waiting=1000), [(t, 1, 1.0, c) for t, c in costs])

    order = asyncio.run(run())
    remaining = {t: sum(1 for x, _ in costs if x == t) for t in "abc"}
    served = dict.fromkeys("abc", 0)
    for ticket in order:
        served[ticket.tenant] += ticket.tokens
        remaining[ticket.tenant] -= 1
        backlogged = [t for t in "abc" if remaining[t] > 0]
        for x in backlogged:
            for y in backlogged:
                assert served[x] - served[y] <= 2 * capacity * max_cost


async def test_a_newcomer_starts_at_once_while_a_flood_holds_the_other_slots() -> None:
    for policy, expect_immediate in (("vtc", True), ("fifo", False)):
        q = TierQueue("mid", capacity=4, max_waiting=1000, policy=policy)  # type: ignore[arg-type]
        flood = [asyncio.ensure_future(q.acquire("a", priority=1, weight=1, tokens=10)) for _ in range(10)]
        await asyncio.sleep(0)
        assert q.in_flight == (3 if policy == "vtc" else 4)
        b = asyncio.ensure_future(q.acquire("b", priority=1, weight=1, tokens=10))
        await asyncio.sleep(0)
        assert b.done() is expect_immediate
        for t in flood:
            t.cancel()
        b.cancel()
        await asyncio.sleep(0)


async def test_a_tenant_reading_its_answers_slowly_does_not_set_the_tiers_measured_rate() -> None:
    """The rate is measured from dispatch to release, which a client reading its stream slowly stretches: one
    tenant's slow reads made the tier look a hundred times slower for everyone, so every plan's predicted wait
    passed its bound. The tier's rate is the median (high) of each tenant's: one tenant alone cannot set it."""
    q = TierQueue("mid", capacity=4, max_waiting=1000)

    async def served(tenant: str, seconds: float) -> None:
        ticket = await q.acquire(tenant, priority=1, weight=1, tokens=100)
        ticket.dispatched_at = time.monotonic() - seconds  # as if it had been dispatched that long ago
        q.release(ticket, 100)

    for _ in range(5):
        await served("a", 0.1)  # 1,000 tokens a second
    assert q.tokens_per_s == pytest.approx(1000, rel=0.05)
    for _ in range(20):
        await served("slow-reader", 10.0)  # 10 a second
    assert q.tokens_per_s == pytest.approx(1000, rel=0.05)  # two tenants: the higher
    await served("b", 0.2)
    await served("c", 0.2)  # 500 a second each: the median of four is theirs
    assert q.tokens_per_s == pytest.approx(500, rel=0.05)
