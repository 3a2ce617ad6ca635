"""wire/schema_costs.py: a schema whose pattern repeats too much, or that refers to itself in place, is refused at
validation naming the keyword (response_format's and tools' alike), before a grammar compiler sees it. Each refused
shape compiled in llguidance in a millisecond and failed (or held the engine's step loop 0.2-0.75 s) at the first
token, after admission. Patterns and recursive schemas as people write them pass."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.structured_output import NESTED_SCHEMA
from wire.chat_request import ChatCompletionRequest
from wire.regex_costs import MAX_PATTERN_WEIGHT, pattern_weight
from wire.validation import BodyError, parse_body

SCHEMA = "response_format.json_schema.schema"


def refusal(schema: dict[str, Any], *, tools: bool = False) -> BodyError | None:
    """The 400 a chat request with `schema` as its response_format's (or its one tool's parameters) gets, or None."""
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    try:
        parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    except BodyError as exc:
        return exc
    return None


def string(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}


@pytest.mark.parametrize("pattern", [
    "^(a{1000}){1000}$",  # 0.75 s and 185 MiB of the step loop, then "too many expressions constructed"
    "^a{1000000}$",  # 0.26 s, 58 MiB, then the same
    "^a{100000}$",  # passed, at 0.22 s a token for the whole batch
    "^(a+){1000}$",  # failed at once
    "^(?:[a-z]{100}){101}$",
    "^\\d{99999999999999999999}$",  # a count too long for any bound is never turned into a number
    # each read by llguidance as a million a's (probe: 0.28-0.85 s of the step loop, then the same failure): a count
    # repeated, a count with spaces, and the x flag's whitespace between a group and its count
    "^a{1000}{1000}$", "^a{1000}?{1000}$", "^a{ 1000000 }$", "(?x)^(a{1000}) {1000}$",
])
def test_a_pattern_that_repeats_too_much_is_refused_naming_it(pattern: str) -> None:
    for tools, where in ((False, SCHEMA), (True, "tools.0.function.parameters")):
        err = refusal(string(pattern), tools=tools)
        assert err is not None and err.param == f"{where}.properties.a.pattern", err
        assert "repeats too much" in err.message and err.message.startswith(f"{where}.properties.a.pattern: ")


def test_patterns_are_found_wherever_a_subschema_can_hold_one() -> None:
    heavy = "^x{20000}$"
    cases = [
        ({"type": "object", "patternProperties": {heavy: {"type": "string"}}}, f"patternProperties.{heavy}"),
        ({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"pattern": heavy}]}}, "items.anyOf.1.pattern"),
        ({"$defs": {"d": {"pattern": heavy}}, "$ref": "#/$defs/d"}, "$defs.d.pattern"),
        ({"type": "object", "propertyNames": {"pattern": heavy}}, "propertyNames.pattern"),
        # a property named like a keyword whose value is data is a subschema all the same
        ({"type": "object", "properties": {"enum": {"type": "string", "pattern": heavy}}}, "properties.enum.pattern"),
    ]
    for schema, where in cases:
        err = refusal(schema)
        assert err is not None and err.param == f"{SCHEMA}.{where}", (schema, err)


@pytest.mark.parametrize("pattern", [
    "^[a-z]{1,64}$", r"^\d{4}-\d{2}-\d{2}$", r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$", r"^\p{Lu}{2}\u{1F600}{3}$", "^(a+){100}$", "^a{10000}$", "^(a{100}){100}$",
    "x{", "a{,", "^[^]]{5}$", "(a|b|c){10}", r"^\d{3} \d{4}$", "(?i)^(ab){10} {10}$", "^a{100}{100}$",
])
def test_patterns_as_people_write_them_pass(pattern: str) -> None:
    assert pattern_weight(pattern) <= MAX_PATTERN_WEIGHT
    assert refusal(string(pattern)) is None


def test_values_are_not_read_as_schemas() -> None:
    """A `pattern` inside an enum's, a const's or a default's value is data, and a property named `pattern` a name."""
    value = {"pattern": "^a{100000}$"}
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "maxLength": 5}},
              "enum": [value], "const": value, "default": value, "examples": [value]}
    assert refusal(schema) is None


@pytest.mark.parametrize(("schema", "where"), [
    ({"allOf": [{"$ref": "#"}]}, "allOf.0.$ref"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "$defs.a.$ref"),
    ({"anyOf": [{"$ref": "#"}]}, "anyOf.0.$ref"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"not": {"$ref": "#/$defs/a"}}},
      "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}, "$defs.b.not.$ref"),
    ({"type": "object", "properties": {"x": {"if": {"$ref": "#/properties/x"}}}}, "properties.x.if.$ref"),
    ({"$ref": "#", "type": "object"}, "$ref"),
    ({"type": "object", "properties": {"const": {"allOf": [{"$ref": "#/properties/const"}]}}},
     "properties.const.allOf.0.$ref"),  # llguidance: "circular references with sibling keys are not supported"
])
def test_a_schema_that_refers_to_itself_in_place_is_refused_naming_the_ref(schema: dict[str, Any], where: str) -> None:
    for tools, at in ((False, SCHEMA), (True, "tools.0.function.parameters")):
        err = refusal(schema, tools=tools)
        assert err is not None and err.param == f"{at}.{where}", err
        assert "refers to itself" in err.message


def test_recursion_through_properties_and_items_passes() -> None:
    tree = {"$defs": {"n": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/n"}},
        "parent": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}, "$ref": "#/$defs/n"}
    assert refusal(tree) is None
    assert refusal({"type": "object", "properties": {"next": {"$ref": "#"}}}) is None
    twice = {"$defs": {"a": {"type": "string"}}, "allOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/a"}]}
    assert refusal(twice) is None  # one subschema reached twice is no cycle
    assert refusal(NESTED_SCHEMA) is None


