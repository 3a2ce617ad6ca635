"""Our errors, each with its HTTP status and OpenAI error type; the one place lower errors map to ours."""

from __future__ import annotations

from typing import Any

from tiers import errors as tier_errors


class TiergateError(Exception):
    """Base: an error a client sees in OpenAI's shape."""

    status_code = 500
    error_type = "api_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or type(self).code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


class InvalidRequest(TiergateError):
    """The request is malformed or asks for something impossible."""

    status_code = 400
    error_type = "invalid_request_error"


class Unauthenticated(TiergateError):
    """No key, an unknown key, a revoked or expired key."""

    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(TiergateError):
    """The key is valid but may not do this."""

    status_code = 403
    error_type = "permission_error"


class NotFound(TiergateError):
    """An unknown model, tenant, key or route."""

    status_code = 404
    error_type = "invalid_request_error"


class Conflict(TiergateError):
    """The thing already exists or is in a state that forbids the change."""

    status_code = 409
    error_type = "invalid_request_error"


class PayloadTooLarge(TiergateError):
    """The body is larger than the gateway accepts."""

    status_code = 413
    error_type = "invalid_request_error"


class RateLimited(TiergateError):
    """Over a rate limit (requests, tokens or concurrency per minute); retry after the window moves."""

    status_code = 429
    error_type = "requests"
    code = "rate_limit_exceeded"


class QuotaExceeded(TiergateError):
    """The tenant's (or key's) money budget for the day or month is spent."""

    status_code = 429
    error_type = "insufficient_quota"
    code = "insufficient_quota"


class Unavailable(TiergateError):
    """No tier that may serve the request is ready; retrying later can help."""

    status_code = 503
    error_type = "service_unavailable"


class UpstreamError(TiergateError):
    """A tier's backend failed or answered with nonsense."""

    status_code = 502
    error_type = "api_error"
    code = "upstream_error"


class UpstreamTimeout(TiergateError):
    """A tier's backend did not answer in time."""

    status_code = 504
    error_type = "api_error"
    code = "upstream_timeout"


def map_tier_error(exc: tier_errors.TierError) -> TiergateError:
    """The one place where routing and upstream failures become client-facing errors."""
    match exc:
        case tier_errors.UnknownModel():
            return NotFound(str(exc), param="model", code="model_not_found")
        case tier_errors.TierNotAllowed():
            return Forbidden(str(exc), param="model", code="tier_not_allowed")
        case tier_errors.NoTierAvailable():
            return Unavailable(str(exc), code="no_tier_available", retry_after=5)
        case tier_errors.UpstreamRejected() if 400 <= exc.status < 500 and exc.status not in (401, 403, 429):
            err = exc.body.get("error") if isinstance(exc.body.get("error"), dict) else {}
            return InvalidRequest(str(exc), param=err.get("param"), code=err.get("code") or "upstream_rejected")  # type: ignore[union-attr]
        case tier_errors.UpstreamRejected():
            return UpstreamError(f"the tier's backend answered {exc.status}: {exc}", retry_after=2)
        case tier_errors.UpstreamTimedOut():
            return UpstreamTimeout(f"the tier's backend did not answer in time: {exc}", retry_after=2)
        case tier_errors.UpstreamUnreachable():
            return Unavailable(f"the tier's backend could not be reached: {exc}", code="upstream_unreachable",
                               retry_after=2)
        case _:
            return UpstreamError(f"the tier's backend failed: {exc}")
