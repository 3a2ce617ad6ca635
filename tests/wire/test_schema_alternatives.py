"""wire/schema_alternatives.py: a schema whose intersections (allOf branches, anyOf beside oneOf, a $ref beside
them) multiply alternatives past the bound is refused before a grammar compiler sees it, however its references are
written; schemas that intersect little, or only branch among alternatives, pass. The refused shapes each cost
llguidance 0.3-2.6 s (a review's timings with engine/grammar.py, noted beside them)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from bench.structured_output import NESTED_SCHEMA
from wire import response_format
from wire.chat_request import ChatCompletionRequest
from wire.response_format import ResponseFormat
from wire.schema_alternatives import (
    MAX_INTERSECTED_ALTERNATIVES,
    MAX_INTERSECTION_WEIGHT,
    check_alternatives,
    may_intersect,
)


def patterns(k: int, tag: str) -> dict[str, Any]:
    return {"anyOf": [{"type": "string", "pattern": f"^.*{chr(97 + i)}{tag}.*$"} for i in range(k)]}


def ref_chain(links: int) -> dict[str, Any]:
    """Each definition an anyOf of 5 patterns beside a $ref to the next (1.6 s at 6 links)."""
    defs = {f"d{j}": {**patterns(5, str(j)), "$ref": f"#/$defs/d{j + 1}"} for j in range(links)}
    return {"$defs": defs | {f"d{links}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def any_beside_one(depth: int) -> dict[str, Any]:
    """An anyOf beside a one-branch oneOf, nested (1.65 s at depth 5, with no allOf and no $ref)."""
    node = patterns(5, "z")
    for j in range(depth):
        node = {**patterns(5, str(j)), "oneOf": [node]}
    return node


def nested_models(n: int) -> dict[str, Any]:
    """Model i has an optional model i + 1 (pydantic's Optional: anyOf of a $ref and null)."""
    defs = {f"M{i}": {"type": "object", "properties": {"x": {"type": "integer"}, "child": {
        "anyOf": [{"$ref": f"#/$defs/M{i + 1}"}, {"type": "null"}]}}} for i in range(n)}
    return {"$defs": defs | {f"M{n}": {"type": "object"}}, "$ref": "#/$defs/M0"}


@pytest.mark.parametrize("schema", [
    {"allOf": [patterns(5, str(j)) for j in range(6)]},  # 15,625: 2.6 s of llguidance, then "too big"
    {"allOf": [patterns(5, str(j)) for j in range(4)]},  # 625
    {"$defs": {f"a{j}": patterns(5, str(j)) for j in range(4)},  # the same through references
     "allOf": [{"$ref": f"#/$defs/a{j}"} for j in range(4)]},
    {"type": "object", "properties": {"x": {"allOf": [  # inside a property, and its branches' objects meet
        {"type": "object", "properties": {"p": patterns(20, "a")}},
        {"type": "object", "properties": {"p": patterns(20, "b")}}]}}},
    ref_chain(4),
    any_beside_one(3),
    {"$defs": {f"a/{j}": patterns(5, str(j)) for j in range(4)},  # references written as the standard allows
     "allOf": [{"$ref": f"#/$defs/a~1{j}"} for j in range(4)]},
    {"$defs": {"n": {"$defs": {f"b{j}": patterns(5, str(j)) for j in range(4)}}},
     "allOf": [{"$ref": f"#/$defs/n/$defs/b{j}"} for j in range(4)]},
    {"$defs": {f"b{j}": patterns(5, str(j)) for j in range(4)},
     "allOf": [{"$ref": f"#/%24defs/b{j}"} for j in range(4)]},
    {"type": "object", "properties": {f"p{j}": patterns(5, str(j)) for j in range(4)},
     "allOf": [{"$ref": f"#/properties/p{j}"} for j in range(4)]},
])
def test_an_allof_that_multiplies_alternatives_is_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_INTERSECTED_ALTERNATIVES}"):
        check_alternatives(schema)
    with pytest.raises(ValidationError, match="intersects"):  # as the gateway and the engine read response_format
        ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


@pytest.mark.parametrize(("ref", "says"), [("#x1", "does not point inside"), ("http://e.com/s.json", "does not point"),
                                          ("#/$defs/missing", "points to nothing")])
