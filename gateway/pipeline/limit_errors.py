"""The 429 for a scope over one of its limits, worded once for the two places that refuse: the exact check at
reservation (gateway/pipeline/reserve.py) and the gate that remembers its refusals (gateway/pipeline/gate.py). A
client reads the same message, code, `Retry-After` and OpenAI's `x-ratelimit-*` headers from either."""

from __future__ import annotations

import math

from gateway.errors import QuotaExceeded, RateLimited, TiergateError
from quotas.plans import Limits

_WHAT = {"rpm": "requests per minute", "tpm": "tokens per minute", "concurrency": "concurrent requests"}


def limit_refusal(label: str, reason: str, retry_after_s: float, limits: Limits | None) -> TiergateError:
    """`label` is "your tenant" or "your key"; `reason` the limit ("rpm", "tpm", "concurrency", "budget_day",
    "budget_month"); `limits`, the tenant scope's plan limits (None for a key's own scope), adds the headers."""
    retry = max(1, math.ceil(retry_after_s))
    if reason in ("budget_day", "budget_month"):
        period = "daily" if reason == "budget_day" else "monthly"
        return QuotaExceeded(f"the {period} budget of {label} is spent; it renews in {retry}s", retry_after=retry)
    headers: dict[str, str] = {}
    if limits is not None:
        if limits.rpm is not None:
            headers["x-ratelimit-limit-requests"] = str(limits.rpm)
        if limits.tpm is not None:
            headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
        if reason == "rpm":
            headers |= {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": reset_duration(retry)}
        if reason == "tpm":
            headers |= {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": reset_duration(retry)}
    return RateLimited(f"rate limit of {label} reached: {_WHAT.get(reason, reason)}; retry in {retry}s",
                       code=f"rate_limit_{reason}", retry_after=retry, headers=headers)


def reset_duration(seconds: float) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `1h2m3s`."""
    s = max(0, math.ceil(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{sec}s"
