"""A seeded request's temperature and top_p through the gateway: the tier gets them as sent, and none where the
request sends none (a remote tier then samples with its own defaults: llama.cpp's server 0.8 and 0.95, vLLM the
model's generation_config), so the cache keeps an answer sampled without them apart from one sampled at an explicit
1.0. Through a real gateway in front of a stub that records the bodies it gets."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import Gateway
from tests.gateway.test_cache_api import wait_for_stores

Q = "Tell me a short story about a lighthouse."


def ask_seeded(gw: Gateway, **sent: Any) -> httpx.Response:
    """A seeded chat request with the sampling parameters `sent` and no others."""
    body = {"model": "mid", "seed": 7, "max_tokens": 3, "messages": [{"role": "user", "content": Q}], **sent}
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=body)
    wait_for_stores(gw)
    assert r.status_code == 200, r.text
    return r


def test_absent_and_explicit_1_are_kept_apart(gateway: Gateway) -> None:
    assert ask_seeded(gateway).headers["x-tiergate-cache"] == "miss"
    sent = gateway.stub.requests[-1]
    assert "temperature" not in sent and "top_p" not in sent and sent["seed"] == 7
    assert ask_seeded(gateway, temperature=1.0, top_p=1.0).headers["x-tiergate-cache"] == "miss"
    assert (gateway.stub.requests[-1]["temperature"], gateway.stub.requests[-1]["top_p"]) == (1.0, 1.0)
    assert ask_seeded(gateway, temperature=1.0).headers["x-tiergate-cache"] == "miss"  # top_p left to the tier
    calls = len(gateway.stub.requests)
    for sent in ({}, {"temperature": 1.0, "top_p": 1.0}, {"temperature": 1}, {"temperature": 1, "top_p": 1}):
        r = ask_seeded(gateway, **sent)  # each finds its own answer; an integer is the same number
        assert (r.headers["x-tiergate-cache"], r.headers["x-tiergate-cache-kind"]) == ("hit", "exact"), sent
    assert len(gateway.stub.requests) == calls
