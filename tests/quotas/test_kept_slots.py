"""A reservation's concurrency slot kept past its settle (`keep_slot`) until its request's answer is handed over
(`QuotaService.release_slot`), on memory and a real redis-server: the settle moves the money and the tokens as ever,
the slot stays taken (on Redis, for every replica) until it is released, once, in either order with the settle; a
follow-on admitted takes a kept slot over (the slot it followed then released with no call to the store; on the
failover, only where one store holds both), a refused one leaves it; a kept slot is renewed while it is held, and its
lease frees it if it never is; on the fail-open fallback (Redis down) the slot is kept and freed there."""

from __future__ import annotations

import asyncio
import signal
import time
from decimal import Decimal

from quotas.backends.base import QuotaBackend, QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.redis import RedisBackend
from quotas.limits import ReservationRequest, ScopeLimits
from quotas.plans import Limits, Plan
from quotas.reservations import QuotaService, Reservation
from tests.conftest import RedisServer
from tests.quotas.test_failover import failover
from tests.quotas.test_failover import reserve as reserve_on
from tests.quotas.test_follow_on_failover import on_fallback, on_redis

ONE_AT_A_TIME = Limits(max_concurrent=1)
_n = iter(range(10**9))


def plan(limits: Limits = ONE_AT_A_TIME) -> Plan:
    return Plan(name="single", allowed_tiers=["mid"], default_tier="mid", limits=limits)


def counting(backend: QuotaBackend) -> list[str]:
    """The backend's slot releases, by request id, as they are asked of it."""
    calls: list[str] = []
    release, release_now = backend.release, backend.release_now

    async def counted(req: ReservationRequest) -> None:
        calls.append(req.request_id)
        await release(req)

    def counted_now(req: ReservationRequest) -> None:
        calls.append(req.request_id)
        release_now(req)

    backend.release = counted  # type: ignore[method-assign]
    backend.release_now = counted_now  # type: ignore[method-assign]
    return calls


async def reserve(quotas: QuotaService, rid: str | None = None, follows: str | None = None,
                  limits: Limits = ONE_AT_A_TIME, tokens: int = 10) -> Reservation | None:
    _, reservation = await quotas.reserve(request_id=rid or f"r{next(_n)}", tenant="acme", plan=plan(limits),
                                          key_id="k1", key_limits=None, tokens=tokens, price=Decimal("0.001"),
                                          follows=follows)
    return reservation


async def released(quotas: QuotaService) -> None:
    """The releases handed to tasks (a store that does not settle at once) done."""
    while quotas._retrying:
        await asyncio.gather(*quotas._retrying)


async def test_a_kept_slot_outlives_the_settle_and_is_freed_once_by_its_release(backend: QuotaBackend) -> None:
    calls = counting(backend)
    quotas = QuotaService(backend)
    first = await reserve(quotas)
    assert first is not None and quotas.keep_slot(first)
    await quotas.settle(first, tokens=5, price=Decimal("0.0005"))
    spent = await backend.spent("acme", ["t"], time.time())
    assert spent is not None and spent["t"][0] == 500_000_000  # the money settled to the use, before the release
    # before: the settle freed the slot, and a second request was admitted while the first's answer was being sent
    assert await reserve(quotas) is None
    quotas.release_slot(first)
    quotas.release_slot(first)  # twice (the path's end and the middleware's): freed once
    await released(quotas)
    assert calls == [first.request.request_id]
    second = await reserve(quotas)
    assert second is not None


async def test_a_slot_released_before_its_settle_stays_free_and_is_released_once(backend: QuotaBackend) -> None:
    """A client gone while its row was being written: the request ends (its place given back) before its settle,
    handed off, runs; the settle then neither takes the slot back nor frees it again."""
    calls = counting(backend)
    quotas = QuotaService(backend)
    first = await reserve(quotas)
    assert first is not None and quotas.keep_slot(first)
    quotas.release_slot(first)
    await released(quotas)
    await quotas.settle(first, tokens=5, price=Decimal("0.0005"))
    quotas.release_slot(first)
    await released(quotas)
    assert calls == [first.request.request_id]
    assert await reserve(quotas) is not None


async def test_a_follow_on_takes_a_kept_slot_over(backend: QuotaBackend) -> None:
    """A floor (or a cascade's first attempt), settled with its slot kept: the exact reservation that follows it takes
    the slot over in the store, so the floor's release asks nothing of the store (it would free nothing: on Redis a
    round trip the answer's last piece waits on), and the request holds one slot until the exact one's release."""
    calls = counting(backend)
    quotas = QuotaService(backend)
    floor = await reserve(quotas)
    assert floor is not None and quotas.keep_slot(floor)
    await quotas.settle(floor, tokens=0, price=Decimal(0))
    exact = await reserve(quotas, follows=floor.request.request_id)
    assert exact is not None and quotas.keep_slot(exact)
    await quotas.settle(exact, tokens=5, price=Decimal("0.0005"))
    assert quotas.release_slot(floor) is None
    await released(quotas)
    assert calls == []  # before: the floor's release went to the store (a round trip to Redis) for nothing
    assert floor.request.request_id not in quotas._kept  # nor is it renewed
    assert await reserve(quotas) is None  # the request's one slot, the exact reservation's now
    quotas.release_slot(exact)
    await released(quotas)
    assert calls == [exact.request.request_id]
    assert await reserve(quotas) is not None


