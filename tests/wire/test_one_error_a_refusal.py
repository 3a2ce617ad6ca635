"""A refused body is one error, however many wrong things it holds. Pydantic makes an error of every field an object
does not know and of every bad pair of a mapping: a request with 380,000 unknown fields (at its top, in a message,
a content part, a tool call, stream_options, response_format, tool_choice; on every endpoint) or a `metadata` of
400,000 pairs cost the event loop 0.8-0.9 s to refuse, four times what any other body of that size costs, and the
refused-bodies bucket (gateway/pipeline/gate.py) charges by size. Now an object of more than 64 fields keeps its first
unknown field only (the one the refusal names, as before) and `metadata` is refused for its length before its pairs
are looked at.

A schema (response_format's, a tool's parameters) far past its size is refused before it is walked: a million `[1]`
in one was walked node by node (0.6 s) before its size was measured.

And a refusal names the client's unknown field whatever its name (one that read as a pydantic union member, `str`,
was not named), cut to 64 characters (a 4 MB name was sent back twice)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from wire.chat_request import ChatCompletionRequest
from wire.completion_request import CompletionRequest
from wire.embeddings import EmbeddingRequest
from wire.response_format import MAX_SCHEMA_BYTES, check_schema_bounds
from wire.validation import BodyError, parse_body

MANY = {f"z{i}": 1 for i in range(1000)}
USER = {"role": "user", "content": "hi"}
CHAT = {"model": "mid", "messages": [USER]}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f"}}

CASES: dict[str, tuple[type[BaseModel], dict[str, Any], str]] = {
    "request": (ChatCompletionRequest, CHAT | MANY, "z0"),
    "message": (ChatCompletionRequest, CHAT | {"messages": [USER | MANY]}, "messages.0.z0"),
    "content part": (ChatCompletionRequest, CHAT | {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"} | MANY]}]}, "messages.0.content.0.z0"),
    "tool call": (ChatCompletionRequest, CHAT | {"messages": [{"role": "assistant", "tool_calls": [CALL | MANY]}]},
                  "messages.0.tool_calls.0.z0"),
    "tool call's function": (ChatCompletionRequest, CHAT | {"messages": [{"role": "assistant", "tool_calls": [
        CALL | {"function": CALL["function"] | MANY}]}]}, "messages.0.tool_calls.0.function.z0"),
    "tool": (ChatCompletionRequest, CHAT | {"tools": [TOOL | MANY]}, "tools.0.z0"),
    "tool_choice": (ChatCompletionRequest, CHAT | {"tools": [TOOL], "tool_choice": TOOL | MANY}, "tool_choice"),
    "stream_options": (ChatCompletionRequest, CHAT | {"stream": True, "stream_options": MANY}, "stream_options.z0"),
    "response_format": (ChatCompletionRequest, CHAT | {"response_format": {"type": "json_object"} | MANY},
                        "response_format.z0"),
    "json_schema": (ChatCompletionRequest, CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {}} | MANY}}, "response_format.json_schema.z0"),
    "completion": (CompletionRequest, {"model": "mid", "prompt": "x"} | MANY, "z0"),
    "embeddings": (EmbeddingRequest, {"model": "m", "input": "x"} | MANY, "z0"),
}


@pytest.mark.parametrize("where", CASES)
def test_an_object_of_many_unknown_fields_is_one_error_naming_the_first(where: str) -> None:
    model, body, param = CASES[where]
    raw = json.dumps(body).encode()
    with pytest.raises(ValidationError) as invalid:
        model.model_validate_json(raw)
    assert invalid.value.error_count() <= 2, invalid.value.error_count()  # a union's members: one error each
    with pytest.raises(BodyError) as refused:
        parse_body(raw, model)
    assert refused.value.param == param


def test_the_first_unknown_field_is_named_wherever_it_stands() -> None:
    body = {"zz": 1, **CHAT, "functions": [], "aa": 2}
    with pytest.raises(BodyError) as refused:
        parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert refused.value.param == "zz" and refused.value.code == "unsupported_parameter"


def test_a_known_unsupported_field_keeps_its_reason_among_others() -> None:
    body = {**CHAT, "functions": [], **MANY}
    with pytest.raises(BodyError) as refused:
        parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert refused.value.param == "functions" and "send `tools`" in refused.value.message


def test_known_fields_and_nulls_are_as_they_were() -> None:
    req = parse_body(json.dumps(CHAT | {"user": None, "zz": None, "max_tokens": 5}).encode(), ChatCompletionRequest)
    assert req.max_tokens == 5 and req.user is None


def test_a_metadata_of_many_pairs_is_refused_for_its_length_in_one_error() -> None:
    raw = json.dumps(CHAT | {"metadata": {str(i): i for i in range(1000)}}).encode()
    with pytest.raises(ValidationError) as invalid:
        ChatCompletionRequest.model_validate_json(raw)
    assert invalid.value.error_count() == 1
    with pytest.raises(BodyError) as refused:
        parse_body(raw, ChatCompletionRequest)
    assert refused.value.param == "metadata" and refused.value.code == "too_long"
    assert "at most 16 pairs" in refused.value.message


def test_sixteen_pairs_are_still_taken() -> None:
    metadata = {f"k{i}": "v" for i in range(16)}
    assert parse_body(json.dumps(CHAT | {"metadata": metadata}).encode(), ChatCompletionRequest).metadata == metadata


class Unwalkable(dict[str, Any]):
    """A node of a schema that must not be walked (msgspec's encoder reads a dict without these methods)."""

    def values(self) -> Any:
        raise AssertionError("walked a schema far past its size")

    items = values  # type: ignore[assignment]


@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "also-too-deep"])
def test_a_schema_far_past_its_size_is_refused_before_it_is_walked(deep: bool) -> None:
    node: Any = Unwalkable(enum=[[1]] * MAX_SCHEMA_BYTES)
    if deep:
        for _ in range(40):
            node = {"items": node}
    with pytest.raises(ValueError, match=f"at most {MAX_SCHEMA_BYTES} are allowed"):
        check_schema_bounds({"type": "object", "properties": {"x": node}})


