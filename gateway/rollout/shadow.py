"""A shadow: a sampled share of requests also sent to the rollout's candidate, off the response's path.

After an attempt on the version answering everyone has settled (its row written, its answer with the client or on
its way), `Shadow.send` copies the request to the candidate in a task the client never waits for: the same body
as the tier got (the same output cap, at batch priority), on the candidate's own replicas, without a dispatch slot,
a reservation, a ledger row or the cache. The tenant is billed nothing for it and never sees it; what it costs us is
counted in `tiergate_rollout_shadow_cost_usd`. At most `max_in_flight` shadow calls run at once, and at most
`max_per_tenant` of one tenant's; a request sampled beyond that is dropped and counted, so a slow candidate cannot pile
up work in the gateway, and one tenant's flood cannot take every place and leave the candidate judged on its requests
alone (the guards let one tenant's outcomes decide only where the others have too few: guards.py). Of the answer the
client got, a call keeps only its first DIVERGENCE_WORDS words (all the comparison reads), not the whole text.

Its outcome goes to the rollout (`RolloutService.observe_shadow`): errors, time to first token and per output token
(as the candidate's own, for the guards), and the divergence of its answer from the one the client got:
1 - difflib's similarity ratio of the two answers' first DIVERGENCE_WORDS words (0: the same words in the same
order, 1: nothing in common), computed in a worker thread (difflib is quadratic in the worst case).

Streamed requests are shadowed too: the gateway always streams from the tier and the meter keeps the text the
client got for a request the shadow samples (`samples`, asked as the call starts), so a streamed answer compares as a
whole one does. A request that needs something the candidate lacks
(gateway/pipeline/needs.py: tools, vLLM's `top_k`; a start refuses such a candidate, a tiers file edited since may
make one) is not copied.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.pipeline.needs import lacking, needs_of
from gateway.pipeline.off_path import OffPathTasks, answer_off_path
from gateway.pipeline.tier_call import TierCaller, upstream_body
from gateway.rollout.service import RolloutService
from gateway.rollout.state import Rollout
from quotas.plans import PRIORITY_ORDER
from tiers.catalogue import TierSpec
from wire.chat_request import ChatCompletionRequest

log = logging.getLogger("tiergate.rollout")
DIVERGENCE_WORDS = 256  # of each answer: bounds the comparison's work whatever the answers' length
MAX_IN_FLIGHT = 16
MAX_PER_TENANT = 4  # of those, one tenant's


def first_words(text: str) -> list[str]:
    """The text's first DIVERGENCE_WORDS words (the split stops there: a long answer is not split whole)."""
    return text.split(maxsplit=DIVERGENCE_WORDS)[:DIVERGENCE_WORDS]


def divergence(served: str, shadowed: str) -> float:
    """1 - the similarity of the two answers' first words (difflib's ratio over word sequences), 0 to 1."""
    a, b = first_words(served), first_words(shadowed)
    if not a and not b:
        return 0.0
    return 1.0 - difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


class Shadow:
    def __init__(self, *, rollouts: RolloutService, caller: TierCaller, metrics: GatewayMetrics,
                 max_in_flight: int = MAX_IN_FLIGHT, max_per_tenant: int = MAX_PER_TENANT) -> None:
        self.rollouts = rollouts
        self.caller = caller
        self.metrics = metrics
        self.tasks = OffPathTasks(max_in_flight, max_per_tenant)

    def samples(self, tier: TierSpec, request_id: str) -> bool:
        """Whether `send` would copy this request (as the rollouts stand now): its answer's text is kept for it."""
        return self.rollouts.shadow_of(tier, request_id) is not None

    def send(self, tier: TierSpec, request_id: str, req: ChatCompletionRequest, max_tokens: int,
             served: str, tenant: str | None = None, end_user: str | None = None) -> None:
        """Copy this answered request (of `tenant`, and of the `end_user` its plan isolates: `isolated_user`) to the
        candidate if the tier's shadow samples it; returns at once. The copy goes as that tenant's (off_path.py)."""
        found = self.rollouts.shadow_of(tier, request_id)
        if found is None:
            return
        rollout, candidate = found
        if lacking(candidate, needs_of(req)) is not None:
            return  # it would not be answered as asked (needs.py): its answer would judge the request, not the version
        body = upstream_body(req, candidate, max_tokens=max_tokens, priority=PRIORITY_ORDER["batch"],
                             logprobs=False)
        kept = " ".join(first_words(served))  # all the comparison reads, held while the candidate answers
        if not self.tasks.start(self._run(rollout, candidate, body, kept, tenant, end_user=end_user), owner=tenant):
            self.metrics.rollout_shadow.labels(rollout.tier, rollout.candidate, "dropped").inc()

    async def _run(self, rollout: Rollout, candidate: TierSpec, body: dict[str, Any], served: str,
                   tenant: str | None = None, *, end_user: str | None = None) -> None:
        # the candidate's failure is what a shadow is for: recorded, never raised
        answer = await answer_off_path(self.caller, candidate, body, tenant=tenant, end_user=end_user)
        outcome = answer.outcome
        tpot = None
        if outcome.ttft_s is not None and outcome.upstream_s is not None and outcome.output_tokens > 1:
            tpot = (outcome.upstream_s - outcome.ttft_s) / (outcome.output_tokens - 1)
        diverged = None if answer.failed else await asyncio.to_thread(divergence, served, outcome.text)
        self.rollouts.observe_shadow(rollout, error=answer.error, ttft_s=outcome.ttft_s, tpot_s=tpot,
                                     divergence=diverged, tenant=tenant, prompt_tokens=outcome.input_tokens or None)
        self.metrics.rollout_shadow.labels(rollout.tier, rollout.candidate, "error" if answer.error else "ok").inc()
        self.metrics.rollout_shadow_cost.labels(rollout.tier, rollout.candidate).inc(float(answer.cost(candidate)))

    def cancel(self) -> None:
        """Stop the shadow calls in flight (shutdown): nobody waits for their answers."""
        self.tasks.cancel()
