"""Background rebuilds of the partitioned index: searches never wait for one, and never see a removed entry or
miss an added one, before, during or after the swap."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest

from cache.index import SWAP_TAIL, PartitionedIndex

DIM = 16
WAIT_S = 10.0  # the longest a call may take while a rebuild is held
HOLD_S = 120.0  # how long a rebuild is held at most (the test opens the gate sooner): far longer than WAIT_S


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class _Gate:
    """Wraps `PartitionedIndex._build`: each build says it started, then waits until the gate opens."""

    def __init__(self, idx: PartitionedIndex):
        self.started = threading.Event()
        self.opened = threading.Event()
        self.builds = 0
        build: Callable[[Sequence[np.ndarray]], object] = idx._build

        def gated(vectors: Sequence[np.ndarray]) -> object:
            self.builds += 1
            self.started.set()
            assert self.opened.wait(HOLD_S), "the test never opened the gate"
            return build(vectors)

        idx._build = gated  # type: ignore[method-assign]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def _invariants(idx: PartitionedIndex) -> None:
    """Every partition's tables agree with each other and with its faiss index."""
    for key, part in idx._partitions.items():
        assert part.index.ntotal == len(part.entry_ids) == len(part.vectors)
        assert part.labels == {e: label for label, e in enumerate(part.entry_ids) if e is not None}
        assert all(idx._where[e] == key for e in part.labels)
    assert len(idx._where) == sum(len(p.labels) for p in idx._partitions.values())


def _check(idx: PartitionedIndex, live: dict[str, tuple[str, np.ndarray]], dead: dict[str, np.ndarray]) -> None:
    """Each live entry is the nearest to its own vector in its partition; no removed entry is ever returned."""
    for entry_id, (key, vector) in live.items():
        hits = idx.search(key, vector, 4)
        assert hits and hits[0][0] == entry_id and hits[0][1] == pytest.approx(1.0, abs=1e-5), entry_id
    for entry_id, vector in dead.items():  # an id re-added since may come back, but only with its new vector
        for key in idx.partitions():
            assert all(e != entry_id or (live.get(e, ("",))[0] == key and s < 0.999)
                       for e, s in idx.search(key, vector, 10)), entry_id


def test_searches_in_every_partition_return_while_a_rebuild_is_blocked(rng: np.random.Generator) -> None:
    idx = PartitionedIndex(DIM)
    va, vb = _unit(rng, 40), _unit(rng, 3)
    idx.add("a", [f"a{i}" for i in range(40)], va)
    idx.add("b", [f"b{i}" for i in range(3)], vb)
    gate = _Gate(idx)
    done = threading.Event()
    remover = threading.Thread(target=lambda: (idx.remove([f"a{i}" for i in range(11)]), done.set()))
    remover.start()  # 11 of 40 dead: a's rebuild starts
    try:
        assert gate.started.wait(WAIT_S), "no rebuild started"
        assert done.wait(WAIT_S), "remove waited for the rebuild"
        found: list[object] = []
        searcher = threading.Thread(target=lambda: found.extend([idx.search("b", vb[1], 1),
                                                                 idx.search("a", va[20], 1)]))
        searcher.start()
        searcher.join(WAIT_S)
        assert not searcher.is_alive(), "a search waited for another partition's rebuild"
        assert found[0][0][0] == "b1" and found[1][0][0] == "a20"
        assert idx.search("a", va[3], 10) and all(e != "a3" for e, _ in idx.search("a", va[3], 10))
    finally:
        gate.opened.set()
        remover.join(WAIT_S)
    assert idx.idle(WAIT_S) and gate.builds == 1
    _invariants(idx)
    assert len(idx._partitions["a"].entry_ids) == 29  # compacted


