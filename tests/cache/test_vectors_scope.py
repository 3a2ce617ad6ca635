"""The memo of recent turn vectors (cache/vectors.py) is per tenant: a memo hit skips the batcher's wait and the
forward pass, so a vector one tenant's text left must never serve another's lookup (its miss would come back
faster, telling it what the other asked). Counted in forward passes, not timed."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from cache.scope import CacheScope
from cache.semantic_cache import SemanticCache
from cache.sqlite_store import SQLiteStore
from cache.vectors import MEMO_OWNERS, MEMO_PER_OWNER, TurnVectors
from tests.cache.conftest import chat

TEXT = "Does patient number 1000 at St Mary clinic have a positive test result?"


class CountingEmbedder:
    """Stands in for MiniLM: a vector per text, and the texts of every forward pass."""

    dim = 4
    max_tokens = 256

    def __init__(self) -> None:
        self.passes: list[list[str]] = []

    def num_tokens(self, text: str) -> int:
        return len(text.split())

    def encode(self, texts: list[str], *, batch_size: int = 64) -> np.ndarray:
        self.passes.append(list(texts))
        return np.stack([np.full(self.dim, float(len(t)), dtype=np.float32) for t in texts])

    def embedded(self) -> list[str]:
        return [t for p in self.passes for t in p]


@pytest.fixture
def fake() -> CountingEmbedder:
    return CountingEmbedder()


@pytest.fixture
def vectors(fake: CountingEmbedder) -> Iterator[TurnVectors]:
    v = TurnVectors(fake, max_wait_s=0)  # type: ignore[arg-type]
    yield v
    v.close()


async def test_another_tenants_text_is_not_in_my_memo(vectors: TurnVectors, fake: CountingEmbedder) -> None:
    await vectors.aget(TEXT, owner="acme")
    assert fake.embedded() == [TEXT]
    await vectors.aget(TEXT, owner="globex")  # globex's miss runs the forward pass, as for a text nobody sent
    assert fake.embedded() == [TEXT, TEXT]
    assert vectors.recent(TEXT, "initech") is None


async def test_a_tenants_own_repeat_is_served_from_its_memo(vectors: TurnVectors, fake: CountingEmbedder) -> None:
    first = await vectors.aget(TEXT, owner="acme")
    again = await vectors.aget(TEXT, owner="acme")
    assert first is not None and again is first and len(fake.passes) == 1
    assert vectors.get(TEXT, owner="acme") is first and len(fake.passes) == 1  # the synchronous path reads it too


def test_the_synchronous_path_is_per_tenant_too(vectors: TurnVectors, fake: CountingEmbedder) -> None:
    vectors.get(TEXT, owner="acme")
    vectors.get(TEXT, owner="globex")
    assert fake.embedded() == [TEXT, TEXT]
    vectors.get(TEXT, owner="globex")
    assert len(fake.passes) == 2


def test_no_owner_no_memo(vectors: TurnVectors, fake: CountingEmbedder) -> None:
    """A caller that names no tenant neither reads nor leaves a vector."""
    vectors.get(TEXT, owner="acme")
    vectors.get(TEXT)
    vectors.get(TEXT)
    assert len(fake.passes) == 3
    assert vectors.recent(TEXT) is None


def test_one_tenants_flood_does_not_evict_anothers_vectors(vectors: TurnVectors, fake: CountingEmbedder) -> None:
    vectors.get(TEXT, owner="acme")
    for i in range(MEMO_PER_OWNER * 4):
        vectors.get(f"flood question number {i}", owner="globex")
    assert vectors.recent(TEXT, "acme") is not None
    assert vectors.recent("flood question number 0", "globex") is None  # globex evicted only its own
    assert vectors.recent(f"flood question number {MEMO_PER_OWNER * 4 - 1}", "globex") is not None


def test_the_memo_is_bounded_in_owners_too(vectors: TurnVectors) -> None:
    for i in range(MEMO_OWNERS + 5):
        vectors.get(TEXT, owner=f"tenant-{i}")
    assert vectors.recent(TEXT, "tenant-0") is None
    assert vectors.recent(TEXT, f"tenant-{MEMO_OWNERS + 4}") is not None


def test_an_isolated_end_users_vector_is_remembered_for_that_end_user(vectors: TurnVectors,
                                                                      fake: CountingEmbedder) -> None:
    """Under a plan isolating its end users, another end user of the tenant timing its lookup learnt whether one
    had just asked the same; the tenant's own (no end user) stays shared, and the batcher's turn stays the tenant's."""
    vectors.get(TEXT, owner="clinic", user="user=alice")
    vectors.get(TEXT, owner="clinic", user="user=bob")
    assert vectors.recent(TEXT, "clinic") is None and len(fake.passes) == 2
    assert vectors.recent(TEXT, "clinic", "user=alice") is not None
    vectors.get(TEXT, owner="clinic")
    assert vectors.recent(TEXT, "clinic") is not None and vectors.recent(TEXT, "clinic", "user=carol") is None


def test_end_users_share_their_tenants_one_memo(vectors: TurnVectors) -> None:
    """However many end users a tenant names, they fill its memo only: no other tenant's is dropped."""
    vectors.get(TEXT, owner="acme")
    for i in range(MEMO_OWNERS + 5):
        vectors.get(TEXT, owner="clinic", user=f"user={i}")
    assert vectors.recent(TEXT, "acme") is not None
    assert vectors.recent(TEXT, "clinic", f"user={MEMO_OWNERS + 4}") is not None


def test_the_cache_remembers_vectors_per_isolated_end_user(fake: CountingEmbedder) -> None:
    """Through the cache: alice's stored question leaves a vector for her alone; bob's lookup of the same text (his
    scope holding an entry, so it is compared by meaning) runs its own forward pass."""
    cache = SemanticCache(SQLiteStore(":memory:"), fake)  # type: ignore[arg-type]
    try:
        alice, bob = (CacheScope.for_request(chat(TEXT), tenant="clinic", end_user=who, model_version="m1")
                      for who in ("alice", "bob"))
        assert alice.end_user == "user=alice" and alice.identity != bob.identity
        cache.store(bob, chat("What are the opening hours of the clinic?"), "9 to 5")
        cache.store(alice, chat(TEXT), "no")
        before = len(fake.embedded())
        cache.lookup(bob, chat(TEXT))
        assert fake.embedded()[before:] == [TEXT]
        mine = CacheScope.for_request(chat(TEXT, system="Be brief."), tenant="clinic", end_user="alice",
                                      model_version="m1")
        cache.store(mine, chat("What are the opening hours of the clinic?", system="Be brief."), "9 to 5")
        assert len(fake.embedded()) == before + 2  # bob's vector of it is not hers either
        cache.lookup(mine, chat(TEXT, system="Be brief."))  # her own text, in another scope of hers: from her memo
        assert len(fake.embedded()) == before + 2
    finally:
        cache.close()
