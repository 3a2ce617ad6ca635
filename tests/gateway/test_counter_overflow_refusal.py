"""A request whose cost would overflow a spend counter (int64 in Redis: a tenant with no budget that has spent $9.2M
on a scope this month) is refused, through a real gateway on memory and on a real redis-server, with words of its own:
a 429 `quota_counter_overflow` that says which counter would overflow and by what, with a Retry-After until it renews,
and nothing charged. It read "the monthly budget of your tenant is spent" (code `insufficient_quota`) on Redis, for a
tenant without a budget, and the in-process store admitted it (Python's integers do not overflow), so the two stores
answered the same request differently."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from gateway.settings import Settings
from quotas.backends.base import COUNTER_MAX
from tests.conftest import Gateway, running_gateway
from tests.stubs import ServerThread, StubState

EMBEDDER = "all-MiniLM-L6-v2"
HI = {"model": "mid", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
NEARLY_FULL = COUNTER_MAX - 1  # picodollars: any request that costs anything overflows it


def _month() -> str:
    return time.strftime("%Y%m", time.gmtime())


@pytest.fixture(params=["memory", "redis"])
def full_month(request: pytest.FixtureRequest, gateway_settings: Settings, stub: tuple[ServerThread, StubState]
               ) -> Iterator[tuple[Gateway, object]]:
    """A gateway whose tenant `acme` (plan `standard`: no budget) has its month's spend counter nearly full; and a
    reader of that counter."""
    settings = gateway_settings
    if request.param == "redis":
        settings = settings.model_copy(update={"redis_url": request.getfixturevalue("redis_url")})
    with running_gateway(settings, stub[1]) as gw:
        if request.param == "memory":
            scope = gw.app.state.services.quota_backend._scope("acme", "t")
            scope.spent_month[_month()] = NEARLY_FULL
            yield gw, lambda: scope.spent_month[_month()]
        else:
            client = redis.Redis.from_url(settings.redis_url)
            key = f"{{tg:acme}}:t:month:{_month()}"
            client.set(key, NEARLY_FULL)
            yield gw, lambda: int(client.get(key))
            client.close()


def test_a_cost_that_would_overflow_a_spend_counter_is_refused_in_its_own_words(
        full_month: tuple[Gateway, object]) -> None:
    gw, month_spent = full_month
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=HI)
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "quota_counter_overflow", error  # before: insufficient_quota (Redis), or admitted (memory)
    assert "would overflow that counter" in error["message"] and "monthly spend counter of your tenant" in error[
        "message"], error
    assert "budget of your tenant is spent" not in error["message"]  # before, on Redis, for a tenant with no budget
    assert int(r.headers["retry-after"]) >= 1  # the month's counter renews with the next month
    assert month_spent() == NEARLY_FULL  # nothing charged


def test_an_embeddings_bound_that_would_overflow_a_counter_is_counted_before_it_is_refused(gateway: Gateway) -> None:
    """An embeddings request reserves its texts' upper bound first; a bound refused for the tokens it would add is
    counted exactly and reserved at its count (gateway/embeddings_service.py TOKEN_REASONS). A bound that would only
    overflow the token counter is such a refusal too: its count may fit (refused at the bound, it never was)."""
    with gateway.client(gateway.tenant_key) as c:  # the service is built on first use
        assert c.post("/v1/embeddings", json={"model": EMBEDDER, "input": "warm up"}).status_code == 200
    scope = gateway.app.state.services.quota_backend._scope("acme", "t")
    scope.token_sum = COUNTER_MAX - 200  # room for the count (40 x 4 = 160), not the bound (40 x 13 = 520)
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/embeddings", json={"model": EMBEDDER, "input": ["hello world"] * 40}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 160
    assert scope.token_sum == COUNTER_MAX - 40
