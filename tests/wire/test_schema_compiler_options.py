"""A schema's `x-guidance` (llguidance's compile options, read at its root) is refused by name: our engines set
their own separators, whitespace and leniency over it, so a tenant's `"whitespace_flexible": true` was dropped
without a word and answered under other options than it asked for; a remote tier read it or not, as its grammar
library does. A property of that name is a property like any other."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.errors import InvalidRequest
from gateway.pipeline.handle import parse_request
from wire.chat_request import ChatCompletionRequest
from wire.completion_request import CompletionRequest
from wire.validation import BodyError, parse_body

OPTIONS = ['{}', '{"whitespace_flexible": true}', '{"coerce_one_of": true}', '"x"']
FORMAT = '"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": %s}}'
TOOLS = '"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}], "tool_choice": {"type": ' \
        '"function", "function": {"name": "f"}}'


def chat(extra: str) -> bytes:
    return ('{"model": "mid", "messages": [{"role": "user", "content": "hi"}], ' + extra + "}").encode()


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize(("extra", "param"), [(FORMAT, "response_format.json_schema.schema.x-guidance"),
                                              (TOOLS, "tools.0.function.parameters.x-guidance")],
                         ids=["format", "tools"])
def test_compiler_options_are_refused_by_name(options: str, extra: str, param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_request(chat(extra % ('{"type": "object", "x-guidance": ' + options + '}')))
    assert refused.value.param == param and refused.value.code == "unsupported_parameter"


def test_a_text_completions_format_refuses_them_too() -> None:
    body = ('{"model": "mid", "prompt": "hi", ' + FORMAT % '{"type": "object", "x-guidance": {}}' + "}").encode()
    with pytest.raises(BodyError) as refused:
        parse_body(body, CompletionRequest)
    assert refused.value.param == "response_format.json_schema.schema.x-guidance"


def test_a_property_of_that_name_is_taken() -> None:
    schema = '{"type": "object", "properties": {"x-guidance": {"type": "string"}}, "required": ["x-guidance"]}'
    req = parse_request(chat(FORMAT % schema))
    assert req.response_format is not None and req.response_format.json_schema is not None


@pytest.mark.parametrize("extra", [FORMAT, TOOLS], ids=["format", "tools"])
def test_the_published_schema_says_so(extra: str) -> None:
    """The document a client reads (the request's JSON schema) refuses what the wire refuses, and takes the rest."""
    document = ChatCompletionRequest.model_json_schema()
    body = json.loads(chat(extra % '{"type": "object", "x-guidance": {}}'))
    assert not jsonschema.Draft202012Validator(document).is_valid(body)
    assert jsonschema.Draft202012Validator(document).is_valid(json.loads(chat(extra % '{"type": "object"}')))
