"""Our errors, each with its HTTP status and OpenAI error type; `client_error` is the one place where a
lower layer's error (tiers, quota backend, dispatch queue, body validation, ledger) becomes one of ours."""

from __future__ import annotations

import logging
import math
import re
from http import HTTPStatus
from typing import Any

from litestar.exceptions import HTTPException, ValidationException

from quotas.backends.base import COUNTER_MAX, QuotaBackendError
from quotas.dispatch import QueueFull
from quotas.ledger import LedgerUnavailable
from quotas.money import from_pico
from tiers import errors as tier_errors
from wire.errors import COMPILES_BUSY_RETRY_AFTER_S
from wire.errors import RESPONSE_FORMAT_COMPILES_BUSY as COMPILES_BUSY
from wire.validation import BodyError

log = logging.getLogger("tiergate.errors")

# what a tier error's own text may carry and a tenant must never read: an upstream's URL, host or port, an
# exception's repr, a traceback (tiers/client.py words its errors for operators: `{url}: {exc!r}`)
_INTERNAL_DETAIL = re.compile(r"://|\blocalhost\b|\b\d{1,3}(?:\.\d{1,3}){3}\b|\[[0-9a-f]*:[0-9a-f:]*\]"
                              r"|\b\w+(?:Error|Exception)\(|Traceback", re.IGNORECASE)


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


class MethodNotAllowed(TiergateError):
    """The route exists, but not for this HTTP method."""

    status_code = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(TiergateError):
    """The thing already exists or is in a state that forbids the change."""

    status_code = 409
    error_type = "invalid_request_error"


class Unprocessable(TiergateError):
    """The request is well formed but contradicts an earlier one (an Idempotency-Key reused with another body)."""

    status_code = 422
    error_type = "invalid_request_error"


class PayloadTooLarge(TiergateError):
    """The body is larger than the gateway accepts."""

    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class RateLimited(TiergateError):
    """Over a rate limit (requests, tokens or concurrency per minute); retry after the window moves."""

    status_code = 429
    error_type = "requests"
    code = "rate_limit_exceeded"


class TokensRateLimited(RateLimited):
    """Over a tokens-per-minute limit: OpenAI's type for it is `tokens`."""

    error_type = "tokens"


class QuotaExceeded(TiergateError):
    """The tenant's (or key's) money budget for the day or month is spent."""

    status_code = 429
    error_type = "insufficient_quota"
    code = "insufficient_quota"


class CounterOverflowed(TiergateError):
    """Admitting the request would overflow one of the quota store's counters (quotas/backends/base.py COUNTER_MAX;
    `Decision.reason` overflow_*): no budget is spent and no rate limit reached; the request's tokens or cost are too
    large to count on top of what the counter holds, until it renews. Worded by `counter_overflowed`."""

    status_code = 429
    error_type = "insufficient_quota"
    code = "quota_counter_overflow"


def counter_overflowed(label: str, reason: str, retry_after_s: float) -> CounterOverflowed:
    """The refusal of a reservation for `reason` (overflow_tpm, overflow_day or overflow_month) in the scope of
    `label` ("your tenant" or "your key"): which counter would overflow, what it holds at most, and when it renews."""
    retry = max(1, math.ceil(retry_after_s))
    if reason == "overflow_tpm":
        return CounterOverflowed(
            f"this request has too many tokens for the tokens-per-minute counter of {label}: adding them would "
            f"overflow that counter, which holds at most {COUNTER_MAX} (the gateway's bound, not a limit); retry in "
            f"{retry}s", retry_after=retry)
    period = "daily" if reason == "overflow_day" else "monthly"
    return CounterOverflowed(
        f"this request's cost is too large for the {period} spend counter of {label}: adding it would overflow that "
        f"counter, which holds at most ${from_pico(COUNTER_MAX).normalize():f} (the gateway's bound, not a budget); "
        f"it renews in {retry}s", retry_after=retry)


