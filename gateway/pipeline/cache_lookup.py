"""Cache: look the request up inside its scope, and keep fresh answers. A failing cache is a miss, never a
failed request.

The scope is what an answer depends on: the tenant, the key's roles (and the end user where the plan
isolates users), the tenant's data version (bumped through the admin API or CLI, combined with an optional
`X-Tiergate-Data-Version` header), the tier's model version (its engine's fingerprint of weights,
quantization and engine version), the system prompt and sampling class.

A lookup costs the event loop microseconds: the exact layer first (this process's own fresh answers without
leaving the loop, then the store in a worker thread), and the embedding, when the semantic layer needs one,
batched with every other request's (`cache.batcher`). `save` runs in the settlement, before the client gets
the end of its answer: it makes the answer an exact hit at once, and leaves embedding and writing it (with the
lookup's vector, not a second embedding) to a background task.

Only a whole answer is kept (`storable`): not empty, ended by the model (`stop`), or cut at the output cap the client
asked for (`length` under its own max_tokens, which is in the key). An answer the upstream ended otherwise (aborted,
filtered, no finish reason) is partial, and one cut at a cap the client did not ask for (the gateway's
`default_max_tokens`, or the room the tier's context left) is not the answer to the request as keyed: the cap is not
in the key, and another gateway (or this one after a restart) may send another. A whole answer does not depend on a
cap it stopped under, so that cap need not be in the key.

A plan's cascade checks `auto`'s answers (gateway/pipeline/cascade.py): such a request is looked up among the
answers its check accepted (`accepted_by=cascade:...` in the scope, `cascade_acceptance`), never among the cheap
tier's other answers (a request naming the tier, a stream nothing judged), and its answer is kept there only when the
check ran and accepted it (`CacheLookup.accepted`, set by the cascade).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from cache import (
    Bypass,
    CacheScope,
    CacheStoreError,
    EmbedderError,
    Entry,
    Hit,
    LookupResult,
    Miss,
    SemanticCache,
    TenantPolicy,
    end_user_snapshot,
)
from cache.request_key import cache_control, decide, exact_key
from cache.scope import body_hashes
from gateway.errors import InvalidRequest
from gateway.ladder.apply import Degradation, shaped_answer
from gateway.pipeline.context import RequestContext
from gateway.pipeline.meter import Outcome
from gateway.pipeline.parsed import Derived
from gateway.tenants.store import TenantStore
from quotas.fault_log import FaultLog
from quotas.plans import RoutingPlan
from tiers.catalogue import TierSpec
from tiers.fleet import Fleet
from tiers.predictor import PredictorSource
from tiers.routing import AUTO
from wire.chat_request import ChatCompletionRequest

log = logging.getLogger("tiergate.cache")
DATA_VERSION_HEADER = "x-tiergate-data-version"
# what the header may hold: it is kept in every entry stored under it, so a tenant must not choose its size (60 KB a
# header made each cached entry 240 KB on disk)
DATA_VERSION_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def cascade_acceptance(routing: RoutingPlan, floor: float | None) -> str:
    """What the cascade's check of an answer is, at `floor`: its plain checks' fixed threshold and the floor of
    its calibrated one. Answers accepted by one check are not served where another decides."""
    return f"cascade:min_mean_logprob={routing.cascade_min_mean_logprob!r}:floor={floor!r}"


# what a kept body's first request leaves its repeats (gateway/pipeline/parsed.py `Derived`)
_BODY, _HASHED, _EXACT, _DECIDED, _SCOPE = "cache.body", "cache.hashed", "cache.exact", "cache.decided", "cache.scope"
ARTIFACT = "|artifact="  # the last part of a cascaded lookup's scope: the router artifact its check read


def artifact_version(predictor: PredictorSource | None) -> str | None:
    """The version of the router artifact loaded now (None: none), whose thresholds the cascade's check reads."""
    model = predictor.model if predictor is not None else None
    return str(model.version) if model is not None else None


def with_artifact(scope: CacheScope, artifact: str | None) -> CacheScope:
    """`scope` (a cascaded lookup's) for the answers the check of router artifact `artifact` accepted: answers
    accepted under one artifact's thresholds are not served as if another's had accepted them."""
    return replace(scope, context_hash=f"{scope.context_hash.rsplit(ARTIFACT, 1)[0]}{ARTIFACT}{artifact!r}")


