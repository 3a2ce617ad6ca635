"""The cache facade the gateway calls: `alookup` before routing, `remember` + `apersist` after a fresh answer.

A lookup goes: tenant policy and cacheability (`request_key.decide`) -> exact layer (the scope and the
whole conversation as sent: first this process's answers still being written or written and read lately
(`cache.recent`), then the store) -> semantic layer (embed the last user turn, NFKC with collapsed whitespace
(`request_key.embedding_text`), if it is short enough to be compared whole, `SEMANTIC_MAX_CHARS`; search the faiss
partition of its scope and history, take (cache/candidates.py) the nearest candidates above the tenant's threshold
and within `fallback_margin` of the nearest, and serve the first one the near-miss guards accept (they read both
turns as sent, so "2³" is not "23" to them, nor an indented line an unindented one, though both pairs embed alike)
and, for a plan with `meaning_check`, the meaning check too, on the texts as the guards read them
(`guards.comparable`): cache/meaning_check.py, one forward pass for each such candidate). Every result says why, so
the gateway can put it in `x-tiergate-cache` and in metrics.

The async path is built for many concurrent requests on one event loop. Policy, keys and the in-memory exact
check run on the loop (no thread for them); the store's exact probe, the faiss search and the guards run in a
worker thread; the embedding goes through `EmbeddingBatcher`, one forward pass for the texts of every lookup and
store in flight. A missed lookup hands its keys and vector to the store of the answer (`Miss.probe`), so a miss
is embedded once, not twice. Storing has two steps: `remember` (synchronous, microseconds) makes the answer an
exact hit for this process at once, so a repeat sent right after the answer is served from it; `apersist`
(in the background) embeds it and writes it to the store and the index, after which every replica sees it.
Writes, deletions, the store's checkpoints and other processes' changes are cache/entry_writes.py's (`EntryWriter`:
one writer thread, tenants in turns, a tenant's oldest queued write dropped past `writes_queued_per_tenant`).

Versions: a scope carries the data and model versions, so a bumped version makes older entries unreachable at
once; `bump_data_version` deletes the tenant's older entries, and `reclaim` (a little on every store) those of a
retired model version and expired ones (cache/stale_versions.py). Other processes' writes arrive through the
store's change log (cache/change_feed.py), applied in the writer thread: a lookup that finds a catch-up due queues
it and goes on. A cache made while its store does not answer (Redis down at start) starts unloaded (`loaded`):
an empty index, no cursor and no trust in its map of recent entries, its lookups and writes failing or missing as in
a running outage; the first catch-up that works (queued by a lookup, in the writer thread) takes the cursor and loads
the index. The synchronous `lookup` and `store` serve tests, benchmarks and
tools; all calls are thread-safe.

Locks: one tenant's writes must never stall another tenant's lookups. A lookup's faiss search takes no lock
of this class, only its own partition's, briefly; a partition's rebuild (a quarter of it dead, or the switch
to HNSW; seconds at 25k entries) runs in the index's builder thread with no lock a search takes
(cache/index.py), so no write holds any lock through a rebuild. `EntryWriter.lock` orders a write's store put,
index update and pending-entry bookkeeping against purges and version bumps (a lookup takes it only to delete
an expired entry, a short write like any other). The search needs no part of it: the
store is the truth and the index only proposes candidates; a candidate the store no longer has is skipped, an
entry removed from the index is never proposed once `remove` returns, and one added is proposed once `add`
returns, which is before `EntryWriter.write` returns (read your own writes).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable, Mapping
from functools import partial
from typing import Any, Protocol, TypeVar

import numpy as np

from cache import guards
from cache.candidates import screen
from cache.change_feed import ChangeFeed
from cache.embedder import Embedder
from cache.entry_writes import EntryWriter
from cache.error_bound import TenantBounds
from cache.index import PartitionedIndex
from cache.lookup_plan import LookupPlan, within_ttl
from cache.meaning_check import MeaningCheck
from cache.meaning_gate import MEANING_DIFFERS, first_accepted
from cache.pending import PendingWrites
from cache.recent import RecentEntries
from cache.request_key import Cacheability, conversation_chars, decide, embedding_text, request_key
from cache.results import Bypass, CacheStats, Hit, LookupResult, Miss, Near, Probe, TenantPolicy
from cache.scope import CacheScope
from cache.stale_versions import StaleVersions
from cache.store import CacheStore, CacheStoreError, Entry
from cache.vectors import SEMANTIC_MAX_CHARS, TurnVectors

# Characters of conversation above which computing a request's keys (hashing every turn) leaves the event loop.
KEYS_ON_LOOP_MAX_CHARS = 32_768
# A tenant's writes queued for the writer thread beyond which its oldest queued one is dropped (a cache write is
# best-effort): at ~1 ms a write, a backlog of well under a second for the flooder, and none for anyone else.
WRITES_QUEUED_PER_TENANT = 256

# The refusal (stats.refused, tiergate_cache_refused_candidates_total) of a candidate the index proposed under a
# partition the store files it under no longer, or never did: a fault, never served (`_servable`).
WRONG_PARTITION = "entry of another partition"

log = logging.getLogger(__name__)
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


class SemanticCache:
    """Versioned exact + semantic cache over one store, one embedder and one partitioned faiss index."""

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
        self.meaning = meaning or MeaningCheck()
        self.top_k = top_k
        # Candidates after the nearest are tried only this close to it: when the nearest entry is refused by
        # the guards, a much farther one that passes is more often another question than the same one.
        self.fallback_margin = fallback_margin
        self.default_policy = default_policy or TenantPolicy()
        self.clock = clock
        self.stats = CacheStats()
        self.vectors = TurnVectors(embedder, max_batch=embed_batch, max_wait_s=embed_wait_s)
        self.batcher = self.vectors.batcher
        self._hnsw_from = hnsw_from
        self._owner_threads = threads
        self._threads: Callable[..., Awaitable[Any]] = threads.run if threads is not None else _to_thread
        self.pending = PendingWrites()  # answers remembered, not yet written: this process serves them
        self.recent = RecentEntries()  # answers written or found lately: exact hits without a store round trip
        self.bounds = TenantBounds()  # each tenant's learned semantic threshold (cache/error_bound.py)
        self.rng = random.Random()  # which semantic hits are checked (seed it for a repeatable run)
        self.sync_interval_s = sync_interval_s  # how often other processes' writes are applied (shared stores)
        self.feed = ChangeFeed(store, sync_interval_s)  # made before the index is loaded: no write in between lost
        # writes, deletions, checkpoints; the writer thread (one tenant's flood of new answers waits there, in turns)
        self.writes = EntryWriter(store, self._first_index(), load_index=self._load_index, pending=self.pending,
                                  recent=self.recent, stats=self.stats, clock=clock, reclaim_batch=reclaim_batch,
                                  per_tenant=writes_queued_per_tenant)

    @property
    def index(self) -> PartitionedIndex:
        """The faiss partitions (the writer's: replaced whole when the change log was cut past this process)."""
        return self.writes.index

    @property
    def stale(self) -> StaleVersions:
        """Bumped data and retired model versions whose entries are to be reclaimed."""
        return self.writes.stale

    @property
    def loaded(self) -> bool:
        """Whether the index was loaded from the store: False from a start while the store did not answer (a
        Redis outage) until the first catch-up that worked after it (in the writer thread, queued by a lookup)."""
        return self.feed.started

    def _first_index(self) -> PartitionedIndex:
        """The index at start: loaded from the store, or empty while it does not answer (the cache then starts
        unloaded: its lookups miss and its writes fail as in a running outage, and the first catch-up that works
        loads it, `ChangeFeed`'s "reset")."""
        if self.feed.started:
            try:
                return self._load_index()
            except CacheStoreError as exc:
                self.feed.unstart()
                log.warning("semantic cache: starting with an empty index, loaded once the store answers: %s", exc)
        return PartitionedIndex(self.embedder.dim, hnsw_from=self._hnsw_from)

    def _load_index(self) -> PartitionedIndex:
        """The faiss partitions rebuilt from the store's vectors (after a restart, or a change log cut short)."""
        return PartitionedIndex.of(self.embedder.dim, self.entries.vectors(), hnsw_from=self._hnsw_from)

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
        found = self._exact(plan)
        if found is not None:
            return found
        vector = self.vectors.get(plan.key.embedding_text, owner=plan.scope.tenant, user=plan.scope.end_user)
        return self._semantic(plan, vector)

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
            found = await self._threads(scope.tenant, self._exact, plan)
            if found is not None:
                return found
            vector = await self.vectors.aget(plan.key.embedding_text, coming, owner=scope.tenant, user=scope.end_user)
        return await self._threads(scope.tenant, self._semantic, plan, vector)

    def _begin(self, scope: CacheScope, request: Mapping[str, Any], headers: Mapping[str, str] | None,
               policy: TenantPolicy | None, admitted: bool = False, exact: str | None = None,
               scope_id: str | None = None) -> LookupResult | LookupPlan:
        """Policy, cacheability (unless `admitted`: see `alookup`), keys, and the answers this process has not
        finished writing. No I/O."""
        if not admitted and (refused := self.bypass(request, headers=headers, policy=policy)) is not None:
            return refused
        plan = LookupPlan(scope, policy or self.default_policy, request, self.clock(), exact, scope_id)
        entry = self.pending.get(plan.scope_id, plan.exact_key)
        if entry is None and self.feed.recent():
            entry = self.recent.get(plan.scope_id, plan.exact_key, plan.now)  # deletions elsewhere applied
        if entry is not None and (entry.expires_at is None or entry.expires_at > plan.now) \
                and within_ttl(entry, plan.policy, plan.now):
            self.stats.exact_hits += 1
            return Hit(entry, "exact", 1.0)
        return plan

    def _exact(self, plan: LookupPlan) -> LookupResult | None:
        """The store's exact entry, or a miss when there is nothing to compare by meaning; None: go semantic."""
        if self.feed.due():  # queued for the writer thread: this lookup never pays for other processes' writes
            self.writes.sync_soon(self._sync_step)
        seen = self.recent.generation  # before the read: a deletion applied after it keeps the entry out of `recent`
        entry = self.entries.find_exact(plan.scope_id, plan.exact_key)
        if entry is not None and self.writes.alive(entry, plan.now) and within_ttl(entry, plan.policy, plan.now):
            self.entries.touch(entry.entry_id, plan.now)
            self.writes.checkpoint_soon()
            self.recent.put(entry, seen=seen)
            self.stats.exact_hits += 1
            return Hit(entry, "exact", 1.0)
        if not (plan.policy.semantic and self.index.partition_size(plan.partition)):
            return self._miss("no entry", probe=plan.probe())  # nothing to compare with: no embedding
        return None

    def _semantic(self, plan: LookupPlan, vector: np.ndarray | None) -> LookupResult:
        if vector is None:
            # no text compared by meaning (request_key.compared_text: too long, several parts, a raw prompt)
            reason = "no entry (too long to match by meaning)" if plan.key.last_user_text else "no entry"
            return self._miss(reason, probe=plan.probe())
        candidates = self.index.search(plan.partition, vector, self.top_k)  # no lock of the writer: see the docstring
        if not candidates:
            return self._miss("no entry", probe=plan.probe(vector))
        policy = plan.policy
        bound = self.bounds.get(plan.scope.tenant, policy.max_error_rate, policy.similarity_threshold,
                                meaning_check=policy.meaning_check)
        threshold = policy.similarity_threshold if bound is None else bound.threshold(policy.similarity_threshold)
        threshold += policy.threshold_delta
        floor = threshold if bound is None else min(threshold, bound.floor)  # near misses to label, down to here
        found = screen(candidates, plan.key.last_user_text, threshold=threshold, floor=floor,
                       fallback_margin=self.fallback_margin, meaning_check=policy.meaning_check,
                       tenant=plan.scope.tenant, user=plan.scope.end_user, fetch=partial(self._servable, plan),
                       checked=partial(self._checked, plan), refused=self.stats.refused)
        servable, refusal = found.servable, found.refusal
        if servable:
            chosen, reason = self._checked(plan, servable)
            if chosen is not None:
                entry, similarity = chosen
                self.entries.touch(entry.entry_id, plan.now)
                self.writes.checkpoint_soon()
                self.stats.semantic_hits += 1
                sampled = bound is not None and self.rng.random() < policy.shadow_rate
                return Hit(entry, "semantic", similarity, shadow_rate=policy.shadow_rate if sampled else 0.0)
            refusal = f"refused near miss: {reason}" + (f" ({servable[0][1]:.3f})" if reason == MEANING_DIFFERS
                                                         else "")
        return self._miss(refusal, candidates[0][1], probe=plan.probe(vector), near=found.near)

    def _servable(self, plan: LookupPlan, entry_id: str) -> Entry | None:
        """The stored entry `entry_id` if the lookup may serve it (not deleted, not expired, within the TTL, and
        filed under the lookup's partition: its scope and history)."""
        entry = self.entries.get(entry_id)
        if entry is None:
            return None
        if entry.partition != plan.partition:  # the index's word alone is not the scope check; no path is known
            self._wrong_partition(entry_id)
            return None
        if not self.writes.alive(entry, plan.now) or not within_ttl(entry, plan.policy, plan.now):
            return None
        return entry

    def _wrong_partition(self, entry_id: str) -> None:
        """Count a candidate of another partition (every one) and log the first this process meets."""
        self.stats.refused[WRONG_PARTITION] += 1
        if self.stats.refused[WRONG_PARTITION] == 1:
            log.error("semantic cache: the index proposed entry %s, which the store files under another partition "
                      "(not served; counted as %r, not logged again)", entry_id, WRONG_PARTITION)

    def _checked(self, plan: LookupPlan,
                 candidates: list[tuple[Entry, float]]) -> tuple[tuple[Entry, float] | None, str]:
        """The candidate to serve: the first, or under the plan's meaning check the first it accepts (and why none
        was), cache/meaning_gate.py."""
        if not plan.policy.meaning_check:
            return candidates[0], ""
        owner, user = plan.scope.tenant, plan.scope.end_user  # whose memo of what texts read as (cache/guards.py)
        return first_accepted(self.meaning, guards.comparable(plan.key.last_user_text, owner, user),
                              [(guards.comparable(c[0].semantic_text, owner, user), c) for c in candidates],
                              scope=plan.scope_id, owner=plan.scope.tenant, refused=self.stats.refused)

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

    # -- versions, purge, reclaim ---------------------------------------------------------------------

    def bump_data_version(self, tenant: str, current: int | str) -> int:
        """The tenant's data is now at version `current`: delete its entries stored before now at any other
        version (in batches). Entries stored later are kept whatever their version (it may combine the counter
        with a per-request header), and scopes already keep old versions unreachable. Returns how many went."""
        return self.writes.bump_data_version(tenant, str(current))

    def retire_model_version(self, model_version: str) -> int:
        """No tier serves `model_version` any more (its weights, quantization or engine changed, or a rollout moved
        the tier to another version): delete its entries now, and drop its answers still being written. Returns
        how many went."""
        return self.writes.retire_model_version(model_version)

    def model_versions(self) -> set[str]:
        """The model versions the store holds entries of (every process's; a scan of the store)."""
        return self.entries.model_versions()

    def serve_model_version(self, model_version: str) -> None:
        """A tier serves `model_version` (again, after a rollback): its new answers are kept."""
        self.writes.serve_model_version(model_version)

    def purge(self, tenant: str | None = None) -> int:
        """Delete every entry of `tenant` (or of everyone, with None) now. Returns how many."""
        return self.writes.purge(tenant)

    def reclaim(self, limit: int = 1000) -> int:
        """Delete up to `limit` expired or stale-version entries. Returns how many."""
        return self.writes.reclaim(limit)

    def sync(self) -> int:
        """Apply the entries other processes stored or deleted since the last sync to the local faiss index, and
        write the LRU marks of hits served from memory.

        A lookup that finds it due (every `sync_interval_s`) queues it for the writer thread (cache/entry_writes.py
        `sync_soon`), a few pages a job (`_sync_step`), never runs it itself. This applies every page in the
        caller's thread, and returns once caught up: how many changes were applied (after waiting out a step in
        progress).
        """
        return self.feed.catch_up(self.writes.apply, before=self.writes.mark_used)

    def _sync_step(self) -> tuple[int, bool]:
        """One job of the writer thread's catch-up: `sync`, at most `feed.pages_per_job` pages (changes applied,
        whether caught up)."""
        return self.feed.step(self.writes.apply, before=self.writes.mark_used)

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

    def _miss(self, reason: str, best: float | None = None, *, probe: Probe | None = None,
              near: Near | None = None) -> Miss:
        self.stats.misses += 1
        return Miss(reason, best, probe=probe, near=near)