@pytest.mark.parametrize("added", [5, SWAP_TAIL + 40])  # all added at the swap, or a catch-up round first
def test_changes_made_during_a_rebuild_hold_before_and_after_the_swap(rng: np.random.Generator, added: int) -> None:
    idx = PartitionedIndex(DIM)
    v = _unit(rng, 40)
    live = {f"a{i}": ("a", v[i]) for i in range(40)}
    dead: dict[str, np.ndarray] = {}
    idx.add("a", list(live), v)
    idx.add("b", ["b0"], _unit(rng, 1))
    live["b0"] = ("b", idx._partitions["b"].vectors[0])
    gate = _Gate(idx)

    def remove(ids: list[str]) -> None:
        assert idx.remove(ids) == len(ids)
        for e in ids:
            dead[e] = live.pop(e)[1]

    def add(key: str, ids: list[str], vectors: np.ndarray) -> None:
        idx.add(key, ids, vectors)
        for e, vec in zip(ids, vectors, strict=True):
            if e in live:
                dead[e] = live[e][1]
            live[e] = (key, vec)

    try:
        remove([f"a{i}" for i in range(11)])  # snapshot taken; its build now waits on the gate
        assert gate.started.wait(WAIT_S)
        remove([f"a{i}" for i in range(11, 16)] + ["a20"])  # in the snapshot, removed after it
        fresh = _unit(rng, added)
        add("a", [f"n{i}" for i in range(added)], fresh)
        remove([f"n{i}" for i in range(2)])  # added after the snapshot, removed before the swap
        add("a", ["a30"], _unit(rng, 1))  # replaced: its old label is tombstoned, its new one found
        add("b", ["a31"], _unit(rng, 1))  # moved to another partition
        add("a", ["n3"], _unit(rng, 1))  # replaced while only in the tail
        _check(idx, live, dead)  # before the swap: the old index and its tombstones
        assert all(e != "a31" for e, _ in idx.search("a", dead["a31"], 10))
    finally:
        gate.opened.set()
    assert idx.idle(WAIT_S)
    _invariants(idx)
    _check(idx, live, dead)  # after the swap
    assert all(e != "a31" for e, _ in idx.search("a", dead["a31"], 10))
    assert len(idx) == len(live)


def test_the_switch_to_hnsw_is_built_in_the_background(rng: np.random.Generator) -> None:
    idx = PartitionedIndex(DIM, hnsw_from=300)
    v = _unit(rng, 400)
    idx.add("p", [f"e{i}" for i in range(299)], v[:299])
    gate = _Gate(idx)
    try:
        idx.add("p", ["e299"], v[299:300])  # passes hnsw_from: the switch starts and waits
        assert gate.started.wait(WAIT_S)
        assert type(idx._partitions["p"].index).__name__ == "IndexFlatIP"  # still answering, exactly
        idx.add("p", [f"e{i}" for i in range(300, 400)], v[300:])
        idx.remove(["e5", "e350"])
        assert [e for e, _ in idx.search("p", v[350], 1)] != ["e350"]
        assert idx.search("p", v[399], 1)[0][0] == "e399"
    finally:
        gate.opened.set()
    assert idx.idle(WAIT_S)
    _invariants(idx)
    assert type(idx._partitions["p"].index).__name__ == "IndexHNSWFlat"
    assert sum(idx.search("p", v[i], 1)[0][0] == f"e{i}" for i in range(0, 400, 4) if i not in (5, 350)) >= 95
    assert all(e not in ("e5", "e350") for i in (5, 350) for e, _ in idx.search("p", v[i], 10))


def test_a_partition_dropped_during_its_rebuild_stays_dropped(rng: np.random.Generator) -> None:
    idx = PartitionedIndex(DIM)
    v = _unit(rng, 20)
    idx.add("p", [f"e{i}" for i in range(20)], v)
    gate = _Gate(idx)
    try:
        idx.remove([f"e{i}" for i in range(6)])
        assert gate.started.wait(WAIT_S)
        assert idx.drop_partition("p") == 14
    finally:
        gate.opened.set()
    assert idx.idle(WAIT_S)
    assert idx.search("p", v[10], 4) == [] and len(idx) == 0 and idx.partitions() == []
    idx.add("p", ["x"], v[:1])  # a new partition under the same key
    assert [e for e, _ in idx.search("p", v[0], 4)] == ["x"]