class Unavailable(TiergateError):
    """No tier that may serve the request is ready; retrying later can help."""

    status_code = 503
    error_type = "service_unavailable"


# What a tenant reads while the ledger cannot write, and when its request's row was not durable in time: fixed
# sentences. Why the ledger cannot write (the database driver's error: for PostgreSQL its host, port, user and the
# DETAIL and CONTEXT lines) is an operator's to read: the ledger logs it once a fault, and /health shows it to an
# admin key (gateway/routes/health.py); the tenant has the Retry-After and the request id to quote.
NOT_READY_MESSAGE = "the gateway cannot record usage now, so it takes no new requests; retry later"
LEDGER_UNAVAILABLE_MESSAGE = "the gateway cannot record usage now; retry later"
# A stream's last event when its row was not durable within the ledger's wait: the client has every token, and the
# row stays queued and commits (billed) once the ledger can (gateway/pipeline/settle.py). "retry later" was false
# advice there: a retry without an Idempotency-Key runs and is billed again.
USAGE_LATE_MESSAGE = ("the answer above is complete and is billed: its usage could not be recorded in time and is "
                      "recorded later; do not retry this request (a retry is billed again)")
_ledger_fault_logged: str | None = None  # the last ledger fault `client_error` logged (each is logged once in a row)


class UsageRecordedLate(TiergateError):
    """A stream sent whole whose ledger row was late (not withdrawn: it commits, billed): its last event."""

    status_code = 500  # never a status: the stream's 200 has been sent
    error_type = "api_error"
    code = "usage_recorded_late"


def stream_client_error(exc: BaseException) -> TiergateError:
    """The error a stream's last event carries for `exc`, raised after its first byte: `client_error`'s, except for
    the ledger's own wait running out on the stream's row (`LedgerUnavailable` itself: a stream's row is never
    withdrawn, and stays queued to commit), which is `UsageRecordedLate`, never the 503's "retry later"."""
    if type(exc) is LedgerUnavailable:
        _log_ledger_fault(exc, "usage_recorded_late")
        return UsageRecordedLate(USAGE_LATE_MESSAGE)
    return client_error(exc)


def _log_ledger_fault(exc: LedgerUnavailable, answered: str) -> None:
    """Its text holds the ledger's fault, the database driver's words: the log's, not the tenant's; logged once a
    fault, not once a request (every request refused in an outage would write the same line)."""
    global _ledger_fault_logged
    if (fault := str(exc)) != _ledger_fault_logged:
        _ledger_fault_logged = fault
        log.warning("usage not recorded in time, answered %s: %s", answered, fault)


def not_ready() -> Unavailable:
    """The refusal of work while the ledger cannot write (a 503 with Retry-After): chat's and embeddings' alike."""
    return Unavailable(NOT_READY_MESSAGE, code="not_ready", retry_after=5)


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


class InternalError(TiergateError):
    """A fault of ours; the client sees the request id to quote, never the details."""

    status_code = 500
    error_type = "api_error"
    code = "internal_error"


def client_error(exc: BaseException) -> TiergateError:
    """The error a client sees for `exc`, in OpenAI's shape: the one mapping for every lower layer."""
    match exc:
        case TiergateError():
            return exc
        case BodyError():
            return InvalidRequest(exc.message, param=exc.param, code=exc.code)
        case QuotaBackendError():
            return Unavailable("the quota service is unavailable; retry shortly", code="quota_backend_unavailable",
                               retry_after=1)
        case HTTPException():
            return _http_error(exc)
        case QueueFull():
            return Unavailable(str(exc), code="queue_full", retry_after=1)
        case tier_errors.TierError():
            return _tier_error(exc)
        case LedgerUnavailable():
            # its text holds the ledger's fault, the database driver's words: the log's, not the tenant's; logged once
            # a fault, not once a request (every request refused in an outage would write the same line)
            _log_ledger_fault(exc, "503 ledger_unavailable")
            return Unavailable(LEDGER_UNAVAILABLE_MESSAGE, code="ledger_unavailable", retry_after=5)
        case _:
            return InternalError("internal error; it has been logged")


