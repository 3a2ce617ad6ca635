"""Fixtures shared by the quota tests: each backend test runs on memory and on a real redis-server."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator

import pytest

from quotas.backends.base import QuotaBackend
from quotas.backends.memory import MemoryBackend
from quotas.backends.redis import RedisBackend
from tests.conftest import RedisServer


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[QuotaBackend]:
    if request.param == "memory":
        yield MemoryBackend()
        return
    b = RedisBackend(request.getfixturevalue("redis_url"), timeout_s=0.5)
    yield b
    await b.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, which it may freeze (SIGSTOP), kill or restart."""
    server = RedisServer().start()
    yield server
    if server.proc is not None:
        os.kill(server.proc.pid, signal.SIGCONT)
    server.stop()
