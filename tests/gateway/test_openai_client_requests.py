"""Requests as the installed `openai` client makes them, through the gateway: the SDK's own spelling of a value we
serve is answered (prompt_cache_retention "in_memory"), and a message OpenAI refuses (no content) is refused by
name before any tier is called."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import Gateway


def test_the_sdks_in_memory_is_answered(gateway: Gateway) -> None:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.tenant_key, max_retries=0) as client:
        out = client.chat.completions.create(model="mid", messages=[{"role": "user", "content": "hi"}],
                                             prompt_cache_retention="in_memory")
    assert out.choices[0].message.content and out.choices[0].finish_reason == "stop"
    assert gateway.stub.requests[-1]["prompt_cache_retention"] == "in_memory"


def test_a_message_without_content_is_refused_before_any_tier(gateway: Gateway) -> None:
    with (openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.tenant_key, max_retries=0) as client,
          pytest.raises(openai.BadRequestError) as refused):
        client.chat.completions.create(model="mid", messages=[{"role": "system"}, {"role": "user", "content": "hi"}])
    error = refused.value.response.json()["error"]
    assert error["param"] == "messages.0.content" and error["type"] == "invalid_request_error"
    assert gateway.stub.requests == []
