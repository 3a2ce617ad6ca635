"""The cache facade the gateway calls: `lookup` before routing, `store` after a fresh answer.

A lookup goes: tenant policy and cacheability (`request_key.decide`) -> exact layer (the scope and the
whole normalized conversation) -> semantic layer (embed the last user turn if it is short enough to be
compared whole, `SEMANTIC_MAX_CHARS`; search the faiss partition of its scope and history, take the nearest
candidates above the tenant's threshold and within `fallback_margin` of the nearest, and serve the first one
the near-miss guards accept). Every result says why, so the gateway can put it in `x-tiergate-cache` and in
metrics.

Versions: a scope carries the data and model versions, so a bumped version makes older entries
unreachable at once. `bump_data_version` and `retire_model_version` additionally tell the cache those
entries will never be asked for again; `reclaim` (run a little on every store, or by the caller on a
timer) deletes them, and expired ones, in small batches.

Calls are synchronous and thread-safe. Embedding a query costs milliseconds of CPU, so async callers use
`alookup`/`astore`, which run them in a worker thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from cache import guards
from cache.embedder import Embedder
from cache.index import PartitionedIndex
from cache.request_key import RequestKey, decide, request_key
from cache.scope import CacheScope
from cache.store import CacheStore, Entry

# The longest last user turn the semantic layer matches by meaning. A semantic hit claims the two questions are
# the same, and that holds only if every part of both was compared: the embedder reads 256 word pieces and the
# near-miss guards read `guards.MAX_CHARS` characters, so a longer turn (a paste, or a 20,000-digit "number"
# sent to make the guards' work explode) is served by an exact hit or not at all. It is never embedded, so the
# embedder and the guards only ever see texts this short, whatever a tenant sends.
SEMANTIC_MAX_CHARS = guards.MAX_CHARS


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """A tenant's cache settings, owned by the caller (plans, tenant admin)."""

    enabled: bool = True  # False: the tenant opted out; nothing is looked up or stored
    semantic: bool = True  # False: exact hits only
    similarity_threshold: float = 0.8  # cosine a semantic candidate must reach before the guards see it
    ttl_s: float | None = 86_400.0  # None: entries live until evicted, purged or reclaimed
    pure_tools: frozenset[str] = frozenset()  # tools declared free of side effects; others make a request uncacheable


@dataclass(frozen=True, slots=True)
class Hit:
    """A cached answer valid for this request."""

    entry: Entry
    kind: Literal["exact", "semantic"]
    similarity: float  # 1.0 for exact hits
    status: Literal["hit"] = "hit"

    @property
    def response(self) -> str:
        return self.entry.response

    @property
    def usage(self) -> dict[str, Any]:
        return self.entry.usage

    def headers(self) -> dict[str, str]:
        out = {"x-tiergate-cache": "hit", "x-tiergate-cache-kind": self.kind}
        if self.kind == "semantic":
            out["x-tiergate-cache-similarity"] = f"{self.similarity:.4f}"
        return out


@dataclass(frozen=True, slots=True)
class Miss:
    """The request may use the cache, but nothing valid was found (`reason` says what came closest)."""

    reason: str  # "no entry", "below threshold (best 0.71)", "refused near miss: numbers differ (0.94)"
    best_similarity: float | None = None
    status: Literal["miss"] = "miss"

    def headers(self) -> dict[str, str]:
        return {"x-tiergate-cache": "miss"}


@dataclass(frozen=True, slots=True)
class Bypass:
    """The cache was not consulted: `reason` is a cacheability rule, e.g. 'bypass: temperature>0 without seed'."""

    reason: str
    status: Literal["bypass"] = "bypass"

    def headers(self) -> dict[str, str]:
        return {"x-tiergate-cache": "bypass"}


LookupResult = Hit | Miss | Bypass


@dataclass
class CacheStats:
    """Counters since start, for metrics."""

    exact_hits: int = 0
    semantic_hits: int = 0
    misses: int = 0
    bypasses: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # guard reason -> count
    stored: int = 0
    reclaimed: int = 0


