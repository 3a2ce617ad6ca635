"""A field that needs another is refused without it, naming it, as OpenAI refuses it (never accepted and ignored):
`stream_options` without `stream: true`, `parallel_tool_calls` without `tools`, `top_logprobs` without `logprobs`;
the message is the validator's own words, and the published schema says the same."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from wire.chat_request import ChatCompletionRequest
from wire.completion_request import CompletionRequest
from wire.validation import BodyError, parse_body

CHAT = {"model": "mid", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "mid", "prompt": "hi"}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
USAGE = {"include_usage": True}


def refusal(model: type, body: dict[str, Any]) -> BodyError:
    with pytest.raises(BodyError) as refused:
        parse_body(json.dumps(body).encode(), model)
    return refused.value


def documented(model: type, body: dict[str, Any]) -> bool:
    """Whether the model's published JSON schema allows `body`."""
    return jsonschema.Draft202012Validator(model.model_json_schema()).is_valid(body)


@pytest.mark.parametrize(("model", "body", "param"), [
    (ChatCompletionRequest, CHAT | {"stream_options": USAGE}, "stream_options"),
    (ChatCompletionRequest, CHAT | {"stream": False, "stream_options": USAGE}, "stream_options"),
    (CompletionRequest, TEXT | {"stream_options": USAGE}, "stream_options"),
    (ChatCompletionRequest, CHAT | {"parallel_tool_calls": False}, "parallel_tool_calls"),
    (ChatCompletionRequest, CHAT | {"tools": None, "parallel_tool_calls": True}, "parallel_tool_calls"),
    (ChatCompletionRequest, CHAT | {"top_logprobs": 2}, "top_logprobs"),
    (ChatCompletionRequest, CHAT | {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    (ChatCompletionRequest, CHAT | {"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
], ids=["stream-options", "stream-options-not-streamed", "text-stream-options", "parallel-calls",
        "parallel-calls-null-tools", "top-logprobs", "top-logprobs-false", "two-caps"])
def test_a_field_without_the_one_it_needs_is_refused_by_name(model: type, body: dict[str, Any], param: str) -> None:
    err = refusal(model, body)
    assert err.param == param and err.code and err.message.startswith(f"{param}: ")
    assert "Value error" not in err.message
    assert not documented(model, body)


@pytest.mark.parametrize(("model", "body"), [
    (ChatCompletionRequest, CHAT | {"stream": True, "stream_options": USAGE}),
    (ChatCompletionRequest, CHAT | {"stream_options": None}),
    (CompletionRequest, TEXT | {"stream": True, "stream_options": USAGE}),
    (ChatCompletionRequest, CHAT | {"tools": TOOLS, "parallel_tool_calls": False}),
    (ChatCompletionRequest, CHAT | {"parallel_tool_calls": None}),
    (ChatCompletionRequest, CHAT | {"logprobs": True, "top_logprobs": 2}),
    (ChatCompletionRequest, CHAT | {"top_logprobs": 0}),
], ids=["streamed", "null-options", "text-streamed", "with-tools", "null-parallel", "with-logprobs", "zero-top"])
def test_with_it_they_are_accepted(model: type, body: dict[str, Any]) -> None:
    parse_body(json.dumps(body).encode(), model)
    assert documented(model, body)


def test_a_field_that_failed_on_its_own_is_the_one_named() -> None:
    assert refusal(ChatCompletionRequest, CHAT | {"stream": "yes", "stream_options": USAGE}).param == "stream"
    assert refusal(ChatCompletionRequest, CHAT | {"tools": "f", "parallel_tool_calls": True}).param == "tools"
