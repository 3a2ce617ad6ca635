"""A request body to a typed request, or the OpenAI-style error that names the offending field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from wire.chat_request import unsupported_reason

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class BodyError(Exception):
    """The body is not a valid request: `message` for the client, `param` the field, `code` the kind."""

    message: str
    param: str | None
    code: str

    def __str__(self) -> str:
        return self.message


def parse_body(body: bytes, model: type[M]) -> M:
    """Validate `body` (JSON) as `model`; raises BodyError (nothing else) when it is not one."""
    if not body.strip():
        raise BodyError("the request body is empty; send a JSON object", None, "invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise describe(exc) from exc


def describe(exc: ValidationError) -> BodyError:
    """The first error of `exc`, worded for the client."""
    err = exc.errors(include_url=False)[0]
    kind = err["type"]
    if kind == "json_invalid":
        return BodyError("we could not parse the JSON body of your request: "
                         f"{err.get('ctx', {}).get('error', err['msg'])}", None, "invalid_json")
    if kind == "model_type" and not err["loc"]:
        return BodyError("the request body must be a JSON object", None, "invalid_json")
    # pydantic names union members in the location ("str", "list[...]", "function-after[...]"); drop them
    loc = [str(p) for p in err["loc"]
           if not str(p).startswith(("function-", "constrained-", "str", "list", "int", "float"))]
    param = ".".join(loc) or None
    if kind == "extra_forbidden" and param is not None:
        name = loc[-1]
        return BodyError(f"{param}: unsupported parameter ({unsupported_reason(name)}); remove it", param,
                         "unsupported_parameter")
    message = f"{param}: {err['msg']}" if param else err["msg"]
    return BodyError(message, param, kind)
