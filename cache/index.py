"""Vector indexes, one per cache partition (a scope and a conversation history), on faiss.

A partition starts as an exact `IndexFlatIP` (inner product of normalized vectors = cosine). Exact search
scans every vector, about 0.2 ms per 1,000 entries here, so a partition that grows past `hnsw_from`
entries is rebuilt once as `IndexHNSWFlat` (graph search, ~0.3 ms at 100,000 entries, recall near 1 for
the near-duplicates a cache looks for).

Neither index type removes cheaply (HNSW not at all), so removal is a tombstone: the label's entry id is
dropped from the partition's table, searches over-fetch and skip dead labels, and the partition is rebuilt
from its live vectors once more than a quarter of it is dead. This is also how bumped versions are
reclaimed: their partitions are dropped whole.

Concurrency: the index is thread-safe, and no lookup ever waits for a rebuild, its own partition's included.
An HNSW build of 8-25k vectors takes seconds, so it never runs under a lock a search takes:

- Each partition has its own lock, held only for short steps (a search, adding one vector, a tombstone, a
  snapshot, a swap). A search finds its partition without any index-wide lock (one `dict.get`), so a
  search in partition B never waits for anything done in partition A. The index-wide lock only keeps the
  map of entry ids to partitions, and no search takes it.
- A rebuild (compaction, or the switch to HNSW) runs in the index's one builder thread, in three steps:
  (1) under the partition's lock, copy its label table (a list copy, microseconds); (2) with no lock,
  build the replacement from the live vectors of that copy, then add, also with no lock, the vectors
  appended since, until few are left; (3) under the lock, add those few, tombstone in the replacement
  every label removed since step 1 (the partition logs them while a rebuild is in flight), and swap.
  Until the swap, searches use the old index and its tombstones, which already say exactly what is live:
  an entry removed is skipped from the moment `remove` returns, and one added is searchable from the
  moment `add` returns, before, during and after the rebuild; the swap changes only which index (and
  which labels) answer, never which entries are live.
- The vectors kept for rebuilds and the label table only grow by appending (a tombstone overwrites one
  slot with None), and a swap replaces them whole, so the builder reads rows of its copy of the table
  without a lock: the rows below the copy's length never change while it builds.

Simpler designs were rejected: a lock per partition held during the rebuild still blocks that tenant's
lookups for seconds, and those blocked lookups hold the worker threads every tenant's lookups run on; one
builder thread (not one per rebuild) keeps concurrent rebuilds from oversubscribing the cores.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import faiss
import numpy as np

log = logging.getLogger(__name__)

# Vectors appended during a rebuild that the swap adds under the partition's lock, at most; more are added
# to the replacement off the lock first.
SWAP_TAIL = 64
# Rows added to an index per faiss call when building one: bounds how long numpy holds the GIL per copy.
BUILD_CHUNK = 1024


@dataclass
class _Partition:
    index: faiss.Index
    vectors: list[np.ndarray] = field(default_factory=list)  # label -> vector; kept for rebuilds
    entry_ids: list[str | None] = field(default_factory=list)  # label -> entry id, None when removed
    labels: dict[str, int] = field(default_factory=dict)  # entry id -> label
    lock: threading.Lock = field(default_factory=threading.Lock)  # over all of the above
    removed: list[int] | None = None  # labels tombstoned since a rebuild's snapshot; None: no rebuild in flight
    gone: bool = False  # dropped or emptied: a search still holding it finds nothing

    @property
    def num_dead(self) -> int:
        return len(self.entry_ids) - len(self.labels)


class PartitionedIndex:
    """Maps partition key -> vector index; add, search and remove entries by id. Thread-safe; rebuilds run in a
    background thread (`idle` waits for them)."""

    def __init__(self, dim: int, *, hnsw_from: int = 8192, hnsw_m: int = 32, ef_search: int = 64,
                 ef_construction: int = 64):
        self.dim = dim
        self.hnsw_from = hnsw_from
        self.hnsw_m = hnsw_m
        self.ef_search = ef_search
        self.ef_construction = ef_construction
        self._partitions: dict[str, _Partition] = {}  # read without a lock by searches; written under _lock
        self._where: dict[str, str] = {}  # entry id -> partition key
        self._lock = threading.Lock()  # over _partitions and _where; never taken by a search
        self._queue: deque[tuple[str, _Partition]] = deque()  # partitions waiting for a rebuild
        self._builder: threading.Thread | None = None
        self._builds = threading.Condition()  # over _queue and _builder

    @classmethod
    def of(cls, dim: int, rows: Iterable[tuple[str, str, np.ndarray]], *, hnsw_from: int = 8192) -> PartitionedIndex:
        """An index of (entry id, partition key, vector) rows, each partition built in one batch (after a restart,
        or a change log cut short)."""
        by_partition: dict[str, tuple[list[str], list[np.ndarray]]] = {}
        for entry_id, key, vector in rows:
            ids, vectors = by_partition.setdefault(key, ([], []))
            ids.append(entry_id)
            vectors.append(vector)
        index = cls(dim, hnsw_from=hnsw_from)
        for key, (ids, vectors) in by_partition.items():
            index.add(key, ids, np.stack(vectors))
        return index

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._where

    def partition_size(self, key: str) -> int:
        part = self._partitions.get(key)
        return len(part.labels) if part else 0

    def _new_index(self, size: int) -> faiss.Index:
        if size < self.hnsw_from:
            return faiss.IndexFlatIP(self.dim)
        index = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self.ef_construction
        index.hnsw.efSearch = self.ef_search
        return index

    def _build(self, vectors: Sequence[np.ndarray]) -> faiss.Index:
        """A new index of `vectors` (rows in label order), HNSW from `hnsw_from` rows. Runs with no lock held."""
        index = self._new_index(len(vectors))
        for start in range(0, len(vectors), BUILD_CHUNK):
            index.add(np.stack(vectors[start:start + BUILD_CHUNK]))
        return index

    def add(self, key: str, entry_ids: list[str], vectors: np.ndarray) -> None:
        """Add vectors ([N, dim] float32, normalized) under `key`; an id already present is replaced. Searchable
        once this returns."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        with self._lock:
            self._remove_locked(e for e in entry_ids if e in self._where)
            part = self._partitions.get(key)
            if part is None:
                part = self._partitions[key] = _Partition(self._new_index(len(entry_ids)))
            with part.lock:
                for entry_id, vector in zip(entry_ids, vectors, strict=True):
                    part.labels[entry_id] = len(part.entry_ids)
                    part.entry_ids.append(entry_id)
                    part.vectors.append(vector)
                    self._where[entry_id] = key
                part.index.add(vectors)
                due = self._rebuild_due(part)
        if due:
            self._schedule(key, part)

    def search(self, key: str, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        """Up to `k` live (entry id, cosine similarity) pairs nearest to `vector`, best first."""
        part = self._partitions.get(key)  # no index-wide lock: a search waits for nothing outside its partition
        if part is None:
            return []
        query = np.asarray(vector, dtype=np.float32).reshape(1, self.dim)
        with part.lock:
            if part.gone or not part.labels:
                return []
            want = min(k, len(part.labels))
            fetch = min(len(part.entry_ids), k + min(part.num_dead, 4 * k))
            while True:
                scores, labels = part.index.search(query, fetch)
                hits: list[tuple[str, float]] = []
                for score, label in zip(scores[0], labels[0], strict=True):
                    if label >= 0 and (entry_id := part.entry_ids[label]) is not None:
                        hits.append((entry_id, float(score)))
                        if len(hits) == k:
                            break
                if len(hits) >= want or fetch >= len(part.entry_ids):
                    return hits
                fetch = min(len(part.entry_ids), 4 * fetch)  # dead labels crowd the nearest: look further

    def remove(self, entry_ids: Iterable[str]) -> int:
        """Tombstone entries (never returned once this returns); a partition more than a quarter dead is rebuilt
        in the background. Returns how many."""
        with self._lock:
            return self._remove_locked(entry_ids)

    def _remove_locked(self, entry_ids: Iterable[str]) -> int:
        by_key: dict[str, list[str]] = {}
        for entry_id in list(entry_ids):
            key = self._where.pop(entry_id, None)
            if key is not None:
                by_key.setdefault(key, []).append(entry_id)
        due: list[tuple[str, _Partition]] = []
        for key, ids in by_key.items():
            part = self._partitions[key]
            with part.lock:
                for entry_id in ids:
                    label = part.labels.pop(entry_id)
                    part.entry_ids[label] = None
                    if part.removed is not None:
                        part.removed.append(label)
                if not part.labels:
                    part.gone = True
                    del self._partitions[key]
                elif self._rebuild_due(part):
                    due.append((key, part))
        for key, part in due:
            self._schedule(key, part)
        return sum(map(len, by_key.values()))

    def drop_partition(self, key: str) -> int:
        """Forget a whole partition (a bumped version); returns how many entries it held."""
        with self._lock:
            part = self._partitions.pop(key, None)
            if part is None:
                return 0
            with part.lock:
                part.gone = True
                for entry_id in part.labels:
                    self._where.pop(entry_id, None)
                return len(part.labels)

    def partitions(self) -> list[str]:
        with self._lock:
            return list(self._partitions)

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until no rebuild is queued or running; False if `timeout` passed first."""
        with self._builds:
            return self._builds.wait_for(lambda: self._builder is None, timeout)

    # -- rebuilds -------------------------------------------------------------------------------------

    def _rebuild_due(self, part: _Partition) -> bool:
        """Under part.lock: whether a rebuild should start (none in flight, and a quarter dead or HNSW due)."""
        if part.removed is not None or part.gone:
            return False
        if part.num_dead * 4 > len(part.entry_ids):
            return True
        return isinstance(part.index, faiss.IndexFlatIP) and len(part.labels) >= self.hnsw_from

    def _schedule(self, key: str, part: _Partition) -> None:
        with part.lock:
            if part.removed is not None or part.gone:
                return
            part.removed = []  # in flight from now: tombstones are logged for the swap
        with self._builds:
            self._queue.append((key, part))
            if self._builder is None:
                self._builder = threading.Thread(target=self._run_builds, name="faiss-rebuild", daemon=True)
                self._builder.start()

    def _run_builds(self) -> None:
        while True:
            with self._builds:
                if not self._queue:
                    self._builder = None
                    self._builds.notify_all()
                    return
                key, part = self._queue.popleft()
            try:
                self._rebuild(key, part)
            except Exception:  # the old index still answers, exactly; a later add or remove retries
                log.exception("rebuilding faiss partition %s failed", key)
                with part.lock:
                    part.removed = None

    def _rebuild(self, key: str, part: _Partition) -> None:
        """Replace `part`'s index by one of its live vectors. Runs in the builder thread, holding `part.lock` only
        for the snapshot, to read what was appended since, and for the swap (work in proportion to what changed
        during the build, at most `SWAP_TAIL` vectors added)."""
        with part.lock:
            if part.gone:
                return
            ids = list(part.entry_ids)
            part.removed = []  # tombstones from the snapshot on, for the swap
            vectors = part.vectors  # only appended to until the swap below, which is ours
        fresh = _Partition(faiss.IndexFlatIP(self.dim))  # private to this thread until the swap
        moved: dict[int, int] = {}  # old label -> label in the replacement
        _extend(fresh, moved, ids, vectors, 0)
        fresh.index = self._build(fresh.vectors)
        done = len(ids)
        while True:
            with part.lock:
                if part.gone:
                    return
                if len(part.entry_ids) - done <= SWAP_TAIL:
                    _add(fresh.index, _extend(fresh, moved, part.entry_ids, vectors, done))
                    for label in part.removed:  # tombstone what was removed since the snapshot
                        if (new := moved.get(label)) is not None and (entry_id := fresh.entry_ids[new]) is not None:
                            fresh.entry_ids[new] = None
                            if fresh.labels.get(entry_id) == new:  # not re-added since under a later label
                                del fresh.labels[entry_id]
                    part.index, part.vectors = fresh.index, fresh.vectors
                    part.entry_ids, part.labels = fresh.entry_ids, fresh.labels
                    part.removed = None
                    due = self._rebuild_due(part)
                    break
                tail = part.entry_ids[done:]
            _add(fresh.index, _extend(fresh, moved, tail, vectors, done, offset=done))
            done += len(tail)
        if due:
            self._schedule(key, part)


def _extend(fresh: _Partition, moved: dict[int, int], ids: Sequence[str | None], vectors: list[np.ndarray],
            start: int, offset: int = 0) -> list[np.ndarray]:
    """Append to `fresh` the live labels from `start` on of `ids` (whose first item is label `offset`); returns
    their vectors (`fresh.index` is not touched)."""
    rows = []
    for i in range(start - offset, len(ids)):
        if (entry_id := ids[i]) is not None:
            label = offset + i
            moved[label] = new = len(fresh.entry_ids)
            fresh.entry_ids.append(entry_id)
            fresh.labels[entry_id] = new
            fresh.vectors.append(vectors[label])
            rows.append(vectors[label])
    return rows


def _add(index: faiss.Index, rows: list[np.ndarray]) -> None:
    if rows:
        index.add(np.stack(rows))
