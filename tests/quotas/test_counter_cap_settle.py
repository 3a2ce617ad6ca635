"""A settle or a charge whose real use would carry a counter past COUNTER_MAX leaves it where Redis leaves it: at the
cap (shared.lua `add_capped`), on the in-process store as on a real redis-server, so that both then refuse and admit
the same requests. The in-process store capped only at reserve and added without a cap at settle."""

from __future__ import annotations

import time

import pytest

from quotas.backends.base import COUNTER_MAX, QuotaBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend
from quotas.limits import ReservationRequest, ScopeLimits

LIM = (ScopeLimits("t"),)  # no limit: only the counters' end refuses
# Redis' scripts add and compare in doubles: every amount here is a multiple of 1,024, held exactly near 2**63
BIG, BIGGER = 2**62, 3 * 2**61  # each fits alone, the two together do not


async def _counters(b: QuotaBackend) -> tuple[int, int, int]:
    """The scope's tokens in the window, and its day's and month's spend, as the store holds them."""
    day, month = (await b.spent("acme", ["t"], time.time()))["t"]
    if isinstance(b, RedisBackend):
        return int(await b.redis.get(f"{b.base('acme', 't')}:tpmsum") or 0), day, month
    assert isinstance(b, MemoryBackend)
    return b._scope("acme", "t").token_sum, day, month


async def _overshoot(b: QuotaBackend, held: bool) -> tuple[tuple[int, int, int], list[tuple[bool, str | None]]]:
    """Two settles, each above what was reserved (or with nothing held: their real use charged), then what the store
    holds and how it answers a request of one token and picodollar, and one that costs nothing."""
    for rid, real in (("a", BIGGER), ("b", BIG)):
        req = ReservationRequest(rid, "acme", LIM, tokens=1024, money_pico=1024)
        if held:
            assert (await b.reserve(req)).admitted
        await b.settle(req, tokens=real, money_pico=real)
    counters = await _counters(b)
    answers = []
    for rid, cost in (("c", 1), ("d", 0)):
        decision = await b.reserve(ReservationRequest(rid, "acme", LIM, tokens=cost, money_pico=cost))
        answers.append((decision.admitted, decision.reason))
    return counters, answers


@pytest.mark.parametrize("held", [True, False], ids=["settle", "charge"])
async def test_a_settle_past_a_counters_end_leaves_it_where_redis_does(redis_url: str, held: bool) -> None:
    r = RedisBackend(redis_url, timeout_s=0.5)
    try:
        on_redis = await _overshoot(r, held)
    finally:
        await r.close()
    on_memory = await _overshoot(MemoryBackend(), held)
    # a settle replaces its reservation's tokens in the window; a charge (nothing held) adds money only
    tokens = COUNTER_MAX if held else 0
    assert on_redis[0] == (tokens, COUNTER_MAX, COUNTER_MAX)
    # before: 2**63 + 2**61 in each of the memory store's counters (a Python integer past int64)
    assert on_memory == on_redis
    # at the cap, a request that adds nothing passes; one that adds a token (or a picodollar) does not
    assert on_redis[1] == [(False, "overflow_tpm" if held else "overflow_day"), (True, None)]
