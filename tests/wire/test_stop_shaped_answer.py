"""`stop` beside an answer whose shape the request sets is refused naming `stop` (400 `unsupported_value`), in chat and
text completions alike, and the published schema says so.

A stop string met inside the JSON or the tool call ended the answer there and it read as complete (finish_reason
"stop"): a strict json_schema with `stop: ['"']` answered `{`, json_object with `stop: ["{", "}"]` answered "",
tool_choice "required" with `stop: ["get_weather"]` answered the content `{"name": "`, a named choice with
`stop: ["}"]` the call wrapper's JSON as content, and under tool_choice "auto" the `<tool_call>` block was sent as
text. A stop string with nothing that shapes the answer, and an empty stop, stay accepted."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from wire.chat_request import ChatCompletionRequest
from wire.completion_request import CompletionRequest
from wire.validation import BodyError, parse_body

CHAT = {"model": "mid", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
TEXT = {"model": "mid", "prompt": "Weather in Paris?"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
JSON_OBJECT = {"type": "json_object"}

SHAPED_CHAT = {
    "json_schema": ({"response_format": SCHEMA}, "the JSON short: response_format json_schema"),
    "json_object": ({"response_format": JSON_OBJECT}, "the JSON short: response_format json_object"),
    "required": ({"tools": TOOLS, "tool_choice": "required"}, "the tool call short: tool_choice 'required'"),
    "named": ({"tools": TOOLS, "tool_choice": NAMED}, "the tool call short: a named tool_choice"),
    "auto": ({"tools": TOOLS, "tool_choice": "auto"}, "the tool call short: with tools and tool_choice 'auto'"),
    "auto_by_default": ({"tools": TOOLS}, "the tool call short: with tools and tool_choice 'auto'"),
    "tool_choice_null": ({"tools": TOOLS, "tool_choice": None}, "the tool call short: with tools"),
}
STOPS = {"string": '"', "list": ["}"], "several": ["\n", "get_weather"]}


def schema_allows(model: type, body: dict[str, Any]) -> bool:
    return jsonschema.Draft202012Validator(model.model_json_schema()).is_valid(body)


def refused(model: type, body: dict[str, Any]) -> BodyError:
    with pytest.raises(BodyError) as caught:
        parse_body(json.dumps(body).encode(), model)
    return caught.value


@pytest.mark.parametrize("stop", list(STOPS.values()), ids=list(STOPS))
@pytest.mark.parametrize(("shape", "says"), list(SHAPED_CHAT.values()), ids=list(SHAPED_CHAT))
def test_stop_beside_a_shaped_chat_answer_is_refused_naming_stop(shape: dict[str, Any], says: str, stop: Any) -> None:
    body = CHAT | shape | {"stop": stop}
    error = refused(ChatCompletionRequest, body)
    assert (error.param, error.code) == ("stop", "unsupported_value"), error
    assert error.message.startswith(f"stop: a stop sequence would cut {says}"), error.message
    assert "remove stop" in error.message
    assert not schema_allows(ChatCompletionRequest, body)
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    assert refused(ChatCompletionRequest, streamed).param == "stop"


@pytest.mark.parametrize("stop", list(STOPS.values()), ids=list(STOPS))
@pytest.mark.parametrize("fmt", [SCHEMA, JSON_OBJECT], ids=["json_schema", "json_object"])
def test_stop_beside_a_json_completion_is_refused_naming_stop(fmt: dict[str, Any], stop: Any) -> None:
    body = TEXT | {"response_format": fmt, "stop": stop}
    error = refused(CompletionRequest, body)
    assert (error.param, error.code) == ("stop", "unsupported_value"), error
    assert error.message.startswith(f"stop: a stop sequence would cut the JSON short: response_format {fmt['type']}")
    assert not schema_allows(CompletionRequest, body)


ACCEPTED_CHAT = {
    "stop_alone": {"stop": ["\n"]},
    "stop_with_text_format": {"stop": ["\n"], "response_format": {"type": "text"}},
    "stop_with_tool_choice_none": {"stop": ["\n"], "tools": TOOLS, "tool_choice": "none"},
    "stop_with_tool_choice_auto_without_tools": {"stop": ["\n"], "tool_choice": "auto"},
    "json_schema_alone": {"response_format": SCHEMA},
    "required_alone": {"tools": TOOLS, "tool_choice": "required"},
    "json_object_empty_stop": {"response_format": JSON_OBJECT, "stop": []},
    "required_empty_stop": {"tools": TOOLS, "tool_choice": "required", "stop": []},
    "named_null_stop": {"tools": TOOLS, "tool_choice": NAMED, "stop": None},
    "auto_empty_stop": {"tools": TOOLS, "stop": []},
}


@pytest.mark.parametrize("extra", list(ACCEPTED_CHAT.values()), ids=list(ACCEPTED_CHAT))
def test_stop_or_a_shape_alone_is_accepted(extra: dict[str, Any]) -> None:
    body = CHAT | extra
    parsed = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert parsed.stop_list == (extra.get("stop") or [])
    assert schema_allows(ChatCompletionRequest, body)


@pytest.mark.parametrize("extra", [{"stop": "\n"}, {"stop": ["\n"], "response_format": {"type": "text"}},
                                   {"response_format": SCHEMA}, {"response_format": JSON_OBJECT, "stop": []},
                                   {"response_format": JSON_OBJECT, "stop": None}],
                         ids=["stop_alone", "stop_with_text_format", "json_schema_alone", "empty_stop", "null_stop"])
def test_a_text_completion_with_stop_or_a_format_alone_is_accepted(extra: dict[str, Any]) -> None:
    body = TEXT | extra
    parsed = parse_body(json.dumps(body).encode(), CompletionRequest)
    assert parsed.stop_list == ([extra["stop"]] if isinstance(extra.get("stop"), str) else extra.get("stop") or [])
    assert schema_allows(CompletionRequest, body)


def test_a_bad_stop_is_refused_for_itself_first() -> None:
    """The field's own check comes first: an empty stop string beside a format is refused as empty."""
    error = refused(ChatCompletionRequest, CHAT | {"response_format": JSON_OBJECT, "stop": [""]})
    assert (error.param, error.code) == ("stop.0", "string_too_short")
