"""`response_format`, OpenAI's structured-output field, as the gateway and our engine both accept it.

Three shapes, as OpenAI's API has them:
- `{"type": "text"}`: plain text (the same as leaving the field out);
- `{"type": "json_object"}`: the answer is one JSON object, any object;
- `{"type": "json_schema", "json_schema": {"name", "description"?, "schema", "strict"?}}`: the answer is JSON that
  validates against `schema`. Our engines enforce it whether or not `strict` is set (grammar-constrained decoding,
  engine/grammar.py); with `strict: true` a keyword they cannot enforce is a 400, without it such a keyword is
  ignored, as OpenAI's non-strict mode does not promise adherence either.

The schema is a tenant's bytes that a grammar compiler will read, so it is bounded before anything walks it: at most
MAX_SCHEMA_BYTES of JSON and MAX_SCHEMA_DEPTH nested arrays and objects, checked in one pass that stops at the first
bound it passes, then what its `allOf`s intersect (wire/schema_alternatives.py: a small schema can cost a
compiler seconds), then its patterns' repetitions and its references to itself (wire/schema_costs.py: what the
compiler takes at once and fails on at the first token, after the request was admitted); such a refusal names the
keyword (`response_format.json_schema.schema.properties.a.pattern`). A schema's `x-guidance` (llguidance's compile
options, which it reads at a schema's root) is refused by name: our engines set their own separators, whitespace
and leniency over it, so `"whitespace_flexible": true` was dropped without a word, the rest changed how our engines
compiled the schema, and a remote tier's server reads it or not, as its own grammar library does. Everything else
(name, description) has OpenAI's limits. Anything else is a 400 whose `param` starts with `response_format`.

The grammar reads only the schema. The `description` (OpenAI: what the format is for, "used by the model to determine
how to respond") is told to the model on our engines as a line at the end of the system message, with the `name`
(wire/tool_calls.py's `format_line`), where the format is the answer (not under a required or named tool call); a
remote tier gets both as sent. A format without a description adds nothing to the prompt.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from wire.fields import drop_nulls, nullable_optionals, one_unknown
from wire.schema_alternatives import check_alternatives, may_intersect
from wire.schema_costs import check_answer_length, check_patterns, check_self_references

MAX_SCHEMA_BYTES = 32 * 1024  # the schema as compact JSON
MAX_SCHEMA_DEPTH = 32  # nested objects and arrays, the schema itself being the first
MAX_DESCRIPTION_CHARS = 1024
COMPILER_OPTIONS = "x-guidance"  # llguidance's compile options, at a schema's root: refused by name
NO_COMPILER_OPTIONS = {"not": {"required": [COMPILER_OPTIONS]}}  # and the published document says so
SCHEMA_BOUNDS = (f"a JSON Schema object of at most {MAX_SCHEMA_BYTES} bytes (compact JSON) and "
                 f"{MAX_SCHEMA_DEPTH} levels of nesting")


def check_schema_bounds(schema: dict[str, Any]) -> None:
    """Raise ValueError when `schema` is nested deeper than MAX_SCHEMA_DEPTH, larger than MAX_SCHEMA_BYTES, or holds
    a number past float64's range.

    Iterative (no recursion a deep schema could exhaust); the depth pass visits each node once and stops at the
    first level too deep, and the exact size is measured only then, by the JSON encoder, on a schema known to be
    shallow. Before either, msgspec's encoder (milliseconds for megabytes; its numbers are never longer than
    `json.dumps`') refuses a schema plainly too large: walked first, a schema of a million `[1]` (4 MB) cost the
    event loop 0.5 s to refuse, four times what parsing any 4 MB body costs.
    A number past float64's range (`1e999`: JSON by RFC 8259's grammar, infinity once the body is read) is refused
    there too: the grammar compiler got it as `null` (`{"const": 1e999}` constrained the answer to `null`, a
    `maximum` of it was refused in the compiler's words), and the gateway sent it to a remote tier as `null`.
    A pattern that repeats too much or a reference to itself in place (`check_costs`) is a pydantic ValidationError
    (a ValueError) located at its keyword inside the schema, and so is COMPILER_OPTIONS (the module's docstring).
    """
    if COMPILER_OPTIONS in schema:
        raise ValidationError.from_exception_data("schema", [InitErrorDetails(
            type=PydanticCustomError("unsupported_parameter", "unsupported parameter (llguidance's compile options: "
                                     "our engines set their own, so the answer would depend on the tier that "
                                     "gave it); remove it"),
            loc=(COMPILER_OPTIONS,), input=None)])
    _size_bounded(schema)
    level: list[Any] = [schema]
    depth = 0
    while level:
        depth += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        nested: list[Any] = []
        for node in level:
            values = node.values() if isinstance(node, dict) else node
            nested.extend(v for v in values if isinstance(v, dict | list))
        level = nested
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:  # a number past float64's range (1e999): JSON, but read as infinity
        raise ValueError("the schema holds a number too large for a 64-bit float (such as 1e999 or -1e999), which "
                         "would be read as infinity; send a finite number") from None
    _refuse_size(len(text.encode()))
    if may_intersect(text):
        check_alternatives(schema)  # what its allOfs would make a grammar compiler intersect
    check_costs(schema, text)


def check_costs(schema: dict[str, Any], compact_json: str | bytes) -> None:
    """What only decoding would find (wire/schema_costs.py): a pattern that repeats too much, a schema that refers
    to itself in place, a schema whose every answer is too long to write. Walked only where its JSON names what
    each needs. A ValidationError located inside the schema."""
    text = compact_json if isinstance(compact_json, str) else compact_json.decode()
    if '"pattern' in text:
        check_patterns(schema)
    if '"$ref"' in text:
        check_self_references(schema)
    if any(key in text for key in ('"pattern"', '"minItems"', '"minLength"')):  # what makes an answer long
        check_answer_length(schema)


def _size_bounded(schema: dict[str, Any]) -> None:
    """ValueError for a schema whose compact JSON, as msgspec writes it, is past MAX_SCHEMA_BYTES; nothing for one
    nested too deep to write (the depth pass refuses it)."""
    try:
        _refuse_size(len(msgspec.json.encode(schema)))
    except RecursionError:
        return


def _refuse_size(size: int) -> None:
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"the schema has {size} bytes as compact JSON; at most {MAX_SCHEMA_BYTES} are allowed")


class JsonSchemaSpec(BaseModel):
    """`response_format.json_schema`: the schema the answer must validate against, and its name."""

    # the schema's key is `schema`, which BaseModel's own namespace has: an alias, used both ways
    model_config = ConfigDict(strict=True, extra="forbid", serialize_by_alias=True,
                              json_schema_extra=nullable_optionals)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$",
                               description="a-z, A-Z, 0-9, underscores and dashes, at most 64 characters")]
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema", description=SCHEMA_BOUNDS,
                                             json_schema_extra=NO_COMPILER_OPTIONS)]
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return one_unknown(drop_nulls(data), cls)

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_schema_bounds(value)
        return value


def _format_schema(schema: dict[str, Any]) -> None:
    """The published schema: `json_schema` goes with type `json_schema` and no other."""
    nullable_optionals(schema)
    schema["allOf"] = [{"if": {"properties": {"type": {"const": "json_schema"}}},
                        "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}},
                        "else": {"properties": {"json_schema": {"type": "null"}}}}]


class ResponseFormat(BaseModel):
    """`response_format`: text, any JSON object, or JSON that validates against a schema."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_format_schema)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return one_unknown(drop_nulls(data), cls)

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs `json_schema` ({\"name\", \"schema\"})")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"`json_schema` goes with type json_schema, not {self.type}")
        return self

    @property
    def constrains(self) -> bool:
        """True when the answer must be JSON (json_object, json_schema); text is unconstrained."""
        return self.type != "text"
