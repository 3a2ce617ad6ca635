"""A schema whose `$ref`s lead one into another further than the bounds of wire/schema_alternatives.py is refused
with a 400 at the schema, and no validation that recurses past Python's stack is a 500.

`check_alternatives` remembers each node it counted, so a chain defined in order (a1 -> a0, a2 -> a1, ...) never
follows more than one reference from a node it has not counted, and passed. `answer_min_chars` (wire/schema_costs.py)
then followed the whole chain from the root, one recursion a hop: 1,150 references (28.9 KB) raised RecursionError,
a 500 `internal_error` with a traceback for every request that sent it, nothing charged. So did 60 references, each
inside 14 nested `allOf`s (11 KB): fewer hops than the bound, but a longer path than the stack holds.
"""

from __future__ import annotations

from typing import Any

import pytest

import wire.response_format
from tests.wire.test_schema_costs import SCHEMA, refusal

TOOL = "tools.0.function.parameters"


def chain(n: int, wrap: int = 0) -> dict[str, Any]:
    """A required string reached through `n` references, each to the one defined before it, each `wrap` `allOf`s
    deep."""
    schema: dict[str, Any] = {"a0": {"type": "string", "minLength": 1}}
    for i in range(1, n):
        link: dict[str, Any] = {"$ref": f"#/a{i - 1}"}
        for _ in range(wrap):
            link = {"allOf": [link]}
        schema[f"a{i}"] = link
    return schema | {"type": "object", "properties": {"p": {"$ref": f"#/a{n - 1}"}}, "required": ["p"]}


@pytest.mark.parametrize(("schema", "words"), [
    (chain(1150), "the schema follows more than 64 references on one path"),
    (chain(65), "the schema follows more than 64 references on one path"),
    (chain(60, wrap=14), "the schema nests more than 200 subschemas and references deep"),
])
def test_a_chain_of_references_past_the_bounds_is_refused_at_the_schema(schema: dict[str, Any], words: str) -> None:
    for tools, at in ((False, SCHEMA), (True, TOOL)):
        err = refusal(schema, tools=tools)
        assert err is not None, at
        assert (err.param, err.code, err.message) == (at, "value_error", f"{at}: {words}")


@pytest.mark.parametrize("schema", [chain(64), chain(64, wrap=2), chain(13, wrap=14)])
def test_a_chain_within_the_bounds_passes(schema: dict[str, Any]) -> None:
    assert refusal(schema) is None
    assert refusal(schema, tools=True) is None


def test_a_validation_that_recurses_past_the_stack_is_a_400(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever check recurses too far on a body, the client is told so: never a 500."""
    def too_deep(*_: Any) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(wire.response_format, "check_costs", too_deep)
    err = refusal({"type": "object"})
    assert err is not None and (err.param, err.code) == (None, "invalid_value"), err
    assert err.message.startswith("the request nests too deeply to validate"), err
