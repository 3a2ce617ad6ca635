"""A Redis that refuses every write for want of replicas (min-replicas-to-write: NOREPLICAS, raised by the first write
of a script) is down for the failover, not one request's script failing: reserves go to the fallback. Real
redis-server."""

from __future__ import annotations

import pytest

from quotas.backends.base import QuotaBackendError
from quotas.backends.failover import FailoverBackend
from quotas.backends.redis import RedisBackend
from quotas.backends.redis_errors import QuotaScriptError
from quotas.limits import ReservationRequest, ScopeLimits
from tests.conftest import RedisServer


async def test_a_redis_without_its_replicas_is_an_outage() -> None:
    redis = RedisServer().start()
    fb = FailoverBackend(RedisBackend(redis.url, timeout_s=0.5), down_after_s=0.0, down_after_tries=1)
    try:
        assert (await fb.reserve(ReservationRequest("ok", "acme", (ScopeLimits("t"),), 10, 100))).admitted
        await fb.primary.redis.config_set("min-replicas-to-write", 1)  # (the tenant is registered: the script fails)
        with pytest.raises(QuotaBackendError) as raised:
            await fb.primary.reserve(ReservationRequest("x0", "acme", (ScopeLimits("t"),), 10, 100))
        assert "NOREPLICAS" in str(raised.value) and not isinstance(raised.value, QuotaScriptError)
        decision = await fb.reserve(ReservationRequest("x1", "acme", (ScopeLimits("t"),), 10, 100))
        assert decision.admitted and not fb.up and fb.num_local_reservations == 1
    finally:
        await fb.close()
        redis.stop()
