"""Admission: route, count the prompt, check the predicted wait, reserve quotas. Nothing is spent on refusal.

Order matters: every check that can refuse without state (route, predicted wait, context length) runs
before the one that charges (the quota reservation), and a reservation is the last step, so a refused
request has charged nothing. Routing reads the difficulty model (for `auto`) and, where the plan relaxes
its quality floor as budgets run low, the tenant's spend: one quota-backend read, only then.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING

from cache import Hit
from engine.model_source import DEFAULT_MODEL, resolve_model
from engine.protocol import ChatMessage
from gateway.cache_service import CacheService
from gateway.errors import InvalidRequest, QuotaExceeded, RateLimited, Unavailable, map_tier_error
from gateway.ladder.apply import Degradation
from gateway.ladder.controller import LadderController
from gateway.metrics import GatewayMetrics
from gateway.token_counter import TokenCounter, token_counter
from quotas.admission import Admission, QuotaService
from quotas.backends.base import QuotaBackendError
from quotas.dispatch import TierQueue
from quotas.limits import Decision
from quotas.plans import PRIORITY_ORDER, Plan, PlanBook
from tiers.catalogue import TierSpec
from tiers.errors import TierError, TierOverloaded
from tiers.fleet import Fleet
from tiers.predictor import PredictorSource
from tiers.routing import AUTO, Prediction, Route, RouteRules, TierConditions, choose_tier

if TYPE_CHECKING:
    from gateway.chat_service import Call


@dataclass
class Admitted:
    """What admission decided for one request."""

    route: Route
    plan: Plan
    prompt_tokens: int
    output_cap: int
    admission: Admission
    degradation: Degradation
    requested_tier: str  # what the request named, or the plan's default for `auto`
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-*, x-tiergate-cache
    hit_price: Decimal | None = None  # set when the answer comes from the cache
    cap_by_context: bool = False  # the output cap is what the tier's context had left (not the client's)


class AdmissionService:
    def __init__(self, *, fleet: Fleet, plans: PlanBook, quotas: QuotaService, queues: dict[str, TierQueue],
                 metrics: GatewayMetrics, models_dir: str, default_max_tokens: int,
                 ladder: LadderController | None = None, cache: CacheService | None = None,
                 predictor: PredictorSource | None = None) -> None:
        self.predictor = predictor
        self.ladder = ladder
        self.cache = cache
        self.fleet = fleet
        self.plans = plans
        self.quotas = quotas
        self.queues = queues
        self.metrics = metrics
        self.models_dir = models_dir
        self.default_max_tokens = default_max_tokens

    def refuse(self, reason: str, err: Exception) -> Exception:
        self.metrics.refused(reason)
        return err

    async def admit(self, call: Call) -> Admitted:
        principal, req = call.principal, call.req
        assert principal.tenant is not None
        plan = self.plans.plans[principal.tenant.plan]
        degr = call.degradation = self._degradation()
        self._shed(degr, plan)
        route, overloaded = await self._route(call, plan)
        route = self._remap(degr, route)
        requested = plan.default_tier if req.model == AUTO else req.model
        if self.cache is not None:
            call.cache_result = await self.cache.lookup(call, plan, route.tier, degr, call.headers)
        if isinstance(call.cache_result, Hit):  # a cached answer needs no tier, however busy
            return await self._admit_hit(call, plan, route, degr, requested, call.cache_result)
        self._cache_only(degr, plan)
        if overloaded is not None:
            raise self.refuse("queue_wait", Unavailable(str(overloaded), code="overloaded",
                                                        retry_after=max(1, math.ceil(overloaded.wait_s))))
        return await self.admit_on(call, plan, route, degr, requested)

    async def admit_on(self, call: Call, plan: Plan, route: Route, degr: Degradation, requested: str) -> Admitted:
        """Count the prompt for `route`'s tier, cap the output, check the context, reserve. A cascade's
        second attempt enters here with the dearer tier."""
        req = call.req
        counter = self._counter(route.tier)
        messages = degr.cap_input(req.messages, lambda ms: counter.prompt_tokens(_as_dicts(ms)))
        if messages is not req.messages:
            call.req = req = req.model_copy(update={"messages": messages})
        prompt = counter.prompt_tokens(_as_dicts(req.messages))
        room = route.tier.context_limit - prompt
        cap = req.output_cap or max(1, min(self.default_max_tokens, room))
        by_context = req.output_cap is None and cap == room
        capped = degr.cap_output(cap)
        if prompt + capped > route.tier.context_limit:
            raise self.refuse("context_length", InvalidRequest(
                f"tier {route.tier.name!r} has a context of {route.tier.context_limit} tokens; the request needs "
                f"{prompt} prompt tokens + {capped} output tokens", param="messages", code="context_length_exceeded"))
        decision, admission = await self._reserve(call, plan, prompt + capped, route.tier.price(prompt, capped))
        return Admitted(route, plan, prompt, capped, admission, degr, requested,
                        _ratelimit_headers(plan, decision) | self._cache_headers(call),
                        cap_by_context=by_context and capped == cap)

    async def _admit_hit(self, call: Call, plan: Plan, route: Route, degr: Degradation, requested: str,
                         hit: Hit) -> Admitted:
        """A cached answer: it consumes what the plan says a hit costs (a request, and the hit price; no
        tokens of the tokens-per-minute limit, as no model runs)."""
        usage = hit.usage
        tokens = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        price = plan.cache.hit_price_per_1k * tokens / 1000
        decision, admission = await self._reserve(call, plan, 0, price)
        return Admitted(route, plan, int(usage.get("prompt_tokens", 0)), 0, admission, degr, requested,
                        _ratelimit_headers(plan, decision) | self._cache_headers(call), hit_price=price)

    async def _reserve(self, call: Call, plan: Plan, tokens: int, price: Decimal) -> tuple[Decision, Admission]:
        """Charge the request's scopes, or raise the refusal a client can act on (nothing charged)."""
        principal = call.principal
        try:
            decision, admission = await self.quotas.reserve(
                request_id=call.request_id, tenant=principal.tenant.name, plan=plan,  # type: ignore[union-attr]
                key_id=principal.key.key_id, key_limits=principal.key.limits, tokens=tokens, price=price)
        except QuotaBackendError as exc:
            raise self.refuse("quota_backend", Unavailable(
                "the quota service is unavailable; retry shortly", code="quota_backend_unavailable",
                retry_after=1)) from exc
        if admission is None:
            raise self.refuse(decision.reason or "quota", self._refusal(plan, decision))
        return decision, admission

    @staticmethod
    def _cache_headers(call: Call) -> dict[str, str]:
        return call.cache_result.headers() if call.cache_result is not None else {}

    def _degradation(self) -> Degradation:
        if self.ladder is None:
            return Degradation(0, [])
        return Degradation(self.ladder.level, list(self.ladder.actions()))

    def _shed(self, degr: Degradation, plan: Plan) -> None:
        """Shed classes get 503 at once, before any work."""
        shed = degr.shed(plan.priority)
        if shed is not None:
            raise self.refuse("degraded_shed", Unavailable(
                f"degradation level {degr.level}: {plan.priority} traffic is shed; retry later",
                code="degraded_shed", retry_after=shed.retry_after_s,
                headers={"x-tiergate-degrade-actions": ",".join(degr.applied)}))

    def _cache_only(self, degr: Degradation, plan: Plan) -> None:
        """Cache-only classes get 503 when the cache had no answer for them."""
        if degr.cache_only(plan.priority):
            degr.applied.append(f"cache_only({plan.priority})")
            raise self.refuse("degraded_cache_only", Unavailable(
                f"degradation level {degr.level}: {plan.priority} traffic is answered from cache only, and "
                "there is no cached answer for this request", code="degraded_cache_only", retry_after=30,
                headers={"x-tiergate-degrade-actions": ",".join(degr.applied)}))

    def _remap(self, degr: Degradation, route: Route) -> Route:
        unavailable = self.fleet.unavailable()
        tiers = self.fleet.catalogue.tiers
        target = degr.remap(route.tier.name, lambda t: t in tiers and t not in unavailable)
        if target == route.tier.name:
            return route
        return replace(route, tier=tiers[target],
                       reason=f"{route.reason}; degrade level {degr.level}: {route.tier.name} -> {target}")

    async def _route(self, call: Call, plan: Plan) -> tuple[Route, TierOverloaded | None]:
        """The tier by the routing policy (tiers/routing.py). When every tier the plan allows is over its
        wait limit, the route without load is returned with the overload: a cached answer may still serve."""
        req, routing = call.req, plan.routing
        prediction: Prediction | None = None
        unpredicted = "no difficulty model yet"
        floor, floor_reason = routing.floor_for(None)
        if req.model == AUTO and self.predictor is not None:
            got = await self.predictor.predict(_as_dicts(req.messages))
            if isinstance(got, Prediction):
                prediction = got
                if routing.budget_thresholds:
                    floor, floor_reason = routing.floor_for(await self._budget_left(call, plan))
            else:
                unpredicted = got
        rules = RouteRules(allowed=plan.allowed_tiers, default=plan.default_tier, allow_upgrade=plan.allow_upgrade,
                           shed_to_cheaper=plan.shed_to_cheaper, dearer_on_load=routing.allow_dearer_on_load,
                           max_wait_s=plan.max_queue_wait_s, quality_floor=floor, floor_reason=floor_reason)
        unavailable = self.fleet.unavailable()
        waits: dict[str, float] = {}
        if plan.max_queue_wait_s is not None:
            priority = PRIORITY_ORDER[plan.priority]
            waits = {t: self.queues[t].predicted_wait_s(priority) for t in plan.allowed_tiers if t in self.queues}
        try:
            try:
                return choose_tier(req.model, catalogue=self.fleet.catalogue, rules=rules, prediction=prediction,
                                   conditions=TierConditions(unavailable, waits), unpredicted=unpredicted), None
            except TierOverloaded as exc:
                return choose_tier(req.model, catalogue=self.fleet.catalogue, rules=rules, prediction=prediction,
                                   conditions=TierConditions(unavailable), unpredicted=unpredicted), exc
        except TierError as exc:
            err = map_tier_error(exc)
            raise self.refuse(err.code or "route", err) from exc

    async def _budget_left(self, call: Call, plan: Plan) -> float | None:
        """The smallest share left of the tenant's (and key's) budgets; None if unknown (the floor stays)."""
        principal = call.principal
        try:
            return await self.quotas.budget_left(tenant=principal.tenant.name, plan=plan,  # type: ignore[union-attr]
                                                 key_id=principal.key.key_id, key_limits=principal.key.limits,
                                                 now=time.time())
        except QuotaBackendError:
            return None  # the reservation that follows reports the backend's state

    def _counter(self, tier: TierSpec) -> TokenCounter:
        source = tokenizer_source(tier)
        try:
            return token_counter(resolve_model(source, Path(self.models_dir)))
        except (OSError, ValueError) as exc:
            raise self.refuse("tokenizer", Unavailable(
                f"the tokenizer of tier {tier.name!r} ({source}) is not prepared: {exc}; run "
                f"`tiergate models fetch --model {source}`", code="tokenizer_unavailable", retry_after=30)) from exc

    @staticmethod
    def _refusal(plan: Plan, decision: Decision) -> Exception:
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


def _as_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


def tokenizer_source(tier: TierSpec) -> str:
    """The model whose tokenizer counts this tier's prompts: its own for local tiers, else the default's."""
    return tier.tokenizer or (tier.model if tier.backend == "local" else DEFAULT_MODEL)


def _ratelimit_headers(plan: Plan, decision: Decision) -> dict[str, str]:
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
