"""One tenant's churn never stalls another tenant's lookups: a partition's index rebuild (a quarter of it evicted,
or the switch to HNSW) runs while every tenant's lookups, the churning tenant's included, go on."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from bench.cache_write_contention import HashEmbedder
from cache.index import PartitionedIndex
from cache.results import Miss
from cache.semantic_cache import SemanticCache
from cache.sqlite_store import SQLiteStore
from tests.cache.conftest import chat, scope

WAIT_S = 10.0  # the longest a call may take while a rebuild is held
HOLD_S = 120.0  # how long a rebuild is held at most (the test releases it sooner): far longer than every WAIT_S


class _BlockedBuilds:
    """Once armed, every index build of at least 3 vectors (a rebuild, not a new partition's first entry) says it
    started and waits until released: a rebuild that takes as long as the test wants."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.armed = False
        self.started = threading.Event()
        self.released = threading.Event()
        new_index = PartitionedIndex._new_index

        def blocking(index: PartitionedIndex, size: int) -> object:
            if self.armed and size >= 3:
                self.started.set()
                assert self.released.wait(HOLD_S), "the test never released the build"
            return new_index(index, size)

        monkeypatch.setattr(PartitionedIndex, "_new_index", blocking)


@pytest.fixture
def blocked(monkeypatch: pytest.MonkeyPatch) -> Iterator[_BlockedBuilds]:
    builds = _BlockedBuilds(monkeypatch)
    yield builds
    builds.released.set()


def _within(seconds: float, fn, *args):  # type: ignore[no-untyped-def]
    """fn(*args) in a thread; its result, or AssertionError if it has not returned after `seconds`."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"{getattr(fn, '__name__', fn)} did not return within {seconds} s"
    return out[0]


@pytest.mark.parametrize("trigger", ["evictions", "hnsw switch"])
def test_lookups_of_every_tenant_return_while_one_partition_rebuilds(blocked: _BlockedBuilds, trigger: str) -> None:
    # per-tenant bound 4: A's 6th entry evicts its 2nd, and 2 of 5 labels dead starts a rebuild; or A's 4th
    # entry takes its partition to hnsw_from
    store = SQLiteStore(":memory:", max_entries=1000, max_entries_per_tenant=4 if trigger == "evictions" else None)
    cache = SemanticCache(store, HashEmbedder(), hnsw_from=4 if trigger == "hnsw switch" else 8192)
    try:
        b_body = chat("What is the boiling point of water?")
        b_scope = scope(b_body, tenant="tenant-b")
        assert cache.store(b_scope, b_body, "100 C") is not None
        a_scope = scope(chat("q"), tenant="tenant-a")
        storing = 6 if trigger == "evictions" else 4
        for i in range(storing - 1):
            assert cache.store(a_scope, chat(f"question {i} of tenant a"), "ok") is not None
        blocked.armed = True
        last_a = chat(f"question {storing - 1} of tenant a")
        writer = threading.Thread(target=cache.store, args=(a_scope, last_a, "ok"), daemon=True)
        writer.start()  # starts A's rebuild, which waits on the test
        assert blocked.started.wait(WAIT_S), "A's writes started no rebuild"

        b_miss = _within(WAIT_S, cache.lookup, b_scope, chat("Which metal melts at the lowest temperature?"))
        assert isinstance(b_miss, Miss) and b_miss.reason.startswith("below threshold")  # B's partition searched
        a_miss = _within(WAIT_S, cache.lookup, a_scope, chat("an unrelated question of tenant a"))
        assert isinstance(a_miss, Miss) and a_miss.reason.startswith("below threshold")  # so was A's, meanwhile
        assert _within(WAIT_S, cache.store, b_scope, chat("Who wrote Hamlet?"), "Shakespeare") is not None
        writer.join(WAIT_S)
        assert not writer.is_alive(), "A's write waited for its partition's rebuild"
        assert cache.lookup(a_scope, last_a).status == "hit"
    finally:
        blocked.released.set()
    assert cache.index.idle(WAIT_S)
    assert cache.lookup(b_scope, b_body).status == "hit"
    cache.close()


def test_an_entry_evicted_during_a_rebuild_is_never_served(blocked: _BlockedBuilds) -> None:
    """The semantic path proposes entries from the index; one evicted while its partition rebuilds is not among
    them, before or after the swap, and the entry that displaced it is found at once."""
    store = SQLiteStore(":memory:", max_entries=1000, max_entries_per_tenant=4)
    cache = SemanticCache(store, HashEmbedder())
    a_scope = scope(chat("q"), tenant="tenant-a")
    bodies = [chat(f"question {i} of tenant a") for i in range(8)]
    try:
        for body in bodies[:5]:
            cache.store(a_scope, body, "ok")
        blocked.armed = True
        threading.Thread(target=cache.store, args=(a_scope, bodies[5], "ok"), daemon=True).start()
        assert blocked.started.wait(WAIT_S)
        for body in bodies[6:]:  # each evicts one more of A's, while the rebuild waits
            assert _within(WAIT_S, cache.store, a_scope, body, "ok") is not None
        (part,) = [p for p in cache.index.partitions() if p.startswith(a_scope.scope_id)]
        vectors = cache.embedder.encode([b["messages"][-1]["content"] for b in bodies])
        live = set(store.ids_of_tenant("tenant-a"))
        assert len(live) == 4  # 4 of the 8 evicted, the last 2 after the rebuild's snapshot

        def proposed() -> set[str]:  # k=8 over a partition of at most 8 labels: every live entry, whatever the query
            return {e for v in vectors for e, _ in cache.index.search(part, v, 8)}

        assert proposed() == live  # before the swap: exactly the live entries, the latest among them
    finally:
        blocked.released.set()
    assert cache.index.idle(WAIT_S)
    assert proposed() == live  # after it too
    cache.close()
