"""gateway/redis_eviction.py on real redis-servers: the gateway refuses to start on a Redis that may evict its keys
(quota counters, reservations, idempotency records, cache entries and their counts), starts on `noeviction`, starts
with one warning when the operator allows eviction or when the server refuses CONFIG (a managed Redis)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.app import create_app
from gateway.cli.main import cli
from gateway.redis_eviction import RedisEvicts
from gateway.settings import Settings
from gateway.stores import open_tenant_store
from tests.stubs import free_port

EVICTING = ("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")




def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "maxmemory" in r.getMessage()]


def test_an_evicting_redis_stops_start_up_with_the_setting_and_the_fix(gateway_settings: Settings, redis_with,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    server = redis_with(*EVICTING)
    with pytest.raises(RedisEvicts) as exc:
        create_app(gateway_settings.model_copy(update={"redis_url": server.url}))
    message = str(exc.value)
    assert "\n" not in message
    assert "maxmemory-policy allkeys-lru" in message and "maxmemory 104857600" in message
    assert "TIERGATE_REDIS_URL" in message and "127.0.0.1" in message
    assert "`maxmemory-policy noeviction`" in message and "TIERGATE_REDIS_ALLOW_EVICTION=1" in message


@pytest.mark.parametrize("policy", ["volatile-lru", "allkeys-lfu", "allkeys-random", "volatile-ttl"])
def test_every_policy_but_noeviction_is_refused_when_maxmemory_is_set(gateway_settings: Settings, redis_with,
                                                                      policy: str) -> None:
    server = redis_with("--maxmemory", "100mb", "--maxmemory-policy", policy)
    with pytest.raises(RedisEvicts, match=f"maxmemory-policy {policy}"):
        create_app(gateway_settings.model_copy(update={"redis_url": server.url}))


def test_serve_on_an_evicting_redis_stops_with_one_line_before_anything_starts(gateway_settings: Settings,
                                                                               prepared_models: Path,
                                                                               redis_with) -> None:
    server = redis_with(*EVICTING, "--requirepass", "s3cret-pw")
    url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
    s = gateway_settings
    store = open_tenant_store(s)  # a tenant on a plan the file lacks stops serve later, once it reads the tenants:
    store.create_tenant("old", "retired")  # the Redis check comes first (and a serve that passed it ends here)
    store.close()
    r = CliRunner().invoke(cli, ["serve", "--tiers", str(s.tiers_file), "--plans", str(s.plans_file),
                                 "--models-dir", str(prepared_models), "--data-dir", str(s.data_dir),
                                 "--port", str(free_port())], env={"TIERGATE_REDIS_URL": url})
    assert r.exit_code == 1, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "maxmemory-policy allkeys-lru" in errors[0], r.output
    assert "noeviction" in errors[0]
    assert "s3cret-pw" not in r.output and "retired" not in r.output


def test_noeviction_starts_without_a_warning(gateway_settings: Settings, redis_with,
                                             caplog: pytest.LogCaptureFixture) -> None:
    server = redis_with("--maxmemory", "100mb", "--maxmemory-policy", "noeviction")
    create_app(gateway_settings.model_copy(update={"redis_url": server.url}))
    assert warnings(caplog) == []


def test_an_evicting_policy_without_maxmemory_starts(gateway_settings: Settings, redis_with,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    server = redis_with("--maxmemory-policy", "allkeys-lru")  # no limit: nothing is ever evicted
    create_app(gateway_settings.model_copy(update={"redis_url": server.url}))
    assert warnings(caplog) == []


def test_allowing_eviction_starts_with_one_warning(gateway_settings: Settings, redis_with,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    server = redis_with(*EVICTING, "--requirepass", "s3cret-pw")
    url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
    create_app(gateway_settings.model_copy(update={"redis_url": url, "redis_allow_eviction": True}))
    [warning] = warnings(caplog)
    assert "maxmemory-policy allkeys-lru" in warning and "TIERGATE_REDIS_ALLOW_EVICTION=1" in warning
    assert "s3cret-pw" not in caplog.text


def test_a_redis_without_config_starts_with_one_warning(gateway_settings: Settings, redis_with,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    server = redis_with(*EVICTING, "--rename-command", "CONFIG", "")  # as managed Redis services do
    create_app(gateway_settings.model_copy(update={"redis_url": server.url}))
    [warning] = warnings(caplog)
    assert "could not check the maxmemory-policy" in warning and "noeviction" in warning


def test_a_redis_down_at_start_up_starts_with_one_warning(gateway_settings: Settings,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0"  # nothing listens: the gateway starts without Redis
    create_app(gateway_settings.model_copy(update={"redis_url": url}))
    [warning] = warnings(caplog)
    assert "could not check the maxmemory-policy" in warning
    assert "s3cret-pw" not in caplog.text
