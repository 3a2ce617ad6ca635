"""A request body to a typed request, or the OpenAI-style error that names the offending field."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
UNKNOWN_FIELD = "this endpoint does not know it"
_UNION_MEMBER = re.compile(r"str|int|float|bool|none|[\w-]+\[.*\]|(function|constrained)-.*")


@dataclass(frozen=True)
class BodyError(Exception):
    """The body is not a valid request: `message` for the client, `param` the field, `code` the kind."""

    message: str
    param: str | None
    code: str

    def __str__(self) -> str:
        return self.message


def parse_body(body: bytes, model: type[M]) -> M:
    """Validate `body` (JSON) as `model`; raises BodyError (nothing else) when it is not one. A model's
    `look_before_validating(body)`, where it has one, may refuse the body first (wire/body_width.py)."""
    if not body.strip():
        raise BodyError("the request body is empty; send a JSON object", None, "invalid_json")
    if (look := getattr(model, "look_before_validating", None)) is not None:
        look(body)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise describe(exc, getattr(model, "unsupported_fields", {})) from exc


def describe(exc: ValidationError, unsupported: dict[str, str] | None = None) -> BodyError:
    """The first error of `exc`, worded for the client; `unsupported` says why known fields are refused."""
    errors = exc.errors(include_url=False)
    # of a union's failed members, the one of the input's own type says more ("at most 4 items", not "a string")
    err = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    kind = err["type"]
    if kind == "json_invalid":
        return BodyError("we could not parse the JSON body of your request: "
                         f"{err.get('ctx', {}).get('error', err['msg'])}", None, "invalid_json")
    if kind == "model_type" and not err["loc"]:
        return BodyError("the request body must be a JSON object", None, "invalid_json")
    # pydantic names union members in the location ("str", "list[...]", "function-after[...]"); drop them
    loc = [str(p) for p in err["loc"] if not _UNION_MEMBER.fullmatch(str(p)) and p != "[key]"]
    param = ".".join(loc) or None
    if kind == "extra_forbidden" and param is not None:
        name = loc[-1]
        return BodyError(f"{param}: unsupported parameter ({(unsupported or {}).get(name, UNKNOWN_FIELD)}); "
                         "remove it", param, "unsupported_parameter")
    message = f"{param}: {err['msg']}" if param else err["msg"]
    return BodyError(message, param, kind)
