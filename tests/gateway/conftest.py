"""Fixtures for the gateway tests: redis-servers started with the options a test gives, each stopped at its end."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.conftest import RedisServer


@pytest.fixture
def redis_with() -> Iterator[Callable[..., RedisServer]]:
    """Starts a redis-server with the options given; each is stopped at the test's end."""
    servers: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        servers.append(RedisServer(*args).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
