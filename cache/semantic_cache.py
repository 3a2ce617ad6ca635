"""The cache facade the gateway calls: `alookup` before routing, `remember` + `apersist` after a fresh answer.

Its parts: the lookup's steps after the policy (cache/lookup_pass.py: what a lookup goes through, and the locks), how
the cache starts, unloaded while its store does not answer (cache/cache_start.py), and its versions, purges and
catch-up with other processes (cache/entry_upkeep.py).

The async path is built for many concurrent requests on one event loop. Policy, keys and the in-memory exact
check run on the loop (no thread for them); the store's exact probe, the faiss search and the guards run in a
worker thread; the embedding goes through `EmbeddingBatcher`, one forward pass for the texts of every lookup and
store in flight. A missed lookup hands its keys and vector to the store of the answer (`Miss.probe`), so a miss
is embedded once, not twice. Storing has two steps: `remember` (synchronous, microseconds) makes the answer an
exact hit for this process at once, so a repeat sent right after the answer is served from it; `apersist`
(in the background) embeds it and writes it to the store and the index, after which every replica sees it.
Writes, deletions, the store's checkpoints and other processes' changes are cache/entry_writes.py's (`EntryWriter`:
one writer thread, tenants in turns, a tenant's oldest queued write dropped past `writes_queued_per_tenant`).

The synchronous `lookup` and `store` serve tests, benchmarks and tools; all calls are thread-safe.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any, Protocol, TypeVar

from cache.cache_start import start_writes
from cache.embedder import Embedder
from cache.entry_upkeep import EntryUpkeep
from cache.error_bound import TenantBounds
from cache.lookup_pass import WRONG_PARTITION as WRONG_PARTITION
from cache.lookup_pass import LookupPass, OnPass
from cache.lookup_plan import LookupPlan
from cache.meaning_check import MeaningCheck
from cache.pending import PendingWrites
from cache.recent import RecentEntries
from cache.request_key import Cacheability, conversation_chars, decide, embedding_text, request_key
from cache.results import Bypass, CacheStats, Hit, LookupResult, Miss, Probe, TenantPolicy
from cache.scope import CacheScope
from cache.store import CacheStore, Entry
from cache.vectors import SEMANTIC_MAX_CHARS, TurnVectors

# Characters of conversation above which computing a request's keys (hashing every turn) leaves the event loop.
KEYS_ON_LOOP_MAX_CHARS = 32_768
# A tenant's writes queued for the writer thread beyond which its oldest queued one is dropped (a cache write is
# best-effort): at ~1 ms a write, a backlog of well under a second for the flooder, and none for anyone else.
WRITES_QUEUED_PER_TENANT = 256

T = TypeVar("T")


class OwnerThreads(Protocol):
    """Worker threads that run each owner's (a tenant's) work in its turn: the gateway's FairThreads."""

    def run(self, owner: Hashable, fn: Callable[..., T], *args: Any) -> Awaitable[T]: ...

    def close(self) -> None: ...


async def _to_thread(owner: Hashable, fn: Callable[..., T], *args: Any) -> T:
    """Without OwnerThreads: asyncio's executor, owners not told apart."""
    return await asyncio.to_thread(fn, *args)


__all__ = ["SEMANTIC_MAX_CHARS", "Bypass", "CacheStats", "Hit", "LookupResult", "Miss", "Probe", "SemanticCache",
           "TenantPolicy"]


