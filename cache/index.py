"""Vector indexes, one per cache partition (a scope and a conversation history), on faiss.

A partition starts as an exact `IndexFlatIP` (inner product of normalized vectors = cosine). Exact search
scans every vector, about 0.2 ms per 1,000 entries here, so a partition that grows past `hnsw_from`
entries is rebuilt once as `IndexHNSWFlat` (graph search, ~0.3 ms at 100,000 entries, recall near 1 for
the near-duplicates a cache looks for).

Neither index type removes cheaply (HNSW not at all), so removal is a tombstone: the label's entry id is
dropped from the partition's table, searches over-fetch and skip dead labels, and the partition is rebuilt
from its live vectors once more than a quarter of it is dead. This is also how bumped versions are
reclaimed: their partitions are dropped whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import faiss
import numpy as np


@dataclass
class _Partition:
    index: faiss.Index
    vectors: list[np.ndarray] = field(default_factory=list)  # label -> vector; kept for rebuilds
    entry_ids: list[str | None] = field(default_factory=list)  # label -> entry id, None when removed
    labels: dict[str, int] = field(default_factory=dict)  # entry id -> label

    @property
    def num_dead(self) -> int:
        return len(self.entry_ids) - len(self.labels)


class PartitionedIndex:
    """Maps partition key -> vector index; add, search and remove entries by id. Not thread-safe by itself."""

    def __init__(self, dim: int, *, hnsw_from: int = 8192, hnsw_m: int = 32, ef_search: int = 64,
                 ef_construction: int = 64):
        self.dim = dim
        self.hnsw_from = hnsw_from
        self.hnsw_m = hnsw_m
        self.ef_search = ef_search
        self.ef_construction = ef_construction
        self._partitions: dict[str, _Partition] = {}
        self._where: dict[str, str] = {}  # entry id -> partition key

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

    def add(self, key: str, entry_ids: list[str], vectors: np.ndarray) -> None:
        """Add vectors ([N, dim] float32, normalized) under `key`; an id already present is replaced."""
        self.remove(e for e in entry_ids if e in self._where)
        part = self._partitions.get(key)
        if part is None:
            part = self._partitions[key] = _Partition(self._new_index(len(entry_ids)))
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        for entry_id, vector in zip(entry_ids, vectors, strict=True):
            part.labels[entry_id] = len(part.entry_ids)
            part.entry_ids.append(entry_id)
            part.vectors.append(vector)
            self._where[entry_id] = key
        if isinstance(part.index, faiss.IndexFlatIP) and len(part.labels) >= self.hnsw_from:
            self._rebuild(key, part)
        else:
            part.index.add(vectors)

    def search(self, key: str, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        """Up to `k` live (entry id, cosine similarity) pairs nearest to `vector`, best first."""
        part = self._partitions.get(key)
        if part is None or not part.labels:
            return []
        fetch = min(len(part.entry_ids), k + min(part.num_dead, 4 * k))
        scores, labels = part.index.search(np.asarray(vector, dtype=np.float32).reshape(1, self.dim), fetch)
        hits: list[tuple[str, float]] = []
        for score, label in zip(scores[0], labels[0], strict=True):
            if label >= 0 and (entry_id := part.entry_ids[label]) is not None:
                hits.append((entry_id, float(score)))
                if len(hits) == k:
                    break
        return hits

    def remove(self, entry_ids: Iterable[str]) -> int:
        """Tombstone entries; rebuild a partition once more than a quarter of it is dead. Returns how many."""
        touched: set[str] = set()
        removed = 0
        for entry_id in list(entry_ids):
            key = self._where.pop(entry_id, None)
            if key is None:
                continue
            part = self._partitions[key]
            part.entry_ids[part.labels.pop(entry_id)] = None
            touched.add(key)
            removed += 1
        for key in touched:
            part = self._partitions[key]
            if not part.labels:
                del self._partitions[key]
            elif part.num_dead * 4 > len(part.entry_ids):
                self._rebuild(key, part)
        return removed

    def drop_partition(self, key: str) -> int:
        """Forget a whole partition (a bumped version); returns how many entries it held."""
        part = self._partitions.pop(key, None)
        if part is None:
            return 0
        for entry_id in part.labels:
            self._where.pop(entry_id, None)
        return len(part.labels)

    def partitions(self) -> list[str]:
        return list(self._partitions)

    def _rebuild(self, key: str, part: _Partition) -> None:
        live = [(e, part.vectors[label]) for e, label in part.labels.items()]
        fresh = _Partition(self._new_index(len(live)))
        if live:
            ids, vectors = zip(*live, strict=True)
            matrix = np.stack(vectors)
            fresh.index.add(matrix)
            fresh.entry_ids = list(ids)
            fresh.vectors = list(matrix)
            fresh.labels = {e: i for i, e in enumerate(ids)}
        self._partitions[key] = fresh
