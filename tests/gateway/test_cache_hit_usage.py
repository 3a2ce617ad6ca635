"""A semantic hit reports and bills this request's own prompt tokens (cache/results.py `Hit.request_usage`), not the
stored answer's request's: the client is told its own prompt's length, and charged the plan's hit price on it and the
cached answer's completion tokens. Before: a paraphrase was told the length of the prompt that stored the answer, and
charged for it. An exact hit's prompt is the stored one's: its count, as the tier reported it, is kept."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from decimal import Decimal
from typing import Any

import httpx
import pytest

from cache import Entry, Hit
from gateway.ladder.apply import NORMAL
from gateway.pipeline.cache_lookup import CacheStage
from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.gateway.test_cache_api import wait_for_stores
from tests.stubs import REPLY, ServerThread, StubState
from wire.chat_request import ChatCompletionRequest

STORED = "What is the capital of France?"
PARAPHRASE = "What's the capital of France?"  # a semantic hit of STORED (test_cache_api.py)
STORED_PROMPT_TOKENS = 1234  # what the stored answer's request "counted": no paraphrase counts that many
HIT_PRICE_PER_1K = Decimal("1")
N = len(REPLY.split())


@pytest.fixture
def gw(gateway_settings: Settings, stub: tuple[ServerThread, StubState],
       monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    """The gateway, tenant `acme` on a plan whose hits cost $1 per 1k tokens, whose fresh answers are stored with
    STORED_PROMPT_TOKENS prompt tokens."""
    gateway_settings.plans_file.write_text(gateway_settings.plans_file.read_text().replace(
        "plans:\n", "plans:\n  pricedhits:\n    allowed_tiers: [mid, full]\n    default_tier: mid\n"
                    f"    cache: {{shadow_check_rate: 0, hit_price_per_1k: \"{HIT_PRICE_PER_1K}\"}}\n", 1))
    save = CacheStage.save
    monkeypatch.setattr(CacheStage, "save", lambda self, lookup, outcome, applied: save(
        self, lookup, replace(outcome, input_tokens=STORED_PROMPT_TOKENS), applied))
    with running_gateway(gateway_settings, stub[1], plan="pricedhits") as gateway:
        yield gateway


def _body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "mid", "temperature": 0, "messages": [{"role": "user", "content": content}]} | extra


def _ask(gw: Gateway, content: str) -> httpx.Response:
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=_body(content))
    wait_for_stores(gw)
    assert r.status_code == 200, r.text
    return r


def _own_count(gw: Gateway, content: str) -> int:
    """The request's prompt tokens as the gateway counts them for its tier (gateway/pipeline/prompt.py)."""
    services = gw.app.state.services
    req = ChatCompletionRequest.model_validate(_body(content))
    return asyncio.run(services.pipeline.prompt.measure(req, services.catalogue.tiers["mid"], NORMAL)).num_tokens


def _hit_price(prompt_tokens: int) -> Decimal:
    return HIT_PRICE_PER_1K * (prompt_tokens + N) / 1000


def test_a_semantic_hit_reports_and_bills_its_own_prompt(gw: Gateway) -> None:
    _ask(gw, STORED)
    own = _own_count(gw, PARAPHRASE)
    assert own != STORED_PROMPT_TOKENS
    hit = _ask(gw, PARAPHRASE)
    assert (hit.headers["x-tiergate-cache"], hit.headers["x-tiergate-cache-kind"]) == ("hit", "semantic")
    assert hit.json()["choices"][0]["message"]["content"] == REPLY
    assert hit.json()["usage"] == {"prompt_tokens": own, "completion_tokens": N, "total_tokens": own + N}
    _, row = gw.ledger_rows()
    assert row.cache_status == "hit"
    assert (row.input_tokens, row.output_tokens) == (own, N)
    assert row.price_usd == _hit_price(own)


def test_a_streamed_semantic_hit_reports_its_own_prompt_in_its_last_usage_chunk(gw: Gateway) -> None:
    _ask(gw, STORED)
    own = _own_count(gw, PARAPHRASE)
    with gw.client(gw.tenant_key) as c, c.stream("POST", "/v1/chat/completions", json=_body(
            PARAPHRASE, stream=True, stream_options={"include_usage": True})) as r:
        assert r.headers["x-tiergate-cache-kind"] == "semantic"
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (own, N)
    _, row = gw.ledger_rows()
    assert (row.input_tokens, row.output_tokens, row.price_usd) == (own, N, _hit_price(own))


def test_an_exact_hit_reports_the_stored_count_of_its_own_prompt(gw: Gateway) -> None:
    _ask(gw, STORED)
    hit = _ask(gw, STORED)
    assert hit.headers["x-tiergate-cache-kind"] == "exact"
    assert hit.json()["usage"]["prompt_tokens"] == STORED_PROMPT_TOKENS  # the same prompt's, as stored
    _, row = gw.ledger_rows()
    assert (row.input_tokens, row.output_tokens) == (STORED_PROMPT_TOKENS, N)
    assert row.price_usd == _hit_price(STORED_PROMPT_TOKENS)


@pytest.mark.parametrize(("kind", "counted", "prompt_tokens"), [
    ("semantic", 37, 37),  # its own count
    ("semantic", None, STORED_PROMPT_TOKENS),  # not counted (its tier's tokenizer not prepared): the stored estimate
    ("exact", 37, STORED_PROMPT_TOKENS),  # the same prompt, as its tier reported it
])
def test_a_hits_usage_takes_only_the_answer_from_its_entry(kind: str, counted: int | None, prompt_tokens: int) -> None:
    entry = Entry("e", "s", "acme", "0", "m", "x", "p", STORED, REPLY, usage={
        "prompt_tokens": STORED_PROMPT_TOKENS, "completion_tokens": N, "total_tokens": STORED_PROMPT_TOKENS + N,
        "finish_reason": "stop"})
    hit = Hit(entry, kind, 0.95 if kind == "semantic" else 1.0, counted_prompt=counted)  # type: ignore[arg-type]
    assert hit.request_usage == {"prompt_tokens": prompt_tokens, "completion_tokens": N, "finish_reason": "stop"}
    assert hit.usage == entry.usage  # as stored
