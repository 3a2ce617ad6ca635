"""What changes the cache's entries: a fresh answer's write, deletions (expired, purged, of a bumped or retired
version, reclaimed), the LRU marks of hits served from memory, other processes' changes applied to the index, and
the store's checkpoints. The lookup side (cache/semantic_cache.py) reads the same store, index and maps, and calls
in here only to delete an expired entry, to write marks and to ask for a checkpoint.

Writes queue per tenant for one writer thread, which takes the tenants in turns (cache/tenant_writes.py): another
tenant's flood delays a write by one of its writes, not by all of them; a tenant with `per_tenant` writes queued
loses its oldest queued one (`stats.dropped_writes`). The writer thread also runs the store's checkpoints
(`CacheStore.checkpoint`: SQLite's WAL into its file), after its own writes and, for the marks and deletions
lookups write, when a lookup finds one due; a lookup never runs one itself (SQLite's own, inside whichever commit
crossed its threshold, are off: cache/sqlite_store.py).

Locks: `lock` orders a write's store put, index update and pending-entry bookkeeping against purges and version
bumps; a lookup takes it only to delete an expired entry. No write holds it through an index rebuild (the index's
builder thread does those, cache/index.py), and the change log's entries are applied without it (a lookup's sync
would wait behind this process's writes, a tenant's flood of them; the index locks itself).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from cache.change_feed import Change
from cache.index import PartitionedIndex
from cache.pending import PendingWrites
from cache.recent import RecentEntries
from cache.results import CacheStats
from cache.stale_versions import StaleVersions
from cache.store import CacheStore, CacheStoreError, Entry
from cache.tenant_writes import TenantWriteQueue

log = logging.getLogger(__name__)
_CHECKPOINT = ("checkpoint",)  # the writer queue's key of checkpoint jobs (no tenant's: tenants are strings)


class EntryWriter:
    """Every change to the entries of one store and its index, and the writer thread that makes a fresh answer's.
    `load_index` rebuilds the index from the store (after the change log was cut past this process's cursor)."""

    def __init__(self, store: CacheStore, index: PartitionedIndex, *, load_index: Callable[[], PartitionedIndex],
                 pending: PendingWrites, recent: RecentEntries, stats: CacheStats, clock: Callable[[], float],
                 reclaim_batch: int, per_tenant: int) -> None:
        self.entries = store
        self.index = index  # replaced whole on a "reset" from the change log
        self.load_index = load_index
        self.pending = pending  # answers remembered, not yet written: this process serves them
        self.recent = recent  # answers written or found lately: exact hits without a store round trip
        self.stats = stats
        self.clock = clock
        self.reclaim_batch = reclaim_batch
        self.stale = StaleVersions()  # bumped data and retired model versions whose entries are to be reclaimed
        # Orders writes, deletions and the pending writes' fate (never taken by a search: the index locks itself).
        self.lock = threading.Lock()
        # Fresh answers' writes run here, not in the threads lookups run in, which every lookup's steps share:
        # writes queued behind the lock above (a tenant's flood of new answers) held those threads, and every
        # tenant's lookups queued behind them. One thread: `write` runs under `lock`, so more would only wait on
        # it. Its queue is per tenant, taken in turns: first come first served, one tenant's flood delayed every
        # other tenant's writes (and the moment they became every replica's hits) by the whole flood.
        self._queue = TenantWriteQueue(per_tenant, on_drop=self._dropped, name="tiergate-cache-write")
        self._checkpoint_queued = False  # a checkpoint a lookup asked for is waiting for the writer thread

    def submit(self, entry: Entry) -> Future[Entry | None]:
        """`write(entry)` in the writer thread, in its tenant's turn; resolves to None also when the write was
        dropped (its tenant had too many queued)."""
        return self._queue.submit(entry.tenant, self.write, entry)

    def write(self, entry: Entry) -> Entry | None:
        """Write an embedded (or exact-only) entry to the store and the index; None if it was purged meanwhile or
        answered from data its tenant has since replaced."""
        if entry.embedding is None:
            entry.semantic_text = ""  # exact-only: nothing kept that only the guards would read
        with self.lock:  # a purge or bump cancels pending entries under this lock, before selecting what to delete
            if self.pending.cancelled(entry):
                return None
            if self.stale.written_too_late(entry):
                return None  # answered from data the tenant has since replaced
            self.mark_used()  # the store evicts by these marks
            displaced = self.entries.put(entry)
            if displaced is None:  # its data was bumped past it, by another process (the store's record of it)
                self.pending.forget(entry)
                return None
            self.index.remove(displaced)
            self.recent.drop_ids(displaced)
            self.recent.put(entry)
            if entry.embedding is not None:
                self.index.add(entry.partition, [entry.entry_id], entry.embedding[None, :])
            self.pending.forget(entry)
        self.stats.stored += 1
        self.reclaim(self.reclaim_batch)
        self._checkpoint()  # if due; in the writer thread (or a synchronous `store`'s caller's)
        return entry

    # -- versions, purge, reclaim ---------------------------------------------------------------------

    def bump_data_version(self, tenant: str, current: str) -> int:
        """`SemanticCache.bump_data_version`."""
        with self.lock:
            bumped_at = self.clock()
            self.stale.bump_data(tenant, current, bumped_at)
            self.pending.cancel_where(lambda e: e.tenant == tenant and e.data_version != current)
            self.recent.drop_where(lambda e: e.tenant == tenant and e.data_version != current)
        gone = self.entries.drop_data_versions(tenant, current, bumped_at)
        with self.lock:
            self.index.remove(gone)
        return len(gone)

    def retire_model_version(self, model_version: str) -> int:
        """`SemanticCache.retire_model_version`."""
        with self.lock:
            self.stale.retire_model(model_version)
            self.pending.cancel_where(lambda e: e.model_version == model_version)
            self.recent.drop_where(lambda e: e.model_version == model_version)
        # one pass (a Redis store reads every entry's version to find them); what lands later, `reclaim` finds
        return self.delete(self.entries.ids_of_model_version(model_version, 1 << 62))

    def serve_model_version(self, model_version: str) -> None:
        """`SemanticCache.serve_model_version`."""
        self.stale.serve_model(model_version)

    def purge(self, tenant: str | None) -> int:
        """`SemanticCache.purge`."""
        with self.lock:
            self.pending.cancel_where(lambda e: tenant is None or e.tenant == tenant)
            self.recent.drop_where(lambda e: tenant is None or e.tenant == tenant)
        return self.delete(self.entries.ids_of_tenant(tenant))

    def reclaim(self, limit: int) -> int:
        """Delete up to `limit` expired or stale-version entries. Returns how many."""
        n = self.delete(self.stale.to_reclaim(self.entries, self.clock(), limit))
        self.stats.reclaimed += n
        return n

    def delete(self, ids: list[str]) -> int:
        self.recent.drop_ids(ids)
        with self.lock:
            gone = self.entries.delete(ids)
            self.index.remove(gone)
        return len(gone)

    def alive(self, entry: Entry, now: float) -> bool:
        """False for an expired entry, deleted then."""
        if entry.expires_at is not None and entry.expires_at <= now:
            self.delete([entry.entry_id])
            return False
        return True

    def mark_used(self) -> None:
        """Write the LRU marks of the exact hits served from memory since the last call."""
        for entry_id, used in self.recent.take_used().items():
            self.entries.touch(entry_id, used)

    # -- other processes' changes ---------------------------------------------------------------------

    def apply(self, change: Change) -> None:
        """One change another process made, to this process's index and recent entries."""
        op, entry_id, partition = change
        if op == "reset":  # the log was cut past our cursor: rebuild from the store
            self.recent.clear()
            index = self.load_index()
            with self.lock:
                self.index = index
        # Not under self.lock (a lookup's sync would wait behind this process's writes, a tenant's flood of them;
        # the index locks itself). An id deleted meanwhile may be added back dead until its own "del" is applied:
        # a lookup that proposes it finds nothing in the store and skips it.
        elif op == "del":
            self.recent.drop_ids([entry_id])
            self.index.remove([entry_id])
        elif entry_id not in self.index:
            entry = self.entries.get(entry_id)
            if entry is not None and entry.embedding is not None:
                self.index.add(partition, [entry_id], entry.embedding[None, :])

    # -- checkpoints ----------------------------------------------------------------------------------

    def checkpoint_soon(self) -> None:
        """On a lookup's path, after it wrote (an LRU mark, an expired entry's deletion): when the store wants a
        checkpoint, queue one for the writer thread, so a workload of hits alone keeps the WAL bounded too."""
        if self._checkpoint_queued or not self.entries.checkpoint_due():
            return
        self._checkpoint_queued = True
        try:
            self._queue.submit(_CHECKPOINT, self._checkpoint)
        except RuntimeError:  # closed
            self._checkpoint_queued = False

    def _checkpoint(self) -> None:
        """The store's checkpoint if it wants one, in the writer thread."""
        self._checkpoint_queued = False
        try:
            if self.entries.checkpoint_due():  # not if a write ran one meanwhile
                self.entries.checkpoint()
        except CacheStoreError as exc:  # the next one tries again; what was written stays written either way
            log.warning("cache store checkpoint failed: %s", exc)

    def _dropped(self, tenant: object) -> None:
        self.stats.dropped_writes[str(tenant)] += 1

    def close(self) -> None:
        self._queue.close()
