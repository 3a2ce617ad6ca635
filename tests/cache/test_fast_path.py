"""The deterministic fast path with the real MiniLM embedder: an exact hit pays no embedding and no thread,
concurrent lookups share forward passes and get the vectors one-at-a-time embedding gives, a miss is embedded
once for lookup and store together, and a repeat right after the answer is a hit."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import numpy as np
import pytest

import cache.semantic_cache as semantic_cache_module
from cache import Embedder, Hit, Miss, SemanticCache, SQLiteStore
from tests.cache.conftest import FakeClock, chat, scope

Q = "How do I convert 5 km to miles?"


class CountingEmbedder(Embedder):
    """The real embedder, counting forward passes (`encode` calls) and the texts in them."""

    def __init__(self, inner: Embedder):
        super().__init__(num_threads=None)
        self.inner, self.calls, self.texts = inner, 0, 0

    @property
    def max_tokens(self) -> int:
        return self.inner.max_tokens

    def num_tokens(self, text: str) -> int:
        return self.inner.num_tokens(text)

    def encode(self, texts: Sequence[str], *, batch_size: int = 64) -> np.ndarray:
        self.calls += 1
        self.texts += len(texts)
        return self.inner.encode(texts, batch_size=batch_size)


@pytest.fixture
def counting(embedder: Embedder) -> CountingEmbedder:
    return CountingEmbedder(embedder)


def _cache(embedder: Embedder, clock: FakeClock, **kwargs: object) -> SemanticCache:
    return SemanticCache(SQLiteStore(":memory:", max_entries=1000), embedder, clock=clock, **kwargs)  # type: ignore[arg-type]


async def test_an_exact_hit_pays_no_embedding(counting: CountingEmbedder, clock: FakeClock) -> None:
    cache = _cache(counting, clock)
    cache.store(scope(chat(Q)), chat(Q), "3.1 miles")  # the store embeds it once
    counting.calls = 0
    hit = await cache.alookup(scope(chat(Q)), chat(Q))
    assert isinstance(hit, Hit) and hit.kind == "exact" and counting.calls == 0
    cache.close()


async def test_a_remembered_answer_is_served_without_a_worker_thread(counting: CountingEmbedder, clock: FakeClock,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(counting, clock)
    assert cache.remember(scope(chat(Q)), chat(Q), "3.1 miles", {"total_tokens": 12}) is not None

    async def no_thread(*args: object, **kwargs: object) -> None:
        raise AssertionError("an in-memory exact hit went to a worker thread")

    monkeypatch.setattr(semantic_cache_module.asyncio, "to_thread", no_thread)
    hit = await cache.alookup(scope(chat(Q)), chat(Q))
    assert isinstance(hit, Hit) and hit.kind == "exact" and hit.usage == {"total_tokens": 12}
    assert counting.calls == 0
    cache.close()


async def test_concurrent_lookups_share_forward_passes_and_get_the_same_vectors(counting: CountingEmbedder,
                                                                              embedder: Embedder,
                                                                              clock: FakeClock) -> None:
    batch, n = 16, 64
    # a long wait budget: every batch is made full by the lookups announced together, never by the timer
    cache = _cache(counting, clock, embed_batch=batch, embed_wait_s=5.0)
    cache.store(scope(chat("What is the capital of France?")), chat("What is the capital of France?"), "Paris")
    questions = [f"Which city hosted the Olympic Games number {i} in the list?" for i in range(n)]
    counting.calls = counting.texts = 0
    results = await asyncio.wait_for(
        asyncio.gather(*(cache.alookup(scope(chat(q)), chat(q)) for q in questions)), timeout=120)
    assert all(isinstance(r, Miss) for r in results)
    assert counting.calls <= math.ceil(n / batch) and counting.texts == n
    alone = np.stack([embedder.encode_one(q) for q in questions])  # one text per forward pass
    together = np.stack([r.probe.vector for r in results])  # type: ignore[union-attr]
    assert np.abs(together - alone).max() <= 1e-5
    cache.close()


async def test_a_lone_lookup_is_not_held_back_by_the_wait_budget(counting: CountingEmbedder,
                                                                 clock: FakeClock) -> None:
    cache = _cache(counting, clock, embed_wait_s=60.0)  # nobody else announced: it must not wait for company
    cache.store(scope(chat("What is the capital of France?")), chat("What is the capital of France?"), "Paris")
    result = await asyncio.wait_for(cache.alookup(scope(chat(Q)), chat(Q)), timeout=10)
    assert result.status == "miss"
    cache.close()


async def test_a_miss_is_embedded_once_for_lookup_and_store(counting: CountingEmbedder, clock: FakeClock) -> None:
    cache = _cache(counting, clock)
    cache.store(scope(chat("What is the capital of France?")), chat("What is the capital of France?"), "Paris")
    counting.calls = counting.texts = 0
    miss = await cache.alookup(scope(chat(Q)), chat(Q))
    assert isinstance(miss, Miss) and miss.probe is not None and miss.probe.vector is not None
    entry = cache.remember(scope(chat(Q)), chat(Q), "3.1 miles", probe=miss.probe)
    assert entry is not None and await cache.apersist(entry) is entry
    assert counting.texts == 1  # the lookup's vector went to the store
    paraphrase = chat("How can I convert 5 kilometers into miles?")
    assert (await cache.alookup(scope(paraphrase), paraphrase)).status == "hit"  # it was indexed
    cache.close()


async def test_a_repeat_right_after_the_answer_is_a_hit(embedder: Embedder, clock: FakeClock) -> None:
    for i in range(50):  # a fresh cache each time: the store's write is still pending when the repeat comes
        cache = _cache(embedder, clock)
        body = chat(f"What is {i} times {i + 1}?")
        miss = await cache.alookup(scope(body), body)
        assert isinstance(miss, Miss)
        entry = cache.remember(scope(body), body, f"{i * (i + 1)}", probe=miss.probe)
        assert entry is not None
        write = asyncio.create_task(cache.apersist(entry))  # in the background, as the gateway does
        repeat = await cache.alookup(scope(body), body)
        assert isinstance(repeat, Hit) and repeat.response == f"{i * (i + 1)}", (i, repeat)
        await write
        assert (await cache.alookup(scope(body), body)).status == "hit"  # and from the store once written
        cache.close()


async def test_a_purge_cancels_a_write_still_pending(embedder: Embedder, clock: FakeClock) -> None:
    cache = _cache(embedder, clock)
    entry = cache.remember(scope(chat(Q)), chat(Q), "3.1 miles")
    assert entry is not None
    cache.purge("acme")
    assert (await cache.alookup(scope(chat(Q)), chat(Q))).status == "miss"
    assert await cache.apersist(entry) is None and len(cache.entries) == 0
    cache.close()


async def test_a_bump_cancels_pending_writes_of_older_versions(embedder: Embedder, clock: FakeClock) -> None:
    cache = _cache(embedder, clock)
    old = cache.remember(scope(chat(Q), data_version=1), chat(Q), "from version 1 data")
    assert old is not None
    clock.now += 1
    cache.bump_data_version("acme", 2)
    assert await cache.apersist(old) is None and len(cache.entries) == 0
    cache.close()
