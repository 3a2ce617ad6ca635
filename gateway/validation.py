"""Request bodies to typed requests, with OpenAI-style 400s that name the offending field."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from gateway.errors import InvalidRequest
from wire.validation import BodyError
from wire.validation import parse_body as parse_wire_body

M = TypeVar("M", bound=BaseModel)


def parse_body(body: bytes, model: type[M]) -> M:
    try:
        return parse_wire_body(body, model)
    except BodyError as exc:
        raise InvalidRequest(exc.message, param=exc.param, code=exc.code) from exc
