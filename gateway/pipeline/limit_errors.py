"""The 429 for a scope over one of its limits, worded once for the two places that refuse: the exact check at
reservation (gateway/pipeline/reserve.py) and the gate that remembers its refusals (gateway/pipeline/gate.py). A
client reads the same message, code, `Retry-After` and OpenAI's `x-ratelimit-*` headers (of the scope refused: the
tenant's or its key's) from either.

A request that alone needs more than a scope's tokens per minute, or may cost more than a whole budget, can never be
admitted: `too_large` says so, without a Retry-After (waiting does not help; it said "retry in 60s"). Its refusal is a
`NeverAdmitted`: the request's own fault, not a limit used up, so it is charged to its tenant's bucket of refused
requests (gateway/pipeline/refusals.py `tenants_fault`), like a prompt too long for the context, and nothing of the
scope is remembered against the tenant's other requests. The gate once remembered it for a second as the scope's
("never_admitted"), so a flood of them skipped its cache lookups, but that refused every request of the tenant
meanwhile: one oversized request made its ordinary ones fail with 429 for a second. A flood is now refused before its
lookup by its own size (gateway/pipeline/handle.py checks it as soon as the prompt is counted) and charged."""

from __future__ import annotations

import math
from decimal import Decimal

from gateway.errors import QuotaExceeded, RateLimited, TiergateError, TokensRateLimited, counter_overflowed
from quotas.money import to_pico
from quotas.plans import Limits

_WHAT = {"rpm": "requests per minute", "tpm": "tokens per minute", "concurrency": "concurrent requests"}


def limit_refusal(label: str, reason: str, retry_after_s: float, limits: Limits | None) -> TiergateError:
    """`label` is "your tenant" or "your key"; `reason` the limit ("rpm", "tpm", "concurrency", "budget_day",
    "budget_month"), or a counter that would overflow ("overflow_tpm", "overflow_day", "overflow_month": worded by
    gateway/errors.py `counter_overflowed`); `limits`, the refused scope's (the plan's, or the key's own), adds the
    headers."""
    if reason.startswith("overflow_"):  # a counter it would overflow (quotas/backends/base.py COUNTER_MAX): no limit
        return counter_overflowed(label, reason, retry_after_s)
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
    kind = TokensRateLimited if reason == "tpm" else RateLimited
    return kind(f"rate limit of {label} reached: {_WHAT.get(reason, reason)}; retry in {retry}s",
                code=f"rate_limit_{reason}", retry_after=retry, headers=headers)


class NeverAdmitted:
    """Marks a `too_large` refusal: the request's own fault (refusals.py `tenants_fault`), charged with the characters
    tokenized to know it (`tokenized_chars`, set where a count came before it), as a prompt too long is."""

    tokenized_chars = 0


class TokensNeverAdmitted(TokensRateLimited, NeverAdmitted):
    """More tokens than a whole tokens-per-minute limit."""


class BudgetNeverAdmitted(QuotaExceeded, NeverAdmitted):
    """A price over a whole daily or monthly budget."""


def too_large(scopes: tuple[tuple[str, Limits | None], ...], tokens: int, price: Decimal
              ) -> tuple[int, str, TokensNeverAdmitted | BudgetNeverAdmitted] | None:
    """The refusal of a request that no minute, day or month can admit in one of `scopes` ((label, limits)): its
    `tokens` (prompt and max_tokens) over the scope's tokens per minute, or its most `price` over a whole budget
    (compared as the quota stores count, in picodollars); with the index of the scope and the limit ("tpm",
    "budget_day", "budget_month"). None if each could admit it."""
    for i, (label, limits) in enumerate(scopes):
        if limits is None:
            continue
        if limits.tpm is not None and tokens > limits.tpm:
            return i, "tpm", TokensNeverAdmitted(
                f"this request needs {tokens} tokens (its prompt and max_tokens), more than the {limits.tpm} tokens "
                f"per minute of {label}: it can never be admitted; shorten the prompt or lower max_tokens",
                code="rate_limit_tpm", headers={"x-ratelimit-limit-tokens": str(limits.tpm)})
        for reason, budget in (("budget_day", limits.budget_day_usd), ("budget_month", limits.budget_month_usd)):
            if budget is not None and price > budget and to_pico(price) > to_pico(budget):
                period = "daily" if reason == "budget_day" else "monthly"
                return i, reason, BudgetNeverAdmitted(
                    f"this request may cost up to ${price:f} (its prompt and max_tokens), more than the {period} "
                    f"budget of {label} (${budget:f}): it can never be admitted; lower max_tokens or shorten the "
                    "prompt")
    return None


def reset_duration(seconds: float) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `1h2m3s`."""
    s = max(0, math.ceil(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{sec}s"
