"""The cache's calls that keep its entries in step, all the writer's (cache/entry_writes.py) and the change feed's
(cache/change_feed.py): versions, purges, reclaim, and the catch-up with other processes' writes.

Versions: a scope carries the data and model versions, so a bumped version makes older entries unreachable at
once; `bump_data_version` deletes the tenant's older entries, and `reclaim` (a little on every store) those of a
retired model version and expired ones (cache/stale_versions.py). Other processes' writes arrive through the
store's change log (cache/change_feed.py), applied in the writer thread: a lookup that finds a catch-up due queues
it and goes on.
"""

from __future__ import annotations

from cache.change_feed import ChangeFeed
from cache.entry_writes import EntryWriter
from cache.index import PartitionedIndex
from cache.stale_versions import StaleVersions
from cache.store import CacheStore


class EntryUpkeep:
    """`SemanticCache`'s versions, purges, reclaim and catch-up: calls on the parts it holds, which it makes."""

    entries: CacheStore
    feed: ChangeFeed
    writes: EntryWriter

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
