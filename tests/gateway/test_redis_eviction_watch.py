"""gateway/redis_eviction_watch.py on real redis-servers: a maxmemory-policy changed while the gateway runs (an
operator's CONFIG SET, a failover to a replica configured otherwise) is seen within TIERGATE_REDIS_EVICTION_CHECK_S:
logged once, exported on /metrics, shown in /health's admin details, and /health answers 503 unless eviction is
allowed. Start-up alone checked it before, and a gateway kept running on a Redis evicting its quota counters."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.redis_eviction_watch import RedisEvictionWatch
from gateway.settings import Settings
from tests.conftest import Gateway, StubState, running_gateway, stub_tiers_yaml
from tests.stubs import ServerThread

EVERY_S = 0.1  # the test's interval: the default is 30 s
WAIT_S = 20.0  # how long a test waits for what it expects, far beyond the interval on a loaded machine
LIMITED = ("--maxmemory", "100mb")


def operator(url: str) -> redis.Redis:
    """A client of the test's own: the operator's redis-cli."""
    return redis.Redis.from_url(url, socket_timeout=5, decode_responses=True)




@pytest.fixture
def ready_settings(gateway_settings: Settings, stub: tuple[ServerThread, StubState], tmp_path: Path) -> Settings:
    """The test gateway with only tiers that answer: /health says 200 until something else holds it back."""
    tiers = tmp_path / "ready-tiers.yaml"
    tiers.write_text(stub_tiers_yaml(small=stub[0].url, mid=stub[0].url, full=stub[0].url))
    return gateway_settings.model_copy(update={"tiers_file": tiers, "redis_eviction_check_s": EVERY_S,
                                               "cache_enabled": False})  # no embedder to load


@pytest.fixture
def guarded(ready_settings: Settings, stub, redis_with) -> Iterator[tuple[Gateway, str]]:
    """A gateway on a Redis with a password, on `noeviction` for now; eviction not allowed. Started before the test
    (as a fixture): the app's logging set-up replaces the handlers of the logging that the test began with."""
    server = redis_with(*LIMITED, "--maxmemory-policy", "noeviction", "--requirepass", "s3cret-pw")
    url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
    with running_gateway(ready_settings.model_copy(update={"redis_url": url}), stub[1]) as gw:
        yield gw, url


@pytest.fixture
def allowing(ready_settings: Settings, stub, redis_with) -> Iterator[tuple[Gateway, str]]:
    """As `guarded`, without a password, and with TIERGATE_REDIS_ALLOW_EVICTION=1."""
    server = redis_with(*LIMITED, "--maxmemory-policy", "noeviction")
    settings = ready_settings.model_copy(update={"redis_url": server.url, "redis_allow_eviction": True})
    with running_gateway(settings, stub[1]) as gw:
        yield gw, server.url


def health(gw: Gateway) -> tuple[int, dict[str, Any]]:
    with gw.client(gw.admin_key) as c:
        r = c.get("/health")
    return r.status_code, r.json()


def metrics(gw: Gateway) -> str:
    with gw.client(gw.admin_key) as c:
        return c.get("/metrics").text