def deep(levels: int) -> dict[str, Any]:
    return {"type": "array", "items": deep(levels - 1)} if levels else {"type": "string"}


def test_a_schema_under_its_size_is_checked_as_before() -> None:
    with pytest.raises(ValueError, match="nested more than 32 levels deep"):
        check_schema_bounds(deep(40))
    with pytest.raises(ValueError, match="too large for a 64-bit float"):
        check_schema_bounds({"type": "number", "maximum": float("inf")})
    check_schema_bounds(deep(10))


@pytest.mark.parametrize("name", ["str", "none", "a[b]", "function-x", "list[int]"])
def test_an_unknown_field_is_named_whatever_its_name(name: str) -> None:
    """A name that reads as one of pydantic's union members was dropped from the location: the refusal named nothing
    ("Extra inputs are not permitted", param null)."""
    for body, param in ((CHAT | {name: 1}, name), (CHAT | {"messages": [USER | {name: 1}]}, f"messages.0.{name}")):
        with pytest.raises(BodyError) as refused:
            parse_body(json.dumps(body).encode(), ChatCompletionRequest)
        assert (refused.value.param, refused.value.code) == (param, "unsupported_parameter")
        assert refused.value.message.startswith(f"{param}: unsupported parameter")


@pytest.mark.parametrize("body", [
    CHAT | {"A" * 100_000: 1},
    CHAT | {"messages": [USER | {"B" * 100_000: 1}]},
    CHAT | {"metadata": {"k" * 100_000: "v"}},
], ids=["request", "message", "metadata-key"])
def test_a_long_name_of_the_clients_is_cut_in_the_refusal(body: dict[str, Any]) -> None:
    """The refusal named the field in full, twice (param and message): 4 MB of name made an 8 MB answer."""
    with pytest.raises(BodyError) as refused:
        parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert refused.value.param is not None and len(refused.value.param) <= 64 + len("messages.0.")
    assert len(refused.value.message) < 300 and refused.value.message.startswith(refused.value.param)
