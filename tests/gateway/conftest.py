"""Fixtures for the gateway tests: redis-servers started with the options a test gives, each stopped at its end, and
a gateway with tight HTTP limits (`slow_gateway`, for test_http_limits.py and test_http_pipelining.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gateway.settings import Settings
from tests.conftest import Gateway, RedisServer, running_gateway
from tests.gateway.raw_http import limited_settings
from tests.stubs import ServerThread, StubState


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


@pytest.fixture
def slow_gateway(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    """A gateway whose requests must arrive whole within `DEADLINE_S` and whose stalled writes are cut after it
    (tests/gateway/raw_http.py `limited_settings`)."""
    with running_gateway(limited_settings(gateway_settings), stub[1]) as gw:
        yield gw