def storable(outcome: Outcome, client_cap: int | None) -> bool:
    """A whole answer: not empty, ended by the model, or cut at the output cap the client asked for."""
    return bool(outcome.text.strip()) and (
        outcome.finish_reason == "stop" or (outcome.finish_reason == "length" and client_cap is not None))


def check_data_version(headers: Mapping[str, str]) -> None:
    """A 400 for an `X-Tiergate-Data-Version` that is not 1-64 letters, digits or `._:-` (checked before any work;
    an empty one counts as absent)."""
    value = headers.get(DATA_VERSION_HEADER)
    if value and DATA_VERSION_PATTERN.fullmatch(value) is None:  # an empty one is no version, as before
        raise InvalidRequest("X-Tiergate-Data-Version must be 1 to 64 letters, digits or . _ : -",
                             param="x-tiergate-data-version", code="invalid_header")


def isolated_user(ctx: RequestContext, req: ChatCompletionRequest) -> str | None:
    """The end user the plan keeps apart from the tenant's others (`end_user_snapshot` of the request's `user` and
    `safety_identifier`), as the cache scope does; None where the plan shares among them or the request names none.
    What one request leaves behind to make another faster (remembered counts, an engine's cached prefix) is kept
    for the tenant and this end user."""
    if not ctx.plan.cache.isolate_users:
        return None
    return end_user_snapshot(req.user, req.safety_identifier)


@dataclass(frozen=True)
class CacheLookup:
    result: LookupResult  # Hit | Miss | Bypass
    scope: CacheScope | None  # None: nothing may be stored (the cache is off, or the request bypasses it)
    policy: TenantPolicy | None
    body: Mapping[str, Any]  # the request as the cache keyed it
    headers: Mapping[str, str]
    applied: tuple[str, ...]  # the ladder's actions that changed the lookup
    client_cap: int | None = None  # the output cap the request asked for (max_tokens), None: the gateway's
    accepted_by: str | None = None  # the cascade check its answer must pass to be kept (`cascade_acceptance`)
    accepted: bool = False  # the cascade's check ran on the answer and accepted it as `accepted_by` says
    tier: TierSpec | None = None  # the tier the scope's model version is of (None: no scope)

    @property
    def hit(self) -> Hit | None:
        return self.result if isinstance(self.result, Hit) else None

    @property
    def status(self) -> str:
        return self.result.status

    def response_headers(self) -> dict[str, str]:
        return self.result.headers()


