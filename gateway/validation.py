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


def refuse_engine_only(req: BaseModel) -> None:
    """vLLM's fields our engines honour and the gateway does not: refused by name, never dropped. `priority` (a
    tenant's plan sets it); `stream_options.continuous_usage_stats` (the gateway sends usage on the last chunk)."""
    if "priority" in req.model_fields_set:
        raise InvalidRequest("priority: unsupported parameter (your plan sets your priority); remove it",
                             param="priority", code="unsupported_parameter")
    options = getattr(req, "stream_options", None)
    if options is not None and options.continuous_usage_stats:
        raise InvalidRequest("stream_options.continuous_usage_stats: unsupported parameter (the gateway sends usage "
                             "on the last chunk, with include_usage); remove it",
                             param="stream_options.continuous_usage_stats", code="unsupported_parameter")
