"""What can go wrong below the gateway when choosing or calling a tier."""

from __future__ import annotations

from wire.errors import RESPONSE_FORMAT_COMPILES_BUSY

QUOTED_MAX_CHARS = 200  # of an upstream's own text, in a log line or a replica's reason


def quoted(text: str, max_chars: int = QUOTED_MAX_CHARS) -> str:
    """An upstream's text as one inert line: a Python literal of its first `max_chars` characters (CR, LF, escape
    sequences and invisible characters written out, never obeyed by a log reader or terminal), then how much was
    cut. An upstream is not trusted text: its message must not forge log lines, nor make one 10 MB long."""
    cut = len(text) - max_chars
    return repr(text[:max_chars]) + (f" (and {cut} more characters)" if cut > 0 else "")


class TierError(Exception):
    """Base for tier errors; the gateway maps each to an HTTP status in one place."""


class UnknownModel(TierError):
    """The request names no tier, model or `auto`."""


class TierNotAllowed(TierError):
    """The tenant's plan does not allow the tier it asked for."""


class NoTierAvailable(TierError):
    """No tier the plan allows is ready to serve."""


class UpstreamUnreachable(TierError):
    """The replica could not be reached (connection refused, reset before any answer)."""


class UpstreamTimedOut(TierError):
    """The replica did not answer in time."""


# An upstream's 4xx that is about the request the tenant sent (our engine's validation, a body too large, a schema
# a framework refused): the tenant's 400, in the upstream's words, and a healthy replica's answer. Any other (404: a
# wrong path or model name, 401 and 403: the tier's key, 405, 415...) is how the tier is configured, never the
# tenant's fault: a misconfigured remote tier read as "your request is invalid" to every tenant, and as no error to
# a rollout's guard or to the replica's circuit breaker.
REQUEST_FAULT_STATUSES = frozenset({400, 413, 422})


class UpstreamRejected(TierError):
    """The replica answered with an HTTP error; its status and OpenAI-shaped body are kept. Its text (`str`) is the
    upstream's message quoted (`quoted`), as log lines and replica reasons take it; `message` is the message as
    sent, for the one place that shows it to a tenant (gateway/errors.py, bounded there).

    `replica_failed` is the one definition of whose fault it is: True, the tier's (the tenant reads the gateway's
    502, the replica's breaker counts a failure); False, an answer about the tenant's own request (the tenant's 400,
    or our engine's 429 `response_format_compiles_busy`), which a working replica gives and no breaker counts."""

    def __init__(self, status: int, body: dict[str, object]) -> None:
        err = body.get("error")
        self.error: dict[str, object] = err if isinstance(err, dict) else {}  # OpenAI's error object, if any
        self.message = str(self.error.get("message") if self.error else body)
        super().__init__(quoted(self.message))
        self.status = status
        self.body = body

    @property
    def compiles_busy(self) -> bool:
        """Our engine's grammar compile queue has no room for this request's new response_format (a 429 the tenant
        retries after a second: a flood of new schemas, the tenant's or everyone's, not a broken replica)."""
        return self.status == 429 and self.error.get("code") == RESPONSE_FORMAT_COMPILES_BUSY

    @property
    def replica_failed(self) -> bool:
        """The tier failed the request (5xx; a 4xx about its key, path or model name; any other 429: the tier's
        own account is over its provider's limits, which every tenant's requests meet alike), as opposed to a
        healthy replica's answer about the tenant's request."""
        return not (self.status in REQUEST_FAULT_STATUSES or self.compiles_busy)


class UpstreamProtocolError(TierError):
    """The replica answered with something that is not the OpenAI streaming format."""


class TierOverloaded(NoTierAvailable):
    """Every tier the request may use would wait longer than the plan allows; `wait_s` is the shortest wait."""

    def __init__(self, message: str, *, tier: str, wait_s: float) -> None:
        super().__init__(message)
        self.tier = tier
        self.wait_s = wait_s
