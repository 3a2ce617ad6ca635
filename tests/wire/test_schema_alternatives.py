"""wire/schema_alternatives.py: an allOf whose branches' alternatives multiply past the bound is refused before a
grammar compiler sees it; schemas that intersect little, or only branch among alternatives, pass."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from bench.structured_output import NESTED_SCHEMA
from wire.response_format import ResponseFormat
from wire.schema_alternatives import MAX_INTERSECTED_ALTERNATIVES, check_alternatives


def patterns(k: int, tag: str) -> dict[str, Any]:
    return {"anyOf": [{"type": "string", "pattern": f"^.*{chr(97 + i)}{tag}.*$"} for i in range(k)]}


@pytest.mark.parametrize("schema", [
    {"allOf": [patterns(5, str(j)) for j in range(6)]},  # 15,625: 2.6 s of llguidance, then "too big"
    {"allOf": [patterns(5, str(j)) for j in range(4)]},  # 625
    {"$defs": {f"a{j}": patterns(5, str(j)) for j in range(4)},  # the same through references
     "allOf": [{"$ref": f"#/$defs/a{j}"} for j in range(4)]},
    {"type": "object", "properties": {"x": {"allOf": [  # inside a property, and its branches' objects meet
        {"type": "object", "properties": {"p": patterns(20, "a")}},
        {"type": "object", "properties": {"p": patterns(20, "b")}}]}}},
])
def test_an_allof_that_multiplies_alternatives_is_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_INTERSECTED_ALTERNATIVES}"):
        check_alternatives(schema)
    with pytest.raises(ValidationError, match="allOf"):  # as the gateway and the engine read response_format
        ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


@pytest.mark.parametrize("schema", [
    NESTED_SCHEMA,
    {"allOf": [patterns(5, str(j)) for j in range(3)]},  # 125: 9.6 ms
    {"anyOf": [{"const": i} for i in range(2000)]},  # alternatives alone are one lexeme's choices, not a product
    {"type": "object", "properties": {f"p{i}": patterns(10, str(i)) for i in range(50)}},
    {"$defs": {"node": {"type": "object", "properties": {  # a recursive reference adds nothing
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}, "v": {"anyOf": [{"type": "integer"},
                                                                                        {"type": "string"}]}}}},
     "allOf": [{"$ref": "#/$defs/node"}, {"type": "object", "required": ["v"]}]},
])
def test_schemas_that_intersect_little_pass(schema: dict[str, Any]) -> None:
    check_alternatives(schema)
    ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def test_a_long_chain_of_references_is_refused_not_followed_without_end() -> None:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(100)} | {"d100": {"type": "string"}}
    with pytest.raises(ValueError, match="nest more than"):
        check_alternatives({"$defs": defs, "$ref": "#/$defs/d0"})
    assert len(json.dumps(defs)) < 32 * 1024  # within the size bound: only this check stops it
