"""RedisIdempotency when Redis fails a call (a timeout, a dropped connection): a claim is tried again and a claim
whose reply was lost is still its request's; Redis down for a claim is `LedgerUnavailable` (a 503) and leaves no
claim behind; an answer is stored by a retry, or owed: replayed from memory on this replica, the key still
`running` on others (never claimable), and written when Redis answers again, even after its claim's lease ended; a
give-up Redis refuses is owed too. Faults are injected by wrapping the store's scripts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout

from quotas.idempotency import Claim, Mismatch, Replay, Running
from quotas.idempotency_redis import RedisIdempotency
from quotas.ledger import LedgerUnavailable

ANSWER = {"text": "the answer", "id": "chatcmpl-1"}


class Faulty:
    """A store's script whose next `fail` calls raise; with `ran`, each runs in Redis first (its reply is lost)."""

    def __init__(self, script: Callable[..., Awaitable[Any]], fail: int, *, ran: bool = False,
                 error: type[Exception] = RedisTimeout) -> None:
        self.script, self.fail, self.ran, self.error, self.calls = script, fail, ran, error, 0

    async def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.fail > 0:
            self.fail -= 1
            if self.ran:
                await self.script(**kwargs)
            raise self.error("Timeout reading from 127.0.0.1:6379")
        return await self.script(**kwargs)


@pytest.fixture
async def replicas(redis_url: str) -> AsyncIterator[tuple[RedisIdempotency, RedisIdempotency]]:
    """Two replicas' stores on one Redis."""
    a, b = RedisIdempotency(redis_url), RedisIdempotency(redis_url)
    yield a, b
    await a.close()
    await b.close()


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.05)


async def test_a_claim_whose_reply_was_lost_is_tried_again_and_is_still_its_requests(
        replicas: tuple[RedisIdempotency, RedisIdempotency]) -> None:
    a, b = replicas
    a._begin = Faulty(a._begin, 1, ran=True)
    assert await a.begin("acme", "k", "fp", "req-1", lease_s=60) == Claim("acme", "k", "fp", "req-1")
    assert await b.begin("acme", "k", "fp", "req-2", lease_s=60) == Running()  # claimed once


async def test_redis_down_for_a_claim_is_unavailable_and_leaves_no_claim(
        replicas: tuple[RedisIdempotency, RedisIdempotency]) -> None:
    a, b = replicas
    a._begin = faulty = Faulty(a._begin, 2, ran=True)  # each try claimed it, and each reply was lost
    with pytest.raises(LedgerUnavailable):  # a retryable 503 at the gateway, not a 500
        await a.begin("acme", "k", "fp", "req-1", lease_s=60)
    assert faulty.calls == 2

    async def free() -> bool:  # the claim the lost replies made is given up in the background
        return isinstance(await b.begin("acme", "k", "fp", "req-2", lease_s=60), Claim)

    await eventually(free)


async def answered_while_redis_refuses(store: RedisIdempotency, *, lease_s: float) -> Any:
    """Claim key "k" for req-1 and store its answer while every write to Redis fails; the real script, to put back."""
    claim = await store.begin("acme", "k", "fp", "req-1", lease_s=lease_s)
    assert isinstance(claim, Claim)
    real = store._finish
    store._finish = Faulty(real, 10**9)
    await store.finish(claim, ANSWER, 3600)
    return real


async def test_an_answer_redis_refuses_once_is_stored_by_a_retry(
        replicas: tuple[RedisIdempotency, RedisIdempotency]) -> None:
    a, b = replicas
    claim = await a.begin("acme", "k", "fp", "req-1", lease_s=60)
    assert isinstance(claim, Claim)
    a._finish = Faulty(a._finish, 1, ran=True, error=RedisConnectionError)
    await a.finish(claim, ANSWER, 3600)
    assert await b.begin("acme", "k", "fp", "req-2", lease_s=60) == Replay(ANSWER)


async def test_an_answer_redis_keeps_refusing_is_owed_never_lost_nor_run_again(
        replicas: tuple[RedisIdempotency, RedisIdempotency]) -> None:
    a, b = replicas
    real = await answered_while_redis_refuses(a, lease_s=60)  # returns: the request was answered, billed and settled
    assert await a.begin("acme", "k", "fp", "req-2", lease_s=60) == Replay(ANSWER)  # from this replica's memory
    assert await a.begin("acme", "k", "other", "req-2", lease_s=60) == Mismatch()
    assert await b.begin("acme", "k", "fp", "req-3", lease_s=60) == Running()  # another replica: 409, never a run
    a._finish = real  # Redis answers again

    async def landed() -> bool:
        return await b.begin("acme", "k", "fp", "req-4", lease_s=60) == Replay(ANSWER)

    await eventually(landed)


async def test_an_owed_answer_lands_even_after_its_claims_lease_ended(
        replicas: tuple[RedisIdempotency, RedisIdempotency]) -> None:
    a, b = replicas
    real = await answered_while_redis_refuses(a, lease_s=0.3)
    await asyncio.sleep(0.5)  # the running claim's lease ended in Redis meanwhile
    a._finish = real

    async def landed() -> bool:
        return json.loads(await b._redis.get("tg:idem:acme:k"))["state"] == "done"

    await eventually(landed)
    assert await b.begin("acme", "k", "fp", "req-2", lease_s=60) == Replay(ANSWER)


async def test_a_give_up_redis_refuses_is_owed(replicas: tuple[RedisIdempotency, RedisIdempotency]) -> None:
    a, b = replicas
    claim = await a.begin("acme", "k", "fp", "req-1", lease_s=60)
    assert isinstance(claim, Claim)
    real = a._abandon
    a._abandon = Faulty(real, 3)  # both tries at once, and the first in the background
    await a.abandon(claim)  # the request failed; Redis refused to free its key: no error on top

    async def free() -> bool:
        return isinstance(await b.begin("acme", "k", "fp", "req-2", lease_s=60), Claim)

    await eventually(free)


async def test_each_lost_claim_of_one_key_is_given_up_not_only_the_last(
        replicas: tuple[RedisIdempotency, RedisIdempotency]) -> None:
    """Redis slow then down: req-1's claim ran but its replies were lost, and the client's retry (req-2) was refused
    outright. Both give-ups are owed; req-2's (which deletes nothing) must not replace req-1's, or req-1's claim holds
    the key for its whole lease and every retry is told 409 meanwhile."""
    a, b = replicas
    begin, abandon = a._begin, a._abandon
    a._abandon = Faulty(abandon, 10**9)  # Redis refuses the give-ups too while it is down
    a._begin = Faulty(begin, 2, ran=True)  # each try claimed it, and each reply was lost
    with pytest.raises(LedgerUnavailable):
        await a.begin("acme", "k", "fp", "req-1", lease_s=60)
    a._begin = Faulty(begin, 2)  # the SDK's retry: refused, nothing claimed
    with pytest.raises(LedgerUnavailable):
        await a.begin("acme", "k", "fp", "req-2", lease_s=60)
    a._begin, a._abandon = begin, abandon  # Redis answers again

    async def free() -> bool:  # req-1's claim is given up once Redis answers: the next retry runs
        return isinstance(await b.begin("acme", "k", "fp", "req-3", lease_s=60), Claim)

    await eventually(free, within_s=10.0)
