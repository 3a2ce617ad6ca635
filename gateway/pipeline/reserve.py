"""Reserve: charge the request's quota scopes with an upper bound (prompt + output cap, at the tier's price;
or a cache hit's price), or refuse with what a client can act on. Nothing is charged on a refusal.

The reservation is settled to real use by the settle stage, exactly once. A refusal for requests or tokens per
minute or a spent budget is also told to the gate, which then refuses the scope cheaply for up to a second
(gateway/pipeline/gate.py).
"""

from __future__ import annotations

import math
from decimal import Decimal

from gateway.errors import QuotaExceeded, RateLimited, TiergateError, Unavailable
from gateway.pipeline.context import RequestContext
from gateway.pipeline.gate import REMEMBERED_REASONS, TenantGate
from quotas.backends.base import QuotaBackendError
from quotas.limits import Decision
from quotas.plans import Plan
from quotas.reservations import QuotaService, Reservation


class ReserveStage:
    def __init__(self, *, quotas: QuotaService, gate: TenantGate) -> None:
        self.quotas = quotas
        self.gate = gate

    async def reserve(self, ctx: RequestContext, request_id: str, *, tokens: int, price: Decimal) -> Reservation:
        try:
            decision, reservation = await self.quotas.reserve(
                request_id=request_id, tenant=ctx.tenant, plan=ctx.plan, key_id=ctx.key_id,
                key_limits=ctx.principal.key.limits, tokens=tokens, price=price)
        except QuotaBackendError as exc:
            raise Unavailable("the quota service is unavailable; retry shortly", code="quota_backend_unavailable",
                              retry_after=1) from exc
        if reservation is None:
            if decision.reason in REMEMBERED_REASONS and decision.scope is not None:
                scope = ctx.tenant if decision.scope == "t" else f"{ctx.tenant}/{decision.scope}"
                self.gate.rate_refused(scope, decision.retry_after_s, decision.reason)
            raise refusal(ctx.plan, decision)
        return reservation


def refusal(plan: Plan, decision: Decision) -> TiergateError:
    """The 429 for a refused reservation, with OpenAI's `x-ratelimit-*` headers for the tenant's scope."""
    scope = "your key" if decision.scope and decision.scope.startswith("k:") else "your tenant"
    retry = max(1, math.ceil(decision.retry_after_s))
    if decision.reason in ("budget_day", "budget_month"):
        period = "daily" if decision.reason == "budget_day" else "monthly"
        return QuotaExceeded(f"the {period} budget of {scope} is spent; it renews in {retry}s", retry_after=retry)
    what = {"rpm": "requests per minute", "tpm": "tokens per minute",
            "concurrency": "concurrent requests"}.get(decision.reason or "", decision.reason or "limit")
    headers = {}
    if decision.scope == "t":
        limits = plan.limits
        if limits.rpm is not None:
            headers["x-ratelimit-limit-requests"] = str(limits.rpm)
        if limits.tpm is not None:
            headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
        if decision.reason == "rpm":
            headers |= {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": _dur(retry)}
        if decision.reason == "tpm":
            headers |= {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": _dur(retry)}
    return RateLimited(f"rate limit of {scope} reached: {what}; retry in {retry}s",
                       code=f"rate_limit_{decision.reason}", retry_after=retry, headers=headers)


def ratelimit_headers(plan: Plan, decision: Decision) -> dict[str, str]:
    """OpenAI's `x-ratelimit-*` headers for an admitted request: the tenant scope's limits and what is left."""
    usage = decision.usage.get("t")
    limits = plan.limits
    if usage is None:
        return {}
    headers = {}
    if limits.rpm is not None:
        headers |= {"x-ratelimit-limit-requests": str(limits.rpm),
                    "x-ratelimit-remaining-requests": str(max(0, limits.rpm - usage.requests)),
                    "x-ratelimit-reset-requests": _dur(usage.reset_requests_s)}
    if limits.tpm is not None:
        headers |= {"x-ratelimit-limit-tokens": str(limits.tpm),
                    "x-ratelimit-remaining-tokens": str(max(0, limits.tpm - usage.tokens)),
                    "x-ratelimit-reset-tokens": _dur(usage.reset_tokens_s)}
    return headers


def _dur(seconds: float) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `1h2m3s`."""
    s = max(0, math.ceil(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{sec}s"