class CacheStage:
    def __init__(self, *, cache: SemanticCache | None, store: TenantStore, fleet: Fleet) -> None:
        self.cache = cache
        self.store = store
        self.fleet = fleet
        self._background: set[asyncio.Task[Any]] = set()
        # in a store's outage every request fails the same way: each fault logged once, then its recovery
        known = (CacheStoreError, EmbedderError)
        self._lookup_faults = FaultLog(log, "cache lookup (served as a miss)", known=known, rounds="lookups")
        self._store_faults = FaultLog(log, "cache store", known=known, rounds="stores")

    async def lookup(self, ctx: RequestContext, req: ChatCompletionRequest, tier: TierSpec,
                     degr: Degradation, artifact: str | None = None, *,
                     counted_prompt: int | None = None, derived: Derived | None = None) -> CacheLookup:
        """`artifact`: the router artifact loaded now (`artifact_version`); a cascaded request is looked up among
        the answers its check accepted (the cascade stores its accepted answer under the artifact its check read,
        cascade.py's `_accepted`). `counted_prompt`: the request's prompt tokens as counted for `tier` (None: not
        counted), which a hit's usage reports and bills (`Hit.request_usage`), not its stored request's.
        `derived`: where `req` is a kept body's (gateway/pipeline/parsed.py), the body as the cache keys it, its
        hashes and its cacheability (`decide`, by Cache-Control directives and pure tools) are taken from there,
        made by the body's first request, and the scope's id where the scope is the last one's: a repeat (an exact
        hit) hashes nothing of it again. That body is every repeat's: the cache only reads it."""
        memo = derived.of(req) if derived is not None else None
        body = memo.get(_BODY) if memo is not None else None
        if body is None:
            body = req.model_dump(mode="json", exclude_none=True)
            if memo is not None:
                memo[_BODY] = body
        if self.cache is None:
            return CacheLookup(Bypass("bypass: the cache is off"), None, None, body, ctx.headers, ())
        policy, applied = self._policy(ctx, degr)
        accepted_by = _cascaded(ctx, req)
        decision = None
        if memo is not None and policy.enabled:  # a function of the body, the directives and the pure tools
            decided = (_DECIDED, cache_control(ctx.headers), policy.pure_tools)
            if (decision := memo.get(decided)) is None:
                decision = memo[decided] = decide(body, ctx.headers, pure_tools=policy.pure_tools)
        if (bypass := self.cache.bypass(body, headers=ctx.headers, policy=policy, decision=decision)) is not None:
            # no scope for a request that may not use the cache (temperature unset: the common case): nothing of it
            # is looked up or kept, and its scope cost hashes of the request and the tier
            return CacheLookup(bypass, None, policy, body, ctx.headers, applied, req.output_cap, accepted_by)
        hashed = exact = None
        if memo is not None:  # a kept body: short (parsed.py's MAX_BODY), so hashed here on the loop, once
            hashed = memo.get(_HASHED) or memo.setdefault(_HASHED, body_hashes(body))
            exact = memo.get(_EXACT) or memo.setdefault(_EXACT, exact_key(body))
        scope = await self._scope(ctx, req, tier, body, hashed)
        if accepted_by is not None:  # apart from the tier's answers that no check accepted
            scope = with_artifact(replace(scope, context_hash=f"{scope.context_hash}|accepted_by={accepted_by}"),
                                  artifact)
        scope_id = None
        if memo is not None:  # the scope's id, hashed again only where a field of the scope changed
            last = memo.get(_SCOPE)
            if last is not None and last[0] == scope and type(last[0].data_version) is type(scope.data_version):
                scope_id = last[1]
            else:
                memo[_SCOPE] = scope, (scope_id := scope.scope_id)
        try:
            result = await self.cache.alookup(scope, body, headers=ctx.headers, policy=policy, admitted=True,
                                              exact=exact, scope_id=scope_id)
        except (CacheStoreError, EmbedderError) as exc:
            self._lookup_faults.failed(exc)
            result = Miss(f"cache unavailable: {exc}")
        else:
            self._lookup_faults.ok()
        if isinstance(result, Hit):
            result = replace(result, counted_prompt=counted_prompt)
        return CacheLookup(result, scope, policy, body, ctx.headers, applied, req.output_cap, accepted_by, tier=tier)

    def save(self, lookup: CacheLookup, outcome: Outcome, applied: tuple[str, ...]) -> None:
        """Keep a fresh answer: a repeat of the request is an exact hit from now on (read your own writes),
        and the write to the store follows in the background (the client is not kept waiting for it).

        An answer the ladder shaped (a trimmed context, a capped output) is not what the request asked for,
        so it is never stored: a later request at normal service must not get it. Nor is an answer that is not
        whole (`storable`), or a cascaded `auto` answer its check did not accept.
        """
        if not self.may_save(lookup, applied) or outcome.tool_calls:  # the store keeps text: not a tool call's
            return
        if not storable(outcome, lookup.client_cap):
            return
        if lookup.policy is not None and lookup.result.near is not None:  # a near miss's label, for the bound
            self.cache.label(lookup.result, lookup.policy, outcome.text)
        usage = {"prompt_tokens": outcome.input_tokens, "completion_tokens": outcome.output_tokens,
                 "finish_reason": outcome.finish_reason}
        entry = self.cache.remember(lookup.scope, lookup.body, outcome.text, usage, headers=lookup.headers,
                                    policy=lookup.policy, probe=lookup.result.probe)
        if entry is None:
            return
        task = asyncio.get_running_loop().create_task(self._persist(entry))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def may_save(self, lookup: CacheLookup, applied: tuple[str, ...]) -> bool:
        """Whether `save` may keep the attempt's answer, as far as its lookup says before the answer (its text is
        then kept for it: Meter.keep_text). A cascade's judge may yet accept it (`accepted`), and keeps the text."""
        return (self.cache is not None and lookup.scope is not None and isinstance(lookup.result, Miss)
                and not shaped_answer(applied) and (lookup.accepted_by is None or lookup.accepted)
                and self._same_model(lookup))

    def _same_model(self, lookup: CacheLookup) -> bool:
        """Whether the tier's model version is still the one its lookup scoped: a replica that came back with other
        weights while the request waited (for a dispatch slot, a fall-back) may have answered it, and an answer
        kept under the old version would be served once the tier is rolled back to it."""
        return lookup.tier is None or lookup.scope is None or \
            self.fleet.model_version(lookup.tier) == lookup.scope.model_version

    async def bump_data_version(self, tenant: str, version: int) -> int:
        """The tenant's data version is now `version`: delete the cached answers of older ones (this process's
        index drops them at once; other processes' follow the store's change log). Returns how many."""
        if self.cache is None:
            return 0
        try:
            deleted = await asyncio.to_thread(self.cache.bump_data_version, tenant, version)
            log.info("data version %s of %s: deleted %d cached answers of older ones", version, tenant, deleted)
            return deleted
        except CacheStoreError as exc:  # they stay unreachable (scopes carry the version) until their TTL
            log.warning("deleting %s's old cache entries failed: %s", tenant, exc)
            return 0

    async def drain(self) -> None:
        """Wait for pending stores (tests, shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _policy(self, ctx: RequestContext, degr: Degradation) -> tuple[TenantPolicy, tuple[str, ...]]:
        c = ctx.plan.cache
        delta = degr.semantic_threshold_delta
        applied = (f"semantic_threshold_delta({delta})",) if delta and c.semantic else ()
        return _tenant_policy(c.enabled, c.semantic, c.similarity_threshold, c.ttl_s, c.max_error_rate,
                              c.shadow_check_rate, delta, c.meaning_check), applied

    async def _scope(self, ctx: RequestContext, req: ChatCompletionRequest, tier: TierSpec,
                     body: Mapping[str, Any], hashed: tuple[str, str] | None = None) -> CacheScope:
        # authenticate followed the store's changes; a version not cached is read off the loop where that waits on a
        # network (PostgreSQL): every write empties every tenant's, and the loop serves them all
        version: int | str = await self.store.data_version_async(ctx.tenant)
        if ctx.headers.get(DATA_VERSION_HEADER):
            version = f"{version}:{ctx.headers[DATA_VERSION_HEADER]}"
        isolate = ctx.plan.cache.isolate_users  # by `user` and `safety_identifier` (one may name the end user alone)
        return CacheScope.for_request(body, tenant=ctx.tenant, roles=ctx.principal.key.roles,
                                      end_user=req.user if isolate else None,
                                      safety_identifier=req.safety_identifier if isolate else None,
                                      data_version=version,
                                      model_version=self.fleet.model_version(tier), hashed=hashed)

    async def _persist(self, entry: Entry) -> None:
        try:
            await self.cache.apersist(entry)  # type: ignore[union-attr]
        except (CacheStoreError, EmbedderError) as exc:
            self._store_faults.failed(exc)
        else:
            self._store_faults.ok()


@lru_cache(maxsize=1024)
def _tenant_policy(enabled: bool, semantic: bool, similarity_threshold: float, ttl_s: float | None,
                   max_error_rate: float | None, shadow_rate: float, threshold_delta: float,
                   meaning_check: bool) -> TenantPolicy:
    """A plan's cache policy at a ladder level, from its values (frozen, so shared: every request of a plan had
    built the same one, ~2 us)."""
    return TenantPolicy(enabled=enabled, semantic=semantic, similarity_threshold=similarity_threshold, ttl_s=ttl_s,
                        max_error_rate=max_error_rate, shadow_rate=shadow_rate, threshold_delta=threshold_delta,
                        meaning_check=meaning_check)


def _cascaded(ctx: RequestContext, req: ChatCompletionRequest) -> str | None:
    """The check a plan's cascade will run on this request's answer (`cascade_acceptance`), or None where none will:
    `auto` under a plan that cascades, and a stream only where the plan holds streams for the cascade (as
    gateway/pipeline/handle.py's `_cascades`). The floor is the plan's own: an answer checked at a floor a low
    budget relaxed is not kept (cascade.py), and one accepted at the plan's floor keeps a relaxed one too."""
    routing = ctx.plan.routing
    if not routing.cascade or req.model != AUTO or (req.stream and not routing.cascade_streams):
        return None
    return cascade_acceptance(routing, routing.floor_for(None)[0])
