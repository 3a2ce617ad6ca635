"""What can go wrong below the gateway when choosing or calling a tier."""

from __future__ import annotations

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


class UpstreamRejected(TierError):
    """The replica answered with an HTTP error; its status and OpenAI-shaped body are kept. Its text (`str`) is the
    upstream's message quoted (`quoted`), as log lines and replica reasons take it; `message` is the message as
    sent, for the one place that shows it to a tenant (gateway/errors.py, bounded there)."""

    def __init__(self, status: int, body: dict[str, object]) -> None:
        err = body.get("error")
        self.error: dict[str, object] = err if isinstance(err, dict) else {}  # OpenAI's error object, if any
        self.message = str(self.error.get("message") if self.error else body)
        super().__init__(quoted(self.message))
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
