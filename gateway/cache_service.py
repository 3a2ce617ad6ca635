"""The gateway's side of the answer cache: build each request's scope, look up, store fresh answers.

The scope is what an answer depends on: the tenant, the key's roles (and the end user where the plan
isolates users), the tenant's data version (bumped through the admin API or CLI, combined with an optional
`X-Tiergate-Data-Version` header), the tier's model version (its engine's fingerprint of weights,
quantization and engine version), the system prompt and sampling class. A failing cache is a miss, never
a failed request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cache import (
    Bypass,
    CacheScope,
    CacheStoreError,
    EmbedderError,
    LookupResult,
    Miss,
    SemanticCache,
    TenantPolicy,
)
from gateway.ladder.apply import Degradation
from gateway.tenants.store import TenantStore
from quotas.plans import Plan
from tiers.catalogue import TierSpec
from tiers.fleet import Fleet

if TYPE_CHECKING:
    from gateway.chat_service import Call

log = logging.getLogger("tiergate.cache")
DATA_VERSION_HEADER = "x-tiergate-data-version"


class CacheService:
    def __init__(self, cache: SemanticCache | None, store: TenantStore, fleet: Fleet) -> None:
        self.cache = cache
        self.store = store
        self.fleet = fleet
        self._background: set[asyncio.Task[Any]] = set()

    def policy(self, plan: Plan, degr: Degradation) -> TenantPolicy:
        c = plan.cache
        delta = degr.semantic_threshold_delta
        if delta and c.semantic:
            degr.applied.append(f"semantic_threshold_delta({delta})")
        return TenantPolicy(enabled=c.enabled, semantic=c.semantic, similarity_threshold=c.similarity_threshold + delta,
                            ttl_s=c.ttl_s)

    def scope(self, call: Call, plan: Plan, tier: TierSpec, headers: Mapping[str, str]) -> CacheScope:
        principal = call.principal
        tenant = principal.tenant.name  # type: ignore[union-attr]
        version: int | str = self.store.data_version(tenant)
        if headers.get(DATA_VERSION_HEADER):
            version = f"{version}:{headers[DATA_VERSION_HEADER]}"
        end_user = call.req.user if plan.cache.isolate_users else None
        return CacheScope.for_request(call.cache_body, tenant=tenant, roles=principal.key.roles, end_user=end_user,
                                      data_version=version, model_version=self.fleet.model_version(tier))

    async def lookup(self, call: Call, plan: Plan, tier: TierSpec, degr: Degradation,
                     headers: Mapping[str, str]) -> LookupResult:
        if self.cache is None:
            return Bypass("bypass: the cache is off")
        call.cache_body = call.req.model_dump(mode="json", exclude_none=True)  # as looked up, so as stored
        call.cache_policy = self.policy(plan, degr)
        call.cache_scope = self.scope(call, plan, tier, headers)
        call.cache_headers = dict(headers)
        try:
            return await self.cache.alookup(call.cache_scope, call.cache_body, headers=call.cache_headers,
                                            policy=call.cache_policy)
        except (CacheStoreError, EmbedderError) as exc:
            log.warning("cache lookup failed, served as a miss: %s", exc)
            return Miss(f"cache unavailable: {exc}")

    def save(self, call: Call, text: str) -> None:
        """Keep a fresh answer (in the background: the client is not kept waiting for it).

        An answer the ladder shaped (a trimmed context, a capped output) is not what the request asked for,
        so it is never stored: a later request at normal service must not get it.
        """
        if self.cache is None or call.cache_scope is None or not isinstance(call.cache_result, Miss):
            return
        if call.degradation is not None and call.degradation.shaped_answer:
            return
        usage = {"prompt_tokens": call.input_tokens, "completion_tokens": call.output_tokens,
                 "finish_reason": call.finish_reason}
        task = asyncio.get_running_loop().create_task(self._save(call, text, usage))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _save(self, call: Call, text: str, usage: dict[str, Any]) -> None:
        try:
            await self.cache.astore(call.cache_scope, call.cache_body, text, usage,  # type: ignore[union-attr]
                                    headers=call.cache_headers, policy=call.cache_policy)
        except (CacheStoreError, EmbedderError) as exc:
            log.warning("cache store failed: %s", exc)

    async def drain(self) -> None:
        """Wait for pending stores (tests, shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

