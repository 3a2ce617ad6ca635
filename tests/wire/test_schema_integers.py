"""An integer in a schema (response_format's, a tool's parameters) past 64 bits is refused where the body is read,
naming the schema: the gateway took `"minimum": 1000…0` (70 digits), routed the request and sent it on, and our
engine refused it only when it compiled the grammar, naming `response_format` in llguidance's words ("Value is not
JSON serializable"). The integers llguidance reads, -2^63..2^64-1, are taken as before."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest
from gateway.pipeline.handle import parse_request
from wire.completion_request import CompletionRequest
from wire.validation import BodyError, parse_body

WIDE = [str(10**70), str(-(10**70)), str(2**64), str(-(2**63) - 1)]
TAKEN = [str(2**64 - 1), str(-(2**63)), "0"]
FORMAT = '"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", ' \
         '"minimum": %s}}}'
TOOLS = '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": ' \
        '{"a": {"enum": [1, %s]}}}}}], "tool_choice": "required"'


def chat(extra: str) -> bytes:
    return ('{"model": "mid", "messages": [{"role": "user", "content": "hi"}], ' + extra + "}").encode()


@pytest.mark.parametrize("number", WIDE)
@pytest.mark.parametrize(("extra", "param"), [(FORMAT, "response_format.json_schema.schema"),
                                              (TOOLS, "tools.0.function.parameters")], ids=["format", "tools"])
def test_a_schema_integer_past_64_bits_is_refused_naming_the_schema(number: str, extra: str, param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_request(chat(extra % number))
    assert refused.value.param == param and "integer past 64 bits" in refused.value.message


@pytest.mark.parametrize("number", WIDE)
def test_a_text_completions_schema_integer_past_64_bits_is_refused(number: str) -> None:
    body = ('{"model": "mid", "prompt": "hi", ' + FORMAT % number + "}").encode()
    with pytest.raises(BodyError) as refused:
        parse_body(body, CompletionRequest)
    assert refused.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize("number", TAKEN)
@pytest.mark.parametrize("extra", [FORMAT, TOOLS], ids=["format", "tools"])
def test_a_64_bit_integer_is_taken(number: str, extra: str) -> None:
    parse_request(chat(extra % number))
