"""The memo of recent turn vectors (cache/vectors.py) is per tenant: a memo hit skips the batcher's wait and the
forward pass, so a vector one tenant's text left must never serve another's lookup (its miss would come back
faster, telling it what the other asked). Counted in forward passes, not timed."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from cache.vectors import MEMO_OWNERS, MEMO_PER_OWNER, TurnVectors

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
