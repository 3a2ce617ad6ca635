"""A reaper claims a lease that ran out; where the live replica's renew lands between that claim and the reaper's
settle, the reservation is its owner's: the reaper leaves it held (slot, money, record) and the owner's settle bills
it once. Real redis-server."""

from __future__ import annotations

import time
from typing import Any

import pytest

from quotas.backends.redis import RedisBackend
from quotas.limits import ReservationRequest, ScopeLimits


async def test_a_lease_renewed_after_the_reapers_claim_is_left_to_its_owner(redis_url: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    b = RedisBackend(redis_url, timeout_s=0.5)
    try:
        req = ReservationRequest("live", "acme", (ScopeLimits("t", max_concurrent=1),), 10, 100)
        assert (await b.reserve(req)).admitted
        await b.redis.zadd(b.leases_key("acme"), {"live": 1})  # its lease ran out: its owner's renew came late
        claim = b._claim

        async def claim_then_renewed(tenant: str) -> Any:
            claimed = await claim(tenant)
            await b.renew([req])  # the live replica's renew, between the reaper's claim and its settle
            return claimed

        monkeypatch.setattr(b, "_claim", claim_then_renewed)
        assert await b.reap() == 0
        assert await b.redis.hget(b.record_key("acme", "live"), "st") == b"r"
        assert await b.redis.zscore("{tg:acme}:t:inflight", "live") is not None  # its slot still counted
        lease = await b.redis.zscore(b.leases_key("acme"), "live")
        assert lease is not None and lease > (time.time() + 600) * 1000  # as renewed (900 s)
        assert not (await b.reserve(ReservationRequest("other", "acme", req.scopes, 10, 100))).admitted
        await b.settle(req, tokens=5, money_pico=50)  # its owner finishes it: billed once, its real use
        assert (await b.spent("acme", ["t"], time.time()))["t"] == (50, 50)
    finally:
        await b.close()
