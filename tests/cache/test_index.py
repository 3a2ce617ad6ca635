"""Partitioned faiss index: search within a partition, tombstones, HNSW switch, rebuild."""

from __future__ import annotations

import numpy as np

from cache.index import PartitionedIndex


def _unit(rng: np.random.Generator, n: int, dim: int = 16) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_search_sees_only_its_partition() -> None:
    rng = np.random.default_rng(0)
    idx = PartitionedIndex(16)
    v = _unit(rng, 2)
    idx.add("a", ["a0"], v[:1])
    idx.add("b", ["b0"], v[1:])
    assert idx.search("a", v[1], 5) == [("a0", idx.search("a", v[1], 5)[0][1])]
    assert [e for e, _ in idx.search("b", v[1], 5)] == ["b0"]
    assert idx.search("missing", v[0], 5) == []


def test_nearest_first_with_cosine_scores() -> None:
    rng = np.random.default_rng(1)
    idx = PartitionedIndex(16)
    v = _unit(rng, 50)
    idx.add("p", [f"e{i}" for i in range(50)], v)
    hits = idx.search("p", v[7], 3)
    assert hits[0][0] == "e7" and abs(hits[0][1] - 1.0) < 1e-5
    assert hits[0][1] >= hits[1][1] >= hits[2][1]


def test_removed_entries_never_come_back_and_partition_rebuilds() -> None:
    rng = np.random.default_rng(2)
    idx = PartitionedIndex(16)
    v = _unit(rng, 20)
    idx.add("p", [f"e{i}" for i in range(20)], v)
    assert idx.remove([f"e{i}" for i in range(10)]) == 10  # more than a quarter dead -> rebuilt
    assert len(idx) == 10 and idx.partition_size("p") == 10
    assert idx.idle(timeout=60) and len(idx._partitions["p"].entry_ids) == 10  # compacted
    for i in range(10):
        assert all(e != f"e{i}" for e, _ in idx.search("p", v[i], 10))
    assert idx.search("p", v[15], 1)[0][0] == "e15"
    assert idx.remove(["e3"]) == 0  # already gone


def test_re_adding_an_id_replaces_it() -> None:
    rng = np.random.default_rng(3)
    idx = PartitionedIndex(16)
    v = _unit(rng, 2)
    idx.add("p", ["e"], v[:1])
    idx.add("q", ["e"], v[1:])
    assert idx.search("p", v[0], 1) == [] and idx.search("q", v[1], 1)[0][0] == "e"


def test_large_partition_switches_to_hnsw_and_finds_duplicates() -> None:
    rng = np.random.default_rng(4)
    idx = PartitionedIndex(16, hnsw_from=500)
    v = _unit(rng, 800)
    idx.add("p", [f"e{i}" for i in range(400)], v[:400])
    idx.add("p", [f"e{i}" for i in range(400, 800)], v[400:])
    assert idx.idle(timeout=60)  # the switch is built in the background
    assert type(idx._partitions["p"].index).__name__ == "IndexHNSWFlat"
    found = sum(idx.search("p", v[i], 1)[0][0] == f"e{i}" for i in range(0, 800, 8))
    assert found >= 98  # of 100
    idx.drop_partition("p")
    assert len(idx) == 0 and idx.search("p", v[0], 1) == []
