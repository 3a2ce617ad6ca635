"""How a cache starts: its change feed first, then its index, loaded from the store or empty, then its writer.

A cache made while its store does not answer (Redis down at start) starts unloaded (`SemanticCache.loaded`):
an empty index, no cursor and no trust in its map of recent entries, its lookups and writes failing or missing as in
a running outage; the first catch-up that works (queued by a lookup, in the writer thread) takes the cursor and loads
the index.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from cache.change_feed import ChangeFeed
from cache.entry_writes import EntryWriter
from cache.index import PartitionedIndex
from cache.pending import PendingWrites
from cache.recent import RecentEntries
from cache.results import CacheStats
from cache.store import CacheStore, CacheStoreError

# The cache's own logger (its messages keep the name they are filtered by).
log = logging.getLogger("cache.semantic_cache")


def start_writes(store: CacheStore, dim: int, *, hnsw_from: int, sync_interval_s: float, pending: PendingWrites,
                 recent: RecentEntries, stats: CacheStats, clock: Callable[[], float], reclaim_batch: int,
                 per_tenant: int) -> tuple[ChangeFeed, EntryWriter]:
    """The change feed (other processes' writes, applied every `sync_interval_s`) and the writer (writes,
    deletions, checkpoints; the writer thread: one tenant's flood of new answers waits there, in turns) of a cache
    over `store`, whose index holds vectors of `dim`."""
    feed = ChangeFeed(store, sync_interval_s)  # made before the index is loaded: no write in between lost
    load = partial(load_index, store, dim, hnsw_from)
    writes = EntryWriter(store, first_index(feed, load, dim, hnsw_from), load_index=load, pending=pending,
                         recent=recent, stats=stats, clock=clock, reclaim_batch=reclaim_batch, per_tenant=per_tenant)
    return feed, writes


def first_index(feed: ChangeFeed, load: Callable[[], PartitionedIndex], dim: int, hnsw_from: int
                ) -> PartitionedIndex:
    """The index at start: loaded from the store, or empty while it does not answer (the cache then starts
    unloaded: its lookups miss and its writes fail as in a running outage, and the first catch-up that works
    loads it, `ChangeFeed`'s "reset")."""
    if feed.started:
        try:
            return load()
        except CacheStoreError as exc:
            feed.unstart()
            log.warning("semantic cache: starting with an empty index, loaded once the store answers: %s", exc)
    return PartitionedIndex(dim, hnsw_from=hnsw_from)


def load_index(store: CacheStore, dim: int, hnsw_from: int) -> PartitionedIndex:
    """The faiss partitions rebuilt from the store's vectors (after a restart, or a change log cut short)."""
    return PartitionedIndex.of(dim, store.vectors(), hnsw_from=hnsw_from)