async def test_a_refused_follow_on_leaves_the_slot_to_the_attempt_it_follows(backend: QuotaBackend) -> None:
    """A follow-on refused (here for tokens per minute) took nothing over: the attempt it follows keeps its slot, and
    its release asks the store to free it."""
    calls = counting(backend)
    quotas = QuotaService(backend)
    limits = Limits(max_concurrent=1, tpm=100)
    first = await reserve(quotas, limits=limits)
    assert first is not None and quotas.keep_slot(first)
    await quotas.settle(first, tokens=10, price=Decimal("0.001"))
    assert await reserve(quotas, follows=first.request.request_id, limits=limits, tokens=95) is None
    assert await reserve(quotas, limits=limits) is None  # the slot is still the first's
    quotas.release_slot(first)
    await released(quotas)
    assert calls == [first.request.request_id]
    assert await reserve(quotas, limits=limits) is not None


async def test_a_release_begun_in_a_task_says_when_the_store_has_answered(backend: QuotaBackend) -> None:
    """What the last piece of an answer waits on (gateway/middleware.py `_send_last`): a store that frees the slot at
    once gives nothing to wait on; Redis' release is a task, and what `release_slot` returns is done once Redis has
    answered, so the next request, sent at once, is admitted. Once: a second call begins nothing."""
    quotas = QuotaService(backend)
    first = await reserve(quotas)
    assert first is not None and quotas.keep_slot(first)
    await quotas.settle(first, tokens=5, price=Decimal("0.0005"))
    begun = quotas.release_slot(first)
    assert quotas.release_slot(first) is None
    if backend.settles_at_once():
        assert begun is None
    else:
        assert begun is not None
        await begun
    assert await reserve(quotas) is not None


async def test_a_release_the_store_fails_is_answered_and_retried_in_the_background(redis_url: str) -> None:
    """Its first try failed: what `release_slot` returns is done all the same (never failed: the answer's last piece
    is written), and the release is retried until the store frees the slot."""
    backend = RedisBackend(redis_url, timeout_s=0.5)
    try:
        calls = counting(backend)
        release = backend.release
        tries: list[str] = []

        async def fails_once(req: ReservationRequest) -> None:
            tries.append(req.request_id)
            if len(tries) == 1:
                raise QuotaBackendError("Redis did not answer")
            await release(req)

        backend.release = fails_once  # type: ignore[method-assign]
        quotas = QuotaService(backend)
        first = await reserve(quotas)
        assert first is not None and quotas.keep_slot(first)
        await quotas.settle(first, tokens=5, price=Decimal("0.0005"))
        begun = quotas.release_slot(first)
        assert begun is not None
        await begun
        assert begun.exception() is None
        assert len(tries) == 1 and calls == []  # answered, not freed: retried
        await released(quotas)
        assert len(tries) == 2 and calls == [first.request.request_id]
        assert await reserve(quotas) is not None
    finally:
        await backend.close()


async def test_nothing_is_kept_without_a_concurrency_limit(backend: QuotaBackend) -> None:
    """No scope counts the slot: the settle frees it as before, and no release costs a round trip to the store."""
    calls = counting(backend)
    quotas = QuotaService(backend)
    free = await reserve(quotas, limits=Limits(rpm=100))
    assert free is not None and not quotas.keep_slot(free)
    await quotas.settle(free, tokens=5, price=Decimal("0.0005"))
    quotas.release_slot(free)
    assert calls == []


async def test_a_kept_slot_is_renewed_while_held_and_its_lease_frees_it_if_never_released(
        backend: QuotaBackend) -> None:
    """A long answer handed over slowly keeps its slot past its lease (renewed with the open reservations); one never
    released (its replica killed mid-send) is freed when its lease runs out, the backstop."""
    # a lease of 3 s, renewed every 1.2 s (due past a third of it): a loaded machine may oversleep by up to 1.8 s
    quotas = QuotaService(backend, lease_s=3.0)
    held = await reserve(quotas)
    assert held is not None and quotas.keep_slot(held)
    await quotas.settle(held, tokens=5, price=Decimal("0.0005"))
    for _ in range(3):  # 3.6 s, past the lease, renewed as the reaper would
        await asyncio.sleep(1.2)
        await quotas.renew_leases()
        assert await reserve(quotas) is None, "a kept slot's lease ran out while it was held"
    del held  # never released: its request gone with its replica
    await asyncio.sleep(3.1)
    await backend.reap()
    assert await reserve(quotas) is not None


