"""A cache made while its Redis does not answer starts unloaded (an empty index, no change-log cursor, no trust in its
map of recent entries): its lookups and writes fail as in a running outage (the gateway's miss), and the first
catch-up that works once Redis answers, in the writer thread, takes the cursor and loads the index (the change log's
"reset"). Building it raised: `tiergate serve` exited 3 with Redis down, even under redis_failure_mode=open."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from cache import CacheStoreError, Embedder, Hit, RedisStore, SemanticCache
from cache.change_feed import Change, ChangeFeed
from tests.cache.conftest import FakeClock, chat, scope
from tests.conftest import RedisServer

Q = "How do I convert 5 km to miles?"
PARAPHRASE = "How can I convert 5 kilometers into miles?"


@pytest.fixture
def later_redis() -> Iterator[RedisServer]:
    """A Redis on a port of its own, not started: the test starts it."""
    server = RedisServer()
    yield server
    server.stop()


def _replica(url: str, embedder: Embedder, clock: FakeClock, sync_interval_s: float = 0.0) -> SemanticCache:
    return SemanticCache(RedisStore(url, max_entries=100), embedder, clock=clock, sync_interval_s=sync_interval_s)


def _load_queued(cache: SemanticCache) -> None:
    """Wait (bounded) for the catch-up a lookup queued for the writer thread."""
    assert cache.writes.last_sync is not None
    cache.writes.last_sync.result(timeout=20)


def test_a_cache_started_with_redis_down_misses_then_loads_once_redis_answers(
        later_redis: RedisServer, embedder: Embedder, clock: FakeClock) -> None:
    b = _replica(later_redis.url, embedder, clock)
    assert not b.loaded and len(b.index) == 0
    body = chat(Q)
    with pytest.raises(CacheStoreError):  # a running outage's lookup: the gateway serves it as a miss
        b.lookup(scope(body), body)
    with pytest.raises(CacheStoreError):  # and its write fails, as in a running outage
        b.store(scope(body), body, "not kept")
    _load_queued(b)  # the lookup queued a catch-up: it failed, nothing loaded
    assert not b.loaded and len(b.pending) == 0

    later_redis.start()
    a = _replica(later_redis.url, embedder, clock)  # another replica stores an answer
    a.store(scope(body), body, "3.1 miles")
    exact = b.lookup(scope(body), body)  # the store is the truth: scoped by its exact key
    assert isinstance(exact, Hit) and exact.kind == "exact" and exact.response == "3.1 miles"
    _load_queued(b)  # that lookup queued the load, in the writer thread
    assert b.loaded and len(b.index) == 1
    para = b.lookup(scope(chat(PARAPHRASE)), chat(PARAPHRASE))  # only the loaded index proposes it
    assert isinstance(para, Hit) and para.kind == "semantic" and para.response == "3.1 miles"
    other = chat("Who wrote Hamlet?")
    a.store(scope(other), other, "Shakespeare")
    b.sync()  # the cursor taken at the load follows the log from there
    assert len(b.index) == 2
    a.close()
    b.close()


def test_an_unloaded_cache_serves_nothing_from_its_memory_a_deletion_elsewhere_removed(
        later_redis: RedisServer, embedder: Embedder, clock: FakeClock) -> None:
    b = _replica(later_redis.url, embedder, clock, sync_interval_s=60.0)
    later_redis.start()
    body = chat(Q)
    b.store(scope(body), body, "3.1 miles")  # a write after Redis came back: b keeps it in its map of recent entries
    a = _replica(later_redis.url, embedder, clock)
    assert a.purge("acme") == 1
    assert b.lookup(scope(body), body).status == "miss"  # no catch-up ever worked: the store is asked, not memory
    a.close()
    b.close()


class _VectorsDown(RedisStore):
    """Its change log's cursor answers, and then the vectors do not (Redis went down in between) until `down` is
    False."""

    down = True

    def vectors(self) -> Iterator[tuple[str, str, np.ndarray]]:
        if self.down:
            raise CacheStoreError("redis: down")
        return super().vectors()


def test_a_cache_whose_index_could_not_be_loaded_takes_a_new_cursor_to_load_it(
        later_redis: RedisServer, embedder: Embedder, clock: FakeClock) -> None:
    later_redis.start()
    a = _replica(later_redis.url, embedder, clock)
    a.store(scope(chat(Q)), chat(Q), "3.1 miles")
    store = _VectorsDown(later_redis.url, max_entries=100)
    b = SemanticCache(store, embedder, clock=clock, sync_interval_s=60.0)
    assert not b.loaded and len(b.index) == 0
    store.down = False  # Redis answers again
    b.lookup(scope(chat("Who wrote Hamlet?")), chat("Who wrote Hamlet?"))  # due at once: queues the load
    _load_queued(b)
    assert b.loaded and len(b.index) == 1
    a.close()
    b.close()


class _Log:
    """A change log whose store does not answer until `up`."""

    def __init__(self, changes: list[Change]) -> None:
        self.changes = changes
        self.up = False

    def change_cursor(self) -> str:
        if not self.up:
            raise CacheStoreError("down")
        return "1"

    def changes_since(self, cursor: str, limit: int = 1000) -> tuple[str, list[Change]]:
        if not self.up:
            raise CacheStoreError("down")
        after = int(cursor)
        page = self.changes[after:after + limit]
        return str(after + len(page)), page


def test_a_feed_without_a_cursor_takes_one_and_resets_once_its_store_answers() -> None:
    log = _Log([("put", "e0", "p"), ("put", "e1", "p"), ("del", "e0", "p")])
    feed = ChangeFeed(log, interval_s=60.0)  # type: ignore[arg-type]
    assert not feed.started and feed.due() and not feed.recent()  # due at once, trusted never
    applied: list[Change] = []
    with pytest.raises(CacheStoreError):
        feed.step(applied.extend)
    assert not feed.started and not feed.recent() and applied == []
    log.up = True
    assert feed.step(applied.extend) == (1, False)  # the cursor ("1"), then the whole index reloaded after it
    assert feed.started and applied == [("reset", "", "")]
    assert feed.step(applied.extend) == (2, True)  # what was written after the cursor, as ever
    assert applied[1:] == log.changes[1:] and feed.recent()
