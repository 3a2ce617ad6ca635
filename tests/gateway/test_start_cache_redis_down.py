"""A gateway with the answer cache on its Redis store starts with that Redis down (TIERGATE_REDIS_FAILURE_MODE `open`)
and serves, its cache unloaded: lookups miss, and nothing it cannot scope is served. Once Redis answers, the cache
takes its change log's cursor and loads its index in its writer thread, so an answer another gateway stored before
is a hit again, by its exact key and by meaning (a paraphrase: only the loaded index proposes it). It did not start:
building the cache read the change log's cursor and every vector from Redis and raised, so `tiergate serve` exited 3.

(tests/gateway/test_start_redis_down.py starts one with the cache off: the ladder's side of the same start.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from gateway.settings import Settings
from tests.conftest import Gateway, RedisServer, running_gateway
from tests.gateway.test_cache_api import Q, wait_for_stores
from tests.stubs import REPLY, ServerThread, StubState

PARAPHRASE = "What's the capital of France?"


@pytest.fixture
def later_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis on a port of its own that keeps its data in a file across a stop and a start (SAVE before the stop)."""
    server = RedisServer("--dir", str(tmp_path), "--dbfilename", "cache.rdb")
    yield server
    server.stop()


def ask(gw: Gateway, content: str) -> httpx.Response:
    body = {"model": "mid", "temperature": 0, "messages": [{"role": "user", "content": content}]}
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=body)
    wait_for_stores(gw)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == REPLY
    return r


def test_the_gateway_starts_with_the_caches_redis_down_and_loads_the_cache_when_it_is_up(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState], later_redis: RedisServer) -> None:
    settings = gateway_settings.model_copy(update={"redis_url": later_redis.url})
    assert settings.cache_enabled and settings.redis_failure_mode == "open"
    later_redis.start()
    with running_gateway(settings, stub[1]) as first:  # another gateway (or this one before) stored an answer
        assert ask(first, Q).headers["x-tiergate-cache"] == "miss"
        assert ask(first, Q).headers["x-tiergate-cache"] == "hit"
    client = redis.Redis.from_url(later_redis.url)
    client.save()
    client.close()
    later_redis.stop()

    with running_gateway(settings, stub[1]) as gw:  # Redis down: it starts, and serves
        cache = gw.app.state.services.cache.cache
        assert not cache.loaded and len(cache.index) == 0
        with gw.client(gw.admin_key) as admin:
            assert "tiergate_cache_index_loaded 0.0" in admin.get("/metrics").text
        assert ask(gw, Q).headers["x-tiergate-cache"] == "miss"
        assert not cache.loaded

        later_redis.start()  # up again, holding the answer stored before
        deadline = time.time() + 20
        while (r := ask(gw, Q)).headers["x-tiergate-cache"] != "hit" and time.time() < deadline:
            time.sleep(0.05)
        assert r.headers["x-tiergate-cache"] == "hit" and r.headers["x-tiergate-cache-kind"] == "exact"
        while not cache.loaded and time.time() < deadline:  # a lookup queued the load for the writer thread
            ask(gw, Q)
            time.sleep(0.05)
        assert cache.loaded and len(cache.index) == 1
        with gw.client(gw.admin_key) as admin:
            assert "tiergate_cache_index_loaded 1.0" in admin.get("/metrics").text
        r = ask(gw, PARAPHRASE)
        assert r.headers["x-tiergate-cache"] == "hit" and r.headers["x-tiergate-cache-kind"] == "semantic"
