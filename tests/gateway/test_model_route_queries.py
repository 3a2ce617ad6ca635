"""The OpenAI routes take no query parameter, and one sent is refused by name (400 `unsupported_parameter`), never
dropped: `POST /v1/chat/completions?stream=true` was answered whole, `?user=u` kept no end user apart, `GET
/v1/models?zz=1` listed the models, each a 200 as if the client had not asked. The key is checked first (a request
without one is a 401, as without a query), and a refused request reaches no tier and writes no row."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Gateway

MSG = [{"role": "user", "content": "hello"}]
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/chat/completions", {"model": "mid", "messages": MSG, "max_tokens": 4}),
    ("POST", "/v1/completions", {"model": "mid", "prompt": "hello", "max_tokens": 4}),
    ("POST", "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "hello"}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/mid", None),
]
QUERIES = [("stream=true", "stream"), ("user=u&zz=1", "user"), ("api-version=2024-10-21", "api-version")]
IDS = [f"{method} {path}" for method, path, _ in ROUTES]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=IDS)
def test_a_query_parameter_is_refused_by_name(gateway: Gateway, method: str, path: str,
                                              body: dict[str, Any] | None) -> None:
    with gateway.client(gateway.tenant_key) as c:
        for query, param in QUERIES:
            r = c.request(method, f"{path}?{query}", json=body)
            assert r.status_code == 400, (query, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert (error["param"], error["code"], error["type"]) == (param, "unsupported_parameter",
                                                                       "invalid_request_error"), r.text
            assert error["message"].startswith(f"{param}: unsupported query parameter"), r.text
        assert gateway.stub.requests == [] and gateway.ledger_rows() == []
        assert c.request(method, path, json=body).status_code == 200  # the same request without its query
        assert c.request(method, f"{path}?", json=body).status_code == 200  # an empty query is none


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=IDS)
def test_the_key_is_checked_first(gateway: Gateway, method: str, path: str, body: dict[str, Any] | None) -> None:
    with gateway.client(None) as c:
        r = c.request(method, f"{path}?zz=1", json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