class SemanticCache(EntryUpkeep):
    """Versioned exact + semantic cache over one store, one embedder and one partitioned faiss index."""

    # the semantic layer's knobs, kept on the lookup's pass (cache/lookup_pass.py)
    meaning = OnPass()
    top_k = OnPass()
    fallback_margin = OnPass()
    bounds = OnPass()
    rng = OnPass()

    def __init__(self, store: CacheStore, embedder: Embedder, *, top_k: int = 4, fallback_margin: float = 0.02,
                 default_policy: TenantPolicy | None = None, clock: Callable[[], float] = time.time,
                 reclaim_batch: int = 64, hnsw_from: int = 8192, sync_interval_s: float = 0.5,
                 embed_batch: int = 32, embed_wait_s: float = 0.003, meaning: MeaningCheck | None = None,
                 writes_queued_per_tenant: int = WRITES_QUEUED_PER_TENANT, threads: OwnerThreads | None = None):
        """`embed_batch` texts at most per forward pass, and `embed_wait_s` the longest a text waits for others
        to join it (`EmbeddingBatcher`); `embed_batch=1` embeds one text at a time (the ablation). `meaning`:
        the check a plan's `meaning_check` asks for (loaded on first use; a default one if not given).
        `writes_queued_per_tenant`: `apersist`'s writes of one tenant waiting for the writer thread, at most.
        `threads` run a lookup's blocking steps, each in its tenant's turn (the cache closes them): the gateway's
        FairThreads. By default asyncio's executor, first come first served, where one tenant's flood of lookups
        (each up to two meaning-check passes) queued every other tenant's lookups behind it."""
        self.entries = store
        self.embedder = embedder
        meaning = meaning or MeaningCheck()
        self.default_policy = default_policy or TenantPolicy()
        self.clock = clock
        self.stats = CacheStats()
        self.vectors = TurnVectors(embedder, max_batch=embed_batch, max_wait_s=embed_wait_s)
        self.batcher = self.vectors.batcher
        self._owner_threads = threads
        self._threads: Callable[..., Awaitable[Any]] = threads.run if threads is not None else _to_thread
        self.pending = PendingWrites()  # answers remembered, not yet written: this process serves them
        self.recent = RecentEntries()  # answers written or found lately: exact hits without a store round trip
        self.sync_interval_s = sync_interval_s  # how often other processes' writes are applied (shared stores)
        self.feed, self.writes = start_writes(store, embedder.dim, hnsw_from=hnsw_from, sync_interval_s=sync_interval_s,
                                              pending=self.pending, recent=self.recent, stats=self.stats, clock=clock,
                                              reclaim_batch=reclaim_batch, per_tenant=writes_queued_per_tenant)
        self.lookups = LookupPass(store, self.writes, self.feed, self.pending, self.recent, self.stats,
                                  self._sync_step, meaning=meaning, top_k=top_k, fallback_margin=fallback_margin,
                                  bounds=TenantBounds(), rng=random.Random())

    # -- lookup ---------------------------------------------------------------------------------------

    def bypass(self, request: Mapping[str, Any], *, headers: Mapping[str, str] | None = None,
               policy: TenantPolicy | None = None, decision: Cacheability | None = None) -> Bypass | None:
        """Why `request` may not be looked up at all (the tenant's policy, `request_key.decide`), counted as a
        bypass; None when it may. What `lookup` answers such a request, known before any scope or key: a caller
        asks it first to skip building the scope of a request that bypasses (then `lookup(..., admitted=True)`).
        `decision`: `decide`'s answer for this request, headers and the policy's pure tools, where the caller has
        it already."""
        policy = policy or self.default_policy
        if not policy.enabled:
            return self._bypass("bypass: tenant opted out")
        if decision is None:
            decision = decide(request, headers, pure_tools=policy.pure_tools)
        return None if decision.lookup else self._bypass(decision.reason)

    def lookup(self, scope: CacheScope, request: Mapping[str, Any], *, headers: Mapping[str, str] | None = None,
               policy: TenantPolicy | None = None) -> LookupResult:
        """A cached answer for `request` in `scope`, or why there is none."""
        plan = self._begin(scope, request, headers, policy)
        if not isinstance(plan, LookupPlan):
            return plan
        found = self.lookups.exact(plan)
        if found is not None:
            return found
        vector = self.vectors.get(plan.key.embedding_text, owner=plan.scope.tenant, user=plan.scope.end_user)
        return self.lookups.semantic(plan, vector)

    async def alookup(self, scope: CacheScope, request: Mapping[str, Any], *,
                      headers: Mapping[str, str] | None = None, policy: TenantPolicy | None = None,
                      admitted: bool = False, exact: str | None = None, scope_id: str | None = None
                      ) -> LookupResult:
        """`lookup` for the event loop: the embedding is batched with other requests', blocking I/O and the
        faiss search run in worker threads, and an answer this process is still writing is served at once.
        `admitted`: the caller asked `bypass` of this request, policy and headers, and was told None. `exact`: the
        request's `exact_key`, where the caller has it already (its first steps then hash nothing of the request);
        `scope_id`: `scope.scope_id`, likewise."""
        if exact is not None or conversation_chars(request) <= KEYS_ON_LOOP_MAX_CHARS:
            plan = self._begin(scope, request, headers, policy, admitted, exact, scope_id)
        else:
            plan = await self._threads(scope.tenant, self._begin, scope, request, headers, policy, admitted)
        if not isinstance(plan, LookupPlan):
            return plan
        with self.batcher.announce() as coming:  # lookups arriving together embed together
            found = await self._threads(scope.tenant, self.lookups.exact, plan)
            if found is not None:
                return found
            vector = await self.vectors.aget(plan.key.embedding_text, coming, owner=scope.tenant, user=scope.end_user)
        return await self._threads(scope.tenant, self.lookups.semantic, plan, vector)

    def _begin(self, scope: CacheScope, request: Mapping[str, Any], headers: Mapping[str, str] | None,
               policy: TenantPolicy | None, admitted: bool = False, exact: str | None = None,
               scope_id: str | None = None) -> LookupResult | LookupPlan:
        """Policy, cacheability (unless `admitted`: see `alookup`), keys, and the answers this process has not
        finished writing. No I/O."""
        if not admitted and (refused := self.bypass(request, headers=headers, policy=policy)) is not None:
            return refused
        return self.lookups.in_memory(LookupPlan(scope, policy or self.default_policy, request, self.clock(), exact,
                                                 scope_id))

    def label(self, result: LookupResult, policy: TenantPolicy, fresh: str) -> bool | None:
        """Teach the tenant's bound whether the candidate the lookup found was right, by the tier's fresh answer
        (`TenantBounds.label`). Returns whether it was (None: nothing to label)."""
        return self.bounds.label(result, policy, fresh)

    # -- store ----------------------------------------------------------------------------------------

    def remember(self, scope: CacheScope, request: Mapping[str, Any], response: str,
                 usage: Mapping[str, Any] | None = None, *, headers: Mapping[str, str] | None = None,
                 policy: TenantPolicy | None = None, metadata: Mapping[str, Any] | None = None,
                 ttl_s: float | None = None, probe: Probe | None = None) -> Entry | None:
        """Make a fresh answer an exact hit for this process now, before it is written; None when the rules
        forbid storing it. Hand the entry to `apersist` (or `persist`) to embed and write it.

        `probe` is the missed lookup's (`Miss.probe`): its keys and vector are reused. `ttl_s` overrides the
        tenant's TTL for this entry (e.g. shorter for answers citing live data).
        """
        policy = policy or self.default_policy
        if not policy.enabled or not decide(request, headers, pure_tools=policy.pure_tools).store:
            return None
        key = probe.key if probe is not None else request_key(request)
        now = self.clock()
        ttl = ttl_s if ttl_s is not None else policy.ttl_s
        scope_id = scope.scope_id
        entry = Entry(entry_id=uuid.uuid4().hex, scope_id=scope_id, tenant=scope.tenant,
                      data_version=str(scope.data_version), model_version=scope.model_version,
                      exact_key=key.exact_key, partition=f"{scope_id}:{key.history_hash}",
                      semantic_text=key.last_user_text, response=response, usage=dict(usage or {}),
                      metadata=dict(metadata or {}), created_at=now, expires_at=None if ttl is None else now + ttl,
                      last_used=now, embedding=probe.vector if probe is not None else None, end_user=scope.end_user)
        self.pending.add(entry)
        return entry

    def persist(self, entry: Entry) -> Entry | None:
        """Embed a remembered entry (unless its lookup did) and write it; None if it was purged meanwhile."""
        if entry.embedding is None:
            entry.embedding = self.vectors.get(embedding_text(entry.semantic_text), owner=entry.tenant,
                                               user=entry.end_user)
        return self.writes.write(entry)

    async def apersist(self, entry: Entry) -> Entry | None:
        """`persist` for the event loop: the embedding batched with others', the write in the cache's own writer
        thread (never in the threads lookups run in: a tenant's flood of writes queues there, not before lookups),
        in its tenant's turn. None also when the write was dropped (its tenant had too many queued)."""
        try:
            if entry.embedding is None:
                entry.embedding = await self.vectors.aget(embedding_text(entry.semantic_text), owner=entry.tenant,
                                                           user=entry.end_user)
            return await asyncio.wrap_future(self.writes.submit(entry))
        finally:
            self.pending.forget(entry)

    def store(self, scope: CacheScope, request: Mapping[str, Any], response: str,
              usage: Mapping[str, Any] | None = None, **kwargs: Any) -> Entry | None:
        """`remember` then `persist`, synchronously; None when the rules forbid storing it."""
        entry = self.remember(scope, request, response, usage, **kwargs)
        try:
            return self.persist(entry) if entry is not None else None
        finally:
            if entry is not None:
                self.pending.forget(entry)

    async def astore(self, scope: CacheScope, request: Mapping[str, Any], response: str,
                     usage: Mapping[str, Any] | None = None, **kwargs: Any) -> Entry | None:
        """`remember` then `apersist`."""
        entry = self.remember(scope, request, response, usage, **kwargs)
        return await self.apersist(entry) if entry is not None else None

    def close(self) -> None:
        self.writes.close()
        if self._owner_threads is not None:
            self._owner_threads.close()
        self.vectors.close()
        self.entries.close()

    # -- helpers --------------------------------------------------------------------------------------

    def _bypass(self, reason: str) -> Bypass:
        self.stats.bypasses += 1
        return Bypass(reason)
