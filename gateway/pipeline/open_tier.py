"""An attempt's way onto its tier: a dispatch slot waited for, then the tier's stream opened (handle.py's
`Pipeline.answer` reads it), falling back from a rollout's candidate that cannot be reached to its baseline.

Kept apart from handle.py, which runs the stages in order and settles what they begin: this is the one step between
the reservation and the first chunk, and what it holds on return (the slot, the open stream) is the caller's to
release. Plain functions of the stages they use, called once per attempt: nothing here is held between requests.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.pipeline.attempt import Attempt, Prepared
from gateway.pipeline.cache_lookup import isolated_user
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import DispatchStage
from gateway.pipeline.meter import Meter, Reading
from gateway.pipeline.route import RouteStage
from gateway.pipeline.tier_call import TierCaller, Upstream, upstream_body
from quotas.dispatch import Ticket
from quotas.plans import PRIORITY_ORDER
from tiers.catalogue import TierSpec
from tiers.errors import NoTierAvailable, UpstreamUnreachable
from tiers.replica_choice import SESSION_HEADER, affinity_key
from wire.chat_request import normalized_role


async def open_tier(dispatch: DispatchStage, tiers: TierCaller, route: RouteStage, ctx: RequestContext,
                    prepared: Prepared, meter: Meter, reading: Reading | None) -> tuple[Ticket, Upstream, Attempt]:
    """Wait for a dispatch slot, then open the tier's stream; the slot is the caller's to release. A rollout's
    candidate that cannot be reached is passed over for its baseline (the attempt returned says so)."""
    attempt, prompt, req = prepared.attempt, prepared.prompt, prepared.req
    assert prompt is not None
    tier = attempt.route.tier
    ticket = await dispatch.acquire(ctx.tenant, ctx.plan, tier.name, prompt.num_tokens + prompt.output_cap)
    try:
        affinity = affinity_key(ctx.tenant, [{"role": normalized_role(m.role), "content": m.text()}
                                             for m in req.messages], ctx.headers.get(SESSION_HEADER))
        # one set of arguments for the tier and its fallback: the same tenant, and the same end user's own
        # prefix-cache namespace where the plan isolates end users; the meter's upstream starts as the request is
        # written to the tier, not while it connects
        shared: dict[str, Any] = {"affinity": affinity, "tenant": ctx.tenant, "end_user": isolated_user(ctx, req),
                                  "on_sent": meter.upstream_started}
        try:
            return ticket, await tiers.open(tier, tier_body(ctx, prepared, tier, reading), **shared), attempt
        except (UpstreamUnreachable, NoTierAvailable):
            if (fallback := route.fall_back(attempt.route)) is None:
                raise
        attempt = replace(attempt, route=fallback,  # looked up in the candidate's scope: its answer not kept
                          lookup=replace(attempt.lookup, scope=None))
        return ticket, await tiers.open(fallback.tier, tier_body(ctx, prepared, fallback.tier, reading),
                                        **shared), attempt
    except BaseException:
        meter.upstream_ended()
        dispatch.release(tier.name, ticket, 0)
        raise


def tier_body(ctx: RequestContext, prepared: Prepared, tier: TierSpec, reading: Reading | None) -> dict[str, Any]:
    """The tier's body; log-probabilities asked for where the client or a check (`reading`) wants them, with
    the check's alternatives unless the client chose its own."""
    assert prepared.prompt is not None
    top = reading.top_logprobs if reading is not None and not prepared.req.logprobs else None
    return upstream_body(prepared.req, tier, max_tokens=prepared.prompt.output_cap,
                         priority=PRIORITY_ORDER[ctx.plan.priority],
                         logprobs=prepared.req.logprobs or reading is not None, top_logprobs=top or None)
