"""A request no window or budget could ever admit (limit_errors.py `too_large`) holds nothing against its tenant's
other requests, and a flood of them is refused before the cache lookup and charged to the tenant's bucket of refused
requests (gateway/pipeline/gate.py), through the whole app. Before: the gate remembered one for a second as the
scope's, so the tenant's next, ordinary request was refused 429 `rate_limit_never_admitted`; and the first of a flood
was looked up in the cache (an embedding on the queue every tenant shares) before it was refused."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.settings import Settings
from quotas.plans import Limits
from tests.conftest import Gateway, running_gateway
from tests.stubs import ServerThread, StubState

MSG = [{"role": "user", "content": "what is the weather like"}]
EMBEDDING_MODEL = "all-MiniLM-L6-v2"


@pytest.fixture
def gw(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    """The gateway with a refused-requests bucket of 4 KB that does not refill in a test."""
    with running_gateway(gateway_settings, stub[1]) as gateway:
        gate = gateway.app.state.services.pipeline.gate
        gate.refused_bytes_burst, gate.refused_bytes_per_s = 4096, 1e-3
        yield gateway


def _key(gw: Gateway, limits: dict[str, object]) -> str:
    with gw.client(gw.admin_key) as admin:
        r = admin.post("/admin/keys", json={"tenant": "acme", "limits": limits})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


def _chat(c: httpx.Client, max_tokens: int) -> httpx.Response:
    # temperature 0: a request the cache may answer, so one that reaches the lookup is looked up
    return c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG, "max_tokens": max_tokens,
                                                "temperature": 0})


@pytest.mark.parametrize("limits", [
    {"tpm": 50},  # 200 tokens of output alone are more than a minute's
    {"budget_day_usd": "0.001"},  # 2,000 tokens of mid's output may cost $0.004, more than the whole day's
], ids=["tpm", "budget"])
def test_a_request_that_fits_right_after_one_that_never_can_is_answered(gw: Gateway, limits: dict[str, object]
                                                                         ) -> None:
    key = _key(gw, limits)
    with gw.client(key) as c:
        never = _chat(c, max_tokens=2000)
        ok = _chat(c, max_tokens=4)  # at once: no second waited out
    assert never.status_code == 429 and "can never be admitted" in never.json()["error"]["message"], never.text
    assert ok.status_code == 200, ok.text
    assert len(gw.stub.requests) == 1 and len(gw.ledger_rows()) == 1


def test_a_flood_of_requests_that_never_fit_is_never_looked_up_and_is_throttled(gw: Gateway) -> None:
    lookups = gw.app.state.services.cache.cache.stats
    key = _key(gw, {"tpm": 50})
    before = lookups.misses
    with gw.client(key) as c:
        codes = [_chat(c, max_tokens=200).json()["error"]["code"] for _ in range(30)]
    refused = codes.index("rate_limit_invalid_requests")  # each charged its body, headers and characters counted
    assert refused >= 1 and set(codes[:refused]) == {"rate_limit_tpm"}, codes
    assert set(codes[refused:]) == {"rate_limit_invalid_requests"}, codes  # every one after, refused at the gate
    assert lookups.misses == before and gw.stub.requests == []  # none looked up in the cache, none sent to a tier


def test_embeddings_that_never_fit_are_charged_the_characters_they_had_counted(gw: Gateway) -> None:
    """Their bound refused, texts are counted before their exact count is refused as never admitted
    (gateway/embeddings_service.py `_count_first`): a flood of them must pay for the counts, as chat's prompts do. Here
    8 KB of texts, charged about 16 times that for the count, empty a bucket their bytes alone would not."""
    gw.app.state.services.pipeline.gate.refused_bytes_burst = 40_000
    key = gw.store.issue_key("acme", name="limited", limits=Limits(tpm=300))[1]
    texts = ["Embeddings map text to vectors; similar meanings land close together. " * 30] * 4  # 256 tokens each
    with gw.client(key) as c:
        never = c.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": texts})
        after = c.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": "hi"})
    assert never.status_code == 429 and "can never be admitted" in never.json()["error"]["message"], never.text
    assert after.status_code == 429 and after.json()["error"]["code"] == "rate_limit_invalid_requests", after.text
