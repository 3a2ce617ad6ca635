"""The check of a sampled semantic cache hit: the tier answers the request too, off the response's path, and its
answer tells the tenant's error bound whether the hit was right (cache/error_bound.py).

Which hits: those the cache marked (`Hit.shadow_rate`, a share `cache.shadow_check_rate` of a plan's semantic hits).
The call is the request as the tier would have got it, at batch priority, with an output cap of the cached
answer's length plus one token: an answer that is the same stops where the cached one did, and one that goes on
is different, so nothing more is needed to tell. It is billed to us (`tiergate_cache_check_cost_usd`), never to
the tenant, and its answer is neither returned nor cached. A failed call labels nothing. The call goes as the
tenant's (off_path.py): its failure is that tenant's in the replica's breaker, its prompt in the tenant's namespace.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from cache import Hit, SemanticCache, TenantPolicy
from gateway.pipeline.off_path import OffPathTasks, answer_off_path
from gateway.pipeline.tier_call import TierCaller, upstream_body
from quotas.plans import PRIORITY_ORDER
from tiers.catalogue import TierSpec
from wire.chat_request import ChatCompletionRequest

MAX_IN_FLIGHT = 8
MAX_PER_TENANT = 2  # of those, one tenant's: its hits cannot take every place from the other tenants' checks


class CacheChecks:
    def __init__(self, *, cache: SemanticCache, caller: TierCaller, registry: CollectorRegistry,
                 max_in_flight: int = MAX_IN_FLIGHT, max_per_tenant: int = MAX_PER_TENANT) -> None:
        self.cache = cache
        self.caller = caller
        self.tasks = OffPathTasks(max_in_flight, max_per_tenant)
        self.checks = Counter("tiergate_cache_checks", "Sampled semantic hits checked against the tier, by result "
                              "(right, wrong, failed, dropped: too many in flight).", ["tenant", "result"],
                              registry=registry)
        self.cost = Counter("tiergate_cache_check_cost_usd", "What checking sampled semantic hits cost us, USD.",
                            ["tenant"], registry=registry)

    def send(self, tenant: str, tier: TierSpec, req: ChatCompletionRequest, hit: Hit,
             policy: TenantPolicy | None, end_user: str | None = None) -> None:
        """Check `hit` if it was sampled, as `tenant`'s request (and its isolated `end_user`'s: `isolated_user`);
        returns at once."""
        if not hit.shadow_rate or policy is None:
            return
        usage = hit.usage
        cap = max(1, int(usage.get("completion_tokens", 0)) + (usage.get("finish_reason") != "length"))
        body = upstream_body(req, tier, max_tokens=cap, priority=PRIORITY_ORDER["batch"], logprobs=False)
        if not self.tasks.start(self._run(tenant, tier, body, hit, policy, end_user), owner=tenant):
            self.checks.labels(tenant, "dropped").inc()

    async def _run(self, tenant: str, tier: TierSpec, body: dict, hit: Hit,  # type: ignore[type-arg]
                   policy: TenantPolicy, end_user: str | None = None) -> None:
        answer = await answer_off_path(self.caller, tier, body, tenant=tenant, end_user=end_user)
        self.cost.labels(tenant).inc(float(answer.cost(tier)))
        if answer.failed:
            self.checks.labels(tenant, "failed").inc()
            return
        right = self.cache.label(hit, policy, answer.outcome.text)
        self.checks.labels(tenant, "right" if right else "wrong").inc()
