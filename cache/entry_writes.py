"""What changes the cache's entries: a fresh answer's write, deletions (expired, purged, of a bumped or retired
version, reclaimed), the LRU marks of hits served from memory, other processes' changes applied to the index, and
the store's checkpoints. The lookup side (cache/lookup_pass.py) reads the same store, index and maps, and calls
in here only to delete an expired entry, to write marks and to ask for a checkpoint or a catch-up.

Writes queue per tenant for one writer thread, which takes the tenants in turns (cache/tenant_writes.py): another
tenant's flood delays a write by one of its writes, not by all of them; a tenant with `per_tenant` writes queued
loses its oldest queued one (`stats.dropped_writes`). The writer thread also runs the store's checkpoints
(`CacheStore.checkpoint`: SQLite's WAL into its file), after its own writes and, for the marks and deletions
lookups write, when a lookup finds one due; a lookup never runs one itself (SQLite's own, inside whichever commit
crossed its threshold, are off: cache/sqlite_store.py).

Other processes' changes (the store's change log, cache/change_feed.py) are applied in the writer thread too, under a
lane of their own (`sync_soon`), at most 1,000 changes a job (`ChangeFeed.step`), the next step queued behind the
tenants' writes queued meanwhile: a lookup that finds a catch-up due only queues it. It ran in that lookup's thread, so
one tenant's lookup paid for every entry any tenant had stored on another worker since the last catch-up (94 ms
after 2,000 of them). The catch-up reads only what the index needs of a new entry, its partition and vector, in
batches (`vectors_of`: one SELECT or one Redis pipeline per 500 ids), never its texts: each put read the whole
entry, its answer included, one read at a time. This process's own writes are in its index before `write` returns,
so it reads its own writes whether a catch-up ran or not.

Locks: `lock` orders a write's store put, index update and pending-entry bookkeeping against purges and version
bumps; a lookup takes it only to delete an expired entry. No write holds it through an index rebuild (the index's
builder thread does those, cache/index.py), and the change log's entries are applied without it (the index locks
itself; a synchronous `store`'s write may run beside a catch-up).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

import numpy as np

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
_SYNC = ("sync",)  # and of catch-ups with the change log
VECTORS_PER_READ = 500  # ids whose vectors one batched read of the store fetches (SQLite's IN list, a pipeline)


class _CatchUp:
    """A catch-up with the change log that a lookup queued, run in the writer thread a step (a few pages) a job."""

    def __init__(self) -> None:
        self.applied = 0  # changes, by the steps run so far
        self.done: Future[int] = Future()  # `applied` once it ends


def _ran(job: Future[object]) -> bool:
    """Whether the writer thread ran a `_sync` job (which returns True) rather than skip or drop it."""
    return not job.cancelled() and job.exception() is None and job.result() is True


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
        self._catching_up: _CatchUp | None = None  # the catch-up a lookup queued, until it ends (`sync_soon`)
        self._sync_lock = threading.Lock()  # guards it
        self.last_sync: Future[int] | None = None  # the catch-up queued last: its changes applied (tests wait for it)

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

    def sync_soon(self, step: Callable[[], tuple[int, bool]]) -> None:
        """On a lookup's path, when a catch-up with the change log is due: queue it for the writer thread, in a lane
        of its own, unless one is queued or running already. The lookup goes on with the index as it is: what it
        lacks costs a miss at worst, and what it holds that is gone from the store is skipped (the store is the
        truth). `step` (`ChangeFeed.step`) applies a few pages: (changes applied, whether caught up). While not
        caught up, the job queues the next step behind the jobs queued meanwhile, so every tenant's writes get
        their turns between the steps of a long backlog (one job for all of it held them, and dropped the oldest
        past `per_tenant`). `last_sync` resolves to the changes applied in all once caught up, or once a step
        failed; cancelling it stops the catch-up at its next step."""
        with self._sync_lock:
            if self._catching_up is not None:
                return
            run = self._catching_up = _CatchUp()
        self.last_sync = run.done
        run.done.add_done_callback(lambda done: self._sync_ended(run) if done.cancelled() else None)
        self._queue_sync(run, step)

    def _queue_sync(self, run: _CatchUp, step: Callable[[], tuple[int, bool]]) -> None:
        try:
            job = self._queue.submit(_SYNC, self._sync, run, step)
        except RuntimeError:  # closed
            self._sync_ended(run)
            return
        # a job that does not run (cancelled or dropped while queued) ends the catch-up: another can be queued
        job.add_done_callback(lambda job: None if _ran(job) else self._sync_ended(run))

    def _sync(self, run: _CatchUp, step: Callable[[], tuple[int, bool]]) -> bool:
        """A step of a catch-up in the writer thread; a failure is logged and ends it (the next one, `interval_s`
        later, tries again)."""
        more = False
        try:
            if not run.done.done():  # else cancelled: ended already
                applied, caught_up = step()
                run.applied += applied
                more = not caught_up
        except CacheStoreError as exc:
            log.warning("cache change log: catching up failed: %s", exc)
        except Exception:  # not the store's: a bug, with its traceback; the writer thread goes on
            log.exception("cache change log: catching up failed")
        finally:
            if more:
                self._queue_sync(run, step)  # behind the jobs queued meanwhile
            else:
                self._sync_ended(run)
        self._checkpoint()  # the marks it wrote (`mark_used`), if the store wants one now
        return True

    def _sync_ended(self, run: _CatchUp) -> None:
        """`run` is over (caught up, failed, cancelled or not run): a lookup may queue another."""
        with self._sync_lock:
            if self._catching_up is run:
                self._catching_up = None
        with contextlib.suppress(InvalidStateError):  # resolved or cancelled already
            run.done.set_result(run.applied)

    def apply(self, changes: list[Change]) -> None:
        """Changes another process made (a page of the log, in order), to this process's index and recent entries.
        The vectors of a run of puts are read together, and nothing else of their entries."""
        puts: list[str] = []
        for op, entry_id, _ in changes:
            if op == "put":
                if entry_id not in self.index:
                    puts.append(entry_id)
                continue
            self._add(puts)  # before a deletion or reset that follows them in the log
            puts = []
            if op == "reset":  # the log was cut past our cursor: rebuild from the store
                self.recent.clear()
                index = self.load_index()
                with self.lock:
                    self.index = index
            # Not under self.lock (the index locks itself). An id deleted meanwhile may be added back dead until its
            # own "del" is applied: a lookup that proposes it finds nothing in the store and skips it.
            elif op == "del":
                self.recent.drop_ids([entry_id])
                self.index.remove([entry_id])
        self._add(puts)

    def _add(self, entry_ids: list[str]) -> None:
        """Add to the index the entries of `entry_ids` still stored with a vector, each under its stored partition."""
        by_partition: dict[str, tuple[list[str], list[np.ndarray]]] = {}
        ids = list(dict.fromkeys(entry_ids))
        for start in range(0, len(ids), VECTORS_PER_READ):
            for entry_id, partition, vector in self._vectors_of(ids[start:start + VECTORS_PER_READ]):
                if entry_id not in self.index:
                    added, vectors = by_partition.setdefault(partition, ([], []))
                    added.append(entry_id)
                    vectors.append(vector)
        for partition, (added, vectors) in by_partition.items():
            self.index.add(partition, added, np.stack(vectors))

    def _vectors_of(self, entry_ids: list[str]) -> list[tuple[str, str, np.ndarray]]:
        """(entry id, partition, vector) of those of `entry_ids` stored with a vector: one batched read."""
        return list(self.entries.vectors_of(entry_ids))

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
