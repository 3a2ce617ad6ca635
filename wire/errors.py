"""OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any


def error_body(message: str, type_: str = "invalid_request_error", *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
