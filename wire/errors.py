"""OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

# An engine's code for a request that failed by its own content (its response_format's grammar could not go on),
# not by the engine's health: the engine answers 400 with it, and the gateway neither retries it nor counts it
# against the replica's circuit breaker (one tenant's schema must not take a tier away from everyone).
RESPONSE_FORMAT_FAILED = "response_format_failed"
REQUEST_FAULT_CODES = frozenset({RESPONSE_FORMAT_FAILED})
# The HTTP status our engine's stream error event stands for, where the event is what an answer before the stream
# would have been (a 400 refusal, a 429 when full, both as the request starts; engine/answer_frames.py): the field of
# the error object that carries it. An event's `type` does not say whose fault it is (an upstream's bad key is an
# `invalid_request_error` too), so only this field, and REQUEST_FAULT_CODES, make an event the tenant's 400.
STREAM_ERROR_STATUS = "status"
# An engine's 429 when its grammar compile queue has no room for a new response_format (engine/compile_queue.py): a
# tenant's flood of new schemas, or every tenant's; the gateway relays it as a 429 with Retry-After, not a 502.
RESPONSE_FORMAT_COMPILES_BUSY = "response_format_compiles_busy"
COMPILES_BUSY_RETRY_AFTER_S = 1
# The gateway's per-tenant namespace for a local engine's prefix cache (engine/block_manager.py `root_hash`): a
# header the gateway sets on its own calls to its engines, never taken from a tenant's request.
CACHE_SALT_HEADER = "x-tiergate-cache-salt"
# The largest request body the gateway takes by default (gateway/settings.py `max_body_bytes`) and an engine's default
# (engine/server.py): a larger one is a 413 with this code, before anything is parsed.
MAX_BODY_BYTES = 4 * 1024 * 1024
PAYLOAD_TOO_LARGE = "payload_too_large"


def error_body(message: str, type_: str = "invalid_request_error", *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
