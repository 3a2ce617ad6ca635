"""Quotas through the HTTP API: 429s a client can act on, nothing charged on refusal, budgets that
survive a restart, admission control, and Redis failing open or closed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from decimal import Decimal

import pytest

from gateway.settings import Settings
from quotas.dispatch import Ticket
from tests.conftest import Gateway, RedisServer, running_gateway
from tests.stubs import ServerThread, StubState

MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def metered(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    with running_gateway(gateway_settings, stub[1], plan="metered") as gw:
        yield gw


def chat(gw: Gateway, key: str | None = None, **body: object):  # type: ignore[no-untyped-def]
    with gw.client(key or gw.tenant_key) as c:
        return c.post("/v1/chat/completions", json={"model": "auto", "messages": MSG, "max_tokens": 5} | body)


def test_rpm_refusal_has_retry_after_and_ratelimit_headers(metered: Gateway) -> None:
    ok = [chat(metered) for _ in range(3)]
    assert all(r.status_code == 200 for r in ok)
    assert ok[0].headers["x-ratelimit-limit-requests"] == "3"
    assert [r.headers["x-ratelimit-remaining-requests"] for r in ok] == ["2", "1", "0"]
    assert ok[0].headers["x-ratelimit-limit-tokens"] == "100000" and "x-ratelimit-reset-tokens" in ok[0].headers
    r = chat(metered)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_rpm"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert r.headers["x-ratelimit-remaining-requests"] == "0" and r.headers["x-ratelimit-reset-requests"].endswith("s")
    assert len(metered.ledger_rows()) == 3 and len(metered.stub.requests) == 3  # the refusal spent nothing


def test_budget_is_reserved_then_settled_and_refusals_say_insufficient_quota(metered: Gateway) -> None:
    """mid costs $0.001/1K in, $0.002/1K out; the day budget is $0.005. A 2,000-token cap reserves about
    $0.004, so while that request runs a 1,000-token request does not fit; once it settles to its real
    (tiny) cost, the same request does."""
    slow = [{"role": "user", "content": "STUB:slow"}]
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(chat, metered, None, max_tokens=2000, messages=slow)
        deadline = time.time() + 5
        while not metered.stub.requests and time.time() < deadline:
            time.sleep(0.01)
        r = chat(metered, max_tokens=1000)
        assert r.status_code == 429 and r.json()["error"]["type"] == "insufficient_quota"
        assert r.json()["error"]["code"] == "insufficient_quota" and int(r.headers["retry-after"]) > 0
        assert first.result().status_code == 200
    assert chat(metered, max_tokens=1000).status_code == 200
    rows = metered.ledger_rows()
    assert len(rows) == 2 and sum(r.price_usd for r in rows) < Decimal("0.0001")


def test_a_tenant_over_its_budget_is_refused_before_the_cache_lookup_after_the_first_refusal(
        metered: Gateway) -> None:
    """A budget refusal fills no request window: before, each of a flood of them was routed, counted and looked
    up in the cache (an embedding on the queue every tenant shares), then refused, uncharged. Now the gate
    remembers it for a second; then the exact check is asked again. (The budget is spent here by an answer of 2,000
    tokens, $0.004 of $0.005: the flood's requests would fit a budget not spent. Before, they each cost more than the
    whole budget, refused as never admitted, and the gate told the ones after the first that the budget was spent.)"""
    lookups = metered.app.state.services.cache.cache.stats
    spend = chat(metered, max_tokens=2000, messages=[{"role": "user", "content": "STUB:big"}])
    assert spend.status_code == 200 and spend.json()["usage"]["completion_tokens"] == 2000

    def over_budget(i: int):  # type: ignore[no-untyped-def]  # mid's 1,000-token cap reserves $0.002 of $0.001 left
        return chat(metered, max_tokens=1000, temperature=0,
                    messages=[{"role": "user", "content": f"question number {i} about the weather"}])

    before = lookups.misses
    refused = [over_budget(i) for i in range(6)]
    assert all(r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota" for r in refused)
    assert all("is spent" in r.json()["error"]["message"] for r in refused)
    assert lookups.misses == before + 1 and len(metered.stub.requests) == 1  # one lookup, no tier call, no charge
    time.sleep(1.1)  # RATE_RECHECK_S: the exact check is asked again
    assert over_budget(7).status_code == 429 and lookups.misses == before + 2
    assert chat(metered).status_code == 429  # a small request too waits out the second: the policy's price
    time.sleep(1.1)
    assert chat(metered).status_code == 200 and len(metered.ledger_rows()) == 2


def test_key_limits_apply_on_top_of_the_plan(metered: Gateway) -> None:
    from quotas.plans import Limits

    _, key = metered.store.issue_key("acme", limits=Limits(rpm=1))
    assert chat(metered, key).status_code == 200
    r = chat(metered, key)
    assert r.status_code == 429 and "your key" in r.json()["error"]["message"]
    assert chat(metered).status_code == 200  # the tenant's other key is not held back by it


def test_embedded_budgets_survive_a_restart(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> None:
    with running_gateway(gateway_settings, stub[1], plan="metered") as gw:
        assert all(chat(gw).status_code == 200 for _ in range(3))
    with running_gateway(gateway_settings, stub[1]) as gw:  # same data dir: seeded from the ledger
        r = chat(gw)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_rpm"


@contextmanager
def full_tier_backed_up(gw: Gateway) -> Iterator[None]:
    """The full tier is busy and 10,000 tokens wait ahead, served at a measured 100 tokens/s."""
    q = gw.app.state.services.queues["full"]
    q.in_flight, q.tokens_per_s = q.capacity, 100.0
    q.waiting[0].append(Ticket("other", 0, 1.0, 10_000, seq=-1))
    try:
        yield
    finally:
        q.waiting[0].clear()
        q.in_flight = 0


def test_predicted_wait_over_the_plan_is_503_before_any_work(gateway_settings: Settings,
                                                              stub: tuple[ServerThread, StubState]) -> None:
    with running_gateway(gateway_settings, stub[1], plan="queued") as gw:
        with full_tier_backed_up(gw):
            r = chat(gw)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
            assert int(r.headers["retry-after"]) >= 100
            assert gw.ledger_rows() == [] and gw.stub.requests == []
        assert chat(gw).status_code == 200


def test_an_overloaded_tier_sheds_to_a_cheaper_one_where_the_plan_allows(
        gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> None:
    with running_gateway(gateway_settings, stub[1], plan="shedding") as gw:
        with full_tier_backed_up(gw):
            r = chat(gw)
        assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "mid"
        assert "shed to mid" in r.headers["x-tiergate-route-reason"]
        assert gw.ledger_rows()[0].route_reason.endswith("shed to mid")


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_kill_and_restart(mode: str, gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> None:
    redis = RedisServer().start()
    settings = gateway_settings.model_copy(update={"redis_url": redis.url, "redis_failure_mode": mode})
    try:
        with running_gateway(settings, stub[1]) as gw:
            assert chat(gw).status_code == 200
            redis.stop()
            during = [chat(gw) for _ in range(3)]
            if mode == "open":
                assert all(r.status_code == 200 for r in during)
            else:
                assert all(r.status_code == 503 for r in during)
                assert during[0].json()["error"]["code"] == "quota_backend_unavailable"
                assert "retry-after" in during[0].headers
            with gw.client(gw.admin_key) as c:
                assert "tiergate_redis_up 0.0" in c.get("/metrics").text
            redis.start()
            time.sleep(1.1)  # the gateway tries Redis again at most once a second
            assert chat(gw).status_code == 200
            with gw.client(gw.admin_key) as c:
                text = c.get("/metrics").text
            assert "tiergate_redis_up 1.0" in text
            assert 'tiergate_redis_state_changes_total{to="down"} 1.0' in text
            ok = 2 + (3 if mode == "open" else 0)
            assert len(gw.ledger_rows()) == ok
            # the rows served on the fallback carry their mark: their money reaches Redis from the ledger
            assert sum(r.fallback is not None for r in gw.ledger_rows()) == ok - 2
    finally:
        redis.stop()