CLIENT_LEFT = "client disconnected prematurely"  # Litestar's 500 when the body's sender has gone


def _http_error(exc: HTTPException) -> TiergateError:
    """Litestar's own refusals (routing, body size, its parameter validation)."""
    message = str(exc.detail)
    if exc.status_code == 500 and message == CLIENT_LEFT:  # nobody to answer, and no fault of ours to log
        return InvalidRequest("the client left before its request had arrived", code="client_disconnected")
    if isinstance(exc, ValidationException) and (invalid := _invalid_parameter(exc.extra)) is not None:
        return invalid
    kind = {400: InvalidRequest, 401: Unauthenticated, 403: Forbidden, 404: NotFound, 405: MethodNotAllowed,
            409: Conflict, 413: PayloadTooLarge, 422: Unprocessable, 429: RateLimited,
            503: Unavailable}.get(exc.status_code)
    if kind is None:
        kind = InternalError if exc.status_code >= 500 else InvalidRequest
    return kind(message, code=kind.code or _http_code(exc.status_code), headers=dict(exc.headers or {}))


# the code of a refusal of Litestar's own that our class of it does not have (a plain 400 of its, an invalid Host
# header, a malformed multipart body, had `code: null`): its status in words, as OpenAI's codes are
_HTTP_CODES = {400: "bad_request", 403: "forbidden", 404: "not_found", 409: "conflict", 422: "unprocessable_entity",
               503: "service_unavailable"}


def _http_code(status: int) -> str:
    """The code of a refusal of Litestar's with `status` (its class's own code, where it has one, comes first)."""
    if status in _HTTP_CODES:
        return _HTTP_CODES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return f"http_{status}"
    return re.sub(r"[^a-z0-9]+", "_", phrase.lower()).strip("_")


def _invalid_parameter(extra: Any) -> InvalidRequest | None:
    """Litestar's refusal of a route's parameter (its `extra`: a list of {"message", "key", "source"}), naming the
    first in words; its own text is a Python repr of the list. None when `extra` is not that."""
    first = extra[0] if isinstance(extra, list) and extra and isinstance(extra[0], dict) else {}
    key, text = first.get("key"), first.get("message")
    if not isinstance(key, str) or not isinstance(text, str):
        return None
    source = getattr(first.get("source"), "value", first.get("source"))
    where = {"query": "query parameter", "path": "path parameter", "header": "header", "cookie": "cookie",
             "body": "body field"}.get(str(source), "parameter")
    return InvalidRequest(f"{key}: {text} ({where})", param=key, code="invalid_value")


def _tier_error(exc: tier_errors.TierError) -> TiergateError:
    """A tier error as the tenant sees it. The text of an upstream's failure (its URL, host and port, the exception
    the client library raised) stays in the log; the tenant reads what failed, in general words. An upstream's 4xx
    answer is the exception: its message and param are about the tenant's own request (our engine's validation)."""
    match exc:
        case tier_errors.UnknownModel() | tier_errors.TierNotAllowed():
            # one answer for both, as OpenAI's ("does not exist or you do not have access to it"): a 403 for a tier
            # the plan leaves out would tell a tenant which of its guessed names are tiers
            return NotFound(str(exc), param="model", code="model_not_found")
        case tier_errors.NoTierAvailable():
            return Unavailable(_public(exc, "no tier can serve this request now"), code="no_tier_available",
                               retry_after=5)
        case tier_errors.UpstreamRejected() if exc.replica_failed:
            # the tier's fault (its key, path or model name, a 5xx), which the replica's breaker counts too
            return _logged(exc, UpstreamError(f"the tier's backend answered {exc.status}", retry_after=2))
        case tier_errors.UpstreamRejected() if exc.compiles_busy:
            # our engine's compile queue is full (engine/compile_queue.py): the tenant retries later, as after a 429
            return RateLimited(_upstream_message(exc), param="response_format", code=COMPILES_BUSY,
                               retry_after=COMPILES_BUSY_RETRY_AFTER_S)
        case tier_errors.UpstreamRejected():  # about the tenant's request (tiers.errors.REQUEST_FAULT_STATUSES)
            return InvalidRequest(_upstream_message(exc), param=_upstream_param(exc.error.get("param")),
                                  code=_upstream_code(exc.error.get("code")))
        case tier_errors.UpstreamTimedOut():
            return _logged(exc, UpstreamTimeout("the tier's backend did not answer in time", retry_after=2))
        case tier_errors.UpstreamUnreachable():
            return _logged(exc, Unavailable("the tier's backend could not be reached", code="upstream_unreachable",
                                            retry_after=2))
        case tier_errors.UpstreamProtocolError():
            return _logged(exc, UpstreamError("the tier's backend answered with something that is not an OpenAI "
                                              "answer"))
        case _:
            return _logged(exc, UpstreamError("the tier's backend failed"))


