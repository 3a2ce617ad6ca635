"""wire/tool_calls.py `call_schema`: a function's local `$ref`s are written against its parameters' root, and still
mean what they meant once the parameters sit inside the call schema a required or named tool_choice is enforced
with. Read against the call schema's root, a pydantic-style `#/$defs/x` pointed at nothing (llguidance: "Pointer
'/$defs/a' does not exist", so every required call of such a tool was a 400) and `#` meant the call object."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from wire.chat_request import ChatCompletionRequest
from wire.tool_calls import call_schema

NESTED = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
          "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"]}
TREE = {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"type": "integer"}}}
# the `$ref` inside an enum's value is data, copied as it is
DATA = {"type": "object", "properties": {"tag": {"enum": [{"$ref": "#/x"}]}}}


def request(*functions: tuple[str, dict[str, Any]], choice: Any = "required") -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": name, "parameters": params}} for name, params in functions]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": tools, "tool_choice": choice})


@pytest.mark.parametrize("functions", [
    [("nested", NESTED)],
    [("nested", NESTED), ("tree", TREE), ("data", DATA)],
])
def test_a_functions_references_keep_their_meaning_in_the_call_schema(functions: list[tuple[str, Any]]) -> None:
    schema = call_schema(request(*functions))
    assert schema is not None
    validate = jsonschema.Draft202012Validator(schema).is_valid
    assert validate({"name": "nested", "arguments": {"p": {"x": 1}}})
    assert not validate({"name": "nested", "arguments": {"p": {"x": "one"}}})
    if len(functions) > 1:
        assert validate({"name": "tree", "arguments": {"next": {"next": {"v": 2}}}})
        assert not validate({"name": "tree", "arguments": {"next": {"v": "two"}}})
        assert validate({"name": "data", "arguments": {"tag": {"$ref": "#/x"}}})


def test_a_named_function_keeps_its_references_too() -> None:
    schema = call_schema(request(("tree", TREE), ("nested", NESTED),
                                 choice={"type": "function", "function": {"name": "nested"}}))
    assert schema is not None and jsonschema.Draft202012Validator(schema).is_valid(
        {"name": "nested", "arguments": {"p": {"x": 1}}})