def test_a_failed_rebuild_leaves_the_old_index_answering_and_is_retried(rng: np.random.Generator,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    idx = PartitionedIndex(DIM)
    v = _unit(rng, 40)
    idx.add("p", [f"e{i}" for i in range(40)], v)
    build = idx._build
    calls = []

    def failing_once(vectors: Sequence[np.ndarray]) -> object:
        calls.append(len(vectors))
        if len(calls) == 1:
            raise RuntimeError("no room")
        return build(vectors)

    idx._build = failing_once  # type: ignore[method-assign]
    idx.remove([f"e{i}" for i in range(11)])
    assert idx.idle(WAIT_S) and calls == [29] and "rebuilding faiss partition p failed" in caplog.text
    assert idx.search("p", v[20], 1)[0][0] == "e20" and all(e != "e3" for e, _ in idx.search("p", v[3], 10))
    idx.remove(["e11"])
    assert idx.idle(WAIT_S) and calls == [29, 28]
    _invariants(idx)
    assert len(idx._partitions["p"].entry_ids) == 28


def _random_ops(seed: int) -> Iterator[tuple[str, str, str]]:
    r = random.Random(seed)
    ids = [f"e{i}" for i in range(120)]
    for _ in range(2500):
        op = r.choices(["add", "remove", "drop"], [6, 5, 0.05])[0]
        yield op, r.choice(ids), r.choice("pqr")


@pytest.mark.parametrize("hnsw_from", [10_000, 60])
def test_random_changes_racing_background_rebuilds_stay_exact(hnsw_from: int) -> None:
    """Adds, replaces, moves, removes and drops from this thread while the builder rebuilds partitions
    concurrently: after every change, what it added is found and what it removed is never returned."""
    rng = np.random.default_rng(11)
    idx = PartitionedIndex(DIM, hnsw_from=hnsw_from)
    live: dict[str, tuple[str, np.ndarray]] = {}
    rebuilt = 0
    for op, entry_id, key in _random_ops(hnsw_from):
        if op == "add":
            vector = _unit(rng, 1)
            old = live.get(entry_id)
            idx.add(key, [entry_id], vector)
            live[entry_id] = (key, vector[0])
            hits = idx.search(key, vector[0], 4)
            assert hits and hits[0][0] == entry_id  # read your own write
            if old is not None and hnsw_from > 1000:  # exact search: the replaced vector never answers for it
                assert all(e != entry_id or (old[0] == key and s < 0.999) for e, s in idx.search(old[0], old[1], 10))
        elif op == "remove":
            old = live.pop(entry_id, None)
            assert idx.remove([entry_id]) == (old is not None)
            if old is not None:
                assert all(e != entry_id for e, _ in idx.search(old[0], old[1], 10))
        else:
            gone = [e for e, (k, _) in live.items() if k == key]
            assert idx.drop_partition(key) == len(gone)
            for e in gone:
                del live[e]
            assert idx.search(key, rng.standard_normal(DIM), 10) == []
        rebuilt += idx._builder is not None
    assert rebuilt > 0, "no rebuild ran during the changes"
    assert idx.idle(WAIT_S)
    _invariants(idx)
    if hnsw_from > 1000:
        _check(idx, live, {})
    assert len(idx) == len(live)


def test_dead_labels_crowding_the_nearest_do_not_hide_live_ones(rng: np.random.Generator) -> None:
    """While a rebuild runs, tombstones pile up past the usual over-fetch: a search looks further."""
    idx = PartitionedIndex(DIM)
    others = _unit(rng, 60)
    idx.add("p", [f"o{i}" for i in range(60)], others)
    v = _unit(rng, 1)
    near = v[0] + 0.05 * _unit(rng, 1)[0]
    idx.add("p", ["near"], (near / np.linalg.norm(near))[None, :])
    gate = _Gate(idx)
    try:
        idx.remove([f"o{i}" for i in range(16)])  # a rebuild starts and waits
        assert gate.started.wait(WAIT_S)
        for i in range(30):  # the same question stored and evicted again and again, nearer than any live entry
            idx.add("p", [f"d{i}"], v)
            idx.remove([f"d{i}"])
        hits = idx.search("p", v[0], 4)
        assert len(hits) == 4 and hits[0][0] == "near" and all(e.startswith(("near", "o")) for e, _ in hits)
    finally:
        gate.opened.set()
    assert idx.idle(WAIT_S)
    _invariants(idx)