class SemanticCache:
    """Versioned exact + semantic cache over one store, one embedder and one partitioned faiss index."""

    def __init__(self, store: CacheStore, embedder: Embedder, *, top_k: int = 4, fallback_margin: float = 0.02,
                 default_policy: TenantPolicy | None = None, clock: Callable[[], float] = time.time,
                 reclaim_batch: int = 64, hnsw_from: int = 8192, sync_interval_s: float = 0.5):
        self.entries = store
        self.embedder = embedder
        self.top_k = top_k
        # Candidates after the nearest are tried only this close to it: when the nearest entry is refused by
        # the guards, a much farther one that passes is more often another question than the same one.
        self.fallback_margin = fallback_margin
        self.default_policy = default_policy or TenantPolicy()
        self.clock = clock
        self.reclaim_batch = reclaim_batch
        self.stats = CacheStats()
        self.index = PartitionedIndex(embedder.dim, hnsw_from=hnsw_from)
        self._lock = threading.Lock()  # guards the index and the reclaim rules
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()  # last user turn -> vector, small LRU
        self._stale_data: dict[str, tuple[str, float]] = {}  # tenant -> (current data version, bumped at)
        self._stale_models: set[str] = set()  # retired model versions
        self.sync_interval_s = sync_interval_s  # how often lookups apply other replicas' writes (shared stores)
        self._sync_lock = threading.Lock()
        self._cursor = store.change_cursor()  # taken before loading, so no write in between is missed
        self._last_sync = time.monotonic()
        self._load_index()

    def _load_index(self) -> None:
        """Rebuild the faiss partitions from the store's vectors (after a restart)."""
        by_partition: dict[str, tuple[list[str], list[np.ndarray]]] = {}
        for entry_id, partition, vector in self.entries.vectors():
            ids, vectors = by_partition.setdefault(partition, ([], []))
            ids.append(entry_id)
            vectors.append(vector)
        for partition, (ids, vectors) in by_partition.items():
            self.index.add(partition, ids, np.stack(vectors))

    # -- lookup ---------------------------------------------------------------------------------------

    def lookup(self, scope: CacheScope, request: Mapping[str, Any], *, headers: Mapping[str, str] | None = None,
               policy: TenantPolicy | None = None) -> LookupResult:
        """A cached answer for `request` in `scope`, or why there is none."""
        policy = policy or self.default_policy
        if not policy.enabled:
            return self._bypass("bypass: tenant opted out")
        decision = decide(request, headers, pure_tools=policy.pure_tools)
        if not decision.lookup:
            return self._bypass(decision.reason)
        key = request_key(request)
        now = self.clock()
        if time.monotonic() - self._last_sync >= self.sync_interval_s:
            self.sync()
        entry = self.entries.find_exact(scope.scope_id, key.exact_key)
        if entry is not None and self._alive(entry, now):
            self.entries.touch(entry.entry_id, now)
            self.stats.exact_hits += 1
            return Hit(entry, "exact", 1.0)
        partition = _partition(scope, key)
        if not (policy.semantic and self.index.partition_size(partition)):
            return self._miss("no entry")  # nothing to compare with: skip the embedding (milliseconds)
        vector = self._embed(key.last_user_text)
        if vector is None:
            return self._miss("no entry (too long to match by meaning)")
        with self._lock:
            candidates = self.index.search(partition, vector, self.top_k)
        if not candidates:
            return self._miss("no entry")
        best = candidates[0][1]
        refusal = f"below threshold (best {best:.3f})"
        for entry_id, similarity in candidates:
            if similarity < policy.similarity_threshold or similarity < best - self.fallback_margin:
                break
            entry = self.entries.get(entry_id)
            if entry is None or not self._alive(entry, now):
                continue
            reason = guards.check(key.last_user_text, entry.semantic_text)
            if reason is None:
                self.entries.touch(entry.entry_id, now)
                self.stats.semantic_hits += 1
                return Hit(entry, "semantic", similarity)
            self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
            if refusal.startswith("below"):
                refusal = f"refused near miss: {reason} ({similarity:.3f})"
        return self._miss(refusal, best)

    async def alookup(self, scope: CacheScope, request: Mapping[str, Any], **kwargs: Any) -> LookupResult:
        """`lookup` in a worker thread, so embedding never blocks the event loop."""
        return await asyncio.to_thread(self.lookup, scope, request, **kwargs)

    # -- store ----------------------------------------------------------------------------------------

    def store(self, scope: CacheScope, request: Mapping[str, Any], response: str,
              usage: Mapping[str, Any] | None = None, *, headers: Mapping[str, str] | None = None,
              policy: TenantPolicy | None = None, metadata: Mapping[str, Any] | None = None,
              ttl_s: float | None = None) -> Entry | None:
        """Keep a fresh answer for later requests of the same scope; None when the rules forbid storing it.

        `ttl_s` overrides the tenant's TTL for this entry (e.g. shorter for answers citing live data).
        """
        policy = policy or self.default_policy
        if not policy.enabled or not decide(request, headers, pure_tools=policy.pure_tools).store:
            return None
        key = request_key(request)
        now = self.clock()
        ttl = ttl_s if ttl_s is not None else policy.ttl_s
        vector = self._embed(key.last_user_text)
        entry = Entry(entry_id=uuid.uuid4().hex, scope_id=scope.scope_id, tenant=scope.tenant,
                      data_version=str(scope.data_version), model_version=scope.model_version,
                      exact_key=key.exact_key, partition=_partition(scope, key),
                      semantic_text=key.last_user_text if vector is not None else "",  # only the guards read it
                      response=response, usage=dict(usage or {}), metadata=dict(metadata or {}), created_at=now,
                      expires_at=None if ttl is None else now + ttl, last_used=now, embedding=vector)
        with self._lock:
            displaced = self.entries.put(entry)
            self.index.remove(displaced)
            if vector is not None:
                self.index.add(entry.partition, [entry.entry_id], vector[None, :])
        self.stats.stored += 1
        self.reclaim(self.reclaim_batch)
        return entry

    async def astore(self, scope: CacheScope, request: Mapping[str, Any], response: str,
                     usage: Mapping[str, Any] | None = None, **kwargs: Any) -> Entry | None:
        """`store` in a worker thread."""
        return await asyncio.to_thread(self.store, scope, request, response, usage, **kwargs)

    # -- versions, purge, reclaim ---------------------------------------------------------------------

    def bump_data_version(self, tenant: str, current: int | str) -> None:
        """The tenant's data is now at version `current`: its entries stored before now at any other version
        will be reclaimed. Entries stored later are kept whatever their version (it may combine the counter
        with a per-request header), and scopes already keep old versions unreachable."""
        with self._lock:
            self._stale_data[tenant] = (str(current), self.clock())

    def retire_model_version(self, model_version: str) -> None:
        """A tier's weights, quantization or engine changed: entries of the old fingerprint will be reclaimed."""
        with self._lock:
            self._stale_models.add(model_version)

    def purge(self, tenant: str | None = None) -> int:
        """Delete every entry of `tenant` (or of everyone, with None) now. Returns how many."""
        return self._delete(self.entries.ids_of_tenant(tenant))

    def reclaim(self, limit: int = 1000) -> int:
        """Delete up to `limit` expired or stale-version entries. Returns how many."""
        ids = self.entries.expired(self.clock(), limit)
        with self._lock:
            data_rules, model_rules = list(self._stale_data.items()), list(self._stale_models)
        for tenant, (current, bumped_at) in data_rules:
            if len(ids) >= limit:
                break
            found = self.entries.ids_not_at_data_version(tenant, current, bumped_at, limit - len(ids))
            ids += found
            if not found:
                with self._lock:
                    if self._stale_data.get(tenant) == (current, bumped_at):
                        del self._stale_data[tenant]
        for model_version in model_rules:
            if len(ids) >= limit:
                break
            found = self.entries.ids_of_model_version(model_version, limit - len(ids))
            ids += found
        n = self._delete(ids)
        self.stats.reclaimed += n
        return n

    def sync(self) -> int:
        """Apply the entries other replicas stored or deleted since the last sync to the local faiss index.

        Lookups call it every `sync_interval_s`; with a single-process store there is nothing to apply.
        Returns how many changes were applied.
        """
        if not self._sync_lock.acquire(blocking=False):
            return 0  # another thread is applying the same changes
        try:
            return self._sync_locked()
        finally:
            self._sync_lock.release()

    def _sync_locked(self) -> int:
        self._last_sync = time.monotonic()
        applied = 0
        while True:
            cursor, changes = self.entries.changes_since(self._cursor)
            if not changes:
                return applied
            for op, entry_id, partition in changes:
                if op == "del":
                    with self._lock:
                        self.index.remove([entry_id])
                elif entry_id not in self.index:
                    entry = self.entries.get(entry_id)
                    if entry is not None and entry.embedding is not None:
                        with self._lock:
                            self.index.add(partition, [entry_id], entry.embedding[None, :])
                applied += 1
            self._cursor = cursor

    def close(self) -> None:
        self.entries.close()

    # -- helpers --------------------------------------------------------------------------------------

    def _delete(self, ids: list[str]) -> int:
        with self._lock:
            gone = self.entries.delete(ids)
            self.index.remove(gone)
        return len(gone)

    def _alive(self, entry: Entry, now: float) -> bool:
        if entry.expires_at is not None and entry.expires_at <= now:
            self._delete([entry.entry_id])
            return False
        return True

    def _embeddable(self, text: str) -> bool:
        """Whether `text` may be matched by meaning: no longer than SEMANTIC_MAX_CHARS and within the word pieces
        the embedder reads. Longer turns are looked up and stored exactly only, never embedded."""
        if not text or len(text) > SEMANTIC_MAX_CHARS:
            return False
        limit = self.embedder.max_tokens
        return len(text) < limit - 2 or self.embedder.num_tokens(text) <= limit

    def _embed(self, text: str) -> np.ndarray | None:
        """The vector of a last user turn, or None when it is matched exactly only (see `_embeddable`)."""
        if not self._embeddable(text):
            return None
        with self._lock:
            vector = self._vectors.get(text)
            if vector is not None:
                self._vectors.move_to_end(text)
                return vector
        vector = self.embedder.encode_one(text)
        with self._lock:
            self._vectors[text] = vector
            if len(self._vectors) > 1024:
                self._vectors.popitem(last=False)
        return vector

    def _bypass(self, reason: str) -> Bypass:
        self.stats.bypasses += 1
        return Bypass(reason)

    def _miss(self, reason: str, best: float | None = None) -> Miss:
        self.stats.misses += 1
        return Miss(reason, best)


def _partition(scope: CacheScope, key: RequestKey) -> str:
    return f"{scope.scope_id}:{key.history_hash}"
