"""POST /v1/completions (legacy text completions) through a real gateway in front of a stub upstream, with the
official openai client: the prompt reaches the tier's /v1/completions as it was sent, answers come back in the
legacy shape (whole and streamed), the ledger bills them, the cache never mixes them with chat answers, and the
fields the gateway does not serve are refused by name with nothing billed."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import Gateway
from tests.stubs import REPLY, TEXT_REPLY

PROMPT = "Once upon a time"


@pytest.fixture
def sdk(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.tenant_key, max_retries=0) as client:
        yield client


def test_a_text_completion_reaches_the_tier_as_its_prompt_and_is_billed(gateway: Gateway, sdk: openai.OpenAI) -> None:
    done = sdk.completions.create(model="auto", prompt=PROMPT, max_tokens=4)
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    assert done.choices[0].text == " ".join(TEXT_REPLY.split()[:4]) and done.choices[0].finish_reason == "length"
    (sent,) = gateway.stub.requests
    assert sent["prompt"] == PROMPT and "messages" not in sent and "prompt_format" not in sent
    assert sent["max_tokens"] == 4 and "logprobs" not in sent
    (row,) = gateway.ledger_rows()
    assert done.id == f"cmpl-{row.request_id}" and row.status == "ok" and row.output_tokens == 4
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (4, 4)


def test_max_tokens_defaults_to_the_legacy_16(gateway: Gateway, sdk: openai.OpenAI) -> None:
    done = sdk.completions.create(model="auto", prompt=PROMPT)
    assert gateway.stub.requests[0]["max_tokens"] == 16
    assert done.choices[0].text == TEXT_REPLY and done.choices[0].finish_reason == "stop"


def test_a_streamed_text_completion_comes_in_pieces_with_usage_last(gateway: Gateway, sdk: openai.OpenAI) -> None:
    chunks = list(sdk.completions.create(model="auto", prompt=PROMPT, stream=True,
                                         stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT_REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(TEXT_REPLY.split())
    assert len(gateway.ledger_rows()) == 1


def test_the_cache_never_answers_a_completion_with_a_chat_answer_or_back(gateway: Gateway, sdk: openai.OpenAI) -> None:
    """Same text, same parameters (max_tokens 32, temperature 0): only the route tells them apart."""

    def chat() -> tuple[str, str | None]:
        r = sdk.chat.completions.with_raw_response.create(model="auto", temperature=0, max_tokens=32,
                                                          messages=[{"role": "user", "content": PROMPT}])
        return r.headers["x-tiergate-cache"], r.parse().choices[0].message.content

    def text() -> tuple[str, str]:
        r = sdk.completions.with_raw_response.create(model="auto", prompt=PROMPT, temperature=0, max_tokens=32)
        return r.headers["x-tiergate-cache"], r.parse().choices[0].text

    assert chat() == ("miss", REPLY)
    assert text() == ("miss", TEXT_REPLY)  # not the chat answer cached a moment ago
    assert text() == ("hit", TEXT_REPLY) and chat() == ("hit", REPLY)  # each its own
    assert len(gateway.stub.requests) == 2


@pytest.mark.parametrize(("field", "value"), [("logprobs", 2), ("priority", 3), ("suffix", "x"), ("best_of", 2),
                                              ("echo", True), ("prompt", ["one", "two"]), ("prompt", [1, 2, 3]),
                                              ("prompt", ""), ("prompt", [""])])  # empty: the engine refused it
def test_what_the_gateway_does_not_serve_is_refused_by_name_and_billed_nothing(gateway: Gateway, field: str,
                                                                               value: object) -> None:
    body = {"model": "auto", "prompt": PROMPT, field: value}
    with gateway.client(gateway.tenant_key) as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert gateway.stub.requests == [] and gateway.ledger_rows() == []


def test_vllms_continuous_usage_stats_is_refused_by_name(gateway: Gateway) -> None:
    """Our engines send usage in every chunk when asked; the gateway sends it on the last one only, so it refuses."""
    body = {"model": "auto", "prompt": PROMPT, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with gateway.client(gateway.tenant_key) as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    assert gateway.stub.requests == [] and gateway.ledger_rows() == []