# An upstream's 4xx `code` becomes the tenant's error code, the ledger row's `error_code` and part of the
# `x-tiergate-cascade` header, so it is kept only as a short token of [a-z0-9_]: every code of OpenAI's and of our
# engine is one (the longest, "response_format_compiles_busy", has 29 characters). A token, not a list of known
# codes: such a list would have to follow every code our engine and wire validation word, and would drop a remote
# backend's own. `fullmatch`, not `^...$`, whose `$` also matches before a final newline.
_UPSTREAM_CODE_MAX_CHARS = 40
_UPSTREAM_CODE = re.compile(rf"[a-z0-9_]{{1,{_UPSTREAM_CODE_MAX_CHARS}}}")
UPSTREAM_REJECTED = "upstream_rejected"  # the code of an upstream's 4xx whose own code is not such a token
UPSTREAM_MESSAGE_MAX_CHARS = 1_000  # of an upstream 4xx's message, as the tenant reads it
_UPSTREAM_PARAM_MAX_CHARS = 200


def _upstream_code(code: object) -> str:
    """An upstream's error code as ours: itself when a short token of safe characters, else UPSTREAM_REJECTED."""
    if (isinstance(code, str) and len(code) <= _UPSTREAM_CODE_MAX_CHARS
            and _UPSTREAM_CODE.fullmatch(lowered := code.lower())):
        return lowered
    return UPSTREAM_REJECTED


def _upstream_param(param: object) -> str | None:
    """An upstream's `param` (a field's path: "messages.0.content"), or None when it is not short printable text."""
    if isinstance(param, str) and len(param) <= _UPSTREAM_PARAM_MAX_CHARS and param.isprintable():
        return param
    return None


def _upstream_message(exc: tier_errors.UpstreamRejected) -> str:
    """An upstream 4xx's message, about the tenant's own request (our engine's validation), cut to a bound: it is
    JSON in the tenant's body (escaped there), but not the upstream's to make megabytes long."""
    text = exc.message
    return text if len(text) <= UPSTREAM_MESSAGE_MAX_CHARS else text[:UPSTREAM_MESSAGE_MAX_CHARS] + "…"


def _logged(exc: tier_errors.TierError, err: TiergateError) -> TiergateError:
    """`err`, the tenant's words for `exc`, once the details it leaves out are in the log."""
    log.warning("upstream failure answered %d %s: %s: %s", err.status_code, err.code, type(exc).__name__, exc)
    return err


def _public(exc: tier_errors.TierError, fallback: str) -> str:
    """The error's own text when a tenant may read it (routing's reasons are words of ours), else `fallback`, with
    the text in the log: a lower layer that words a reason with an upstream's details must not leak them."""
    text = str(exc)
    if _INTERNAL_DETAIL.search(text) is None:
        return text
    log.warning("%s: %s (the client reads: %s)", type(exc).__name__, text, fallback)
    return fallback
