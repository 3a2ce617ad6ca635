"""What `Pipeline._prepare` (handle.py) refuses on before the reservation that is no stage's own: the ladder's
shed and cache-only classes, and the prompt counted early and refused if no limit of its tenant could ever admit it.

These are the request path's cheap early exits, so each is a plain function of the stages it reads (the ladder, the
prompt counter, the reservations), called once per request with them: nothing here is held between requests. Kept
apart from handle.py, which runs the stages in order and settles what they begin; here, each refusal says why it
comes where it does.
"""

from __future__ import annotations

from gateway.errors import Unavailable
from gateway.ladder.apply import NORMAL, Degradation
from gateway.ladder.controller import LadderController
from gateway.pipeline.cache_lookup import CacheLookup, isolated_user
from gateway.pipeline.context import RequestContext
from gateway.pipeline.prompt import Prompt, PromptStage
from gateway.pipeline.reserve import ReserveStage, refuse_too_large
from gateway.pipeline.route import RouteDecision
from wire.chat_request import ChatCompletionRequest


def degradation(ladder: LadderController | None, ctx: RequestContext) -> Degradation:
    """The ladder's level in force, read once; its shed classes are refused here, before any work."""
    if ladder is None:
        return NORMAL
    degr = Degradation(ladder.level, tuple(ladder.actions()))
    shed = degr.shed(ctx.plan.priority)
    if shed is not None:
        raise Unavailable(f"degradation level {degr.level}: {ctx.plan.priority} traffic is shed; retry later",
                          code="degraded_shed", retry_after=shed.retry_after_s,
                          headers={"x-tiergate-degrade-actions": f"shed({ctx.plan.priority})"})
    return degr


def refuse_cache_only(ctx: RequestContext, degr: Degradation, route: RouteDecision, lookup: CacheLookup) -> None:
    """Cache-only classes get 503 when the cache had no answer for them."""
    if degr.cache_only(ctx.plan.priority):
        applied = (*route.applied, *lookup.applied, f"cache_only({ctx.plan.priority})")
        raise Unavailable(f"degradation level {degr.level}: {ctx.plan.priority} traffic is answered from cache "
                          "only, and there is no cached answer for this request", code="degraded_cache_only",
                          retry_after=30, headers={"x-tiergate-degrade-actions": ",".join(applied)})


async def measure_early(prompts: PromptStage, reserve: ReserveStage, ctx: RequestContext, req: ChatCompletionRequest,
                        route: RouteDecision) -> tuple[Prompt | None, str | None]:
    """The prompt counted for the route's tier; None when the tier's tokenizer is not prepared (a cached answer
    may still serve the request; a miss is refused by `Pipeline.prepare_on`'s count). A prompt long to count is
    counted holding its floor (reserve.py's `floor`, whose id is returned): a tenant that cannot have even that is
    refused before its count, with the 429 its exact reservation would get. Counted, a request no window or budget
    of its tenant could ever admit is refused (`refuse_too_large`), charged its characters counted (about: its
    turns' and tools'), before its lookup."""
    tier, degr, user = route.tier, route.degradation, isolated_user(ctx, req)
    try:
        unread = prompts.size(req, tier, degr)  # (its tokenizer loaded: `measure` raises no Unavailable)
    except Unavailable:
        return None, None
    held: str | None = None
    if unread.inline:  # microseconds: counted first, and reserved once, at its count
        prompt = await prompts.measure(req, tier, degr, owner=ctx.tenant, user=user, unread=unread)
    else:
        async with reserve.floor(ctx, tokens=unread.floor,
                                 price=tier.price(unread.floor_input, unread.floor_output)) as held:
            prompt = await prompts.measure(req, tier, degr, owner=ctx.tenant, user=user, unread=unread)
    refuse_too_large(ctx, prompt.num_tokens + prompt.output_cap, tier.price(prompt.num_tokens, prompt.output_cap),
                     unread.chars)
    return prompt, held
