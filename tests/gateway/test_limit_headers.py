"""OpenAI's `x-ratelimit-*` headers follow the scope that binds: a key's own limits as well as its tenant's plan
(gateway/pipeline/reserve.py `ratelimit_headers`, limit_errors.py); and a request no minute or day can ever admit is
told so, without a Retry-After, before the quota store is asked (`too_large`). Before: a key of rpm 1 under a plan
without one was told nothing, and one under a plan of rpm 3 was told the plan's; a key's own 429 carried no header;
a request of more tokens than its tpm was told "retry in 60s"."""

from __future__ import annotations

import httpx

from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hi"}]


def _key(gw: Gateway, tenant: str, limits: dict[str, object]) -> str:
    with gw.client(gw.admin_key) as admin:
        r = admin.post("/admin/keys", json={"tenant": tenant, "limits": limits})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


def _chat(gw: Gateway, key: str, **extra: object) -> httpx.Response:
    with gw.client(key) as c:
        return c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG, "max_tokens": 8} | extra)


def test_a_keys_own_rpm_is_in_its_headers_and_its_429s(gateway: Gateway) -> None:
    key = _key(gateway, "acme", {"rpm": 1})  # acme's plan has no limits
    ok = _chat(gateway, key)
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-ratelimit-limit-requests"] == "1" and ok.headers["x-ratelimit-remaining-requests"] == "0"
    refused = _chat(gateway, key)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_rpm", refused.text
    assert refused.headers["x-ratelimit-limit-requests"] == "1"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0" and "x-ratelimit-reset-requests" in refused.headers


def test_the_headers_tell_the_scope_with_the_least_left(gateway: Gateway) -> None:
    gateway.store.create_tenant("metered-co", "metered")  # rpm 3
    key = _key(gateway, "metered-co", {"rpm": 2, "tpm": 500_000})
    r = _chat(gateway, key)
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-limit-requests"] == "2" and r.headers["x-ratelimit-remaining-requests"] == "1"
    assert r.headers["x-ratelimit-limit-tokens"] == "100000"  # the plan's tpm has less left than the key's


def test_a_request_over_a_whole_tpm_is_told_it_can_never_fit(gateway: Gateway) -> None:
    key = _key(gateway, "acme", {"tpm": 50})
    r = _chat(gateway, key, max_tokens=200)
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "rate_limit_tpm" and error["type"] == "tokens", error
    assert "can never be admitted" in error["message"] and "retry-after" not in r.headers, r.headers
    assert r.headers["x-ratelimit-limit-tokens"] == "50"
    assert _chat(gateway, key, max_tokens=4).status_code == 200  # at once: it used nothing of the key's tpm up
    assert len(gateway.ledger_rows()) == 1


def test_a_request_that_may_cost_more_than_a_whole_budget_is_told_so(gateway: Gateway) -> None:
    key = _key(gateway, "acme", {"budget_day_usd": "0.000002"})
    r = _chat(gateway, key, max_tokens=1000)  # up to 1000 tokens at $0.002 a 1K: more than the day's budget
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "insufficient_quota" and "daily budget of your key" in error["message"], error
    assert "can never be admitted" in error["message"] and "retry-after" not in r.headers
    assert not gateway.ledger_rows() and not gateway.stub.requests
