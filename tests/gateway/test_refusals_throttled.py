"""Refusals of a request's own fault after its parse (a prompt too long for the context, a model not found) are
charged to the tenant's bucket of refused requests (gateway/pipeline/gate.py), as a body that does not parse is:
before, they charged nothing and filled no request window, so a tenant could have the gateway parse and count its
prompts without end. A prompt tokenized before it was refused is charged for its characters tokenized; one refused
unread, for its bytes only. Another tenant's requests are not affected."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from assets.model_source import DEFAULT_MODEL, resolve_model
from gateway.pipeline.gate import TOKENIZED_CHAR_BYTES
from gateway.settings import Settings
from gateway.token_counter import token_counter
from tests.conftest import MODELS_DIR, Gateway, running_gateway
from tests.stubs import ServerThread, StubState

CONTEXT = 4096  # tier mid's, in tests/conftest.py


@pytest.fixture
def gw(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    """The gateway (bodies up to 1 MiB) with a refused-requests bucket of 64 KB that does not refill in a test."""
    with running_gateway(gateway_settings.model_copy(update={"max_body_bytes": 1 << 20}), stub[1]) as gateway:
        gate = gateway.app.state.services.pipeline.gate
        gate.refused_bytes_burst, gate.refused_bytes_per_s = 64_000, 1e-3
        yield gateway


def too_long(content: str) -> dict[str, Any]:
    """A request counted in full and then refused: its prompt fits, but not with `max_tokens` the whole context."""
    return {"model": "mid", "max_tokens": CONTEXT, "messages": [{"role": "user", "content": content}]}


def other_tenant(gw: Gateway) -> str:
    gw.store.create_tenant("beta", "standard")
    return gw.store.issue_key("beta")[1]


def test_prompts_refused_as_too_long_are_throttled_and_another_tenant_is_not(gw: Gateway) -> None:
    content = "hello there " * 100  # 1,200 characters: 19 KB charged for its count, so 64 KB take 3 or 4
    statuses, codes = [], []
    with gw.client(gw.tenant_key) as c:
        for _ in range(8):
            r = c.post("/v1/chat/completions", json=too_long(content))
            statuses.append(r.status_code)
            codes.append(r.json()["error"]["code"])
        small = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
    refused = statuses.index(429)
    assert 1 <= refused <= 5 and set(codes[:refused]) == {"context_length_exceeded"}, codes
    assert set(codes[refused:]) == {"rate_limit_invalid_requests"}, codes  # every one after, refused at the gate
    assert small.status_code == 429 and int(small.headers["retry-after"]) >= 1  # a valid one too, until it refills
    with gw.client(other_tenant(gw)) as c:
        assert c.post("/v1/chat/completions", json=too_long(content)).json()["error"]["code"] == \
            "context_length_exceeded"
        assert c.post("/v1/chat/completions", json={"model": "mid", "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 200
    assert len(gw.stub.requests) == 1  # beta's only


def test_a_prompt_counted_in_full_is_charged_for_its_count(gw: Gateway) -> None:
    spaces = " " * (64_000 // TOKENIZED_CHAR_BYTES + 10)  # few tokens, many characters: all of it is counted
    with gw.client(gw.tenant_key) as c:
        first = c.post("/v1/chat/completions", json=too_long(spaces))
        after = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
    assert first.json()["error"]["code"] == "context_length_exceeded"  # a body of 4 KB, but counted: past 64 KB
    assert after.status_code == 429 and after.json()["error"]["code"] == "rate_limit_invalid_requests"


def test_a_prompt_of_many_empty_messages_is_charged_its_rendered_count(gw: Gateway) -> None:
    """Empty messages have no content to charge, but the chat template writes its markers around each, and those were
    tokenized too: 400 of them are a 13 KB body and an 11 KB prompt (181 KB charged for its count)."""
    messages = [{"role": "user", "content": ""} for _ in range(400)]  # ~2,000 tokens: it fits, not with max_tokens
    with gw.client(gw.tenant_key) as c:
        first = c.post("/v1/chat/completions", json={"model": "mid", "max_tokens": CONTEXT, "messages": messages})
        after = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
    assert first.json()["error"]["code"] == "context_length_exceeded"  # its body alone is far from 64 KB
    assert after.status_code == 429 and after.json()["error"]["code"] == "rate_limit_invalid_requests"


def test_a_prompt_refused_unread_is_charged_its_bytes_only(gw: Gateway) -> None:
    max_token_chars = token_counter(resolve_model(DEFAULT_MODEL, MODELS_DIR)).max_token_chars  # tier mid's tokenizer
    unread = "9" * (CONTEXT * max_token_chars + 1)  # more than the context can hold: never tokenized
    assert len(unread) > 64_000 // TOKENIZED_CHAR_BYTES
    gate = gw.app.state.services.pipeline.gate
    gate.refused_bytes_burst = len(unread) + 20_000  # its bytes fit; as many again tokenized would not
    with gw.client(gw.tenant_key) as c:
        first = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": unread}]})
        after = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
    assert first.json()["error"]["code"] == "context_length_exceeded"
    assert after.status_code == 200


def test_requests_for_a_model_not_found_are_charged(gw: Gateway) -> None:
    gate = gw.app.state.services.pipeline.gate
    gate.refused_bytes_burst = 4096
    with gw.client(gw.tenant_key) as c:
        first = c.post("/v1/chat/completions", json={"model": "no-such-tier", "messages": [
            {"role": "user", "content": "x" * 5000}]})
        after = c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}]})
    assert first.status_code == 404
    assert after.status_code == 429 and after.json()["error"]["code"] == "rate_limit_invalid_requests"
    assert gw.stub.requests == []
