"""What the request models share: `null` means "not set", refusals that name the field and say why, and JSON
schemas that say both, so the published OpenAPI document accepts exactly what the models accept.

- `drop_nulls`: a model's `mode="before"` validator, as the OpenAI SDKs send unset fields as `null`.
- `nullable_optionals`: the matching `json_schema_extra`: every property that is not required also takes `null`.
- `only(*values, reason=…)`: a field that exists in OpenAI's API but whose other values we do not serve. The schema
  comes from the annotated type (a `Literal`, a bounded list); any other value is refused with code
  `unsupported_value` and `reason`, and the check is type-exact (JSON `0` is not `false`, as it is to pydantic's
  `Literal[False]`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

UNSUPPORTED_VALUE = "unsupported_value"


def drop_nulls(data: Any, echoed: tuple[str, ...] = ()) -> Any:
    """A JSON object without its `null` fields (and without `echoed` fields that are empty)."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if v is not None and not (k in echoed and _empty(v))}


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