def wait_for(what: Callable[[], Any], why: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if found := what():
            return found
        time.sleep(EVERY_S / 2)
    raise AssertionError(f"not seen within {WAIT_S} s: {why}")


def logged(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()]


def rounds_pass(gw: Gateway, n: int = 5) -> None:
    """At least `n` more rounds of the watch run (its own count, not a sleep guessed long enough)."""
    watch = gw.app.state.services.redis_eviction
    target = watch.rounds + n
    wait_for(lambda: watch.rounds >= target, f"{n} more rounds of the watch")


def test_a_policy_changed_while_running_fails_readiness_once_logged(guarded: tuple[Gateway, str],
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    gw, url = guarded
    caplog.set_level(logging.INFO, logger="tiergate.gateway")
    status, body = health(gw)
    assert status == 200 and body["redis"]["may_evict"] is False and body["redis"]["not_ready"] is None
    assert "tiergate_redis_may_evict 0.0" in metrics(gw)

    with operator(url) as cli:
        cli.config_set("maxmemory-policy", "allkeys-lru")
    status, body = wait_for(lambda: (h := health(gw))[0] == 503 and h, "/health 503 on allkeys-lru")
    redis = body["redis"]
    assert redis["may_evict"] is True and redis["maxmemory_policy"] == "allkeys-lru"
    assert "maxmemory-policy allkeys-lru" in redis["not_ready"]
    assert "TIERGATE_REDIS_ALLOW_EVICTION=1" in redis["not_ready"]
    assert "tiergate_redis_may_evict 1.0" in metrics(gw)
    with gw.client() as c:  # a load balancer's probe: not ready, and nothing of why
        r = c.get("/health")
    assert (r.status_code, r.json()) == (503, {"status": "starting"})
    with gw.client(gw.tenant_key) as c:  # requests routed here are still served, and billed
        assert c.post("/v1/chat/completions", json={"model": "mid", "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 200
    rounds_pass(gw)
    [error] = logged(caplog, logging.ERROR, "maxmemory-policy allkeys-lru")  # once, not every round
    assert "/health answers 503" in error and "noeviction" in error

    with operator(url) as cli:
        cli.config_set("maxmemory-policy", "noeviction")
    status, body = wait_for(lambda: (h := health(gw))[0] == 200 and h, "/health 200 again on noeviction")
    assert body["redis"]["may_evict"] is False and "tiergate_redis_may_evict 0.0" in metrics(gw)
    rounds_pass(gw)
    [back] = logged(caplog, logging.INFO, "maxmemory-policy noeviction")
    assert "evicts no key" in back
    assert "s3cret-pw" not in caplog.text


def test_allowed_eviction_keeps_readiness_and_warns_once(allowing: tuple[Gateway, str],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    gw, url = allowing
    with operator(url) as cli:
        cli.config_set("maxmemory-policy", "volatile-lru")
    wait_for(lambda: "tiergate_redis_may_evict 1.0" in metrics(gw), "the gauge at 1")
    status, body = health(gw)
    assert status == 200 and body["redis"]["may_evict"] is True and body["redis"]["not_ready"] is None
    rounds_pass(gw)
    [warning] = logged(caplog, logging.WARNING, "maxmemory-policy volatile-lru")
    assert "TIERGATE_REDIS_ALLOW_EVICTION=1" in warning
    assert logged(caplog, logging.ERROR, "maxmemory-policy") == []


def watch_rounds(url: str, rounds: int, between: Callable[[int], object] = lambda _: None, *,
                 allow_eviction: bool = False) -> RedisEvictionWatch:
    """`rounds` rounds of a watch of its own (no gateway), `between(i)` before each."""
    async def run() -> RedisEvictionWatch:
        watch = RedisEvictionWatch(url, every_s=EVERY_S, allow_eviction=allow_eviction)
        for i in range(rounds):
            between(i)
            await watch.check()
        await watch.stop()
        return watch

    return asyncio.run(run())


def test_a_redis_refusing_config_is_not_judged_and_not_logged_every_round(redis_with,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    server = redis_with(*LIMITED, "--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", "")
    watch = watch_rounds(server.url, 5)
    assert watch.may_evict is None and watch.not_ready_reason is None  # as start-up: a warning there, no refusal
    assert watch.unread and "CONFIG" in watch.unread
    assert watch.evicted_keys == 0  # INFO still answers: evictions are still counted
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []  # start-up said it already


def test_evicted_keys_are_counted_and_logged_once_a_spell(redis_with, caplog: pytest.LogCaptureFixture) -> None:
    server = redis_with("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    value = "x" * 10_000

    def fill(i: int) -> None:
        if i in (1, 2, 4):  # evictions before rounds 1 and 2 (one spell), none before 3, some before 4 (another)
            with operator(server.url) as cli, cli.pipeline(transaction=False) as pipe:
                for k in range(400):  # 4 MB into 2
                    pipe.set(f"k{i}:{k}", value)
                pipe.execute()

    watch = watch_rounds(server.url, 5, fill, allow_eviction=True)
    assert watch.evicted_keys is not None and watch.evicted_keys > 0
    spells = logged(caplog, logging.WARNING, "has evicted keys")
    assert len(spells) == 2 and all("INFO stats evicted_keys" in s for s in spells)
    assert watch.not_ready_reason is None  # allowed: readiness kept


def test_config_denied_later_then_redis_down_keeps_the_last_verdict(redis_with,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A failover to a replica that refuses CONFIG (a managed one), then an outage: each said once, and /health
    keeps what was last read, here that the Redis may evict."""
    caplog.set_level(logging.INFO, logger="tiergate.gateway")
    server = redis_with(*LIMITED, "--maxmemory-policy", "allkeys-lru")

    def change(i: int) -> None:
        if i == 1:
            with operator(server.url) as cli:
                cli.acl_setuser("default", enabled=True, nopass=True, commands=["-config"])
        elif i == 4:
            server.stop()

    watch = watch_rounds(server.url, 7, change)
    assert watch.may_evict is True and watch.not_ready_reason is not None
    assert watch.unread is not None and "CONFIG GET answered" in watch.unread
    [denied] = logged(caplog, logging.WARNING, "any more")
    assert "noeviction" in denied
    down = [r.getMessage() for r in caplog.records if "failed (logged once" in r.getMessage()]
    assert down and len(down) == len(set(down)) < 3  # 3 rounds failed: each distinct fault once (closed, refused)
    assert all("ConnectionError" in line for line in down)