async def test_a_slot_kept_on_the_fail_open_fallback_is_freed_there_once(own_redis: RedisServer) -> None:
    """Redis down: the reservation is the replica's fallback's, and so are its kept slot and its release."""
    backend = failover(own_redis.url)
    quotas = QuotaService(backend)
    own_redis.proc.send_signal(signal.SIGSTOP)
    try:
        r = ReservationRequest("on-fallback", "acme", (ScopeLimits("t", max_concurrent=1),), 10, 100)
        decision = await reserve_on(backend, r)
        assert decision.admitted and "on-fallback" in backend._local
        held = Reservation(r, decision)
        assert quotas.keep_slot(held)
        await quotas.settle(held, tokens=5, price=Decimal(0))
        assert on_fallback(backend)[1] == {"on-fallback"}  # settled, its slot still counted
        assert (await reserve_on(backend, ReservationRequest("next", "acme", r.scopes, 10, 100))).reason \
            == "concurrency"
        quotas.release_slot(held)
        quotas.release_slot(held)
        await released(quotas)
        assert on_fallback(backend)[1] == set() and backend._local_slots == {}
        assert (await reserve_on(backend, ReservationRequest("next", "acme", r.scopes, 10, 100))).admitted
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
        await backend.close()


async def down(backend: FailoverBackend) -> None:
    """Redis (frozen) counted as down: each reserve goes to the fallback, none sent to Redis (tried again only when
    the test says so)."""
    backend.retry_every_s = 60.0
    await reserve_on(backend, ReservationRequest("probe", "other", (ScopeLimits("t", rpm=100),), 1, 1))
    assert not backend.up


async def kept_on_fallback(backend: FailoverBackend, quotas: QuotaService) -> Reservation:
    """With Redis frozen: a reservation admitted on the fallback, its slot kept, settled."""
    await down(backend)
    first = await reserve(quotas)
    assert first is not None and quotas.keep_slot(first)
    await quotas.settle(first, tokens=0, price=Decimal(0))
    return first


async def test_a_follow_on_on_the_fallback_takes_over_the_fallbacks_kept_slot(own_redis: RedisServer) -> None:
    """Redis down for both attempts: the fallback moved the slot, so the first's release asks nothing of the store
    and the fallback forgets the slot it kept for it."""
    assert own_redis.proc is not None
    backend = failover(own_redis.url)
    calls = counting(backend)
    quotas = QuotaService(backend)
    own_redis.proc.send_signal(signal.SIGSTOP)
    try:
        first = await kept_on_fallback(backend, quotas)
        assert set(backend._local_slots) == {first.request.request_id}
        exact = await reserve(quotas, follows=first.request.request_id)
        assert exact is not None and quotas.keep_slot(exact)
        assert backend._local_slots == {}
        quotas.release_slot(first)
        await quotas.settle(exact, tokens=5, price=Decimal(0))
        assert calls == [] and on_fallback(backend)[1] == {exact.request.request_id}
        quotas.release_slot(exact)
        await released(quotas)
        assert calls == [exact.request.request_id] and on_fallback(backend)[1] == set()
        assert backend._local_slots == {}
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
        await backend.close()


async def test_a_follow_on_on_the_other_store_leaves_the_first_its_release(own_redis: RedisServer) -> None:
    """The first attempt's slot on Redis, the follow-on admitted on the fallback (Redis failed between them): the
    fallback took a slot of its own and Redis' is still the first's, so its release still goes to Redis and frees it
    there, once Redis answers."""
    assert own_redis.proc is not None
    backend = failover(own_redis.url)
    calls = counting(backend)
    quotas = QuotaService(backend)
    try:
        first = await reserve(quotas)
        assert first is not None and quotas.keep_slot(first) and backend.up
        await quotas.settle(first, tokens=0, price=Decimal(0))
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            await down(backend)
            exact = await reserve(quotas, follows=first.request.request_id)
            assert exact is not None and exact.request.request_id in backend._local
            assert first.request.request_id in quotas._kept
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        quotas.release_slot(first)
        await released(quotas)
        assert calls == [first.request.request_id]
        assert (await on_redis(own_redis.url))[1] == set()
    finally:
        await backend.close()


async def test_a_follow_on_on_redis_leaves_the_fallbacks_slot_its_release(own_redis: RedisServer) -> None:
    """The reverse: the first attempt's slot on the fallback, the follow-on admitted on Redis (back between them), which
    took one of its own: the first's release frees the fallback's slot."""
    assert own_redis.proc is not None
    backend = failover(own_redis.url)
    calls = counting(backend)
    quotas = QuotaService(backend)
    try:
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            first = await kept_on_fallback(backend, quotas)
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        backend._retry_at = 0.0  # Redis is tried again
        exact = await reserve(quotas, follows=first.request.request_id)
        assert exact is not None and backend.up and exact.request.request_id not in backend._local
        assert on_fallback(backend)[1] == {first.request.request_id}
        quotas.release_slot(first)
        await released(quotas)
        assert calls == [first.request.request_id]
        assert on_fallback(backend)[1] == set() and backend._local_slots == {}
    finally:
        await backend.close()
