"""What the request models share: `null` means "not set", refusals that name the field and say why, and JSON
schemas that say both, so the published OpenAPI document accepts exactly what the models accept.

- `drop_nulls`: a model's `mode="before"` validator, as the OpenAI SDKs send unset fields as `null`.
- `one_unknown`: the same validator's next step, for a model that forbids fields it does not know: an object keeps
  the first such field only, which the refusal names.
- `nullable_optionals`: the matching `json_schema_extra`: every property that is not required also takes `null`.
- `only(*values, reason=…)`: a field that exists in OpenAI's API but whose other values we do not serve. The schema
  comes from the annotated type (a `Literal`, a bounded list); any other value is refused with code
  `unsupported_value` and `reason`, and the check is type-exact (JSON `0` is not `false`, as it is to pydantic's
  `Literal[False]`).
- `NoBoolNumbers`: a base model whose number fields refuse `true` and `false`, which pydantic reads as 1 and 0.
"""

from __future__ import annotations

import types
from decimal import Decimal
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

UNSUPPORTED_VALUE = "unsupported_value"
FEW_FIELDS = 64  # an object with no more fields makes few enough errors to validate as it is (`one_unknown`)


def drop_nulls(data: Any, echoed: tuple[str, ...] = ()) -> Any:
    """A JSON object without its `null` fields (and without `echoed` fields that are empty)."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if v is not None and not (k in echoed and _empty(v))}


@cache
def _input_names(model: type[BaseModel]) -> frozenset[str]:
    """The names `model`'s fields have in JSON (an alias where one has it: `schema`)."""
    return frozenset(field.alias or name for name, field in model.model_fields.items())


def one_unknown(data: Any, model: type[BaseModel]) -> Any:
    """A JSON object for `model` (which forbids fields it does not know) with the first of its unknown fields only,
    where it has more than FEW_FIELDS fields (no model of ours has as many; an object with fewer is left as it is,
    for a check of its length alone). Pydantic makes an error of every unknown field, and refusing 380,000 of them
    (4 MB of `"z0":1,`, at the top of a request, in a message, a content part, a tool call, stream_options,
    response_format, tool_choice) cost the event loop 0.8-0.9 s, four times what parsing any other 4 MB body costs,
    and the refused-bodies bucket (gateway/pipeline/gate.py) charges by size. The first is the one the refusal names,
    as it was."""
    if not isinstance(data, dict) or len(data) <= FEW_FIELDS:
        return data
    names = _input_names(model)
    first = next((name for name in data if name not in names), None)
    if first is None:
        return data
    return {name: value for name, value in data.items() if name in names or name == first}


def _empty(value: Any) -> bool:
    return type(value) in (list, dict, str) and not value


def nullable_optionals(schema: dict[str, Any]) -> None:
    """`json_schema_extra` for models whose before-validator drops nulls: optional properties take `null` too."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or _takes_null(prop):
            continue
        title, default = prop.pop("title", None), prop.pop("default", None)
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}]} | (
            {"title": title} if title is not None else {}) | ({"default": default} if default is not None else {})


def _takes_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(p.get("type") == "null" for p in prop.get("anyOf", ()))


def _same(a: Any, b: Any) -> bool:
    """Equal JSON values of the same JSON types (`0` is not `false`, `1.0` is `1`)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def only(*values: Any, reason: str) -> BeforeValidator:
    """Accept exactly `values` (JSON values); refuse any other with `reason` (code `unsupported_value`)."""

    def check(value: Any) -> Any:
        if any(_same(value, v) for v in values):
            return value
        raise PydanticCustomError(UNSUPPORTED_VALUE, reason)

    return BeforeValidator(check)


def integral(value: Any) -> Any:
    """A before-validator for the integer fields of strict models: JSON has one number type, and `5.0` is the
    integer 5, as JSON Schema's `integer` says; 5.5, "5" and true are still refused. (A field validator, not an
    annotation: pydantic then keeps the field's bounds in its JSON schema as `minimum`/`maximum`.)"""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


class NoBoolNumbers(BaseModel):
    """A base for models read from files (the tiers, the plans, the ladder): a field that takes a number (int, float,
    Decimal) and not a bool refuses `true` and `false`, also inside its lists and mappings. Pydantic's lax mode reads
    YAML's `true` as 1: `replicas: true` was one replica, `cap_output_tokens: true` one-token answers. Whatever else
    a field takes (a quoted "100" where lax mode reads it) it takes as before; a field that takes a bool keeps it."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bools(cls, value: Any, info: ValidationInfo) -> Any:
        found = bool_as_number(value, cls.model_fields[info.field_name].annotation) if info.field_name else None
        if found is not None:
            given, path = found
            raise PydanticCustomError("bool_not_number", "{inside}Input should be a number, not a boolean ({given})",
                                      {"inside": f"{path[1:]}: " if path else "", "given": given})
        return value


def bool_as_number(value: Any, annotation: Any) -> tuple[str, str] | None:
    """Where in `value` a bool stands that `annotation` would read as a number: (`true`/`false`, the path into the
    value: "" for the value itself, ".key" or ".0" inside a mapping or list), or None."""
    members = _members(annotation)
    if isinstance(value, bool):
        takes_bool = any(m is bool or (get_origin(m) is Literal and any(type(a) is bool for a in get_args(m)))
                         for m in members)
        takes_number = any(m in (int, float, Decimal) for m in members)
        return (str(value).lower(), "") if takes_number and not takes_bool else None
    for m in members:
        origin, args = get_origin(m), get_args(m)
        if origin is dict and isinstance(value, dict) and len(args) == 2:
            items: Any = value.items()
            inner = args[1]
        elif origin is list and isinstance(value, list) and args:
            items, inner = enumerate(value), args[0]
        else:
            continue
        for key, item in items:
            if (found := bool_as_number(item, inner)) is not None:
                return found[0], f".{key}{found[1]}"
    return None


def _members(annotation: Any) -> list[Any]:
    """The types a field's annotation takes, without `Annotated`'s metadata and flattened out of unions."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [m for arg in get_args(annotation) for m in _members(arg)]
    return [annotation]
