"""Fixtures shared by the quota tests: each backend test runs on memory and on a real redis-server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from quotas.backends.base import QuotaBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[QuotaBackend]:
    if request.param == "memory":
        yield MemoryBackend()
        return
    b = RedisBackend(request.getfixturevalue("redis_url"), timeout_s=0.5)
    yield b
    await b.close()
