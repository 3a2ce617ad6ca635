"""What can go wrong below the gateway when choosing or calling a tier."""

from __future__ import annotations


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


class UpstreamRejected(TierError):
    """The replica answered with an HTTP error; its status and OpenAI-shaped body are kept."""

    def __init__(self, status: int, body: dict[str, object]) -> None:
        err = body.get("error")
        self.error: dict[str, object] = err if isinstance(err, dict) else {}  # OpenAI's error object, if any
        super().__init__(str(self.error.get("message") if self.error else body))
        self.status = status
        self.body = body


class UpstreamProtocolError(TierError):
    """The replica answered with something that is not the OpenAI streaming format."""


class TierOverloaded(NoTierAvailable):
    """Every tier the request may use would wait longer than the plan allows; `wait_s` is the shortest wait."""

    def __init__(self, message: str, *, tier: str, wait_s: float) -> None:
        super().__init__(message)
        self.tier = tier
        self.wait_s = wait_s
