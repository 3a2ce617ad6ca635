"""`NaN`, `Infinity` and `-Infinity` are not JSON (RFC 8259), and pydantic's parser takes them: a body with one inside
a free-form object (a tool's `parameters`) passed the width check (msgspec could not read it, and the check let it
through) and had all its 160,000 content parts validated, 0.6-1.9 s of the event loop each. Such a body is refused
(400 `invalid_json`) before pydantic sees it, and a width check that cannot read a body refuses it."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequest
from gateway.pipeline.handle import parse_request
from wire.body_width import MAX_ITEMS, check_width
from wire.chat_request import ChatCompletionRequest
from wire.completion_request import CompletionRequest
from wire.embeddings import EmbeddingRequest
from wire.validation import BodyError, parse_body

NON_FINITE = ["NaN", "Infinity", "-Infinity"]
PART = '{"type": "text", "text": ""}'


def chat(literal: str, messages: int = 1, parts: int = 1) -> bytes:
    """A chat body of `messages` messages of `parts` empty parts each, with `literal` in a tool's parameters."""
    message = '{"role": "user", "content": [' + ", ".join([PART] * parts) + "]}"
    return ('{"model": "mid", "messages": [' + ", ".join([message] * messages) + '], "tools": [{"type": "function", '
            f'"function": {{"name": "f", "parameters": {{"type": "object", "x": {literal}}}}}}}], '
            '"tool_choice": "none"}').encode()


@pytest.fixture
def never_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    for model in (ChatCompletionRequest, CompletionRequest, EmbeddingRequest):
        monkeypatch.setattr(model, "model_validate_json", lambda *_: pytest.fail("validated a body that is not JSON"))


@pytest.mark.parametrize("literal", NON_FINITE)
@pytest.mark.parametrize(("messages", "parts"), [(625, 256), (1, 1)], ids=["160000-parts", "one-part"])
def test_a_non_finite_number_is_refused_before_validation(literal: str, messages: int, parts: int,
                                                          never_validated: None) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_request(chat(literal, messages, parts))
    assert refused.value.code == "invalid_json" and refused.value.param is None
    assert "NaN, Infinity and -Infinity are not JSON" in refused.value.message


@pytest.mark.parametrize(("model", "body"), [
    (CompletionRequest, b'{"model": "mid", "prompt": "x", "temperature": NaN}'),
    (CompletionRequest, b'{"model": "mid", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": '
                        b'{"name": "n", "schema": {"type": "number", "maximum": Infinity}}}}'),
    (EmbeddingRequest, b'{"model": "m", "input": "x", "dimensions": -Infinity}'),
], ids=["completion-number", "completion-schema", "embedding"])
def test_every_endpoint_refuses_them(model: type, body: bytes, never_validated: None) -> None:
    with pytest.raises(BodyError) as refused:
        parse_body(body, model)
    assert refused.value.code == "invalid_json" and "not JSON" in refused.value.message


def test_the_words_in_a_string_are_text() -> None:
    body = json.dumps({"model": "mid", "messages": [{"role": "user", "content": "NaN, Infinity and -Infinity"}]})
    assert parse_request(body.encode()).messages[0].text() == "NaN, Infinity and -Infinity"


@pytest.mark.parametrize("raw", [
    chat("NaN", 625, 256),
    b"[" + b", ".join([b"{}"] * (MAX_ITEMS + 1)) + b"]",  # JSON, but not an object
    chat("1", 625, 256)[:-3],  # cut short
], ids=["nan", "array", "cut"])
def test_a_wide_body_the_width_check_cannot_read_is_refused_not_skipped(raw: bytes) -> None:
    assert raw.count(b"{") > MAX_ITEMS  # wide enough to be looked at
    with pytest.raises(BodyError) as refused:
        check_width(raw)
    assert refused.value.code == "invalid_json"


@pytest.mark.parametrize(("extra", "param"), [
    ('"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"const": 1e999}}}',
     "response_format.json_schema.schema"),
    ('"tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": -1e400}}}]',
     "tools.0.function.parameters"),
])
def test_a_schema_number_past_float64s_range_is_refused_naming_the_schema(extra: str, param: str) -> None:
    """`1e999` is JSON, but read as infinity, which the gateway sent a remote tier as `null` (msgspec's encoding):
    the tier constrained the answer with a schema other than the tenant's."""
    body = '{"model": "mid", "messages": [{"role": "user", "content": "hi"}], ' + extra + "}"
    with pytest.raises(InvalidRequest) as refused:
        parse_request(body.encode())
    assert refused.value.param == param and "1e999" in refused.value.message
