"""A message's `content` as OpenAI requires it: a system, developer, user or tool message has content (a string, or
at least one content part), an assistant message has content or tool calls. Without it the request is refused
naming the message (it was answered as if the message had said nothing), and the published schema says so."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from wire.chat_request import ChatCompletionRequest
from wire.validation import BodyError, parse_body

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _body(*messages: dict[str, Any]) -> dict[str, Any]:
    return {"model": "mid", "messages": list(messages)}


def _documented(body: dict[str, Any]) -> bool:
    return jsonschema.Draft202012Validator(ChatCompletionRequest.model_json_schema()).is_valid(body)


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user"}, "messages.0.content"),
    ({"role": "user", "content": None}, "messages.0.content"),
    ({"role": "system"}, "messages.0.content"),
    ({"role": "developer", "content": None}, "messages.0.content"),
    ({"role": "tool", "tool_call_id": "call_1"}, "messages.0.content"),
    ({"role": "user", "content": []}, "messages.0.content"),
    ({"role": "assistant"}, "messages.0"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages.0"),
], ids=["user", "user-null", "system", "developer-null", "tool", "no-parts", "assistant", "assistant-no-calls"])
def test_a_message_without_content_is_refused_by_name(message: dict[str, Any], param: str) -> None:
    body = _body(message, {"role": "user", "content": "hi"})
    with pytest.raises(BodyError) as refused:
        parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert refused.value.param == param, refused.value
    assert "content" in refused.value.message and "Value error" not in refused.value.message
    assert not _documented(body)


@pytest.mark.parametrize("message", [
    {"role": "user", "content": ""},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "assistant", "content": ""},
], ids=["empty-text", "parts", "calls-null-content", "calls-only", "assistant-empty-text"])
def test_content_or_calls_are_enough(message: dict[str, Any]) -> None:
    body = _body({"role": "user", "content": "hi"}, message, {"role": "user", "content": "go on"})
    if message.get("tool_calls"):
        body["messages"].insert(2, {"role": "tool", "tool_call_id": "call_1", "content": "42"})
    assert parse_body(json.dumps(body).encode(), ChatCompletionRequest).messages[1].role == message["role"]
    assert _documented(body)
