"""cache: a versioned exact + semantic answer cache that never serves an answer across its scope.

The gateway's calls, in request order::

    from cache import CacheScope, SemanticCache, SQLiteStore, TenantPolicy, default_embedder

    store = open_cache_store(sqlite_path=data_dir / "cache.sqlite3", redis_url=None, max_entries=100_000,
                             max_entries_per_tenant=25_000)
    cache = SemanticCache(store, default_embedder())
    users = {"end_user": body.get("user"), "safety_identifier": body.get("safety_identifier")} if t.isolate_users \
        else {}
    scope = CacheScope.for_request(body, tenant=t.id, roles=key.roles, **users, data_version=t.data_version,
                                   model_version=tier.fingerprint)
    result = await cache.alookup(scope, body, headers=request.headers, policy=t.cache_policy)
    # result.status is "hit" | "miss" | "bypass"; result.headers() gives x-tiergate-cache (and the similarity)
    if result.status == "hit":
        ...answer result.response (stream it as SSE if asked), bill as a cache hit, saving = result.usage...
    elif result.status == "miss":
        ...call the tier, then, before the client gets the end of the answer:
        entry = cache.remember(scope, body, answer_text, usage, headers=request.headers, policy=t.cache_policy,
                               probe=result.probe)   # a repeat is an exact hit from now on
        ...and in the background: await cache.apersist(entry)   # embed (batched), write, index
        cache.label(result, t.cache_policy, answer_text)   # a near miss below the learned threshold: the bound learns
    # a semantic hit with result.shadow_rate > 0: ask the tier too, off the response's path, and label it the same way

    cache.bump_data_version(tenant, new_version)   # after the admin bump: deletes the older versions' entries
    cache.retire_model_version(old_fingerprint)    # no tier serves it any more: deletes its entries
    cache.serve_model_version(fingerprint)         # a tier serves it (again, after a rollback): keeps its answers
    cache.purge(tenant)                            # admin purge (None: everything)

What the caller decides: `data_version` is the tenant's counter, combined with an `X-Tiergate-Data-Version`
header when present (e.g. f"{counter}:{header}"); `model_version` is the fingerprint of the tier that will answer
(with `model: auto`, of the tier the router picks; entries of different tiers never mix); `end_user` only for
tenants that isolate users. `CacheStoreError` (store unreachable) and `EmbedderError` should be treated as a
miss, never as a failed request. Misses and bypasses carry a `reason` (e.g. "refused near miss: numbers differ
(0.941)", "bypass: temperature>0 without seed") for logs and metrics; `cache.stats` counts them.

Modules, one job each: `scope` (what an answer depends on), `request_key` (exact key, history, last user
turn, cacheability rules), `guards` (near-miss refusal), `embedder` (MiniLM; `onnx_runtime` runs its forward
pass on ONNX Runtime where installed), `vectors` (which turns are embedded, a memo) and `batcher` (one forward
pass for concurrent requests), `index` (faiss partitions), `store` (the store boundary), `sqlite_store` (the
entries in SQLite: TTL, LRU bounds overall and per tenant (entries and bytes), persistence, a change log),
`redis_store` (the same in Redis, shared by replicas), `pending` (answers not yet written, served to their own process),
`tenant_writes` (the one writer thread, taking tenants' writes in turns), `owner_lanes` (per-owner queues taken
in turns, which it and the gateway's FairThreads keep), `entry_writes` (what changes the entries: writes,
deletions, checkpoints, other processes' changes), `results` (what a lookup answers), `semantic_cache` (the
facade: lookups and stores), `lookup_pass` (a lookup's steps after the policy: exact, semantic, scope and meaning
checks), `cache_start` (the change feed, index and writer at start, loaded or not), `entry_upkeep` (versions,
purges and the index's sync, over the writer).

Several processes may share one store (a SQLite file, or a Redis with `redis_url`): each one's faiss index
applies the others' writes and deletes (the CLI's too) from the store's change log within `sync_interval_s`
(0.5 s) of its next lookup.
"""

from __future__ import annotations

from cache.embedder import Embedder, EmbedderError, default_embedder
from cache.redis_store import RedisStore
from cache.request_key import Cacheability, RequestKey, decide, request_key
from cache.results import Bypass, CacheStats, Hit, LookupResult, Miss, Probe, TenantPolicy
from cache.scope import CacheScope, end_user_snapshot, identity_snapshot
from cache.semantic_cache import SemanticCache
from cache.sqlite_store import SQLiteStore
from cache.store import CacheStore, CacheStoreError, Entry, open_cache_store

__all__ = [
    "Bypass", "CacheScope", "CacheStats", "CacheStore", "CacheStoreError", "Cacheability", "Embedder",
    "EmbedderError", "Entry", "Hit", "LookupResult", "Miss", "Probe", "RedisStore", "RequestKey", "SQLiteStore",
    "SemanticCache", "TenantPolicy", "decide", "default_embedder", "end_user_snapshot", "identity_snapshot",
    "open_cache_store", "request_key",
]