def strings(n: int, pattern: str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string", "pattern": pattern}, "minItems": n}


@pytest.mark.parametrize("schema", [
    strings(1000, "^a{5000}$"),  # 2.3 s and 289 MiB of the step loop a token, for the whole batch
    strings(100_000, "^a{5000}$"),  # 29.5 s and 2 GiB, then "Too many items"
    {"type": "array", "items": {"const": "x"}, "minItems": 1_000_000},  # failed at the first token
    {"type": "object", "required": [f"p{i}" for i in range(20)],
     "properties": {f"p{i}": {"type": "string", "pattern": "^a{9999}$"} for i in range(20)}},
    {"type": "array", "prefixItems": [{"type": "string", "minLength": 60_000}] * 2, "minItems": 2},
    # the same through a $ref (which counted 0): llguidance forces what it points to as it forces the same in place
    {"$defs": {"s": {"type": "string", "pattern": "^a{5000}$"}}, "type": "array", "items": {"$ref": "#/$defs/s"},
     "minItems": 1000},
    {"$defs": {"s": {"type": "string", "pattern": "^a{9999}$"}}, "type": "object",
     "required": [f"p{i}" for i in range(20)], "properties": {f"p{i}": {"$ref": "#/$defs/s"} for i in range(20)}},
    {"$defs": {"a": {"type": "array", "items": {"const": "x"}, "minItems": 40_000}}, "$ref": "#/$defs/a"},
    strings(1000, "^(?x) a{5000}  # five thousand a's\n$"),  # the x flag's comment is no character, the a's are
])
def test_a_schema_whose_every_answer_is_too_long_to_write_is_refused(schema: dict[str, Any]) -> None:
    for tools, at in ((False, SCHEMA), (True, "tools.0.function.parameters")):
        err = refusal(schema, tools=tools)
        assert err is not None and err.param == at and "more than 100,000 characters" in err.message, err


@pytest.mark.parametrize("schema", [
    strings(3, "^a{5000}$"),
    {"type": "array", "items": {"type": "integer"}, "minItems": 10_000},
    {"anyOf": [{"type": "string", "minLength": 1_000_000}, {"type": "null"}]},  # the null answer is short
    {"type": "string", "minLength": 99_000},
    {"type": "array", "items": {"type": "string", "pattern": "^(a{5000})?$"}, "minItems": 1000},  # "" is an item
    {"$defs": {"s": {"type": "string", "pattern": "^a{5000}$"}}, "type": "array", "items": {"$ref": "#/$defs/s"},
     "minItems": 3},
    # a reference reached again while it is counted counts 0 (the walk ends)
    {"$defs": {"n": {"type": "object", "required": ["next"], "properties": {"next": {"$ref": "#/$defs/n"}}}},
     "$ref": "#/$defs/n", "minItems": 1},
    # 84,002 characters at least; a group's opening and the x flag's comments were counted as characters (100,001)
    strings(1000, "^(?:ab){40}$"),
    strings(1000, "^(?<pair>ab){40}$"),
    strings(1000, "^(?x) (?: a  # one a\n b ){40} $"),
])
def test_a_schema_that_allows_a_short_enough_answer_passes(schema: dict[str, Any]) -> None:
    assert refusal(schema) is None


def test_a_long_min_length_beside_a_pattern_is_refused_naming_it() -> None:
    """`^a*$` with minLength 5,000: "too many expressions constructed" at the first token; without the pattern, or
    with a shorter minLength, it passes."""
    heavy = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a*$", "minLength": 5000}}}
    err = refusal(heavy)
    assert err is not None and err.param == f"{SCHEMA}.properties.s.minLength", err
    assert refusal({"type": "string", "minLength": 5000}) is None
    assert refusal({"type": "string", "pattern": "^a*$", "minLength": 2000, "maxLength": 50_000}) is None


@pytest.mark.parametrize(("schema", "where"), [
    ({"allOf": [{"type": "string", "pattern": "^a*$"}, {"minLength": 5000}]}, "allOf.1.minLength"),
    ({"$defs": {"p": {"type": "string", "pattern": "^a*$"}}, "$ref": "#/$defs/p", "minLength": 5000}, "minLength"),
    ({"$defs": {"m": {"minLength": 5000}}, "type": "object", "properties": {
        "s": {"type": "string", "pattern": "^a*$", "allOf": [{"$ref": "#/$defs/m"}]}}}, "$defs.m.minLength"),
])
def test_a_long_min_length_joined_to_a_pattern_by_all_of_or_ref_is_refused(schema: dict[str, Any], where: str) -> None:
    """llguidance merges what allOf and $ref join into one string's: each of these failed at the first token ("too
    many expressions constructed", probe), as the pattern and minLength side by side do; they passed."""
    err = refusal(schema)
    assert err is not None and err.param == f"{SCHEMA}.{where}", err


def test_a_long_min_length_in_another_branch_than_the_pattern_passes() -> None:
    """Alternatives are not merged (llguidance took these at a millisecond a token), nor are separate properties."""
    assert refusal({"anyOf": [{"type": "string", "pattern": "^a*$"}, {"type": "string", "minLength": 5000}]}) is None
    assert refusal({"type": "string", "minLength": 5000, "anyOf": [{"pattern": "^a*$"}, {"pattern": "^b*$"}]}) is None
    assert refusal({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a*$"},
                                                     "b": {"type": "string", "minLength": 5000}}}) is None