def test_a_reference_the_count_cannot_follow_is_refused(ref: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_alternatives({"$defs": {"b": {**patterns(5, "b"), "$anchor": "x1"}}, "allOf": [{"$ref": ref}] * 2})


def test_the_intersections_of_many_small_schemas_add_up() -> None:
    """Each within the bound at every node; together past the weight (12 tools like these took 3.9 s)."""
    small = {"type": "object", "properties": {"a": any_beside_one(2)}}  # one node of 125, one of 25
    assert check_alternatives(small) == 150
    with pytest.raises(ValueError, match=f"at most {MAX_INTERSECTION_WEIGHT}"):
        check_alternatives({"type": "object", "properties": {f"p{i}": any_beside_one(2) for i in range(7)}})
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": small}} for i in range(7)]
    with pytest.raises(ValidationError, match=f"at most {MAX_INTERSECTION_WEIGHT}"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "tools": tools, "tool_choice": "required"})
    ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                          "tools": tools[:6], "tool_choice": "required"})


@pytest.mark.parametrize("schema", [
    NESTED_SCHEMA,
    {"allOf": [patterns(5, str(j)) for j in range(3)]},  # 125: 9.6 ms
    {"anyOf": [{"const": i} for i in range(2000)]},  # alternatives alone are one lexeme's choices, not a product
    {"type": "object", "properties": {f"p{i}": patterns(10, str(i)) for i in range(50)}},
    {"$defs": {"node": {"type": "object", "properties": {  # a recursive reference adds nothing
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}, "v": {"anyOf": [{"type": "integer"},
                                                                                        {"type": "string"}]}}}},
     "allOf": [{"$ref": "#/$defs/node"}, {"type": "object", "required": ["v"]}]},
    {"allOf": [{"anyOf": [{"const": i} for i in range(300)]}], "description": "one branch: nothing to meet"},
    {"$defs": {"Big": {"anyOf": [{"const": i} for i in range(300)]}}, "allOf": [{"$ref": "#/$defs/Big"}]},
    nested_models(22),
    # the root, recursively (a `$ref` to the root beside siblings, in place, is refused apart: wire/schema_costs.py)
    {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"anyOf": [{"type": "integer"}, {"const": 1}]}}},
    any_beside_one(2),
])
def test_schemas_that_intersect_little_pass(schema: dict[str, Any]) -> None:
    """Including what a review found refused wrongly: one allOf branch intersects nothing (pydantic's older
    `{"allOf": [{"$ref": ...}], "description": ...}`), and a chain of 22 optional nested models."""
    check_alternatives(schema)
    ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def test_a_long_chain_of_references_is_refused_not_followed_without_end() -> None:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(100)} | {"d100": {"type": "string"}}
    with pytest.raises(ValueError, match="more than 64 references"):
        check_alternatives({"$defs": defs, "$ref": "#/$defs/d0"})
    assert len(json.dumps(defs)) < 32 * 1024  # within the size bound: only this check stops it


# -- the shortcut: a schema naming no allOf, oneOf or $ref is not walked ------------------------------------------

_KEYS = st.sampled_from(["anyOf", "properties", "items", "type", "enum", "$defs", "allOf", "oneOf", "$ref",
                         "not", "prefixItems", "description"])
_SCHEMAS = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer"}, {"$ref": "#"}, {"$ref": "#/nowhere"}, {}]),
    lambda inner: st.one_of(
        st.dictionaries(_KEYS, st.one_of(inner, st.lists(inner, min_size=1, max_size=4),
                                         st.dictionaries(st.sampled_from(["a", "b", "allOf"]), inner, max_size=3)),
                        max_size=4),
        st.builds(lambda bs: {"anyOf": bs}, st.lists(inner, min_size=1, max_size=6))),
    max_leaves=40)


@settings(max_examples=400, deadline=None)
@given(_SCHEMAS)
def test_a_schema_that_cannot_intersect_is_known_by_its_json(schema: dict[str, Any]) -> None:
    """The shortcut changes no answer: where the JSON names none of the three keys, the count refuses nothing and
    weighs 0 (whatever else the schema nests: anyOfs of anyOfs, maps, lists)."""
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if not may_intersect(text):
        assert check_alternatives(schema) == 0
    assert may_intersect(text) == may_intersect(msgspec.json.encode(schema))  # the tools' way, as bytes


def test_only_a_schema_that_names_an_intersection_is_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[dict[str, Any]] = []
    monkeypatch.setattr(response_format, "check_alternatives", lambda s: walked.append(s) or 0)
    wide = {"type": "object", "properties": {f"p{i}": {"anyOf": [{"type": "integer"}, {"type": "null"}]}
                                             for i in range(500)}}
    response_format.check_schema_bounds(wide)
    assert walked == []
    for key in ("allOf", "oneOf", "$ref"):
        named = wide | {"properties": wide["properties"] | {"x": {key: "#" if key == "$ref" else [{}]}}}
        response_format.check_schema_bounds(named)
        assert walked[-1] is named
    assert may_intersect('{"description":"say \\"allOf\\" twice"}') is False  # inside a string: escaped quotes
