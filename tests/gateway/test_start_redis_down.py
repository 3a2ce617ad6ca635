"""A gateway starts with its Redis down (TIERGATE_REDIS_FAILURE_MODE `open`: quotas on local limits) and serves; the
ladder runs at level 0 with its shared state unknown, and takes the real state at the first tick after Redis comes
up. It did not start: the ladder's constructor read its state from Redis and raised, so `tiergate serve` exited 3 and
a Redis outage with a restart was a full outage.

The answer cache is off here, to test the ladder alone: a cache started with its Redis down is
tests/gateway/test_start_cache_redis_down.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.ladder.state import READ_MESSAGE, LadderState, state_json
from gateway.settings import Settings
from tests.conftest import Gateway, RedisServer, running_gateway
from tests.gateway.test_degrade_api import LADDER, MSG
from tests.stubs import ServerThread, StubState


@pytest.fixture
def later_redis() -> Iterator[RedisServer]:
    """A Redis on a port of its own, not started: the test starts it, locked (a password the gateway has not), and
    opens it once it holds the state the test puts there."""
    server = RedisServer("--requirepass", "setting-up")
    yield server
    server.stop()


@pytest.fixture
def redis_down(gateway_settings: Settings, stub: tuple[ServerThread, StubState], later_redis: RedisServer,
               tmp_path: Path) -> Iterator[Gateway]:
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    settings = gateway_settings.model_copy(update={
        "ladder_file": f, "redis_url": later_redis.url, "ladder_tick_s": 0.1, "cache_enabled": False})
    assert settings.redis_failure_mode == "open"
    with running_gateway(settings, stub[1]) as gw:
        yield gw


def degrade_status(gw: Gateway) -> dict:  # type: ignore[type-arg]
    with gw.client(gw.admin_key) as c:
        r = c.get("/admin/degrade/")
    assert r.status_code == 200, r.text
    return r.json()


def test_the_gateway_starts_and_serves_with_redis_down_and_reads_the_ladder_when_it_is_up(
        redis_down: Gateway, later_redis: RedisServer) -> None:
    with redis_down.client(redis_down.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "full", "messages": MSG})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello from the stub upstream ."
    assert r.headers["x-tiergate-degrade-level"] == "0"
    status = degrade_status(redis_down)
    assert status["level"] == 0 and status["source"] == "unknown" and status["manual"] is None
    assert status["shared_state"]["read"] is False and READ_MESSAGE in status["shared_state"]["error"]
    with redis_down.client(redis_down.admin_key) as c:  # on-call's change: the store's 503, as in a running outage
        r = c.post("/admin/degrade/", json={"level": 2, "reason": "drill"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "ladder_state_unavailable", r.text

    later_redis.start()  # what the other replicas hold: level 2, held by on-call
    shared = state_json(LadderState(manual_level=2, manual_by="k1", manual_reason="incident"))
    client = redis.Redis.from_url(later_redis.url, password="setting-up")
    client.set("tg:degrade:state", shared)
    assert degrade_status(redis_down)["shared_state"]["read"] is False  # locked: still a failed read
    client.config_set("requirepass", "")  # Redis is up for the gateway
    deadline = time.time() + 20
    while (status := degrade_status(redis_down))["shared_state"]["read"] is False and time.time() < deadline:
        time.sleep(0.05)
    assert status["level"] == 2 and status["source"] == "manual" and status["manual"]["reason"] == "incident"
    assert status["shared_state"] == {"read": True, "error": None}
    assert client.get("tg:degrade:state") == shared.encode()  # read, never written over
    with redis_down.client(redis_down.tenant_key) as c:
        assert c.post("/v1/chat/completions", json={"model": "full", "messages": MSG}
                      ).headers["x-tiergate-degrade-level"] == "2"
    client.close()
