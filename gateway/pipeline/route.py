"""Route: which tier answers (tiers/routing.py's rules), with the ladder's level read once for the request.

An explicit tier, or `auto`: the cheapest allowed tier whose predicted fidelity reaches the plan's quality
floor (or, under the cascade policy, the cheapest allowed tier, checked after it answers), the floor relaxed
as the tenant's budget runs low (one quota-backend read, only for plans that relax it).
Around unavailable and overloaded tiers (load moves only to a tier outside the overloaded one's hardware
group: the fleet's `hardware_groups`); the ladder's remap last, bounded by the plan (gateway/ladder/apply.py: never
a tier the plan leaves out, a dearer one only with `allow_upgrade`, else a 503 naming the level). When every allowed
tier is over its wait limit, the route without load is still returned, with the overload: a cached answer may serve
it anyway.

A request that needs something of its tier (needs.py: tools, or tool calls and results in its messages; vLLM's
`top_k`; `response_format` on a text completion) goes only to tiers that have it: `auto` and every fallback skip
the others (and so does a cascade, through the decision's `unable`), and naming one is a 400 naming the field. An
answer with tools is not cascaded: a tool call is not prose the cascade's checks can judge.

Last, the version: on a tier with versions, the rollout in progress (gateway/rollout) picks the one that answers
this conversation; the decision's tier is then that version's spec, whose replicas the call uses and whose model
version scopes the cache. A candidate none of whose replicas can take a request now is passed over for the
baseline (the rollout counts it as the candidate's error, for its guards). What a tier offers a request with needs is
what its version outside the canary has (`RolloutService.steady`: the one a `full` rollout put everyone on, say),
and a candidate that lacks one of the request's needs is passed over for the baseline too (not its error: it was
never asked; the rollout service's docstring says why a start refuses such a candidate, and why this stays).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from gateway.errors import Unavailable, client_error
from gateway.ladder.apply import Degradation, RemapRefused
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import DispatchStage
from gateway.pipeline.needs import Need, able, check_named, lacking, needs_of, unable
from gateway.rollout.assign import conversation_id
from gateway.rollout.service import RolloutService
from quotas.backends.base import QuotaBackendError
from quotas.reservations import QuotaService
from tiers.catalogue import TierSpec
from tiers.errors import TierError, TierOverloaded
from tiers.fleet import Fleet, public_reason
from tiers.predictor import PredictorSource
from tiers.replica_choice import SESSION_HEADER
from tiers.routing import (
    AUTO,
    CASCADE,
    PREDICT,
    Prediction,
    Route,
    RouteRules,
    TierConditions,
    check_model,
    choose_tier,
)
from wire.chat_request import ChatCompletionRequest, normalized_role

REMAP_RETRY_AFTER_S = 30  # a level dwells minutes (its min_dwell_s), not seconds


@dataclass(frozen=True)
class RouteDecision:
    route: Route
    degradation: Degradation  # the ladder's level in force, read once for the whole request
    requested_tier: str  # what the request named, or the plan's default for `auto`
    overloaded: TierOverloaded | None  # every allowed tier is over its wait limit
    applied: tuple[str, ...]  # the ladder's actions that changed the route
    # tier name -> why it cannot answer this request (needs.py), whatever its health: a cascade passes them over
    unable: dict[str, str] = field(default_factory=dict)

    @property
    def tier(self) -> TierSpec:
        return self.route.tier

    @property
    def reason(self) -> str:
        return self.route.reason

    def overload_refusal(self) -> Unavailable | None:
        """The 503 for a request that must run on a tier (not a cache hit) while every tier is overloaded."""
        if self.overloaded is None:
            return None
        return Unavailable(str(self.overloaded), code="overloaded",
                           retry_after=max(1, math.ceil(self.overloaded.wait_s)))

    def moved_to(self, tier: TierSpec, reason: str) -> RouteDecision:
        """The same request on another tier (a cascade's second attempt)."""
        return replace(self, route=Route(tier, reason, auto=True), overloaded=None, applied=())


class RouteStage:
    def __init__(self, *, fleet: Fleet, quotas: QuotaService, dispatch: DispatchStage,
                 predictor: PredictorSource | None, rollouts: RolloutService | None = None) -> None:
        self.fleet = fleet
        self.quotas = quotas
        self.dispatch = dispatch
        self.predictor = predictor
        self.rollouts = rollouts

    async def choose(self, ctx: RequestContext, req: ChatCompletionRequest, degr: Degradation) -> RouteDecision:
        plan, routing = ctx.plan, ctx.plan.routing
        prediction: Prediction | None = None
        unpredicted = "no difficulty model yet"
        floor, floor_reason = routing.floor_for(None)
        if req.model == AUTO and routing.policy == PREDICT and self.predictor is not None:
            got = await self.predictor.predict(lambda: [{"role": normalized_role(m.role), "content": m.text()}
                                                        for m in req.messages], owner=ctx.tenant)
            if isinstance(got, Prediction):
                prediction = got
            else:
                unpredicted = got
        if req.model == AUTO and routing.budget_thresholds and (prediction is not None or routing.policy == CASCADE):
            floor, floor_reason = routing.floor_for(await self._budget_left(ctx))
        rules = RouteRules(allowed=plan.allowed_tiers, default=plan.default_tier, allow_upgrade=plan.allow_upgrade,
                           shed_to_cheaper=plan.shed_to_cheaper, dearer_on_load=routing.allow_dearer_on_load,
                           max_wait_s=plan.max_queue_wait_s, quality_floor=floor, floor_reason=floor_reason,
                           policy=routing.policy, cascade=routing.cascade)
        unavailable = self.fleet.unavailable()
        cannot: dict[str, str] = {}
        if needs := needs_of(req):
            # the plan's refusal first, as without them: a 400 saying "tier X cannot call tools" would confirm
            # to the tenant that X is a tier when its plan does not offer it
            try:
                check_model(req.model, catalogue=self.fleet.catalogue, allowed=rules.allowed)
            except TierError as exc:
                raise client_error(exc) from exc
            rules, cannot = self._able_tiers(req, needs, rules)
            unavailable = unavailable | cannot
        waits = self.dispatch.predicted_waits(plan, ctx.tenant) if plan.max_queue_wait_s is not None else {}
        overloaded: TierOverloaded | None = None
        try:
            try:
                route = choose_tier(req.model, catalogue=self.fleet.catalogue, rules=rules, prediction=prediction,
                                    conditions=TierConditions(unavailable, waits, self.fleet.hardware_groups),
                                    unpredicted=unpredicted)
            except TierOverloaded as exc:
                overloaded = exc
                route = choose_tier(req.model, catalogue=self.fleet.catalogue, rules=rules, prediction=prediction,
                                    conditions=TierConditions(unavailable), unpredicted=unpredicted)
        except TierError as exc:
            raise client_error(exc) from exc
        route, applied = self._remap(degr, route, rules, unavailable)
        if req.uses_tools:  # never cascaded (only `auto` routes are; the tier `auto` chose answers)
            route = replace(route, auto=False, cascade=False)
        if self.rollouts is not None:
            route = self._version(ctx, req, route, needs)
        requested = plan.default_tier if req.model == AUTO else req.model
        return RouteDecision(route, degr, requested, overloaded, applied, cannot)

    def on_version(self, ctx: RequestContext, req: ChatCompletionRequest, decision: RouteDecision) -> RouteDecision:
        """The decision on the version its tier's rollout gives this conversation (a cascade's second attempt)."""
        if self.rollouts is None:
            return decision
        return replace(decision, route=self._version(ctx, req, decision.route, needs_of(req)))

    def _version(self, ctx: RequestContext, req: ChatCompletionRequest, route: Route, needs: tuple[Need, ...]) -> Route:
        """The route on the version the tier's rollout gives this conversation (one that has the request's
        `needs`)."""
        assert self.rollouts is not None

        def lacks(spec: TierSpec) -> str | None:
            need = lacking(spec, needs)
            return None if need is None else need.cannot

        def conversation() -> str:
            return conversation_id(ctx.tenant, [{"role": normalized_role(m.role), "content": m.text()}
                                                for m in req.messages], ctx.headers.get(SESSION_HEADER))

        spec, why = self.rollouts.choose(route.tier, ctx.tenant, conversation, self._down, lacks)
        return route if why is None else replace(route, tier=spec, reason=f"{route.reason}; {why}")

    def fall_back(self, decision: RouteDecision) -> RouteDecision | None:
        """The decision on the baseline when its tier is a running rollout's candidate that could not be reached
        (counted as the candidate's error); None otherwise."""
        if self.rollouts is None:
            return None
        spec = self.rollouts.fall_back(decision.tier, decision.tier.version_name)
        if spec is None:
            return None
        why = f"candidate {decision.tier.version_name} unreachable: version {spec.version_name} answers"
        return replace(decision, route=replace(decision.route, tier=spec, reason=f"{decision.reason}; {why}"))

    def _down(self, spec: TierSpec) -> str | None:
        """Why no replica of this version can take a request now (None: one can)."""
        reps = self.fleet.replicas_of(spec)
        if any(r.can_take for r in reps):
            return None
        # the tenant reads it (x-tiergate-route-reason): the replicas' public reasons, never their own (URLs)
        return "; ".join(sorted({public_reason(r) for r in reps})) or "circuit breaker open on every replica"

    def _able_tiers(self, req: ChatCompletionRequest, needs: tuple[Need, ...],
                    rules: RouteRules) -> tuple[RouteRules, dict[str, str]]:
        """The rules of a request with `needs`: only tiers that have them, and why each other tier cannot answer;
        a 400 naming the field when the request names a tier without it, or when the plan allows none with it."""
        catalogue, steady = self.fleet.catalogue, self._steady
        named = catalogue.tiers.get(req.model)
        check_named(None if named is None else steady(named), needs)
        names = [t.name for t in able((steady(t) for t in catalogue.by_price() if t.name in rules.allowed), needs)]
        default = rules.default if rules.default in names else names[0]
        return replace(rules, allowed=names, default=default), unable(map(steady, catalogue.tiers.values()), needs)

    def _steady(self, tier: TierSpec) -> TierSpec:
        """The version whose abilities are the tier's (the one answering outside a canary's share)."""
        return tier if self.rollouts is None else self.rollouts.steady(tier)

    def _remap(self, degr: Degradation, route: Route, rules: RouteRules,
               unavailable: dict[str, str]) -> tuple[Route, tuple[str, ...]]:
        """The ladder's remap, bounded by the plan (gateway/ladder/apply.py): a 503 naming the level when the plan
        offers no tier in the remapped one's place."""
        if not degr.moves_off(route.tier.name):  # the common case: no remap, no sort of the tiers by price
            return route, ()
        tiers = self.fleet.catalogue.tiers
        try:
            target, action = degr.remap(route.tier.name, by_price=[t.name for t in self.fleet.catalogue.by_price()],
                                        allowed=rules.allowed, upgrade=rules.allow_upgrade,
                                        usable=lambda t: t in tiers and t not in unavailable)
        except RemapRefused as exc:
            raise Unavailable(str(exc), code="degraded_no_tier", retry_after=REMAP_RETRY_AFTER_S,
                              headers={"x-tiergate-degrade-actions": exc.action}) from exc
        if action is None:
            return route, ()
        return replace(route, tier=tiers[target], reason=f"{route.reason}; degrade level {degr.level}: "
                                                         f"{route.tier.name} -> {target}"), (action,)

    async def _budget_left(self, ctx: RequestContext) -> float | None:
        """The smallest share left of the tenant's (and key's) budgets; None if unknown (the floor stays)."""
        try:
            return await self.quotas.budget_left(tenant=ctx.tenant, plan=ctx.plan, key_id=ctx.key_id,
                                                 key_limits=ctx.principal.key.limits, now=time.time())
        except QuotaBackendError:
            return None  # the reservation that follows reports the backend's state

