"""Request bodies to typed requests, with OpenAI-style 400s that name the offending field."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError

from gateway.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)


def parse_body(body: bytes, model: type[M]) -> M:
    if not body.strip():
        raise InvalidRequest("the request body is empty; send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            raise InvalidRequest(
                "we could not parse the JSON body of your request: "
                f"{err.get('ctx', {}).get('error', err['msg'])}", code="invalid_json") from exc
        loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "str", "list", "int"))]
        param = ".".join(loc) or None
        if err["type"] == "model_type":
            raise InvalidRequest("the request body must be a JSON object", code="invalid_json") from exc
        message = f"{param}: {err['msg']}" if param else err["msg"]
        raise InvalidRequest(message, param=param, code=err["type"]) from exc
