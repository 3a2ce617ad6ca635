"""A plan's cascade: a cheap non-streamed `auto` answer that fails its check (tiers/cascade.py) is answered
once more on the next dearer tier. Both attempts are billed; the second's row names the first in
`cascade_of`, the first's route reason says what became of it.

The check: empty, truncated by the context, below the plan's fixed mean log-probability, and then, where the
router's artifact has a calibration for the pair (this tier → the tier a retry would use), the calibrated
confidence against the floor `auto` routed with (tiers/routing.py's `Route.floor`): the answer stands when
it is expected to keep the floor, and the route reason says so either way.

The check runs before the first attempt settles, and the second attempt is reserved then too, so the first
row can say whether the cascade happened, and why not when it did not (no dearer tier, the ladder, a
refused reservation). Streams are never cascaded: their first tokens are with the client already. Under an
Idempotency-Key the answer stored is the one the client gets: the second attempt's; if that one fails, the
first answer stands but is not stored (a retry runs again).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from cache import Bypass
from gateway.errors import TiergateError
from gateway.pipeline.attempt import Attempt, Prepared
from gateway.pipeline.cache_lookup import CacheLookup
from gateway.pipeline.context import RequestContext
from gateway.pipeline.events import Event, Head
from gateway.pipeline.idempotency import Keep
from gateway.pipeline.meter import Outcome
from gateway.pipeline.route import RouteDecision, RouteStage
from gateway.pipeline.settle import Settler
from tiers.cascade import Verdict, check_answer, check_confidence, next_dearer, outcome_values
from wire.chat_request import ChatCompletionRequest


class Pipeline(Protocol):
    """What the cascade uses of the pipeline that calls it (gateway/pipeline/handle.py)."""

    route: RouteStage
    settler: Settler

    def answer(self, ctx: RequestContext, prepared: Prepared, *, judge: Any = None,
               headers: dict[str, str] | None = None) -> AsyncIterator[Event]: ...

    async def prepare_on(self, ctx: RequestContext, req: ChatCompletionRequest, route: RouteDecision,
                         lookup: CacheLookup, request_id: str, cascade_of: str | None = None,
                         keep: Keep | None = None) -> Prepared: ...

    def head(self, ctx: RequestContext, req: ChatCompletionRequest, attempt: Attempt,
             extra: dict[str, str] | None = None) -> Head: ...


@dataclass(frozen=True)
class Step:
    attempt: Attempt  # the first attempt, as judged
    second: Prepared | None  # the reserved second attempt, when the cascade goes ahead
    label: str = ""  # `small->mid`


async def cascade(pipeline: Pipeline, ctx: RequestContext, prepared: Prepared) -> AsyncIterator[Event]:
    step: Step | None = None

    async def judge(attempt: Attempt, outcome: Outcome) -> Attempt:
        nonlocal step
        step = await _judge(pipeline, ctx, prepared, attempt, outcome)
        return step.attempt

    first = [event async for event in pipeline.answer(ctx, prepared, judge=judge)]
    assert step is not None and isinstance(first[0], Head)
    if step.second is None:
        yield pipeline.head(ctx, prepared.req, step.attempt)
        for event in first[1:]:
            yield event
        return
    try:
        labelled = {"x-tiergate-cascade": step.label}
        second = [event async for event in pipeline.answer(ctx, step.second, headers=labelled)]
    except TiergateError as err:  # the retry failed (and is settled as such): the first answer stands
        failed = {"x-tiergate-cascade": f"{step.label} failed ({err.code})"}
        yield pipeline.head(ctx, prepared.req, step.attempt, failed)
        for event in first[1:]:
            yield event
        return
    for event in second:
        yield event


async def _judge(pipeline: Pipeline, ctx: RequestContext, prepared: Prepared, attempt: Attempt,
                 outcome: Outcome) -> Step:
    routing, tier = ctx.plan.routing, attempt.route.tier
    fleet = pipeline.route.fleet
    verdict = check_answer(outcome.text, finish_reason=outcome.finish_reason, cap_by_context=attempt.cap_by_context,
                           mean_logprob=outcome.mean_logprob, min_mean_logprob=routing.cascade_min_mean_logprob)
    if verdict is None:
        verdict, note = await _confidence(pipeline, ctx, attempt, outcome)
        if verdict is None:
            return Step(replace(attempt, extra_reason=(note,)) if note else attempt, None)
    target = next_dearer(fleet.catalogue, tier, ctx.plan.allowed_tiers, fleet.unavailable(), verdict)
    degr = attempt.route.degradation
    unkept = replace(attempt.lookup, scope=None)  # an answer that failed its check is not worth keeping
    if target is None:
        return Step(replace(attempt, lookup=unkept, extra_reason=(f"{verdict.why}, no dearer tier to cascade to",)),
                    None)
    if degr.cascade_disabled:
        return Step(replace(attempt, lookup=unkept, applied=(*attempt.applied, "disable_cascade"),
                            extra_reason=(f"{verdict.why}, not cascaded (degrade level {degr.level})",)), None)
    second_id = f"{attempt.request_id}-cascade"
    route = pipeline.route.on_version(ctx, prepared.req,
                                      attempt.route.moved_to(target, f"cascade from {tier.name} ({verdict.why})"))
    no_cache = CacheLookup(Bypass("bypass: a cascade's second attempt"), None, None, {}, ctx.headers, ())
    try:
        second = await pipeline.prepare_on(ctx, prepared.req, route, no_cache, second_id,
                                           cascade_of=attempt.request_id, keep=prepared.keep)
    except TiergateError as err:  # over budget or limits for a second attempt: the first answer stands
        why = f"{verdict.why}, cascade to {target.name} refused ({err.code})"
        return Step(replace(attempt, lookup=unkept, extra_reason=(why,)), None)
    pipeline.settler.metrics.cascades.labels(tier.name, target.name, verdict.code).inc()
    judged = replace(attempt, lookup=unkept, final=False,  # the second attempt's answer is the client's
                     extra_reason=(f"{verdict.why}: cascaded to {target.name} as {second_id}",))
    return Step(judged, second, f"{tier.name}->{target.name}")


async def _confidence(pipeline: Pipeline, ctx: RequestContext, attempt: Attempt, outcome: Outcome
                ) -> tuple[Verdict | None, str | None]:
    """The calibrated check (the router's artifact): only for a route `auto` gave a floor, and only where
    there is a dearer tier to retry on (the thresholds are per pair)."""
    floor, source = attempt.route.route.floor, pipeline.route.predictor
    if floor is None or source is None:
        return None, None
    fleet = pipeline.route.fleet
    target = next_dearer(fleet.catalogue, attempt.route.tier, ctx.plan.allowed_tiers, fleet.unavailable(),
                         Verdict("low_confidence", ""))
    if target is None:
        return None, None
    return check_confidence(outcome_values(outcome), calibration=await source.calibration(),
                            cheap=attempt.route.tier.name, strong=target.name, floor=floor)
